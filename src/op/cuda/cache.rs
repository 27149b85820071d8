//! What the forward keeps for its backward ([`crate::GdpOptions::save_intermediates`]): the WY
//! factors and every chunk's start state and Delta.

use super::inputs::ChunkTable;
use super::wy::WyFactors;
use crate::op::shape::{GdpShape, CHUNK};
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::cuda_backend::CudaDevice;
use candle_core::Result;
use half::bf16;
use std::ops::Range;

/// Each chunk's start state `[slots, K, V]` and Delta `[slots, 64, V]` in bf16, which the
/// backward's gradient kernel reads.
pub(super) struct ChunkStates {
    pub hs: CudaSlice<bf16>,
    pub dn: CudaSlice<bf16>,
}

impl ChunkStates {
    /// Uninitialised buffers for every slot of `table` (the forward scan fills them).
    pub fn alloc(dev: &CudaDevice, table: &ChunkTable, sh: &GdpShape) -> Result<Self> {
        let slots = table.slots(sh);
        // SAFETY: the forward scan writes every element of every slot of the table's chunks
        // before anything reads them; slots of no chunk (none, or the one placeholder slot) are
        // never read.
        unsafe {
            Ok(Self {
                hs: dev.alloc::<bf16>(slots * sh.dk * sh.dv)?,
                dn: dev.alloc::<bf16>(slots * CHUNK * sh.dv)?,
            })
        }
    }
}

/// What a forward in segments keeps for a backward in the same segments
/// ([`crate::op::config::Segments`]): the segments, as the sequences of a sub-problem of the
/// op's shape, each original sequence's segments, and the state each segment starts from.
pub(super) struct SegmentStates {
    /// The op's shape with the segments as its sequences (each sequence's in order).
    pub sub: GdpShape,
    /// Per original sequence, the indices of its segments.
    pub owners: Vec<Range<usize>>,
    /// Each segment's incoming state, f32 `[segments, H, K, V]` (zero where a sequence starts
    /// without an initial state).
    pub incoming: CudaSlice<f32>,
}

/// What the chunked forward leaves for the backward when asked to (`save_intermediates`): the
/// WY factors with Ainv (about `780 n` bytes per token and head at K = V = 128), so that the
/// backward skips its WY kernel, and where the slot says so every chunk's start state and Delta
/// too (about `1548 n` bytes in all), so that it skips its rerun of the forward scan as well. A
/// forward in segments keeps its segments' incoming states instead of the chunk states.
pub struct ForwardCache {
    pub(super) wy: WyFactors,
    pub(super) states: Option<ChunkStates>,
    pub(super) segments: Option<SegmentStates>,
}

impl ForwardCache {
    /// A cache of the WY factors alone (the backward reruns the state scan).
    pub(super) fn wy_only(wy: WyFactors) -> Self {
        Self {
            wy,
            states: None,
            segments: None,
        }
    }

    pub(super) fn into_parts(self) -> (WyFactors, Option<ChunkStates>, Option<SegmentStates>) {
        (self.wy, self.states, self.segments)
    }
}

/// Where an op instance keeps its [`ForwardCache`] between its forward and its backward (taken
/// by the backward, so that the memory goes with it).
pub struct CacheSlot {
    /// Keep the chunk states too, not only the WY factors.
    pub(super) states: bool,
    pub(super) cache: std::sync::Mutex<Option<ForwardCache>>,
}

impl CacheSlot {
    /// An empty slot for the WY factors and, with `states`, the chunk states.
    pub fn new(states: bool) -> Self {
        Self {
            states,
            cache: std::sync::Mutex::new(None),
        }
    }

    pub(super) fn put(&self, cache: ForwardCache) {
        *self.cache.lock().unwrap_or_else(|e| e.into_inner()) = Some(cache);
    }

    /// The cache, if the forward left one (once).
    pub(crate) fn take(&self) -> Option<ForwardCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl std::fmt::Debug for CacheSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let full = self.cache.lock().map(|c| c.is_some()).unwrap_or(false);
        let state = if full { "full" } else { "empty" };
        let what = if self.states { "all" } else { "WY factors" };
        write!(f, "CacheSlot({what}, {state})")
    }
}
