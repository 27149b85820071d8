//! The WY kernel (`gdp_fwd_wy_bf16`): every chunk's WY factors in parallel, and the readiness
//! counters through which a scan running beside it waits for them.

use super::device::{
    allow_smem, device_attr, grid_dim, shape_i32, smem_and_sms, to_i32, GRID_X, GRID_YZ,
};
use super::inputs::{Bf16Inputs, ChunkTable};
use super::module::load_kernel;
use super::plan::wy_smem_bytes;
use crate::op::kernel_params::WyParams;
use crate::op::shape::{GdpShape, CHUNK};
use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig};
use candle_core::cuda_backend::CudaDevice;
use candle_core::Result;
use half::bf16;

/// Threads per block of the WY kernel (`GDPC_THREADS`).
const THREADS: u32 = 128;

/// The WY kernel's per-chunk outputs, slot `(chunk · H + head)`: W `[64, K]`, U `[64, V]`,
/// P `[64, 64]` (bf16), coef `[3, 64]` (f32), and for the backward bf16(Ainv) `[64, 64]`.
pub(super) struct WyFactors {
    /// V, the value columns of U's rows (a scan over more columns reads the rest as zeros).
    pub dv: usize,
    pub w: CudaSlice<bf16>,
    pub u: CudaSlice<bf16>,
    pub p: CudaSlice<bf16>,
    pub coef: CudaSlice<f32>,
    pub ainv: Option<CudaSlice<bf16>>,
}

impl WyFactors {
    /// Runs `gdp_fwd_wy_bf16` over every chunk on the device's stream (skipped when there is
    /// none).
    pub fn compute(
        dev: &CudaDevice,
        inp: &Bf16Inputs,
        table: &ChunkTable,
        sh: &GdpShape,
        scale: f32,
        with_ainv: bool,
    ) -> Result<Self> {
        let f = Self::alloc(dev, table, sh, with_ainv)?;
        f.launch(dev, inp, table, sh, scale, None)?;
        Ok(f)
    }

    /// Buffers for every slot of `table`, to be filled by [`WyFactors::launch`].
    pub fn alloc(
        dev: &CudaDevice,
        table: &ChunkTable,
        sh: &GdpShape,
        with_ainv: bool,
    ) -> Result<Self> {
        let slots = table.slots(sh);
        // SAFETY (all allocations): every element is written by the WY kernel before the
        // scans read it (rows past a chunk's end as zeros).
        unsafe {
            Ok(Self {
                dv: sh.dv,
                w: dev.alloc::<bf16>(slots * CHUNK * sh.dk)?,
                u: dev.alloc::<bf16>(slots * CHUNK * sh.dv)?,
                p: dev.alloc::<bf16>(slots * CHUNK * CHUNK)?,
                coef: dev.alloc::<f32>(slots * 3 * CHUNK)?,
                ainv: if with_ainv {
                    Some(dev.alloc::<bf16>(slots * CHUNK * CHUNK)?)
                } else {
                    None
                },
            })
        }
    }

