//! The one-kernel forward `gdp_fwd_*` (`cuda/gdp.cu`, any dtype): the WY factors recomputed in
//! every value tile on the sequential path; the fallback where the chunked bf16 kernels do not
//! serve.

use super::device::{allow_smem, check_states, shape_i32, smem_and_sms, to_i32, view};
use super::inputs::CudaCall;
use super::module::load_kernel;
use super::plan::fused_tile;
use crate::op::kernel_params::FusedFwdParams;
use crate::op::shape::{GdpShape, CHUNK};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{CudaStorage, Layout, Result};

/// Threads per block of the forward kernel (`GDP_THREADS` in `cuda/gdp.cu`).
pub const THREADS: u32 = 256;

/// Dynamic shared memory of one block, in bytes, for key dimension `dk`, `bv` value columns and
/// input elements of `elem` bytes. Must match the carve-up at the top of `gdp_fwd` in
/// `cuda/gdp.cu`.
pub fn smem_bytes(dk: usize, bv: usize, elem: usize) -> usize {
    let c = CHUNK;
    let kstr = dk + if elem == 4 { 1 } else { 2 };
    let floats = dk * bv + 2 * c * bv + 3 * c * c + 4 * c;
    4 * floats + 2 * c * kstr * elem
}

/// Block shape of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchPlan {
    /// Value columns per block.
    pub bv: usize,
    /// Dynamic shared memory per block, bytes.
    pub smem: usize,
    /// Grid `(N·H, ceil(V / bv))`.
    pub grid: (u32, u32),
}

impl LaunchPlan {
    /// Picks the value tile `bv`: `forced` when set, else the widest tile that fits in
    /// `max_smem` bytes and still gives at least `sms / 2` blocks (else the narrowest fitting
    /// tile of at least 16 columns, for parallelism).
    pub fn new(
        sh: &GdpShape,
        elem: usize,
        max_smem: usize,
        sms: usize,
        forced: Option<usize>,
    ) -> Result<Self> {
        let smem = |bv: usize| smem_bytes(sh.dk, bv, elem);
        let rows = sh.num_seqs() * sh.heads;
        let what = "tiles.fused_forward";
        let (bv, grid) = fused_tile(sh.dv, rows, smem, max_smem, sms, forced, what)?;
        Ok(Self {
            bv,
            smem: smem(bv),
            grid,
        })
    }
}

/// The one-kernel forward `kernel` (of the inputs' dtype `T`) on the packed `qk`, `v` and the
/// gate buffer: the packed f32 `[o | final states]`.
pub(super) fn launch<T: CudaDType + DeviceRepr>(
    kernel: &str,
    dev: &CudaDevice,
    qk: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    aux: (&CudaStorage, &Layout),
    call: &CudaCall,
    h0_override: Option<&CudaSlice<f32>>,
) -> Result<CudaStorage> {
    let CudaCall {
        shape: sh,
        scale,
        has_h0,
        kernels: cfg,
        ..
    } = *call;
    let qk_v = view::<T>(qk.0, qk.1, sh.qk_len(), "qk")?;
    let v_v = view::<T>(v.0, v.1, sh.v_len(), "v")?;
    let aux_v = view::<f32>(aux.0, aux.1, sh.aux_len(has_h0), "gates")?;
    check_states(h0_override, sh, "initial-state override")?;
    let [b, t, h, k, vd, n] = shape_i32(sh)?;
    let mut seqs = Vec::with_capacity(3 * sh.num_seqs());
    for s in &sh.seqs {
        seqs.extend([
            to_i32(s.batch, "batch")?,
            to_i32(s.start, "start")?,
            to_i32(s.len, "len")?,
        ]);
    }
    let seqs = dev.clone_htod(&seqs)?;

    let (max_smem, sms) = smem_and_sms(dev, cfg.shared_memory_limit)?;
    let forced = cfg.tiles.fused_forward;
    let plan = LaunchPlan::new(sh, std::mem::size_of::<T>(), max_smem, sms, forced)?;

    let func = load_kernel(dev, kernel)?;
    allow_smem(&func, plan.smem)?;

    let mut out = dev.alloc_zeros::<f32>(sh.o_len() + sh.state_len())?;
    let use_override = i32::from(h0_override.is_some());
    let has_h0 = i32::from(has_h0);
    let bv = plan.bv as i32;
    let mut args = func.args();
    let params = FusedFwdParams {
        qk: args.read(&qk_v),
        v: args.read(&v_v),
        aux: args.read(&aux_v),
        seqs: args.read(&seqs),
        // Never read where the flag is 0, but a valid address all the same.
        h0_override: match h0_override {
            Some(h0) => args.read(h0),
            None => args.read(&aux_v),
        },
        out: args.write(&mut out),
        use_h0_override: use_override,
        batch: b,
        tokens: t,
        heads: h,
        dk: k,
        dv: vd,
        n,
        has_h0,
        scale,
        bv,
    };
    let cfg = LaunchConfig {
        grid_dim: (plan.grid.0, plan.grid.1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: plan.smem as u32,
    };
    // SAFETY: `gdp_fwd_*` takes `GdpFusedFwdParams`; the buffers' lengths were checked above
    // against the shape the kernel indexes with; the dynamic shared memory equals `smem_bytes`.
    unsafe { args.launch(cfg, &params) }?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}
