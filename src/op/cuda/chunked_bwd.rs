//! Launcher of the bf16 backward in FLA's split (`cuda/gdp_bwd_chunked.cuh`): the WY factors
//! and the forward scan rerun without its output (`gdp_fwd_states_bf16_<BV>_<KPT>`, staging no
//! query rows) to get every chunk's start state h and Delta, one reverse scan of the state
//! gradient (`gdp_bwd_dh_bf16_<BV>_<KPT>`: dS in registers, cp.async staging, like the forward
//! scan), then every gradient of every (chunk, head) in parallel
//! (`gdp_bwd_grads_bf16_<KP>_<VP>`; `_tiles` at K = V = 128 and n >= 2: dv and dk stored
//! through shared memory, measured faster there and slower at n = 1). The per-value-tile kernel
//! of `backward.rs` redoes the WY factors and all the chunk's gradient products on its
//! sequential path; this takes them off it. Where the forward kept its intermediates and the
//! state-gradient scan's blocks fill fewer than half the multiprocessors (B1 T32768 H16: 64 of
//! 132), the gradient kernel (its `_tiles` form: K = V = 128 tiles, n >= 2) runs beside it:
//! persistent blocks on the multiprocessors the scan leaves take the (chunk, head) pairs in the
//! order the scan finishes them and wait for each group of chunks (`gdpg_pipe` in the kernel
//! file), and once the scan is done a second launch takes the pairs left on every
//! multiprocessor. The bf16 default where it fits (K, V <= 128);
//! `KernelConfig::backward` forces the other (`Fused`) or this one (`Chunked`, an error where it
//! does not fit).

use super::chunked::{
    key_tile, query_rows, run_scan, scan_pair_plan, scan_plan, smem_and_sms, untracked,
    wy_smem_bytes, Bf16Inputs, ChunkStates, ChunkTable, ForwardCache, QkIn, ScanDest, ScanKind,
    ScanOut, ScanPlan, WyFactors, STATES_SCAN,
};
use super::launch::{allow_smem, check_states, shape_i32, to_i32, view};
use super::module::load_kernel;
use super::pipeline::{OverlapRun, Pipeline};
use super::side::SideStream;
use crate::op::config::{KernelConfig, KernelPath};
use crate::op::shape::{GdpShape, CHUNK};
use crate::op::QueryKeys;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use half::bf16;
use std::sync::Arc;

/// Threads per block of the gradient kernel (`GDPG_THREADS`) and its column groups
/// (`GDPG_GROUPS`).
const GRAD_THREADS: u32 = 512;
const GRAD_GROUPS: usize = 4;

/// Shared memory of the state-gradient scan, bytes (`gdp_bwd_dh_bf16_impl`: `ns` stages of
/// `gdpd_stage_bytes`, the bf16 state gradient twice, -dDelta, coef_q ⊙ dO, `ns` chunks' row
/// tables); `qr` query rows staged per chunk.
pub fn dh_smem_bytes(kpt: usize, qr: usize, bv: usize, ns: usize) -> usize {
    let c = CHUNK;
    let lb = bv + 8;
    let stage = 2 * ((2 * c + qr) * (kpt + 8) + qr * (c + 8) + qr * lb) + 4 * 3 * c;
    ns * stage + 2 * (2 * kpt * lb + c * lb + qr * lb) + 8 * ns * 3 * c + 12 * ns
}

/// The state-gradient scan (`gdp_bwd_dh_bf16_<BV>_<KPT>`, K up to 128).
pub(super) const DH_SCAN: ScanKind = ScanKind {
    prefix: "gdp_bwd_dh_bf16",
    smem: dh_smem_bytes,
    max_kpt: 128,
    tile: |t| t.dh_scan,
    tile_name: "tiles.dh_scan",
    queries: true,
    max_stages: 3,
    wide: true,
};

/// Shared memory of the gradient kernel, bytes (`gdpg_smem_bytes` in the kernel file).
pub fn grads_smem_bytes(kp: usize, vp: usize, qr: usize) -> usize {
    let c = CHUNK;
    2 * ((c + qr) * (kp + 8) + (kp + 4 * c + qr) * (vp + 8) + (c + qr) * (c + 8))
        + 4 * (c * 68 + 5 * c + 6 * GRAD_GROUPS * c + c + 8)
}

/// K or V padded to the gradient kernel's tiles (64 or 128).
fn grad_tile(d: usize) -> Option<usize> {
    [64, 128].into_iter().find(|&t| d <= t)
}

