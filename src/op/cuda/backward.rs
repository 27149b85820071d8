//! The backward composed from its stages ([`backward`] dispatches): the bf16 split backward of
//! FLA's design (`cuda/gdp_bwd_chunked.cuh`, [`try_backward_bf16`]): the WY factors
//! and the forward scan rerun without its output (`gdp_fwd_states_bf16_<BV>_<KPT>`, staging no
//! query rows) to get every chunk's start state h and Delta, one reverse scan of the state
//! gradient (`gdp_bwd_dh_bf16_<BV>_<KPT>`: dS in registers, cp.async staging, like the forward
//! scan), then every gradient of every (chunk, head) in parallel
//! (`gdp_bwd_grads_bf16_<KP>_<VP>`; `_tiles` at K = V = 128 and n >= 2: dv and dk stored
//! through shared memory, measured faster there and slower at n = 1). The per-value-tile kernel
//! of `fused_bwd.rs` redoes the WY factors and all the chunk's gradient products on its
//! sequential path; this takes them off it. Where the forward kept its intermediates and the
//! state-gradient scan's blocks fill fewer than half the multiprocessors (B1 T32768 H16: 64 of
//! 132), the gradient kernel (its `_tiles` form: K = V = 128 tiles, n >= 2) runs beside it:
//! persistent blocks on the multiprocessors the scan leaves take the (chunk, head) pairs in the
//! order the scan finishes them and wait for each group of chunks (`gdpg_pipe` in the kernel
//! file), and once the scan is done a second launch takes the pairs left on every
//! multiprocessor. The bf16 default where it fits (K, V <= 128);
//! `KernelConfig::backward` forces the other (`Fused`) or this one (`Chunked`, an error where it
//! does not fit).

use super::cache::{ChunkStates, ForwardCache};
use super::copy::to_bf16;
use super::device::{check_inputs, check_states, smem_and_sms, to_i32, view, In};
use super::dh_scan::{run_dh_scan, DhDest, DhInputs};
use super::fused_bwd::{backward_len, Launch, MODE_FULL};
use super::fwd_scan::{run_scan, ScanDest, ScanInputs, ScanOut};
use super::grads::{GradLayout, Grads, GradsLaunch, PipeArgs, QkGrads, GRADS_PIPE_COUNTERS};
use super::inputs::{Bf16Inputs, ChunkTable, Cotangent, CudaCall, QkIn};
use super::module::On;
use super::pipeline::{OverlapRun, Pipeline};
use super::plan::{grads_tiles, query_rows, split_plan, SplitPlan};
use super::side::SideStream;
use super::widened::{WidenedDh, WidenedFold, WidenedRun};
use super::wy::WyFactors;
use crate::op::shape::{GdpShape, CHUNK};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result};
use half::bf16;

/// What a split backward starts from besides its inputs: the forward's kept intermediates and
/// a context-parallel rank's replacements.
#[derive(Default)]
pub(crate) struct SplitExtras<'a, 'f> {
    /// What the bf16 chunked forward of these inputs (and initial states) kept: spares the
    /// split backward its rerun of the WY kernel and the forward scan.
    pub cache: Option<ForwardCache>,
    /// Replaces the gate buffer's initial states (f32 `[N, H, K, V]`).
    pub h0: Option<&'a CudaSlice<f32>>,
    /// Replaces the cotangent's `dht` (f32 `[N, H, K, V]`).
    pub dht: Option<&'a CudaSlice<f32>>,
    /// Runs the state-gradient scan widened, the exchange inside ([`WidenedFold`]).
    pub widened: Option<WidenedFold<'f>>,
}

