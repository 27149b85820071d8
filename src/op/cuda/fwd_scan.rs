//! The forward state scan (`gdp_fwd_scan_bf16_<BV>_<KPT>`, and without its output
//! `gdp_fwd_states_bf16_<BV>_<KPT>`): sequential over the chunks with the state in registers,
//! the next chunk's operands copied with cp.async while the current one computes.

use super::cache::ChunkStates;
use super::device::{allow_smem, grid_dim, shape_i32, to_i32, GRID_X, GRID_YZ};
use super::inputs::{Bf16Inputs, ChunkTable};
use super::module::load_kernel;
use super::module::On;
use super::plan::ScanPlan;
use super::wy::WyFactors;
use crate::op::kernel_params::ScanParams;
use crate::op::shape::GdpShape;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig};
use candle_core::Result;
use half::bf16;
use std::ops::Range;

/// Where a scan runs beside the WY kernel (`pipeline::Pipeline`): its side stream, for whose
/// life `'b` the scan's buffers stay borrowed, and the WY kernel's readiness counters it waits
/// for.
#[derive(Clone, Copy)]
pub(super) struct Beside<'s, 'b> {
    pub on: On<'s, 'b>,
    pub ready: &'b CudaSlice<i32>,
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
    /// The sequences whose value columns past U's width are scanned (a context-parallel rank's
    /// fragments that need them); `None`: all (the others' rows there are not written).
    pub widened: Option<Range<usize>>,
}

/// What the forward scan reads besides the WY factors: the inputs, their chunk table, and the
/// initial states that replace the gate buffer's (f32 `[N, H, K, V]`, or `[N, H, K, V + K]`
/// for a context-parallel rank's widened scan), if any.
#[derive(Clone, Copy)]
pub(super) struct ScanInputs<'a> {
    pub inp: &'a Bf16Inputs<'a>,
    pub table: &'a ChunkTable,
    pub h0_override: Option<&'a CudaSlice<f32>>,
}

/// Runs the forward scan `plan.kernel` on the WY factors of `src.table`'s chunks, over the
/// value columns of `sh` (U's `wy.dv` columns and, past them, zeros: a context-parallel rank's
/// `[U | 0_K]`).
pub(super) fn run_scan<'b>(
    src: &ScanInputs<'b>,
    wy: &'b WyFactors,
    sh: &GdpShape,
    plan: &ScanPlan,
    dest: ScanDest<'b>,
    beside: Option<Beside<'_, 'b>>,
) -> Result<()> {
    let ScanInputs {
        inp,
        table,
        h0_override,
    } = *src;
    let dev = &inp.dev;
    let [b, t, h, k, vd, n] = shape_i32(sh)?;
    let with_output = matches!(
        dest.out,
        ScanOut::Packed(_) | ScanOut::Plain(_) | ScanOut::PlainFinal(..)
    );
    if with_output && plan.qr == 0 {
        candle_core::bail!("gdp cuda: {} writes no output", plan.kernel);
    }
    if wy.dv > sh.dv {
        candle_core::bail!(
            "gdp cuda: U has {} value columns, the scan {}",
            wy.dv,
            sh.dv
        );
    }
    let scan = load_kernel(dev, &plan.kernel)?;
    allow_smem(&scan, plan.smem)?;
    let mut args = match beside {
        Some(b) => scan.args_on(b.on),
        None => scan.args(),
    };
    // The kernel's `out, outb, fin, hs, dn`: f32 o, bf16 o, final states, start states, Delta
    // (null where not wanted: it writes what is not null).
    let (mut out, mut outb, mut fin) = (0, 0, 0);
    match dest.out {
        ScanOut::Packed(o) => {
            // Its `o` and final-state parts, at one address and `o_len` floats on.
            if o.len() < sh.o_len() + sh.state_len() {
                candle_core::bail!("gdp cuda: a packed output of {} elements", o.len());
            }
            out = args.write(o);
            fin = out + (sh.o_len() * std::mem::size_of::<f32>()) as u64;
        }
        ScanOut::Plain(o) => outb = args.write(o),
        ScanOut::PlainFinal(o, f) => (outb, fin) = (args.write(o), args.write(f)),
        ScanOut::Final(f) => fin = args.write(f),
        ScanOut::None => {}
    }
    let (hs, dn) = match dest.states {
        Some(st) => (args.write(&mut st.hs), args.write(&mut st.dn)),
        None => (0, 0),
    };
    let widened = dest.widened.unwrap_or(0..sh.num_seqs());
    let params = ScanParams {
        q: args.read(&inp.q),
        k: args.read(&inp.k),
        aux: args.read(&inp.aux),
        table: args.read(&table.table),
        // The WY factors outside cudarc's event tracking (see `Launch::untracked`).
        w: args.untracked(&wy.w),
        u: args.untracked(&wy.u),
        p: args.untracked(&wy.p),
        coef: args.untracked(&wy.coef),
        // Never read where the flag is 0, but a valid address all the same.
        h0_override: match h0_override {
            Some(h0) => args.read(h0),
            None => args.read(&inp.aux),
        },
        out,
        outb,
        fin,
        hs,
        dn,
        ready: args.untracked_opt(beside.map(|b| b.ready)),
        split: inp.split,
        use_h0_override: i32::from(h0_override.is_some()),
        batch: b,
        tokens: t,
        heads: h,
        dk: k,
        dv: vd,
        dv_in: to_i32(wy.dv, "V")?,
        wide_from: to_i32(widened.start, "N")?,
        wide_to: to_i32(widened.end, "N")?,
        n,
        has_h0: i32::from(inp.has_h0),
        qr: plan.qr as i32,
        ns: plan.stages as i32,
    };
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
    // SAFETY: `gdp_fwd_scan_bf16_*` takes `GdpScanParams` (a null pointer for each output not
    // wanted: it writes what is not null); the scratch buffers were filled by the WY launch
    // before this one on the same stream, or (`beside`) are filled by one running beside it,
    // whose readiness counters the kernel waits for before reading a chunk's; the dynamic
    // shared memory is the plan's.
    unsafe { args.launch(cfg, &params) }?;
    Ok(())
}
