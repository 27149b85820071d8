//! The forward state scan (`gdp_fwd_scan_bf16_<BV>_<KPT>`, and without its output
//! `gdp_fwd_states_bf16_<BV>_<KPT>`): sequential over the chunks with the state in registers,
//! the next chunk's operands copied with cp.async while the current one computes.

use super::cache::ChunkStates;
use super::device::{allow_smem, grid_dim, shape_i32, untracked, GRID_X, GRID_YZ};
use super::inputs::{Bf16Inputs, ChunkTable};
use super::module::load_kernel;
use super::plan::ScanPlan;
use super::wy::WyFactors;
use crate::op::shape::GdpShape;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::Result;
use half::bf16;
use std::sync::Arc;

/// Where a scan runs beside the WY kernel (`pipeline::Pipeline`): its stream and the
/// WY kernel's readiness counters it waits for.
#[derive(Clone, Copy)]
pub(super) struct Beside<'a> {
    pub stream: &'a Arc<CudaStream>,
    pub ready: &'a CudaSlice<i32>,
}

/// The forward scan's output: the packed f32 `[o | final state]`, `o` alone in bf16, `o` in
/// bf16 and the final states apart (a context-parallel rank's widened scan), the final states
/// alone (f32 `[N, H, K, V]`, context parallelism's summaries), or none (the backward's rerun).
pub(super) enum ScanOut<'a> {
    Packed(&'a mut CudaSlice<f32>),
    Plain(&'a mut CudaSlice<bf16>),
    PlainFinal(&'a mut CudaSlice<bf16>, &'a mut CudaSlice<f32>),
    Final(&'a mut CudaSlice<f32>),
    None,
}

/// Where the forward scan writes: its output and, for the backward, the chunk states.
pub(super) struct ScanDest<'a> {
    pub out: ScanOut<'a>,
    pub states: Option<&'a mut ChunkStates>,
}

/// Runs the forward scan `plan.kernel` on the WY factors of `table`'s chunks.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_scan(
    dev: &CudaDevice,
    inp: &Bf16Inputs,
    table: &ChunkTable,
    wy: &WyFactors,
    sh: &GdpShape,
    has_h0: bool,
    h0_override: Option<&CudaSlice<f32>>,
    plan: &ScanPlan,
    dest: ScanDest,
    beside: Option<Beside>,
) -> Result<()> {
    let [b, t, h, k, vd, n] = shape_i32(sh)?;
    let with_output = matches!(
        dest.out,
        ScanOut::Packed(_) | ScanOut::Plain(_) | ScanOut::PlainFinal(..)
    );
    if with_output && plan.qr == 0 {
        candle_core::bail!("gdp cuda: {} writes no output", plan.kernel);
    }
    let scan = load_kernel(dev, &plan.kernel)?;
    allow_smem(&scan, plan.smem)?;
    let use_override = i32::from(h0_override.is_some());
    let has_h0 = i32::from(has_h0);
    let qr = plan.qr as i32;
    let stages = plan.stages as i32;
    let null = 0u64;
    let wy_in = [
        untracked(dev, &wy.w),
        untracked(dev, &wy.u),
        untracked(dev, &wy.p),
        untracked(dev, &wy.coef),
    ];
    let ready = beside.map_or(0, |b| untracked(dev, b.ready));
    let mut args = match beside {
        Some(b) => scan.builder_on(b.stream),
        None => scan.builder(),
    };
    args.arg(&inp.q);
    args.arg(&inp.k);
    args.arg(&inp.split);
    args.arg(&inp.aux);
    args.arg(&table.table);
    for x in &wy_in {
        args.arg(x);
    }
    match h0_override {
        Some(h0) => args.arg(h0),
        // Never read (the flag is 0), but the kernel wants a valid pointer.
        None => args.arg(&inp.aux),
    };
    args.arg(&use_override);
    // The kernel's `out, outb, fin, hs, dn`: f32 o, bf16 o, final states, start states, Delta.
    let mut parts;
    match dest.out {
        ScanOut::Packed(out) => {
            parts = out.split_at_mut(sh.o_len());
            args.arg(&mut parts.0);
            args.arg(&null);
            args.arg(&mut parts.1);
        }
        ScanOut::Plain(o) => {
            args.arg(&null);
            args.arg(o);
            args.arg(&null);
        }
        ScanOut::PlainFinal(o, fin) => {
            args.arg(&null);
            args.arg(o);
            args.arg(fin);
        }
        ScanOut::Final(fin) => {
            args.arg(&null);
            args.arg(&null);
            args.arg(fin);
        }
        ScanOut::None => {
            for _ in 0..3 {
                args.arg(&null);
            }
        }
    }
    match dest.states {
        Some(st) => {
            args.arg(&mut st.hs);
            args.arg(&mut st.dn);
        }
        None => {
            args.arg(&null);
            args.arg(&null);
        }
    }
    for x in [&b, &t, &h, &k, &vd, &n, &has_h0, &qr, &stages] {
        args.arg(x);
    }
    args.arg(&ready);
    let rows = sh.num_seqs() * sh.heads;
    let cfg = LaunchConfig {
        grid_dim: (
            grid_dim(rows, "sequences x heads", GRID_X)?,
            grid_dim(sh.dv.div_ceil(plan.bv), "value tiles", GRID_YZ)?,
            1,
        ),
        block_dim: (plan.threads, 1, 1),
        shared_mem_bytes: plan.smem as u32,
    };
    // SAFETY: the arguments match `gdp_fwd_scan_bf16_impl` (a null pointer for each output not
    // wanted: it writes what is not null); the scratch buffers were filled by the WY launch
    // before this one on the same stream, or (`beside`) are filled by one running beside it,
    // whose readiness counters the kernel waits for before reading a chunk's; the dynamic
    // shared memory is the plan's.
    unsafe { args.launch(cfg) }.w()?;
    drop(args);
    Ok(())
}