/// Backward on CUDA: `grad` is the f32 `[do (B·T·H·V) | dht (N·H·K·V)]`; returns the packed f32
/// `[dqk | dv | dg | dbeta | dh0?]` of [`crate::op::cpu::backward()`]. bf16 inputs take the split
/// backward (`try_backward_bf16`) where it fits (`KernelConfig::backward`), everything else the
/// per-value-tile kernel `gdp_bwd_*`. `extras.h0` replaces the initial states and `extras.dht`
/// the `dht` part of `grad` (context parallelism; `extras.widened` must be `None`); the
/// initial-state gradients of the sequences in `zero_dh0` are set to zero.
pub(crate) fn backward(
    qk: In,
    v: In,
    aux: In,
    grad: In,
    call: &CudaCall,
    extras: SplitExtras,
    zero_dh0: &[usize],
) -> Result<CudaStorage> {
    let CudaCall {
        shape: sh,
        scale,
        has_h0,
        kernels: cfg,
        ..
    } = *call;
    if extras.widened.is_some() {
        candle_core::bail!("gdp cuda: the packed backward does not run the widened scan");
    }
    let dev = check_inputs(qk, v, aux, Some(grad))?;
    let total = backward_len(sh, has_h0);
    let (h0_override, dht_override) = (extras.h0, extras.dht);
    let split = if qk.0.dtype() == DType::BF16 {
        use super::inputs::QkIn;
        let cot = Cotangent::Packed(grad);
        let layout = GradLayout::Packed;
        match try_backward_bf16(QkIn::Packed(qk), v, aux, cot, call, extras, layout)? {
            Some(Grads::Packed(out)) => Some(out),
            Some(Grads::Parts { .. }) => candle_core::bail!("gdp cuda: packed gradients expected"),
            None => None,
        }
    } else {
        None
    };
    let mut out = match split {
        Some(out) => out,
        None => {
            let mut out = dev.alloc_zeros::<f32>(total)?;
            let seqs: Vec<usize> = (0..sh.num_seqs()).collect();
            Launch {
                sh,
                scale,
                has_h0,
                seqs: &seqs,
                mode: MODE_FULL,
                h0: h0_override,
                grad: Some(grad),
                dht: dht_override,
                cfg,
            }
            .run(qk, v, aux, &mut out)?;
            out
        }
    };
    if has_h0 {
        zero_state_grads(&dev, &mut out, total - sh.state_len(), sh, zero_dh0)?;
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// Zeroes the initial-state gradients (`[N, H, K, V]`, from element `at` of `grads`) of the
/// sequences `seqs`: a context-parallel rank's sequences whose gradient went to earlier ranks.
pub(super) fn zero_state_grads(
    dev: &CudaDevice,
    grads: &mut CudaSlice<f32>,
    at: usize,
    sh: &GdpShape,
    seqs: &[usize],
) -> Result<()> {
    let per_seq = sh.heads * sh.dk * sh.dv;
    for &s in seqs {
        let start = at + s * per_seq;
        let mut part = grads.slice_mut(start..start + per_seq);
        dev.cuda_stream().memset_zeros(&mut part).w()?;
    }
    Ok(())
}

/// The side stream of the backward's state-gradient scan: forked after the WY kernel, or an
/// overlapped launch of a [`Pipeline`] (the scan beside the gradient kernel, and, with `waits`,
/// beside a WY kernel taking the chunks from the sequences' ends). Either keeps the scan's
/// buffers borrowed (`'b`) until it is joined.
pub(super) enum Side<'b> {
    Plain(SideStream<'b>),
    Beside { run: OverlapRun<'b>, waits: bool },
}

impl<'b> Side<'b> {
    fn on(&self) -> On<'_, 'b> {
        match self {
            Side::Plain(s) => s.on(),
            Side::Beside { run, .. } => run.side.on(),
        }
    }

    /// The WY kernel's readiness counters, where the scan runs beside it.
    fn ready(&self) -> Option<&'b CudaSlice<i32>> {
        match self {
            Side::Beside { run, waits: true } => Some(run.ready),
            _ => None,
        }
    }

    /// Joins the side stream into the device's stream (beside: after recording it in the
    /// registry of overlapped launches).
    fn finish(self) -> Result<()> {
        match self {
            Side::Plain(s) => s.join(),
            Side::Beside { run, .. } => run.finish(),
        }
    }
}

/// Runs the split bf16 backward if `cfg.backward` allows it and it fits this shape (the
/// contract of [`backward`] without `zero_dh0`, and with a plain `do` allowed);
/// `Ok(None)` means: use the per-value-tile backward. With the forward's `cache` (of these
/// inputs, without an initial-state override) the WY factors and chunk states are not
/// recomputed. With `widened` (a context-parallel rank) the state-gradient scan runs widened
/// ([`WidenedFold`]), beside the rerun, and the gradient kernel after both.
pub(super) fn try_backward_bf16(
    qk: QkIn,
    v: (&CudaStorage, &Layout),
    aux: (&CudaStorage, &Layout),
    cot: Cotangent,
    call: &CudaCall,
    extras: SplitExtras,
    layout: GradLayout,
) -> Result<Option<Grads>> {
    let CudaCall {
        shape: sh,
        scale,
        has_h0,
        kernels: cfg,
        ..
    } = *call;
    let SplitExtras {
        cache,
        h0: h0_override,
        dht: dht_override,
        widened,
    } = extras;
    let dev = &qk.lead().0.device().clone();
    let (kept_wy, kept_states, segments) = match cache {
        Some(cache) => {
            let (wy, states, segments) = cache.into_parts();
            (Some(wy), states, segments)
        }
        None => (None, None, None),
    };
    // A forward in segments kept their incoming states: the plain op's backward runs in the
    // same segments (`super::segmented`), its scans and kernels over the sub-problem `tsh`
    // whose sequences are the segments; the gradients keep the op's layout.
    let segments =
        segments.filter(|_| widened.is_none() && h0_override.is_none() && dht_override.is_none());
    let tsh = segments.as_ref().map_or(sh, |s| &s.sub);
    let Some(SplitPlan {
        kp,
        vp,
        rerun: rerun_alone,
        dh: dh_alone,
        side_by_side,
    }) = split_plan(dev, tsh, cfg)?
    else {
        return Ok(None);
    };
    let widened = match &segments {
        Some(s) => Some(s.fold(dev)?),
        None => widened,
    };
    // Rerun the forward scan for the chunk states unless the forward kept them; compute the WY
    // factors unless it kept those (it keeps the states only with them).
    let rerun = kept_states.is_none();
    let wy_again = kept_wy.is_none();
    let qr = query_rows(sh.n);
    let inp = Bf16Inputs::new(qk, v, aux, sh, has_h0)?;
    check_states(h0_override, sh, "initial-state override")?;
    check_states(dht_override, sh, "dht override")?;
    let (o_len, s_len) = (sh.o_len(), sh.state_len());
    let table = ChunkTable::new(dev, tsh)?;
    let slots = table.slots(tsh);
    let kv = sh.dk * sh.dv;
    let aux_len = sh.aux_len(has_h0);
    // SAFETY: the kernels below write every element of the gradients: `cu_seqlens` covers
    // every token (`validate_cu_seqlens`), and the gradient kernel writes dq, dk, dv, dβ and dg
    // of every row of every chunk (each once), the state-gradient scan dh0 of every (sequence,
    // head) when the layout has it. With no (sequence, head) pair every length is zero.
    let mut out = unsafe {
        match (layout, inp.split) {
            (GradLayout::Packed, 0) => {
                Grads::Packed(dev.alloc::<f32>(sh.qk_len() + sh.v_len() + aux_len)?)
            }
            (GradLayout::Packed, _) => candle_core::bail!(
                "gdp cuda: the packed f32 gradients need the packed `qk`, not `q` and `k`"
            ),
            (GradLayout::Parts, split) => Grads::Parts {
                dqk: if split == 0 {
                    QkGrads::Packed(dev.alloc::<bf16>(sh.qk_len())?)
                } else {
                    // Per value head (the layout of `q`, `k` at H heads): with grouped value
                    // heads, the caller sums each group.
                    let q_len = sh.batch * sh.tokens * sh.heads * sh.dk;
                    QkGrads::Split {
                        dq: dev.alloc::<bf16>(q_len)?,
                        dk: dev.alloc::<bf16>(q_len * sh.n)?,
                    }
                },
                dv: dev.alloc::<bf16>(sh.v_len())?,
                daux: dev.alloc::<f32>(aux_len)?,
            },
        }
    };
    if sh.num_seqs() * sh.heads == 0 {
        return Ok(Some(out));
    }

    // 1. WY factors with Ainv (kept by the forward, or computed again below: before both scans,
    // or beside the state-gradient scan), and the buffers of every chunk's start state and Delta
    // (kept by the forward, or computed again in 3).
    let alone_bv = dh_alone.bv;
    let [rerun_plan, dh] = match side_by_side {
        Some(pair) if rerun && widened.is_none() => pair,
        _ => [rerun_alone, dh_alone],
    };
    let sms = smem_and_sms(dev, None)?.1;
    let pipeline = match widened {
        None => {
            let order = sh.chunks_from_the_end();
            Pipeline::plan(dev, sh, &table, &dh, order, cfg)?
        }
        Some(_) => None,
    };
    // With a pipeline, the WY kernel runs beside the state-gradient scan only where the scan
    // runs at the tile it would have alone (B1 T32768 H16), not beside a side-by-side pair of
    // wider scans: there the scan's blocks wait for a WY kernel on the other half of the GPU and
    // the rerun for its end, slower than the WY kernel first.
    let side_by_side = rerun && dh.bv != alone_bv;
    let wy_beside = wy_again && !side_by_side && widened.is_none();
    // The gradient kernel's counters where it runs beside the state-gradient scan (zeroed
    // before the side stream forks): with the forward's intermediates, where the scan alone
    // would leave most multiprocessors idle, and after the rerun of a side-by-side pair, on the
    // multiprocessors the rerun leaves when it ends before the scan. A rerun at the scan's own
    // tile takes them instead (the gradient kernel after it, beside the scan's end, gained
    // nothing). Only the kernel measured so (`_tiles`:
    // K, V in (64, 128], n >= 2) has persistent blocks.
    let grads_pipe = match &pipeline {
        Some(p) if !wy_beside && grads_tiles(kp, vp, sh.n) => {
            Some(dev.alloc_zeros::<i32>(GRADS_PIPE_COUNTERS + p.counters())?)
        }
        _ => None,
    };
    let wy = match kept_wy {
        Some(wy) => wy,
        None => WyFactors::alloc(dev, &table, tsh, true)?,
    };
    let mut states = match kept_states {
        Some(states) => states,
        None => ChunkStates::alloc(dev, &table, tsh)?,
    };

    // dO in bf16 (the tensor cores' operand type), and dht (f32) when given: each as a view
    // (the gradient kernel's) and as its buffer and first element (the state-gradient scan's).
    let converted;
    let (dob, do_src, dht_src) = match cot {
        Cotangent::Plain(d) => (
            view::<bf16>(d.0, d.1, o_len, "do")?,
            (d.0.as_cuda_slice::<bf16>()?, d.1.start_offset()),
            None,
        ),
        Cotangent::Packed(g) => {
            let grad = view::<f32>(g.0, g.1, o_len + s_len, "grad")?;
            converted = to_bf16(dev, &grad.slice(0..o_len))?;
            let at = g.1.start_offset() + o_len;
            (
                converted.slice(..),
                (&converted, 0),
                Some((g.0.as_cuda_slice::<f32>()?, at)),
            )
        }
    };

    // 3. The state-gradient scan on a side stream, beside the forward's rerun (when the forward
    // kept no states) on the device's stream: the two are independent, each sequential over the
    // chunks with a block per (sequence, head, value tile), and at small B·H (B1 H16: 64 blocks
    // each on 132 multiprocessors) one alone leaves half the GPU idle. There (`pipeline`) the
    // scan starts on a high-priority stream, beside the WY kernel when it reruns, else counting
    // its chunks done for the gradient kernel of 4. What the scan writes and reads is declared
    // here, before its side stream, which borrows it until it is joined.
    let dh0_at = aux_len - if has_h0 { s_len } else { 0 };
    let (plain_rows, wide_bufs, counters);
    // The plain scan's initial-state gradients, copied into `out` once it is joined (the
    // gradient kernel writes the rest of `out` meanwhile).
    let mut dh0 = None;
    // A context-parallel rank's widened scan (`WidenedDh`) or the plain op's, launched on a side
    // stream; then the rerun on the device's stream, beside it.
    let segment_dht;
    let launched = if let Some(fold) = widened {
        if wy_again {
            wy.launch(dev, &inp, &table, tsh, scale, None)?;
        }
        // In segments, each sequence's dht goes to its last segment.
        let dht_src = match &segments {
            Some(s) => {
                segment_dht = s.scatter_dht(dev, dht_src)?;
                segment_dht.as_ref().map(|d| (d, 0))
            }
            None => dht_src,
        };
        let ctx = WidenedDh {
            inp: &inp,
            table: &table,
            wy: &wy,
            sh: tsh,
            do_src,
            dht_src,
            widened: fold.outgoing.clone(),
            beside_blocks: if rerun {
                tsh.scan_blocks(tsh.dv, rerun_plan.bv)
            } else {
                0
            },
            cfg,
        };
        wide_bufs = ctx.buffers(dev)?;
        Launched::Widened(Box::new(ctx.launch(dev, &wide_bufs)?), fold)
    } else {
        // SAFETY: the scan writes every element of every slot of the table's chunks (dS, dDelta)
        // before the gradient kernel reads them, and the initial-state gradient of every
        // (sequence, head); slots of no chunk are never read.
        plain_rows = unsafe {
            (
                dev.alloc::<bf16>(slots * kv)?,
                dev.alloc::<bf16>(slots * CHUNK * sh.dv)?,
            )
        };
        if has_h0 {
            dh0 = Some(unsafe { dev.alloc::<f32>(s_len)? });
        }
        let dest = DhDest {
            chunks: Some((&plain_rows.0, &plain_rows.1)),
            dh0: dh0.as_ref(),
            widened: None,
        };
        // With a pipeline: the side stream forked before the WY kernel where the scan runs
        // beside it (waiting for its counters); else forked after it.
        if side_by_side && wy_again {
            wy.launch(dev, &inp, &table, sh, scale, None)?;
        }
        let overlap = match &pipeline {
            Some(p) => {
                counters = p.zeroed_counters(dev)?;
                p.start(dev, &counters)?.map(|run| (p, run))
            }
            None => None,
        };
        let side = match overlap {
            Some((p, run)) => {
                if wy_beside {
                    wy.launch(dev, &inp, &table, sh, scale, Some(p.signal(&run, false)))?;
                }
                Side::Beside {
                    run,
                    waits: wy_beside,
                }
            }
            None => {
                if wy_beside {
                    wy.launch(dev, &inp, &table, sh, scale, None)?;
                }
                Side::Plain(SideStream::fork(dev, cfg.side_streams)?)
            }
        };
        let signal = match &side {
            Side::Beside { .. } => grads_pipe.as_ref(),
            Side::Plain(_) => None,
        };
        let src = DhInputs {
            inp: &inp,
            table: &table,
            wy: &wy,
            dob: do_src,
            do_width: sh.dv,
            dht: dht_override.map(|d| (d, 0)).or(dht_src),
        };
        run_dh_scan(side.on(), &src, sh, &dh, dest, side.ready(), signal)?;
        Launched::Plain(side, (&plain_rows.0, &plain_rows.1))
    };
    if rerun {
        let dest = ScanDest {
            out: ScanOut::None,
            states: Some(&mut states),
            widened: None,
        };
        let src = ScanInputs {
            inp: &inp,
            table: &table,
            h0_override: segments.as_ref().map(|s| &s.incoming).or(h0_override),
        };
        run_scan(&src, &wy, tsh, &rerun_plan, dest, None)?;
    }
    // The plain scan still running beside what follows, and the chunk rows the gradient kernel
    // reads (the widened scan's, corrected once it is joined and the exchange has run).
    let fixed_rows;
    let (side, (dhs, ddn)) = match launched {
        Launched::Plain(side, rows) => (Some(side), rows),
        Launched::Widened(run, fold) => {
            let (dhs, ddn, dh0) = run.finish(dev, fold, has_h0)?;
            if let Some(dh0) = dh0 {
                let dh0 = match &segments {
                    Some(s) => s.first_segments(&dh0)?,
                    None => dh0,
                };
                out.copy_states_in(&dh0, sh, dh0_at)?;
            }
            fixed_rows = (dhs, ddn);
            (None, (&fixed_rows.0, &fixed_rows.1))
        }
    };
    // Joins the plain scan and puts its initial-state gradients into `out`.
    let join = |side: Option<Side>, out: &mut Grads| -> Result<()> {
        if let Some(side) = side {
            side.finish()?;
        }
        if let Some(d) = &dh0 {
            out.copy_states_slice_in(dev, d, sh, dh0_at)?;
        }
        Ok(())
    };

    // 4. Every gradient, per (chunk, head): beside the state-gradient scan where it counts its
    // chunks (persistent blocks on the multiprocessors it leaves, then the pairs left on all of
    // them once it is done), else after it.
    let ainv = wy
        .ainv
        .as_ref()
        .ok_or_else(|| candle_core::Error::Msg("gdp cuda: Ainv was not kept".into()))?;
    let grads = GradsLaunch {
        inp: &inp,
        table: &table,
        sh: tsh,
        kp,
        vp,
        qr,
        ainv,
        states: &states,
        dhs,
        ddn,
        dob: &dob,
        scale,
    };
    match (&side, &pipeline, &grads_pipe) {
        (Some(Side::Beside { .. }), Some(p), Some(pipe)) if table.chunks > 0 => {
            let dh_blocks = sh.scan_blocks(sh.dv, dh.bv);
            let pipe = PipeArgs {
                pipe,
                order: p.order(),
                ready_count: to_i32(sh.dv.div_ceil(dh.bv), "value tiles")?,
                scan_blocks: to_i32(dh_blocks, "scan blocks")?,
            };
            // The scan's blocks take at most half the multiprocessors (`Pipeline::plan`).
            grads.launch(dev, &mut out, Some((&pipe, true, sms - dh_blocks)))?;
            join(side, &mut out)?;
            grads.launch(dev, &mut out, Some((&pipe, false, 2 * sms)))?;
        }
        _ => {
            join(side, &mut out)?;
            // A block per pair: since the gradient kernel lost its K h product, faster than
            // persistent blocks over the table's chunks.
            if table.chunks > 0 {
                grads.launch(dev, &mut out, None)?;
            }
        }
    }
    Ok(Some(out))
}

/// The state-gradient scan as launched in the split backward: the plain op's, or a
/// context-parallel rank's widened one with the exchange still to run.
pub(super) enum Launched<'a, 'b, 'f> {
    /// The plain scan's side stream and the chunk rows it writes (`dhs`, `ddn`).
    Plain(Side<'b>, (&'b CudaSlice<bf16>, &'b CudaSlice<bf16>)),
    Widened(Box<WidenedRun<'a, 'b>>, WidenedFold<'f>),
}
