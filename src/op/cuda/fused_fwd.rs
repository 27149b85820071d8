//! The one-kernel forward `gdp_fwd_*` (`cuda/gdp.cu`, any dtype): the WY factors recomputed in
//! every value tile on the sequential path; the fallback where the chunked bf16 kernels do not
//! serve.

use super::device::{allow_smem, check_states, device_attr, shape_i32, to_i32, view};
use super::module::load_kernel;
use crate::op::shape::{GdpShape, CHUNK};
use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CudaStorage, Layout, Result};

/// Threads per block of the forward kernel (`GDP_THREADS` in `cuda/gdp.cu`).
pub const THREADS: u32 = 256;

/// Candidate value-column tile widths, widest first.
pub(super) const BV_CANDIDATES: [usize; 4] = [64, 32, 16, 8];

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
        let cap = sh.dv.next_power_of_two().clamp(8, 64);
        let fits = |bv: usize| smem_bytes(sh.dk, bv, elem) <= max_smem;
        let rows = sh.num_seqs() * sh.heads;
        let blocks = |bv: usize| rows * sh.dv.div_ceil(bv);
        let bv = match forced {
            Some(bv) => {
                if !BV_CANDIDATES.contains(&bv) {
                    candle_core::bail!(
                        "gdp cuda: KernelConfig::tiles.fused_forward must be one of {BV_CANDIDATES:?}, got {bv}"
                    );
                }
                if !fits(bv) {
                    candle_core::bail!(
                        "gdp cuda: KernelConfig::tiles.fused_forward = {bv} needs {} bytes of shared memory, the device allows {max_smem}",
                        smem_bytes(sh.dk, bv, elem)
                    );
                }
                bv
            }
            None => {
                let fitting: Vec<usize> = BV_CANDIDATES
                    .iter()
                    .copied()
                    .filter(|&bv| bv <= cap && fits(bv))
                    .collect();
                let Some(&narrowest) = fitting.last() else {
                    candle_core::bail!(
                        "gdp cuda: K = {} needs {} bytes of shared memory even with 8 value columns \
                         per block, the device allows {max_smem}",
                        sh.dk,
                        smem_bytes(sh.dk, 8, elem)
                    );
                };
                // Each block recomputes the V-independent WY factors, so narrower tiles cost
                // more work in all; only split V further while the grid is under half a wave.
                match fitting.iter().copied().find(|&bv| 2 * blocks(bv) >= sms) {
                    Some(bv) => bv,
                    None => fitting
                        .iter()
                        .rev()
                        .copied()
                        .find(|&bv| bv >= 16)
                        .unwrap_or(narrowest),
                }
            }
        };
        let (gx, gy) = (rows, sh.dv.div_ceil(bv));
        if gx > i32::MAX as usize || gy > 65_535 {
            candle_core::bail!("gdp cuda: grid ({gx}, {gy}) is too large");
        }
        Ok(Self {
            bv,
            smem: smem_bytes(sh.dk, bv, elem),
            grid: (gx as u32, gy as u32),
        })
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn launch<T: CudaDType + DeviceRepr>(
    kernel: &str,
    dev: &CudaDevice,
    qk: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    aux: (&CudaStorage, &Layout),
    sh: &GdpShape,
    scale: f32,
    has_h0: bool,
    h0_override: Option<&CudaSlice<f32>>,
    forced_bv: Option<usize>,
) -> Result<CudaStorage> {
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

    let max_smem = device_attr(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    )?;
    let sms = device_attr(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )?;
    let plan = LaunchPlan::new(sh, std::mem::size_of::<T>(), max_smem, sms, forced_bv)?;

    let func = load_kernel(dev, kernel)?;
    allow_smem(&func, plan.smem)?;

    let mut out = dev.alloc_zeros::<f32>(sh.o_len() + sh.state_len())?;
    let use_override = i32::from(h0_override.is_some());
    let has_h0 = i32::from(has_h0);
    let bv = plan.bv as i32;
    let mut args = func.builder();
    args.arg(&qk_v);
    args.arg(&v_v);
    args.arg(&aux_v);
    args.arg(&seqs);
    match h0_override {
        Some(h0) => args.arg(h0),
        // Never read (the flag is 0), but the kernel wants a valid pointer.
        None => args.arg(&aux_v),
    };
    args.arg(&use_override);
    args.arg(&mut out);
    for x in [&b, &t, &h, &k, &vd, &n, &has_h0] {
        args.arg(x);
    }
    args.arg(&scale);
    args.arg(&bv);
    let cfg = LaunchConfig {
        grid_dim: (plan.grid.0, plan.grid.1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: plan.smem as u32,
    };
    // SAFETY: the argument list matches `gdp_fwd_*` in cuda/gdp.cu (pointers to buffers whose
    // lengths were checked above against the shape the kernel indexes with, then the i32 sizes,
    // the f32 scale and the tile width); the dynamic shared memory equals `smem_bytes`.
    unsafe { args.launch(cfg) }.w()?;
    drop(args);
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}
