//! The gradient kernel (`gdp_bwd_grads_bf16_<KP>_<VP>`): every gradient of every (chunk, head)
//! in parallel, from the chunk states and the state-gradient scan's rows; with persistent blocks
//! (`_pipe`) beside that scan.

use super::cache::ChunkStates;
use super::device::{allow_smem, grid_dim, shape_i32, to_i32, GRID_X, GRID_YZ};
use super::inputs::{Bf16Inputs, ChunkTable};
use super::module::load_kernel;
use super::plan::{grads_smem_bytes, grads_tiles};
use crate::op::kernel_params::{GradsParams, PipeParams};
use crate::op::shape::GdpShape;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{Result, Tensor};
use half::bf16;

/// Threads per block of the gradient kernel (`GDPG_THREADS`) and its column groups
/// (`GDPG_GROUPS`).
pub(super) const GRAD_THREADS: u32 = 512;
const _: () = assert!(GRAD_THREADS as usize / 32 == super::plan::GRAD_WARPS);

/// Where the gradients go: the packed f32 `[dqk | dv | dg | dbeta | dh0?]` (packed `qk` only),
/// or bf16 query/key gradients in the layout of the inputs and `dv` with the f32
/// `[dg | dbeta | dh0?]` (the layout of the gate buffer).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum GradLayout {
    Packed,
    Parts,
}

/// The bf16 query/key gradients: `dqk [B, T, n+1, H, K]`, or FLA's `dq`, `dk`.
pub enum QkGrads {
    Packed(CudaSlice<bf16>),
    Split {
        dq: CudaSlice<bf16>,
        dk: CudaSlice<bf16>,
    },
}

/// The gradients, in the requested [`GradLayout`].
pub enum Grads {
    Packed(CudaSlice<f32>),
    Parts {
        dqk: QkGrads,
        dv: CudaSlice<bf16>,
        daux: CudaSlice<f32>,
    },
}

impl Grads {
    /// The f32 buffer that holds the initial-state gradients (`[N, H, K, V]`) and where they
    /// start in it: the packed gradients, or the gates part `daux`, in which they start at
    /// `dh0_at`.
    fn states_part(&mut self, sh: &GdpShape, dh0_at: usize) -> (&mut CudaSlice<f32>, usize) {
        match self {
            Grads::Packed(p) => (p, sh.qk_len() + sh.v_len() + dh0_at),
            Grads::Parts { daux, .. } => (daux, dh0_at),
        }
    }

    /// Copies the initial-state gradients `dh0` (an f32 tensor `[N, H, K, V]`) in.
    pub(super) fn copy_states_in(
        &mut self,
        dh0: &Tensor,
        sh: &GdpShape,
        dh0_at: usize,
    ) -> Result<()> {
        let (buf, at) = self.states_part(sh, dh0_at);
        super::device::copy_tensor_into(dh0, buf, at)
    }

    /// Copies the initial-state gradients `dh0` (an f32 buffer `[N, H, K, V]`) in.
    pub(super) fn copy_states_slice_in(
        &mut self,
        dev: &CudaDevice,
        dh0: &CudaSlice<f32>,
        sh: &GdpShape,
        dh0_at: usize,
    ) -> Result<()> {
        let n = sh.state_len();
        let (buf, at) = self.states_part(sh, dh0_at);
        if dh0.len() < n || buf.len() < at + n {
            candle_core::bail!("gdp cuda: {n} initial-state gradients do not fit");
        }
        dev.cuda_stream()
            .memcpy_dtod(&dh0.slice(..n), &mut buf.slice_mut(at..at + n))
            .w()
    }
}

/// Counters ahead of the per-group ones in the gradient kernel's pipe (`GDPG_PIPE_COUNTERS`:
/// the next pair to take, the state-gradient scan's blocks done).
pub(super) const GRADS_PIPE_COUNTERS: usize = 2;

/// A gradient kernel's persistent blocks (`gdpg_pipe`): the pipe's counters and the chunk order
/// (device addresses outside cudarc's tracking: the state-gradient scan writes the counters, dS
/// and dDelta on its stream while the blocks beside it read them), the value tiles of the scan
/// that count each group done, and the scan's blocks.
pub(super) struct PipeArgs<'a> {
    pub(super) pipe: &'a CudaSlice<i32>,
    pub(super) order: &'a CudaSlice<i32>,
    pub(super) ready_count: i32,
    pub(super) scan_blocks: i32,
}