    /// Runs `gdp_fwd_wy_bf16` over every chunk of `table` on the device's stream; with
    /// `signal`, in its order of chunks (time-major across heads), counting each (chunk, head)
    /// in its readiness counters for a scan running beside it (`pipeline::Pipeline`).
    /// The outputs and counters are untracked (`module::Launch::untracked`).
    pub fn launch(
        &self,
        dev: &CudaDevice,
        inp: &Bf16Inputs,
        table: &ChunkTable,
        sh: &GdpShape,
        scale: f32,
        signal: Option<Signal>,
    ) -> Result<()> {
        let [b, t, h, k, vd, n] = shape_i32(sh)?;
        let nseq = to_i32(sh.num_seqs(), "N")?;
        if table.chunks == 0 {
            return Ok(());
        }
        let (order, ready, two_per_sm) = match signal {
            Some(Signal {
                order,
                ready,
                two_per_sm,
            }) => {
                if order.len() != table.chunks || ready.len() < ready_counters(table, sh) {
                    candle_core::bail!(
                        "gdp cuda: a chunk order of {} and {} counters for {} chunks x {} heads",
                        order.len(),
                        ready.len(),
                        table.chunks,
                        sh.heads
                    );
                }
                (Some(order), Some(ready), two_per_sm)
            }
            None => (None, None, false),
        };
        let smem = if two_per_sm {
            wy_smem_two_per_sm(dev, sh)?
        } else {
            wy_smem_bytes(sh.dk, sh.dv)
        };
        let wy = load_kernel(dev, "gdp_fwd_wy_bf16")?;
        allow_smem(&wy, smem)?;
        let mut args = wy.args();
        let params = WyParams {
            q: args.read(&inp.q),
            k: args.read(&inp.k),
            v: args.read(&inp.v),
            aux: args.read(&inp.aux),
            table: args.read(&table.table),
            w: args.untracked(&self.w),
            u: args.untracked(&self.u),
            p: args.untracked(&self.p),
            coef: args.untracked(&self.coef),
            ainv: args.untracked_opt(self.ainv.as_ref()),
            order: args.read_opt(order),
            ready: args.untracked_opt(ready),
            split: inp.split,
            batch: b,
            tokens: t,
            heads: h,
            dk: k,
            dv: vd,
            n,
            nseq,
            scale,
        };
        // With an order, a 1-D grid of (chunk, head) pairs (time-major across heads).
        let grid_dim = if params.ready == 0 {
            (
                grid_dim(table.chunks, "chunks", GRID_X)?,
                grid_dim(sh.heads, "heads", GRID_YZ)?,
                1,
            )
        } else {
            let blocks = table.chunks * sh.heads;
            (u32::try_from(blocks).ok().filter(|&b| b <= i32::MAX as u32))
                .map(|b| (b, 1, 1))
                .ok_or_else(|| {
                    candle_core::Error::Msg(format!("gdp cuda: {blocks} WY blocks in one launch"))
                })?
        };
        let cfg = LaunchConfig {
            grid_dim,
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: `gdp_fwd_wy_bf16` takes `GdpWyParams` (buffers sized in `alloc` from the
        // same shape and chunk table the kernel indexes with, alive for the call; a null `ag`
        // when Ainv is not wanted; with a signal, an order of the table's chunk ids, checked
        // to have one per chunk, and `ready_counters` counters); the dynamic shared memory is
        // at least `wy_smem_bytes`.
        unsafe { args.launch(cfg, &params) }?;
        Ok(())
    }
}

/// The WY kernel's dynamic shared memory padded so that at most two of its blocks share a
/// multiprocessor (half of it, less the per-block reservation), for the forward's WY kernel
/// beside its scan ([`Signal::two_per_sm`]).
pub(super) fn wy_smem_two_per_sm(dev: &CudaDevice, sh: &GdpShape) -> Result<usize> {
    let per_sm = device_attr(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
    )?;
    let reserved = device_attr(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
    )?;
    // Padding only: the plan checked the unpadded size against the configured limit.
    let (max_smem, _) = smem_and_sms(dev, None)?;
    let two_per_sm = (per_sm / 2).saturating_sub(reserved).min(max_smem);
    Ok(wy_smem_bytes(sh.dk, sh.dv).max(two_per_sm))
}

/// Chunks per readiness counter (`GDPC_READY_GROUP`).
pub(super) const READY_GROUP: usize = 8;

/// The readiness counters a WY launch with a [`Signal`] needs: one per (group of
/// [`READY_GROUP`] chunks of a sequence, head), indexed as `gdpc_ready_index` does (below
/// `(chunks / G + N + 1) · H`).
pub(super) fn ready_counters(table: &ChunkTable, sh: &GdpShape) -> usize {
    (table.chunks / READY_GROUP + sh.num_seqs() + 1) * sh.heads
}

/// What a WY launch tells a scan running beside it: the order in which it takes the chunks
/// (ids of the table, one per chunk) and its readiness counters (zeroed, [`ready_counters`]).
pub(super) struct Signal<'a> {
    pub order: &'a CudaSlice<i32>,
    pub ready: &'a CudaSlice<i32>,
    /// At most two WY blocks per multiprocessor (padded shared memory: [`wy_smem_two_per_sm`]).
    /// The forward's scan runs faster beside two than beside four (53,760 bytes each at
    /// K = V = 128), and the WY kernel, slower alone, still stays ahead of the scan
    /// (`KB_WY_PAD` in `cuda/bench/kernels.cu`). The backward keeps four: its states rerun
    /// waits for the whole WY kernel, which padding slows.
    pub two_per_sm: bool,
}
