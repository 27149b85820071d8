//! The bf16 chunked kernels' inputs: the queries and keys (packed, or FLA's `q`, `k` in place),
//! the device views of every input, the output's gradient, and the table of 64-row chunks.

use super::device::{to_i32, view, In};
use crate::op::config::KernelConfig;
use crate::op::heads::key_groups;
use crate::op::shape::GdpShape;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{CudaStorage, Layout, Result};
use half::bf16;

/// Where the bf16 chunked kernels read the queries and keys (their `qb, kb, split` arguments,
/// `GdpcRows` in `cuda/gdp_fwd_chunked.cuh`).
#[derive(Clone, Copy)]
pub enum QkIn<'a> {
    /// `qk [B, T, n+1, H, K]` (every kernel takes it).
    Packed(In<'a>),
    /// FLA's `q [B, T, Hk, K]` and `k [B, T·n, Hk, K]`, read in place (the bf16 chunked kernels
    /// only: see `forward::reads_qk_in_place`); with `Hk < H` key heads, value head `h` reads
    /// key head `h / (H / Hk)` (grouped value heads).
    Split(In<'a>, In<'a>),
}

impl<'a> QkIn<'a> {
    /// `qk`, or `q`: the storage whose device and dtype the op runs on.
    pub fn lead(&self) -> In<'a> {
        match *self {
            QkIn::Packed(qk) | QkIn::Split(qk, _) => qk,
        }
    }
}

/// What the op tells the CUDA launches about one call besides its tensors.
#[derive(Clone, Copy)]
pub(crate) struct CudaCall<'a> {
    pub shape: &'a GdpShape,
    pub scale: f32,
    /// Whether the gate buffer carries initial states.
    pub has_h0: bool,
    /// The output is `o` alone in the inputs' dtype (else the packed f32 `[o | final states]`).
    pub plain: bool,
    pub kernels: &'a KernelConfig,
}

/// The bf16 inputs as device views: the queries and keys as the kernels' `qb, kb, split` (see
/// [`QkIn`]; for the packed `qk`, `k` starts at its first key slot), `v [B, T·n, H, V]`, the
/// f32 gate buffer `[g | beta | h0?]`, and the device they are on.
pub(super) struct Bf16Inputs<'a> {
    pub dev: CudaDevice,
    pub q: CudaView<'a, bf16>,
    pub k: CudaView<'a, bf16>,
    /// 0 for the packed `qk`; for FLA's separate `q`, `k`, the value heads per key head
    /// `r = H / Hk` (1 without grouped value heads).
    pub split: i32,
    pub v: CudaView<'a, bf16>,
    pub aux: CudaView<'a, f32>,
    /// Whether `aux` ends with the initial states `[N, H, K, V]`.
    pub has_h0: bool,
}

impl<'a> Bf16Inputs<'a> {
    pub fn new(
        qk: QkIn<'a>,
        v: (&'a CudaStorage, &Layout),
        aux: (&'a CudaStorage, &Layout),
        sh: &GdpShape,
        has_h0: bool,
    ) -> Result<Self> {
        let (q, k, split) = match qk {
            QkIn::Packed(qk) => {
                let all = view::<bf16>(qk.0, qk.1, sh.qk_len(), "qk")?;
                let slot = (sh.heads * sh.dk).min(all.len());
                (all.slice(..), all.slice(slot..), 0)
            }
            QkIn::Split(q, k) => {
                // `q [B, T, Hk, K]`: its heads say the groups.
                let hk = match q.1.dims() {
                    &[_, _, hk, _] => hk,
                    dims => {
                        candle_core::bail!("gdp cuda: `q` of shape {dims:?}, not [B, T, Hk, K]")
                    }
                };
                let groups = key_groups(hk, sh.heads, "v")?;
                let q_len = sh.batch * sh.tokens * hk * sh.dk;
                (
                    view::<bf16>(q.0, q.1, q_len, "q")?,
                    view::<bf16>(k.0, k.1, q_len * sh.n, "k")?,
                    to_i32(groups, "value heads per key head")?,
                )
            }
        };
        Ok(Self {
            dev: qk.lead().0.device().clone(),
            q,
            k,
            split,
            v: view::<bf16>(v.0, v.1, sh.v_len(), "v")?,
            aux: view::<f32>(aux.0, aux.1, sh.aux_len(has_h0), "gates")?,
            has_h0,
        })
    }
}

/// The chunk table of the split kernels, on the device: per sequence (batch, start, len, first
/// chunk), then per chunk (sequence, index within it).
pub(super) struct ChunkTable {
    pub table: CudaSlice<i32>,
    /// Chunks of all sequences.
    pub chunks: usize,
}

impl ChunkTable {
    pub fn new(dev: &CudaDevice, sh: &GdpShape) -> Result<Self> {
        let mut table = Vec::with_capacity(4 * sh.num_seqs());
        let mut chunks = vec![];
        for (si, (s, nch)) in sh.seqs.iter().zip(sh.chunks_per_seq()).enumerate() {
            table.extend([
                to_i32(s.batch, "batch")?,
                to_i32(s.start, "start")?,
                to_i32(s.len, "len")?,
                to_i32(chunks.len() / 2, "chunks")?,
            ]);
            for ci in 0..nch {
                chunks.extend([si as i32, ci as i32]);
            }
        }
        let total = chunks.len() / 2;
        if total > i32::MAX as usize || sh.heads > 65_535 {
            candle_core::bail!("gdp cuda: {total} chunks x {} heads is too large", sh.heads);
        }
        table.extend(chunks);
        Ok(Self {
            table: dev.clone_htod(&table)?,
            chunks: total,
        })
    }

    /// Scratch slots `(chunk, head)`, at least one head's worth (valid pointers when there is
    /// no chunk).
    pub fn slots(&self, sh: &GdpShape) -> usize {
        self.chunks.max(1) * sh.heads
    }
}

/// The gradient of the forward's output: the packed f32 `[do | dht]`, or `do [B, T, H, V]` alone
/// in bf16 (the op's plain output; `dht` is then zero unless overridden).
#[derive(Clone, Copy)]
pub enum Cotangent<'a> {
    Packed((&'a CudaStorage, &'a Layout)),
    Plain((&'a CudaStorage, &'a Layout)),
}