/// The gradient kernel's inputs (`gdp_bwd_grads_bf16_impl`).
pub(super) struct GradsLaunch<'a> {
    pub(super) inp: &'a Bf16Inputs<'a>,
    pub(super) table: &'a ChunkTable,
    pub(super) sh: &'a GdpShape,
    pub(super) kp: usize,
    pub(super) vp: usize,
    pub(super) qr: usize,
    pub(super) ainv: &'a CudaSlice<bf16>,
    pub(super) states: &'a ChunkStates,
    /// dS and dDelta of every slot, outside cudarc's tracking (see [`PipeArgs`]).
    pub(super) dhs: &'a CudaSlice<bf16>,
    pub(super) ddn: &'a CudaSlice<bf16>,
    pub(super) dob: &'a CudaView<'a, bf16>,
    pub(super) scale: f32,
}

impl GradsLaunch<'_> {
    /// Launches the gradient kernel on the device's stream into `out`: a block per (chunk,
    /// head), or with `pipe` at most `blocks` persistent blocks, beside the state-gradient scan
    /// (waiting for its groups, leaving when it is done) or after it.
    pub(super) fn launch(
        &self,
        dev: &CudaDevice,
        out: &mut Grads,
        pipe: Option<(&PipeArgs<'_>, bool, usize)>,
    ) -> Result<()> {
        let (sh, inp) = (self.sh, self.inp);
        let [b, t, h, k, vd, n] = shape_i32(sh)?;
        let tiles = if grads_tiles(self.kp, self.vp, sh.n) {
            "_tiles"
        } else {
            ""
        };
        let suffix = if pipe.is_some() { "_pipe" } else { "" };
        let name = format!("gdp_bwd_grads_bf16_{}_{}{tiles}{suffix}", self.kp, self.vp);
        let smem = grads_smem_bytes(self.kp, self.vp, self.qr);
        let func = load_kernel(dev, &name)?;
        allow_smem(&func, smem)?;
        let pairs = self.table.chunks * sh.heads;
        let mut args = func.args();
        // The kernel's `out, dq, dk_out, dv_out, dgates` (a null `dk_out` with a packed `dqk`).
        let (mut packed, mut dq, mut dk, mut dv, mut dgates) = (0, 0, 0, 0, 0);
        match out {
            Grads::Packed(p) => packed = args.write(p),
            Grads::Parts {
                dqk,
                dv: dv_out,
                daux,
            } => {
                match dqk {
                    QkGrads::Packed(dqk) => dq = args.write(dqk),
                    QkGrads::Split { dq: q, dk: k } => (dq, dk) = (args.write(q), args.write(k)),
                }
                (dv, dgates) = (args.write(dv_out), args.write(daux));
            }
        }
        let params = GradsParams {
            q: args.read(&inp.q),
            k: args.read(&inp.k),
            v: args.read(&inp.v),
            aux: args.read(&inp.aux),
            table: args.read(&self.table.table),
            ainv: args.read(self.ainv),
            hs: args.read(&self.states.hs),
            dhs: args.untracked(self.dhs),
            dn: args.read(&self.states.dn),
            ddn: args.untracked(self.ddn),
            dob: args.read(self.dob),
            out: packed,
            dq,
            dk_out: dk,
            dv_out: dv,
            dgates,
            split: inp.split,
            batch: b,
            tokens: t,
            heads: h,
            dk: k,
            dv: vd,
            n,
            nseq: to_i32(sh.num_seqs(), "N")?,
            scale: self.scale,
            qr: self.qr as i32,
        };
        let cfg = |grid_dim| LaunchConfig {
            grid_dim,
            block_dim: (GRAD_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY (both launches): `gdp_bwd_grads_bf16_*` takes `GDP_GRADS_FIELDS` (the `_pipe`
        // entry `GDP_PIPE_FIELDS` after them): every per-slot buffer was sized from the same table
        // and filled above on this stream, or (dS and dDelta, beside the scan) is read only after
        // the scan's counter of its group says it is written; the gradients are either the packed
        // f32 layout (null part pointers) or the parts (a null packed pointer), sized above; the
        // pipe holds `GRADS_PIPE_COUNTERS` plus the pipeline's counters, the order every chunk of
        // the table; the dynamic shared memory is `grads_smem_bytes`.
        match pipe {
            None => {
                let grid = (
                    grid_dim(self.table.chunks, "chunks", GRID_X)?,
                    grid_dim(sh.heads, "heads", GRID_YZ)?,
                    1,
                );
                unsafe { args.launch(cfg(grid), &params) }
            }
            Some((p, beside, blocks)) => {
                let pipe = PipeParams {
                    pipe: args.untracked(p.pipe),
                    order: args.untracked(p.order),
                    items: to_i32(pairs, "chunk-head pairs")?,
                    ready_count: p.ready_count,
                    beside: i32::from(beside),
                    scan_blocks: p.scan_blocks,
                };
                let grid = (
                    grid_dim(blocks.clamp(1, pairs), "chunk-head blocks", GRID_X)?,
                    1,
                    1,
                );
                unsafe { args.launch(cfg(grid), &(params, pipe)) }
            }
        }
    }
}
