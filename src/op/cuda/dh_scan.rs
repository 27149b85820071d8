//! The state-gradient scan (`gdp_bwd_dh_bf16_<BV>_<KPT>`): the reverse scan of dS, writing every
//! chunk's end-state gradient and dDelta for the gradient kernel, and the initial-state
//! gradients.

use super::device::{allow_smem, grid_dim, shape_i32, to_i32, GRID_X, GRID_YZ};
use super::inputs::{Bf16Inputs, ChunkTable};
use super::module::{load_kernel, On};
use super::plan::ScanPlan;
use super::wy::WyFactors;
use crate::op::kernel_params::DhParams;
use crate::op::shape::GdpShape;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig};
use candle_core::Result;
use half::bf16;
use std::ops::Range;

/// Where the state-gradient scan writes: every chunk's end-state gradient `dhs [slots, K, V]` and
/// `-dDelta` `ddn [slots, 64, V]` (bf16, for the gradient kernel; none for a CP summary), and
/// with `dh0` the initial-state gradients (f32 `[N, H, K, V]`). Borrowed shared: the scan may
/// run on a side stream while the gradient kernel reads `dhs` and `ddn` (`Launch::untracked`).
#[derive(Clone)]
pub(super) struct DhDest<'a> {
    pub chunks: Option<(&'a CudaSlice<bf16>, &'a CudaSlice<bf16>)>,
    pub dh0: Option<&'a CudaSlice<f32>>,
    /// The sequences whose value columns past dO's width are scanned (a context-parallel
    /// rank's fragments that need them); `None`: all (the others' rows there are not written).
    pub widened: Option<Range<usize>>,
}

/// What the state-gradient scan reads: the inputs, their chunk table, the WY factors (W, P and
/// the gate coefficients), the bf16 output gradient `dob [B, T, H, V']` (`V' = do_width`, at
/// most the scan's `V`; its columns past `V'` read as zero: a context-parallel rank's
/// `[dO | 0_K]`) and the end-state gradients `dht [N, H, K, V]` (zero when `None`), each of
/// these two as its buffer and first element.
#[derive(Clone, Copy)]
pub(super) struct DhInputs<'a> {
    pub inp: &'a Bf16Inputs<'a>,
    pub table: &'a ChunkTable,
    pub wy: &'a WyFactors,
    pub dob: (&'a CudaSlice<bf16>, usize),
    pub do_width: usize,
    pub dht: Option<(&'a CudaSlice<f32>, usize)>,
}

/// Runs the state-gradient scan `plan.kernel` (`gdp_bwd_dh_bf16_<BV>_<KPT>`) on `src` over
/// the value columns of `sh`, `on` the device's stream or a side stream (`side::SideStream`),
/// which keeps the buffers borrowed until it is joined; with `ready`,
/// waiting for the readiness counters of a WY kernel running beside it
/// (`pipeline::Pipeline`); with `signal`, counting its chunks done for a gradient kernel beside
/// it.
pub(super) fn run_dh_scan<'b>(
    on: On<'_, 'b>,
    src: &DhInputs<'b>,
    sh: &GdpShape,
    plan: &ScanPlan,
    dest: DhDest<'b>,
    ready: Option<&'b CudaSlice<i32>>,
    signal: Option<&'b CudaSlice<i32>>,
) -> Result<()> {
    let DhInputs {
        inp,
        table,
        wy,
        dob,
        do_width,
        dht,
    } = *src;
    let dev = &inp.dev;
    let [b, t, h, k, vd, n] = shape_i32(sh)?;
    let do_len = dob.0.len().saturating_sub(dob.1);
    if do_width > sh.dv || do_len < sh.batch * sh.tokens * sh.heads * do_width {
        candle_core::bail!(
            "gdp cuda: dO of {do_len} elements in rows of {do_width} for a scan of {} columns",
            sh.dv
        );
    }
    if let Some((d, at)) = dht {
        if d.len().saturating_sub(at) < sh.num_seqs() * sh.heads * sh.dk * sh.dv {
            candle_core::bail!("gdp cuda: dht of {} elements from {at}", d.len());
        }
    }
    let func = load_kernel(dev, &plan.kernel)?;
    allow_smem(&func, plan.smem)?;
    let mut args = func.args_on(on);
    let widened = dest.widened.unwrap_or(0..sh.num_seqs());
    // dS and dDelta outside cudarc's tracking: a gradient kernel beside the scan reads them.
    let (dhs, ddn) = match dest.chunks {
        Some((dhs, ddn)) => (args.untracked(dhs), args.untracked(ddn)),
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
        dob: args.read_at(dob.0, dob.1)?,
        // Never read where `has_dht` is 0, but a valid address all the same.
        dht: match dht {
            Some((d, at)) => args.read_at(d, at)?,
            None => args.read(&inp.aux),
        },
        dhs,
        ddn,
        // Written on the scan's stream, read after its join (untracked like dS).
        dh0: args.untracked_opt(dest.dh0),
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
