//! The state-gradient scan (`gdp_bwd_dh_bf16_<BV>_<KPT>`): the reverse scan of dS, writing every
//! chunk's end-state gradient and dDelta for the gradient kernel, and the initial-state
//! gradients.

use super::device::{allow_smem, grid_dim, shape_i32, untracked, GRID_X, GRID_YZ};
use super::inputs::{Bf16Inputs, ChunkTable};
use super::module::load_kernel;
use super::plan::ScanPlan;
use super::wy::WyFactors;
use crate::op::shape::GdpShape;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::Result;
use half::bf16;
use std::sync::Arc;

/// Where the state-gradient scan writes: every chunk's end-state gradient `dhs [slots, K, V]` and
/// `-dDelta` `ddn [slots, 64, V]` (bf16, for the gradient kernel; none for a CP summary), and
/// with `dh0` the initial-state gradients (f32 `[N, H, K, V]`).
pub(super) struct DhDest<'a, 'b> {
    pub chunks: Option<(&'a mut CudaSlice<bf16>, &'a mut CudaSlice<bf16>)>,
    pub dh0: Option<&'a mut CudaViewMut<'b, f32>>,
}

/// Runs the state-gradient scan `plan.kernel` (`gdp_bwd_dh_bf16_<BV>_<KPT>`) over `table`'s
/// chunks with the WY factors `wy` (W, P and the gate coefficients), the bf16 output gradient
/// `dob [B, T, H, V]` and the end-state gradients `dht [N, H, K, V]` (zero when `None`), on
/// `stream` (the device's, or a [`SideStream`]'s); with `ready`, waiting for the readiness
/// counters of a WY kernel running beside it (`pipeline::Pipeline`).
#[allow(clippy::too_many_arguments)]
pub(super) fn run_dh_scan(
    dev: &CudaDevice,
    stream: &Arc<CudaStream>,
    inp: &Bf16Inputs,
    table: &ChunkTable,
    wy: &WyFactors,
    dob: &CudaView<bf16>,
    dht: Option<&CudaView<f32>>,
    sh: &GdpShape,
    plan: &ScanPlan,
    dest: DhDest,
    ready: Option<&CudaSlice<i32>>,
    signal: Option<&CudaSlice<i32>>,
) -> Result<()> {
    let [b, t, h, k, vd, n] = shape_i32(sh)?;
    let func = load_kernel(dev, &plan.kernel)?;
    allow_smem(&func, plan.smem)?;
    let has_dht = i32::from(dht.is_some());
    let write_dh0 = i32::from(dest.dh0.is_some());
    let (qr, ns) = (plan.qr as i32, plan.stages as i32);
    let null = 0u64;
    // The WY factors and counters outside cudarc's event tracking (`untracked`): a WY kernel
    // beside this scan writes them while it reads them.
    let wy_in = [
        untracked(dev, &wy.w),
        untracked(dev, &wy.p),
        untracked(dev, &wy.coef),
    ];
    let ready = ready.map_or(0, |r| untracked(dev, r));
    let signal = signal.map_or(0, |r| untracked(dev, r));
    let mut args = func.builder_on(stream);
    args.arg(&inp.q);
    args.arg(&inp.k);
    args.arg(&inp.split);
    args.arg(&table.table);
    for x in &wy_in {
        args.arg(x);
    }
    args.arg(dob);
    match dht {
        Some(d) => args.arg(d),
        // Never read (`has_dht` is 0), but the kernel wants a valid pointer.
        None => args.arg(&inp.aux),
    };
    args.arg(&has_dht);
    match dest.chunks {
        Some((dhs, ddn)) => {
            args.arg(dhs);
            args.arg(ddn);
        }
        None => {
            args.arg(&null);
            args.arg(&null);
        }
    }
    match dest.dh0 {
        Some(d) => args.arg(d),
        None => args.arg(&null),
    };
    args.arg(&write_dh0);
    for x in [&b, &t, &h, &k, &vd, &n, &qr, &ns] {
        args.arg(x);
    }
    args.arg(&ready);
    args.arg(&signal);
    let cfg = LaunchConfig {
        grid_dim: (
            grid_dim(sh.num_seqs() * sh.heads, "sequences x heads", GRID_X)?,
            grid_dim(sh.dv.div_ceil(plan.bv), "value tiles", GRID_YZ)?,
            1,
        ),
        block_dim: (plan.threads, 1, 1),
        shared_mem_bytes: plan.smem as u32,
    };
    // SAFETY: the arguments match `gdp_bwd_dh_bf16_impl`: the WY factors come from launches on
    // this stream (or on the device's stream, which it was forked from after them), or, with
    // `ready`, from a WY kernel beside it whose counters it waits for; the bf16 dO from before
    // the fork; all are sized from `sh` and `table`; dht (read only with `has_dht`) and dh0
    // (written only with `write_dh0`) hold one state per (sequence, head);
    // dhs and ddn hold every slot of the table, or are null (not written); `ready` is null (no
    // wait) or holds `ready_counters` counters; the dynamic shared memory is the plan's
    // (`dh_smem_bytes`).
    unsafe { args.launch(cfg) }.w()?;
    Ok(())
}