/// The gradient of the forward's output: the packed f32 `[do | dht]`, or `do [B, T, H, V]` alone
/// in bf16 (the op's plain output; `dht` is then zero unless overridden).
#[derive(Clone, Copy)]
pub enum Cotangent<'a> {
    Packed((&'a CudaStorage, &'a Layout)),
    Plain((&'a CudaStorage, &'a Layout)),
}

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

/// Whether the split backward serves this shape under `cfg.backward`: `Ok(None)` means the
/// per-value-tile backward; `Chunked` where it does not fit is an error.
fn plan(dev: &CudaDevice, sh: &GdpShape, cfg: &KernelConfig) -> Result<Option<SplitPlan>> {
    if cfg.backward == KernelPath::Fused {
        return Ok(None);
    }
    let forced = &cfg.tiles;
    let (max_smem, sms) = smem_and_sms(dev)?;
    let qr = query_rows(sh.n);
    let tiles = grad_tile(sh.dk)
        .zip(grad_tile(sh.dv))
        .filter(|&(kp, vp)| grads_smem_bytes(kp, vp, qr) <= max_smem);
    let fits = wy_smem_bytes(sh.dk, sh.dv) <= max_smem && key_tile(sh.dk).is_some();
    // The scans are planned only where the gradient and WY kernels fit (K, V <= 128), so that a
    // scan's forced value tile (`tiles.states_scan`, `tiles.dh_scan`) is not checked against
    // shapes the split backward never serves.
    let scans = match (tiles, fits) {
        (Some(_), true) => scan_plan(&STATES_SCAN, sh, max_smem, sms, forced)?
            .zip(scan_plan(&DH_SCAN, sh, max_smem, sms, forced)?),
        _ => None,
    };
    let side_by_side = match scans {
        Some(_) => scan_pair_plan([&STATES_SCAN, &DH_SCAN], sh, max_smem, sms, forced)?,
        None => None,
    };
    match (tiles, scans) {
        (Some((kp, vp)), Some((rerun, dh))) => Ok(Some(SplitPlan {
            kp,
            vp,
            rerun,
            dh,
            side_by_side,
        })),
        _ if cfg.backward == KernelPath::Chunked => candle_core::bail!(
            "gdp cuda: KernelConfig::backward = Chunked does not fit K = {}, V = {}, n = {} (needs K, V <= \
             128 and {max_smem} bytes of shared memory)",
            sh.dk,
            sh.dv,
            sh.n
        ),
        _ => Ok(None),
    }
}

/// Whether the split backward serves this shape (what a forward keeps its intermediates for).
pub(crate) fn split_backward_fits(
    dev: &CudaDevice,
    sh: &GdpShape,
    cfg: &KernelConfig,
) -> Result<bool> {
    Ok(plan(dev, sh, cfg)?.is_some())
}

/// The side stream of the backward's state-gradient scan: forked after the WY kernel, or an
/// overlapped launch of a [`Pipeline`] (the scan beside the gradient kernel, and, with `waits`,
/// beside a WY kernel taking the chunks from the sequences' ends).
enum Side {
    Plain(SideStream),
    Beside {
        run: OverlapRun,
        waits: bool,
    },
    /// Already joined (a widened context-parallel scan): the device's stream.
    Joined(Arc<CudaStream>),
}

impl Side {
    fn stream(&self) -> &Arc<CudaStream> {
        match self {
            Side::Plain(s) => s.stream(),
            Side::Beside { run, .. } => run.side.stream(),
            Side::Joined(s) => s,
        }
    }

    /// The WY kernel's readiness counters, where the scan runs beside it.
    fn ready(&self) -> Option<&CudaSlice<i32>> {
        match self {
            Side::Beside { run, waits: true } => Some(&run.ready),
            _ => None,
        }
    }

    /// Joins the side stream into the device's stream (beside: after recording it in the
    /// registry of overlapped launches).
    fn finish(self) -> Result<()> {
        match self {
            Side::Plain(s) => s.join(),
            Side::Beside { run, .. } => run.finish(),
            Side::Joined(_) => Ok(()),
        }
    }
}

/// The tiles and scan plans of one split backward.
struct SplitPlan {
    kp: usize,
    vp: usize,
    /// The states rerun and the state-gradient scan, each planned alone (the scan runs alone
    /// where the forward kept its intermediates).
    rerun: ScanPlan,
    dh: ScanPlan,
    /// The two planned to run side by side ([`scan_pair_plan`]), where a common tile lets them
    /// share the GPU.
    side_by_side: Option<[ScanPlan; 2]>,
}

