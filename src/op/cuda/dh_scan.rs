//! The state-gradient scan (`gdp_bwd_dh_bf16_<BV>_<KPT>`): the reverse scan of dS, writing every
//! chunk's end-state gradient and dDelta for the gradient kernel, and the initial-state
//! gradients.

use super::device::{allow_smem, grid_dim, shape_i32, to_i32, GRID_X, GRID_YZ};
use super::inputs::{Bf16Inputs, ChunkTable};
use super::module::load_kernel;
use super::plan::ScanPlan;
use super::wy::WyFactors;
use crate::op::kernel_params::DhParams;
use crate::op::shape::GdpShape;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig,
};
use candle_core::Result;
use half::bf16;
use std::ops::Range;
use std::sync::Arc;

/// Where the state-gradient scan writes: every chunk's end-state gradient `dhs [slots, K, V]` and
/// `-dDelta` `ddn [slots, 64, V]` (bf16, for the gradient kernel; none for a CP summary), and
/// with `dh0` the initial-state gradients (f32 `[N, H, K, V]`).
pub(super) struct DhDest<'a, 'b> {
    pub chunks: Option<(&'a mut CudaSlice<bf16>, &'a mut CudaSlice<bf16>)>,
    pub dh0: Option<&'a mut CudaViewMut<'b, f32>>,
    /// The sequences whose value columns past dO's width are scanned (a context-parallel
    /// rank's fragments that need them); `None`: all (the others' rows there are not written).
    pub widened: Option<Range<usize>>,
}

/// What the state-gradient scan reads: the inputs, their chunk table, the WY factors (W, P and
/// the gate coefficients), the bf16 output gradient `dob [B, T, H, V']` (`V' = do_width`, at
/// most the scan's `V`; its columns past `V'` read as zero: a context-parallel rank's
/// `[dO | 0_K]`) and the end-state gradients `dht [N, H, K, V]` (zero when `None`).
pub(super) struct DhInputs<'a> {
    pub inp: &'a Bf16Inputs<'a>,
    pub table: &'a ChunkTable,
    pub wy: &'a WyFactors,
    pub dob: CudaView<'a, bf16>,
    pub do_width: usize,
    pub dht: Option<CudaView<'a, f32>>,
}

/// Runs the state-gradient scan `plan.kernel` (`gdp_bwd_dh_bf16_<BV>_<KPT>`) on `src` over
/// the value columns of `sh`, on `stream` (the device's, or a [`SideStream`]'s); with `ready`,
/// waiting for the readiness counters of a WY kernel running beside it
/// (`pipeline::Pipeline`); with `signal`, counting its chunks done for a gradient kernel beside
/// it.
pub(super) fn run_dh_scan(
    stream: &Arc<CudaStream>,
    src: &DhInputs,
    sh: &GdpShape,
    plan: &ScanPlan,
    dest: DhDest,
    ready: Option<&CudaSlice<i32>>,
    signal: Option<&CudaSlice<i32>>,
) -> Result<()> {
    let DhInputs {
        inp,
        table,
        wy,
        ref dob,
        do_width,
        ref dht,
    } = *src;
    let dev = &inp.dev;
    let [b, t, h, k, vd, n] = shape_i32(sh)?;
    if do_width > sh.dv || dob.len() < sh.batch * sh.tokens * sh.heads * do_width {
        candle_core::bail!(
            "gdp cuda: dO of {} elements in rows of {do_width} for a scan of {} columns",
            dob.len(),
            sh.dv
        );
    }
    let func = load_kernel(dev, &plan.kernel)?;
    allow_smem(&func, plan.smem)?;
    let mut args = func.args_on(stream);
    let widened = dest.widened.unwrap_or(0..sh.num_seqs());
    let (dhs, ddn) = match dest.chunks {
        Some((dhs, ddn)) => (args.write(dhs), args.write(ddn)),
        None => (0, 0),
    };
    let params = DhParams {
        q: args.read(&inp.q),
        k: args.read(&inp.k),
        table: args.read(&table.table),
        // The WY factors and counters outside cudarc's event tracking (`Launch::untracked`): a WY
        // kernel beside this scan writes them while it reads them.
        w: args.untracked(&wy.w),
        p: args.untracked(&wy.p),
        coef: args.untracked(&wy.coef),
        dob: args.read(dob),
        // Never read where `has_dht` is 0, but a valid address all the same.
        dht: match dht {
            Some(d) => args.read(d),
            None => args.read(&inp.aux),
        },
        dhs,
        ddn,
        dh0: match dest.dh0 {
            Some(d) => args.write(d),
            None => 0,
        },
        ready: args.untracked_opt(ready),
        signal: args.untracked_opt(signal),
        split: inp.split,
        has_dht: i32::from(dht.is_some()),
        write_dh0: 0,
        batch: b,
        tokens: t,
        heads: h,
        dk: k,
        dv: vd,
        dv_in: to_i32(do_width, "V")?,
        wide_from: to_i32(widened.start, "N")?,
        wide_to: to_i32(widened.end, "N")?,
        n,
        qr: plan.qr as i32,
        ns: plan.stages as i32,
    };
    let params = DhParams {
        write_dh0: i32::from(params.dh0 != 0),
        ..params
    };
    let cfg = LaunchConfig {
        grid_dim: (
            grid_dim(sh.num_seqs() * sh.heads, "sequences x heads", GRID_X)?,
            grid_dim(sh.dv.div_ceil(plan.bv), "value tiles", GRID_YZ)?,
            1,
        ),
        block_dim: (plan.threads, 1, 1),
        shared_mem_bytes: plan.smem as u32,
    };
    // SAFETY: `gdp_bwd_dh_bf16_*` takes `GdpDhParams`: the WY factors come from launches on
    // this stream (or on the device's stream, which it was forked from after them), or, with
    // `ready`, from a WY kernel beside it whose counters it waits for; the bf16 dO from before
    // the fork; all are sized from `sh` and `table`; dht (read only with `has_dht`) and dh0
    // (written only with `write_dh0`) hold one state per (sequence, head);
    // dhs and ddn hold every slot of the table, or are null (not written); `ready` is null (no
    // wait) or holds `ready_counters` counters; the dynamic shared memory is the plan's
    // (`dh_smem_bytes`).
    unsafe { args.launch(cfg, &params) }?;
    Ok(())
}