/// A context-parallel rank's backward in one widened pass: the state-gradient scan runs from
/// `[dht | I_K]` on `[do | 0_K]`, so its initial-state gradients are the rank's `[γ | Mᵀ]` (f32
/// `[N, H, K, V + K]`) and every chunk row it writes is `[x⁰ | x̃]`. The function exchanges
/// those and returns what the following ranks send into the final states of the sequences
/// `range` (f32 `[range.len(), H, K, V]`), or `None`; the chunk rows are then corrected with
/// it (`x = x⁰ + x̃ dS`, [`super::cp_fix`]) and no second state-gradient scan runs.
pub(crate) type WidenedFold<'a> = Box<
    dyn FnOnce(&CudaSlice<f32>) -> Result<Option<(CudaSlice<f32>, std::ops::Range<usize>)>> + 'a,
>;

/// Runs the split bf16 backward if `cfg.backward` allows it and it fits this shape (the
/// contract of [`super::backward`] without `zero_dh0`, and with a plain `do` allowed);
/// `Ok(None)` means: use the per-value-tile backward. With the forward's `cache` (of these
/// inputs, without an initial-state override) the WY factors and chunk states are not
/// recomputed. With `widened` (a context-parallel rank) the state-gradient scan runs widened
/// ([`WidenedFold`]), beside the rerun, and the gradient kernel after both.
#[allow(clippy::too_many_arguments)]
pub fn try_backward_bf16(
    dev: &CudaDevice,
    qk: QkIn,
    v: (&CudaStorage, &Layout),
    aux: (&CudaStorage, &Layout),
    cot: Cotangent,
    sh: &GdpShape,
    scale: f32,
    has_h0: bool,
    h0_override: Option<&CudaSlice<f32>>,
    dht_override: Option<&CudaSlice<f32>>,
    layout: GradLayout,
    cache: Option<ForwardCache>,
    widened: Option<WidenedFold<'_>>,
    cfg: &KernelConfig,
) -> Result<Option<Grads>> {
    let Some(SplitPlan {
        kp,
        vp,
        rerun: rerun_alone,
        dh: dh_alone,
        side_by_side,
    }) = plan(dev, sh, cfg)?
    else {
        return Ok(None);
    };
    let (kept_wy, kept_states) = match cache {
        Some(cache) => {
            let (wy, states) = cache.into_parts();
            (Some(wy), states)
        }
        None => (None, None),
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
    let table = ChunkTable::new(dev, sh)?;
    let slots = table.slots(sh);
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
                    QkGrads::Split {
                        dq: dev.alloc::<bf16>(inp.q.len())?,
                        dk: dev.alloc::<bf16>(inp.k.len())?,
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
    let sms = smem_and_sms(dev)?.1;
    let pipeline = match widened {
        None => Pipeline::plan(dev, sh, &table, &dh, sms, sh.chunks_from_the_end(), cfg)?,
        Some(_) => None,
    };
    // With a pipeline, the WY kernel runs beside the state-gradient scan only where the scan
    // runs at the tile it would have alone (B1 T32768 H16), not beside a side-by-side pair of
    // wider scans: at B4 T4096 H16 n2 the scan's 64 blocks of 128 columns then waited for a WY
    // kernel on the other half of the GPU and the rerun for its end (forward+backward 4.666 ms
    // against 4.332 with the WY kernel first, on an H200).
    let side_by_side = rerun && dh.bv != alone_bv;
    let wy_beside = wy_again && !side_by_side && widened.is_none();
    // The gradient kernel's counters where it runs beside the state-gradient scan (zeroed
    // before the side stream forks): with the forward's intermediates, where the scan alone
    // would leave most multiprocessors idle, and after the rerun of a side-by-side pair, on the
    // multiprocessors the rerun leaves when it ends before the scan. A rerun at the scan's own
    // tile takes them instead (measured: the gradient kernel after it, beside the scan's end,
    // gained nothing at B1 T32768 on an H200). Only the kernel measured so (`_tiles`:
    // K, V in (64, 128], n >= 2) has persistent blocks.
    let grads_pipe = match &pipeline {
        Some(p) if !wy_beside && grads_tiles(kp, vp, sh.n) => {
            Some(dev.alloc_zeros::<i32>(GRADS_PIPE_COUNTERS + p.counters())?)
        }
        _ => None,
    };
    let mut wy = match kept_wy {
        Some(wy) => wy,
        None => WyFactors::alloc(dev, &table, sh, true)?,
    };
    let mut states = match kept_states {
        Some(states) => states,
        None => ChunkStates::alloc(dev, &table, sh)?,
    };

    // dO in bf16 (the tensor cores' operand type), and dht (f32) when given.
    let converted;
    let (dob, dht, do_src, dht_src) = match cot {
        Cotangent::Plain(d) => (
            view::<bf16>(d.0, d.1, o_len, "do")?,
            None,
            (d.0.as_cuda_slice::<bf16>()?, d.1.start_offset()),
            None,
        ),
        Cotangent::Packed(g) => {
            let grad = view::<f32>(g.0, g.1, o_len + s_len, "grad")?;
            converted = to_bf16(dev, &grad.slice(0..o_len))?;
            let at = g.1.start_offset() + o_len;
            (
                converted.slice(..),
                Some(grad.slice(o_len..o_len + s_len)),
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
    // its chunks done for the gradient kernel of 4.
    // SAFETY (dhs, ddn): the scan writes every element of every slot of the table's chunks
    // before the gradient kernel reads them; slots of no chunk are never read.
    let mut dhs = unsafe { dev.alloc::<bf16>(slots * kv)? };
    let mut ddn = unsafe { dev.alloc::<bf16>(slots * CHUNK * sh.dv)? };
    let dh0_at = aux_len - if has_h0 { s_len } else { 0 };
    // A context-parallel rank's widened scan (`WidenedDh`) or the plain op's, launched on a side
    // stream; then the rerun on the device's stream, beside it.
    let launched = if let Some(fold) = widened {
        if wy_again {
            wy.launch(dev, &inp, &table, sh, scale, None)?;
        }
        let ctx = WidenedDh {
            inp: &inp,
            table: &table,
            wy: &wy,
            sh,
            do_src,
            dht_src,
            beside_blocks: if rerun {
                sh.num_seqs() * sh.heads * sh.dv.div_ceil(rerun_plan.bv)
            } else {
                0
            },
            cfg,
        };
        Launched::Widened(Box::new(ctx.launch(dev)?), fold)
    } else {
        let mut dh0 = match &mut out {
            Grads::Packed(p) => p.slice_mut(sh.qk_len() + sh.v_len() + dh0_at..),
            Grads::Parts { daux, .. } => daux.slice_mut(dh0_at..),
        };
        let dht = match dht_override {
            Some(d) => Some(d.slice(..)),
            None => dht,
        };
        let dest = DhDest {
            chunks: Some((&mut dhs, &mut ddn)),
            dh0: has_h0.then_some(&mut dh0),
        };
        let dht = dht.as_ref();
        // With a pipeline: the side stream forked before the WY kernel where the scan runs
        // beside it (waiting for its counters); else forked after it.
        if side_by_side && wy_again {
            wy.launch(dev, &inp, &table, sh, scale, None)?;
        }
        let overlap = match &pipeline {
            Some(p) => p.start(dev)?.map(|run| (p, run)),
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
            Side::Plain(_) | Side::Joined(_) => None,
        };
        run_dh_scan(
            dev,
            side.stream(),
            &inp,
            &table,
            &wy,
            &dob,
            dht,
            sh,
            &dh,
            dest,
            side.ready(),
            signal,
        )?;
        Launched::Plain(side)
    };
    if rerun {
        let dest = ScanDest {
            out: ScanOut::None,
            states: Some(&mut states),
        };
        run_scan(
            dev,
            &inp,
            &table,
            &wy,
            sh,
            has_h0,
            h0_override,
            &rerun_plan,
            dest,
            None,
        )?;
    }
    let side = match launched {
        Launched::Plain(side) => side,
        Launched::Widened(run, fold) => {
            let dh0 = run.finish(dev, &mut dhs, &mut ddn, fold)?;
            if has_h0 {
                match &mut out {
                    Grads::Packed(p) => {
                        let at = sh.qk_len() + sh.v_len() + dh0_at;
                        super::copy_tensor_into(&dh0, p, at)?
                    }
                    Grads::Parts { daux, .. } => super::copy_tensor_into(&dh0, daux, dh0_at)?,
                }
            }
            Side::Joined(dev.cuda_stream())
        }
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
        sh,
        kp,
        vp,
        qr,
        ainv,
        states: &states,
        dhs: untracked(dev, &dhs),
        ddn: untracked(dev, &ddn),
        dob: &dob,
        scale,
    };
    match (&side, &pipeline, &grads_pipe) {
        (Side::Beside { .. }, Some(p), Some(pipe)) if table.chunks > 0 => {
            let scan_blocks = sh.num_seqs() * sh.heads * sh.dv.div_ceil(dh.bv);
            let pipe = PipeArgs {
                pipe: untracked(dev, pipe),
                order: untracked(dev, p.order()),
                ready_count: to_i32(sh.dv.div_ceil(dh.bv), "value tiles")?,
                scan_blocks: to_i32(scan_blocks, "scan blocks")?,
            };
            // The scan's blocks take at most half the multiprocessors (`Pipeline::plan`).
            grads.launch(dev, &mut out, Some((&pipe, true, sms - scan_blocks)))?;
            side.finish()?;
            grads.launch(dev, &mut out, Some((&pipe, false, 2 * sms)))?;
        }
        _ => {
            side.finish()?;
            // A block per pair: since the gradient kernel lost its K h product, 5% faster than
            // persistent blocks over the table's chunks (on an H200).
            if table.chunks > 0 {
                grads.launch(dev, &mut out, None)?;
            }
        }
    }
    Ok(Some(out))
}

/// Whether the gradient kernel with `kp`, `vp` tiles stores dv and dk through shared memory
/// (`_tiles`): K = V = 128 tiles at n >= 2, where it measured 3% faster (slower at n = 1,
/// on an H200). Only that kernel has persistent blocks (`_tiles_pipe`).
fn grads_tiles(kp: usize, vp: usize, n: usize) -> bool {
    kp == 128 && vp == 128 && n >= 2
}

/// Counters ahead of the per-group ones in the gradient kernel's pipe (`GDPG_PIPE_COUNTERS`:
/// the next pair to take, the state-gradient scan's blocks done).
const GRADS_PIPE_COUNTERS: usize = 2;

/// A gradient kernel's persistent blocks (`gdpg_pipe`): the pipe's counters and the chunk order
/// (device addresses outside cudarc's tracking: the state-gradient scan writes the counters, dS
/// and dDelta on its stream while the blocks beside it read them), the value tiles of the scan
/// that count each group done, and the scan's blocks.
struct PipeArgs {
    pipe: u64,
    order: u64,
    ready_count: i32,
    scan_blocks: i32,
}

/// The gradient kernel's inputs (`gdp_bwd_grads_bf16_impl`).
struct GradsLaunch<'a> {
    inp: &'a Bf16Inputs<'a>,
    table: &'a ChunkTable,
    sh: &'a GdpShape,
    kp: usize,
    vp: usize,
    qr: usize,
    ainv: &'a CudaSlice<bf16>,
    states: &'a ChunkStates,
    dhs: u64,
    ddn: u64,
    dob: &'a CudaView<'a, bf16>,
    scale: f32,
}

impl GradsLaunch<'_> {
    /// Launches the gradient kernel on the device's stream into `out`: a block per (chunk,
    /// head), or with `pipe` at most `blocks` persistent blocks, beside the state-gradient scan
    /// (waiting for its groups, leaving when it is done) or after it.
    fn launch(
        &self,
        dev: &CudaDevice,
        out: &mut Grads,
        pipe: Option<(&PipeArgs, bool, usize)>,
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
        let nseq = to_i32(sh.num_seqs(), "N")?;
        let qr_i = self.qr as i32;
        let null = 0u64;
        let mut args = func.builder();
        args.arg(&inp.q);
        args.arg(&inp.k);
        args.arg(&inp.split);
        args.arg(&inp.v);
        args.arg(&inp.aux);
        args.arg(&self.table.table);
        args.arg(self.ainv);
        args.arg(&self.states.hs);
        args.arg(&self.dhs);
        args.arg(&self.states.dn);
        args.arg(&self.ddn);
        args.arg(self.dob);
        // The kernel's `out, dqb, dkb, dvb_out, dgates` (a null `dkb` with a packed `dqk`).
        match out {
            Grads::Packed(p) => {
                args.arg(p);
                for _ in 0..4 {
                    args.arg(&null);
                }
            }
            Grads::Parts { dqk, dv, daux } => {
                args.arg(&null);
                match dqk {
                    QkGrads::Packed(dqk) => {
                        args.arg(dqk);
                        args.arg(&null);
                    }
                    QkGrads::Split { dq, dk } => {
                        args.arg(dq);
                        args.arg(dk);
                    }
                }
                args.arg(dv);
                args.arg(daux);
            }
        }
        for x in [&b, &t, &h, &k, &vd, &n, &nseq] {
            args.arg(x);
        }
        args.arg(&self.scale);
        args.arg(&qr_i);
        let pairs = self.table.chunks * sh.heads;
        let items = to_i32(pairs, "chunk-head pairs")?;
        let beside_i;
        let grid_dim = match pipe {
            None => (self.table.chunks as u32, sh.heads as u32, 1),
            Some((p, beside, blocks)) => {
                beside_i = i32::from(beside);
                args.arg(&p.pipe);
                args.arg(&p.order);
                args.arg(&items);
                args.arg(&p.ready_count);
                args.arg(&beside_i);
                args.arg(&p.scan_blocks);
                (blocks.clamp(1, pairs) as u32, 1, 1)
            }
        };
        let cfg = LaunchConfig {
            grid_dim,
            block_dim: (GRAD_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: the arguments match `gdp_bwd_grads_bf16_impl` (and `gdpg_pipe` for the
        // `_pipe` entries): every per-slot buffer was sized from the same table and filled
        // above on this stream, or (dS and dDelta, beside the scan) is read only after the
        // scan's counter of its group says it is written; the gradients are either the packed
        // f32 layout (null part pointers) or the parts (a null packed pointer), sized above;
        // the pipe holds `GRADS_PIPE_COUNTERS` plus the pipeline's counters, the order every
        // chunk of the table; the dynamic shared memory is `grads_smem_bytes`.
        unsafe { args.launch(cfg) }.w()?;
        Ok(())
    }
}

/// `src` rounded to bf16, in a new buffer.
pub(super) fn to_bf16(dev: &CudaDevice, src: &CudaView<f32>) -> Result<CudaSlice<bf16>> {
    let len = src.len();
    // SAFETY: the conversion below writes every element.
    let mut dst = unsafe { dev.alloc::<bf16>(len.max(1))? };
    if len == 0 {
        return Ok(dst);
    }
    let cvt = load_kernel(dev, "gdp_f32_to_bf16")?;
    let len_i = len as i64;
    let mut args = cvt.builder();
    args.arg(src);
    args.arg(&mut dst);
    args.arg(&len_i);
    let cfg = LaunchConfig {
        grid_dim: (len.div_ceil(256).min(65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `gdp_f32_to_bf16(src, dst, len)` with both buffers holding `len` elements.
    unsafe { args.launch(cfg) }.w()?;
    drop(args);
    Ok(dst)
}

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
/// counters of a WY kernel running beside it ([`super::pipeline::Pipeline`]).
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
            (sh.num_seqs() * sh.heads) as u32,
            sh.dv.div_ceil(plan.bv) as u32,
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

/// Context parallelism's replacements in a rank's backward: the folded initial states (f32
/// `[N, H, K, V]`, on the device), the final-state gradients from the following ranks, and the
/// sequences whose initial-state gradient went to earlier ranks as γ (their `dh0` rows are
/// zeroed).
pub(crate) struct CpOverrides<'a> {
    pub h0: CudaSlice<f32>,
    pub dht: CpFinalGrads<'a>,
    pub zero_dh0: Vec<usize>,
}

/// What the following ranks send into a rank's final-state gradients: folded already (added
/// to `dht`, f32 `[N, H, K, V]`), or exchanged from inside the backward's widened scan.
pub(crate) enum CpFinalGrads<'a> {
    Folded(CudaSlice<f32>),
    Widened(WidenedFold<'a>),
}

/// The split bf16 backward on tensors, for the op's `bwd`: the queries and keys (the packed
/// `qk`, or FLA's `q`, `k`), `v` (bf16), the gate buffer and the output's gradient `grad` (the
/// packed f32 `[do | dht]`, or with `plain` the bf16 `do [B, T, H, V]`) on one CUDA device;
/// returns the gradients of the query/key inputs (one or two, in their shapes) and of `v`
/// (bf16) and of the gate buffer (f32), without the packed f32 detour of
/// [`super::backward`]. `Ok(None)` where this path does not apply (not CUDA, not bf16, or the
/// split backward does not fit). `cp`: a context-parallel rank's overrides.
#[allow(clippy::too_many_arguments)]
pub(crate) fn try_backward_tensors(
    qk: QueryKeys,
    v: &Tensor,
    aux: &Tensor,
    grad: &Tensor,
    sh: &GdpShape,
    scale: f32,
    has_h0: bool,
    plain: bool,
    cache: Option<ForwardCache>,
    cp: Option<CpOverrides>,
    cfg: &KernelConfig,
) -> Result<Option<(Vec<Tensor>, Tensor, Tensor)>> {
    let inputs: Vec<&Tensor> = match qk {
        QueryKeys::Packed(qk) => vec![qk],
        QueryKeys::Split(q, k) => vec![q, k],
    };
    let lead = inputs[0];
    if lead.dtype() != DType::BF16 || v.dtype() != DType::BF16 || !lead.device().is_cuda() {
        return Ok(None);
    }
    let guards: Vec<_> = inputs.iter().map(|t| t.storage_and_layout()).collect();
    let mut cuda = vec![];
    for (s, l) in &guards {
        match &**s {
            Storage::Cuda(s) => cuda.push((s, *l)),
            _ => return Ok(None),
        }
    }
    let qk_in = match cuda[..] {
        [qk] => QkIn::Packed(qk),
        [q, k] => QkIn::Split(q, k),
        _ => candle_core::bail!("gdp cuda: one or two query/key inputs expected"),
    };
    let (vs, vl) = v.storage_and_layout();
    let (xs, xl) = aux.storage_and_layout();
    let (gs, gl) = grad.storage_and_layout();
    let (Storage::Cuda(vs), Storage::Cuda(xs), Storage::Cuda(gs)) = (&*vs, &*xs, &*gs) else {
        return Ok(None);
    };
    let dev = vs.device().clone();
    let cot = if plain {
        Cotangent::Plain((gs, gl))
    } else {
        Cotangent::Packed((gs, gl))
    };
    let (h0, dht, widened, zero_dh0) = match cp {
        None => (None, None, None, vec![]),
        Some(CpOverrides { h0, dht, zero_dh0 }) => match dht {
            CpFinalGrads::Folded(d) => (Some(h0), Some(d), None, zero_dh0),
            CpFinalGrads::Widened(f) => (Some(h0), None, Some(f), zero_dh0),
        },
    };
    let grads = try_backward_bf16(
        &dev,
        qk_in,
        (vs, vl),
        (xs, xl),
        cot,
        sh,
        scale,
        has_h0,
        h0.as_ref(),
        dht.as_ref(),
        GradLayout::Parts,
        cache,
        widened,
        cfg,
    )?;
    let Some(Grads::Parts { dqk, dv, mut daux }) = grads else {
        return Ok(None);
    };
    if has_h0 {
        let kv = sh.dk * sh.dv;
        let dh0 = sh.aux_len(true) - sh.state_len();
        for &s in &zero_dh0 {
            let at = dh0 + s * sh.heads * kv;
            let mut part = daux.slice_mut(at..at + sh.heads * kv);
            dev.cuda_stream().memset_zeros(&mut part).w()?;
        }
    }
    let tensor = |s: CudaStorage, shape: &Shape| {
        Tensor::from_storage(Storage::Cuda(s), shape.clone(), BackpropOp::none(), false)
    };
    let bf16_tensor = |s: CudaSlice<bf16>, t: &Tensor| {
        tensor(CudaStorage::wrap_cuda_slice(s, dev.clone()), t.shape())
    };
    let dqk = match dqk {
        QkGrads::Packed(dqk) => vec![bf16_tensor(dqk, inputs[0])],
        QkGrads::Split { dq, dk } => vec![bf16_tensor(dq, inputs[0]), bf16_tensor(dk, inputs[1])],
    };
    let dv = bf16_tensor(dv, v);
    let daux = tensor(CudaStorage::wrap_cuda_slice(daux, dev.clone()), aux.shape());
    Ok(Some((dqk, dv, daux)))
}

/// The widened state-gradient scan of a context-parallel rank ([`WidenedFold`]).
struct WidenedDh<'a> {
    inp: &'a Bf16Inputs<'a>,
    table: &'a ChunkTable,
    wy: &'a WyFactors,
    sh: &'a GdpShape,
    /// `do` (bf16 `[B, T, H, V]`): its buffer and first element.
    do_src: (&'a CudaSlice<bf16>, usize),
    /// `dht` (f32 `[N, H, K, V]`): its buffer and first element, when given.
    dht_src: Option<(&'a CudaSlice<f32>, usize)>,
    /// Blocks of the states rerun beside the scan (0: none): the scan's tile leaves them room.
    beside_blocks: usize,
    cfg: &'a KernelConfig,
}

impl<'a> WidenedDh<'a> {
    /// Launches the widened scan on a side stream forked from the device's (what runs on the
    /// device's stream until [`WidenedRun::finish`] runs beside it).
    fn launch(self, dev: &CudaDevice) -> Result<WidenedRun<'a>> {
        use super::summary::{widen_rows, widened_states_dev};
        let sh = self.sh;
        let (h, k, v) = (sh.heads, sh.dk, sh.dv);
        let wide = GdpShape {
            dv: v + k,
            ..sh.clone()
        };
        let (max_smem, sms) = smem_and_sms(dev)?;
        let budget = sms.saturating_sub(self.beside_blocks);
        let forced = &self.cfg.tiles;
        let Some(plan) =
            super::chunked::widened_scan_plan(&DH_SCAN, &wide, max_smem, sms, budget, forced)?
        else {
            candle_core::bail!(
                "gdp cuda: the widened state-gradient scan does not fit K = {k}, V = {v}, n = {}",
                sh.n
            );
        };
        let dow = widen_rows(
            dev,
            self.do_src.0,
            self.do_src.1,
            sh.batch * sh.tokens * h,
            v,
            k,
        )?;
        let dhtw = widened_states_dev(dev, self.dht_src, sh)?;
        let slots = self.table.slots(sh);
        // SAFETY: the scan writes every element of every slot of the table's chunks; slots of
        // no chunk are never read.
        let (mut dhs_w, mut ddn_w) = unsafe {
            (
                dev.alloc::<bf16>(slots * k * (v + k))?,
                dev.alloc::<bf16>(slots * CHUNK * (v + k))?,
            )
        };
        let mut dh0w = dev.alloc_zeros::<f32>(wide.state_len().max(1))?;
        let side = SideStream::fork(dev, self.cfg.side_streams)?;
        {
            let mut d0 = dh0w.slice_mut(..);
            let dest = DhDest {
                chunks: Some((&mut dhs_w, &mut ddn_w)),
                dh0: Some(&mut d0),
            };
            let (dow, dhtw) = (dow.slice(..), dhtw.slice(..));
            run_dh_scan(
                dev,
                side.stream(),
                self.inp,
                self.table,
                self.wy,
                &dow,
                Some(&dhtw),
                &wide,
                &plan,
                dest,
                None,
                None,
            )?;
        }
        Ok(WidenedRun {
            sh,
            chunks: self.table.chunks,
            side,
            dhs_w,
            ddn_w,
            dh0w,
            _inputs: (dow, dhtw),
        })
    }
}

/// A launched [`WidenedDh`]: its side stream and widened outputs.
struct WidenedRun<'a> {
    sh: &'a GdpShape,
    chunks: usize,
    side: SideStream,
    dhs_w: CudaSlice<bf16>,
    ddn_w: CudaSlice<bf16>,
    dh0w: CudaSlice<f32>,
    /// `[do | 0]` and `[dht | I]`, alive until the scan that reads them is joined.
    _inputs: (CudaSlice<bf16>, CudaSlice<f32>),
}

impl WidenedRun<'_> {
    /// Joins the scan, calls `fold` with its `[γ | Mᵀ]` and writes the corrected chunk rows into
    /// `dhs [slots, K, V]` and `ddn [slots, 64, V]`; returns the initial-state gradients f32
    /// `[N, H, K, V]`.
    fn finish(
        self,
        dev: &CudaDevice,
        dhs: &mut CudaSlice<bf16>,
        ddn: &mut CudaSlice<bf16>,
        fold: WidenedFold,
    ) -> Result<Tensor> {
        use super::cp_fix::{fix_planned, plan_rows, FixDims};
        use super::summary::chunk_spans;
        let sh = self.sh;
        let (ns, h, k, v) = (sh.num_seqs(), sh.heads, sh.dk, sh.dv);
        self.side.join()?;
        let folded = fold(&self.dh0w)?;
        let (s, fixed) = match &folded {
            Some((s, r)) => (Some(s.slice(..)), r.clone()),
            None => (None, 0..0),
        };
        let spans = chunk_spans(sh);
        let dims = FixDims {
            heads: h,
            dk: k,
            dv: v,
        };
        for (dst, src, inner) in [(dhs, &self.dhs_w, k), (ddn, &self.ddn_w, CHUNK)] {
            let rows = plan_rows(&spans, self.chunks, fixed.clone(), inner)?;
            let src = src.slice(..);
            fix_planned(dev, (&src, &mut dst.slice_mut(..)), s.as_ref(), dims, &rows)?;
        }
        // The initial-state gradients: γ⁰ + Mᵀ dS for the corrected sequences.
        let t = super::tensor_of(dev, &self.dh0w, &[ns, h, k, v + k])?;
        let dh0 = t.narrow(3, 0, v)?;
        let Some((s, r)) = &folded else {
            return dh0.contiguous();
        };
        let ds = super::tensor_of(dev, s, &[r.len(), h, k, v])?;
        let part = t.narrow(0, r.start, r.len())?;
        let fixed = (part.narrow(3, 0, v)? + part.narrow(3, v, k)?.contiguous()?.matmul(&ds)?)?;
        let mut parts = vec![];
        if r.start > 0 {
            parts.push(dh0.narrow(0, 0, r.start)?);
        }
        parts.push(fixed);
        if r.end < ns {
            parts.push(dh0.narrow(0, r.end, ns - r.end)?);
        }
        Tensor::cat(&parts, 0)
    }
}

/// The state-gradient scan as launched in the split backward: the plain op's, or a
/// context-parallel rank's widened one with the exchange still to run.
enum Launched<'a, 'f> {
    Plain(Side),
    Widened(Box<WidenedRun<'a>>, WidenedFold<'f>),
}
