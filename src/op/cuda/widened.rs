//! A context-parallel rank in one widened pass per direction, on the bf16 chunked kernels.
//!
//! Forward ([`widened_forward`], [`finish_widened_forward`]): the forward scan
//! (`gdp_fwd_scan_bf16_*`) on the value columns widened to `[u | 0_K]` from the initial states
//! `[h0 | I_K]` writes `[o⁰ | Q̃]` and the summary `[ΔS | M]`; after the exchange
//! `o = o⁰ + Q̃ S_in` (`cp_fix`). Backward ([`WidenedDh`], [`WidenedRun`]): the
//! state-gradient scan on `[do | 0_K]` from `[dht | I_K]` writes `[x⁰ | x̃]` and `[γ | Mᵀ]`;
//! after the exchange `x = x⁰ + x̃ dS`. Both recurrences are separable over value columns, so
//! the `K` extra columns carry the fragment's transition; the WY factors (which do not depend
//! on the values' width) are computed once for the real `V`. At small `B·H` the scans are short
//! of blocks, so the extra columns cost little time.

use super::copy::copy_rows_slice;
use super::device::{smem_and_sms, In};
use super::dh_scan::{run_dh_scan, DhDest, DhInputs};
use super::fwd_scan::{ScanDest, ScanInputs, ScanOut};
use super::inputs::{Bf16Inputs, ChunkTable, CudaCall, QkIn};
use super::pipeline::{wy_then_scan, Pipeline};
use super::plan::{widened_scan_plan, wy_smem_bytes, ScanKind, ScanPlan, DH_SCAN, FWD_SCAN};
use super::side::SideStream;
use super::wy::WyFactors;
use crate::op::config::{KernelConfig, KernelPath};
use crate::op::pack::RowCopy;
use crate::op::shape::{GdpShape, CHUNK};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result, Tensor};
use half::bf16;
use std::ops::Range;

/// [`KernelConfig::summaries`] for bf16 inputs (`None`: the per-value-tile kernel's summaries).
pub(super) fn wanted(qk: In, cfg: &KernelConfig) -> Option<KernelPath> {
    (qk.0.dtype() == DType::BF16 && cfg.summaries != KernelPath::Fused).then_some(cfg.summaries)
}

/// Whether a context-parallel rank of shape `sh` (its shard) runs on the bf16 chunked kernels
/// both ways under `cfg` (the widened forward and the widened state-gradient scan, besides
/// what [`reads_qk_in_place`](super::reads_qk_in_place) asks of the plain op), so that it reads
/// FLA's `q`, `k` in place instead of a packed copy. `q` says the device and dtype. Decided from
/// the shape, dtype and device only, as the collectives that follow need.
pub fn rank_reads_qk_in_place(q: &Tensor, sh: &GdpShape, cfg: &KernelConfig) -> Result<bool> {
    let candle_core::Device::Cuda(dev) = q.device() else {
        return Ok(false);
    };
    if cfg.summaries == KernelPath::Fused || !super::reads_qk_in_place(q, sh, cfg)? {
        return Ok(false);
    }
    Ok(Widened::plan_every(dev, sh, &FWD_SCAN, cfg)?.is_some()
        && backward_summaries_served(dev, sh, cfg)?)
}

/// Whether the backward summaries of bf16 inputs of shape `sh` run on the chunked kernels here
/// (what a rank's direct bf16 backward needs, since it has no packed f32 `do`).
pub(crate) fn backward_summaries_served(
    dev: &CudaDevice,
    sh: &GdpShape,
    cfg: &KernelConfig,
) -> Result<bool> {
    if cfg.summaries == KernelPath::Fused {
        return Ok(false);
    }
    Ok(Widened::plan_every(dev, sh, &DH_SCAN, cfg)?.is_some())
}

/// A summary's sub-problem: `sh` with only the sequences `frags` (in that order), the same with
/// `K` more value columns, and the plan of the scan of `kind` over those.
pub(super) struct Widened {
    pub(super) sub: GdpShape,
    pub(super) wide: GdpShape,
    pub(super) plan: ScanPlan,
}

impl Widened {
    /// `None` where the widened scan or the WY kernel does not fit. The tile is the one wave of
    /// blocks that fills the GPU where there is one ([`widened_scan_plan`]);
    /// [`Widened::forward_scan`] runs the scan beside the WY kernel where the blocks leave more
    /// than half the multiprocessors idle ([`Pipeline`]). (Narrowing the blocks to make room for
    /// the WY kernel costs the scan more than the WY kernel it hides; `docs/cp.md`.)
    pub(super) fn plan(
        dev: &CudaDevice,
        sh: &GdpShape,
        frags: &[usize],
        kind: &ScanKind,
        cfg: &KernelConfig,
    ) -> Result<Option<Self>> {
        let sub = GdpShape {
            seqs: frags.iter().map(|&s| sh.seqs[s]).collect(),
            ..sh.clone()
        };
        let wide = GdpShape {
            dv: sh.dv + sh.dk,
            ..sub.clone()
        };
        let (max_smem, sms) = smem_and_sms(dev, cfg.shared_memory_limit)?;
        if wy_smem_bytes(sh.dk, sh.dv) > max_smem {
            return Ok(None);
        }
        let plan = widened_scan_plan(kind, &wide, max_smem, sms, sms, &cfg.tiles)?;
        Ok(plan.map(|plan| Self { sub, wide, plan }))
    }

    /// [`Widened::plan`] over every sequence of `sh`.
    pub(super) fn plan_every(
        dev: &CudaDevice,
        sh: &GdpShape,
        kind: &ScanKind,
        cfg: &KernelConfig,
    ) -> Result<Option<Self>> {
        let every: Vec<usize> = (0..sh.num_seqs()).collect();
        Self::plan(dev, sh, &every, kind, cfg)
    }

    /// Runs the WY kernel over the sub-problem's chunks (keeping `Ainv` with `keep`) and the
    /// forward scan on the values widened to `[U | 0_K]` (U read in place) from the initial
    /// states `h0w` (`[h0 | I_K]` per fragment and head, f32 `[N, H, K, V + K]`) into `dest`
    /// (whose `widened` are the sequences whose scan runs widened; `None`: all): side by side
    /// where the plan leaves the WY kernel room ([`Pipeline`]), else one after the other.
    /// Returns the WY factors, as the backward reads them.
    pub(super) fn forward_scan(
        &self,
        inp: &Bf16Inputs,
        scale: f32,
        h0w: &CudaSlice<f32>,
        dest: ScanDest,
        keep: bool,
        cfg: &KernelConfig,
    ) -> Result<WyFactors> {
        let (sub, wide, dev) = (&self.sub, &self.wide, &inp.dev);
        let table = ChunkTable::new(dev, sub)?;
        let order = sub.chunks_time_major();
        let pipeline = Pipeline::plan(dev, wide, &table, &self.plan, order, cfg)?;
        let wy = WyFactors::alloc(dev, &table, sub, keep)?;
        let src = ScanInputs {
            inp,
            table: &table,
            h0_override: Some(h0w),
        };
        wy_then_scan(pipeline.as_ref(), &src, &wy, wide, scale, &self.plan, dest)?;
        Ok(wy)
    }
}

/// `[x | I_K]` per (sequence, head) on the device, `[N, H, K, V + K]` f32: the rows of `x`
/// (f32 `[N, H, K, V]`, elements from `at` on in `src`) or zeros, each widened by an identity
/// (`gdp_cp_widen_states`, no host copy).
pub(crate) fn widened_states_dev(
    dev: &CudaDevice,
    src: Option<(&CudaSlice<f32>, usize)>,
    sh: &GdpShape,
) -> Result<CudaSlice<f32>> {
    use super::device::to_i32;
    use crate::op::kernel_params::WidenParams;
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    let blocks = sh.num_seqs() * sh.heads;
    let total = blocks * sh.dk * (sh.dv + sh.dk);
    // SAFETY: the kernel below writes every element.
    let mut out = unsafe { dev.alloc::<f32>(total.max(1))? };
    if total == 0 {
        return Ok(out);
    }
    if let Some((x, at)) = src {
        if x.len() < at + sh.state_len() {
            candle_core::bail!(
                "gdp cuda: {} states from {at} in {} elements",
                sh.state_len(),
                x.len()
            );
        }
    }
    let func = super::module::load_kernel(dev, "gdp_cp_widen_states")?;
    let x = src.map(|(x, at)| x.slice(at..));
    let mut args = func.args();
    let params = WidenParams {
        x: args.read_opt(x.as_ref()),
        out: args.write(&mut out),
        blocks: blocks as i64,
        dk: to_i32(sh.dk, "K")?,
        dv: to_i32(sh.dv, "V")?,
    };
    // Four elements a thread where the widths allow it (the kernel checks the alignment too and
    // otherwise walks the elements one by one over the same threads).
    let per_thread = if sh.dv.is_multiple_of(4) && sh.dk.is_multiple_of(4) {
        4
    } else {
        1
    };
    let cfg = LaunchConfig {
        grid_dim: (total.div_ceil(256 * per_thread).min(65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `gdp_cp_widen_states` takes `GdpWidenParams`: `out` holds `blocks·K·(V+K)`
    // elements, `x` (when not null) `blocks·K·V` from its start, checked above.
    unsafe { args.launch(cfg, &params) }?;
    Ok(out)
}

/// A context-parallel rank's forward in one widened pass ([`widened_forward`]): the scan from
/// `[S0 | I_K]` on `[U | 0_K]`, whose rows are `[o⁰ | Q̃]` and whose final states are
/// `[ΔS | M]`; the rank's output is `o⁰ + Q̃ S` once the incoming state `S` is known.
pub(crate) struct WidenedForward {
    /// `[o⁰ | Q̃]`, bf16 `[B, T, H, V + K]`.
    pub o: CudaSlice<bf16>,
    /// `[ΔS | M]`, f32 `[N, H, K, V + K]`.
    pub fin: CudaSlice<f32>,
}

/// Runs the forward of a context-parallel rank in one widened pass on the bf16 chunked kernels,
/// from the initial states `h0` (f32 `[N, H, K, V]` on the device: zeros for the sequences
/// `incoming`, which continue from an earlier rank and are the only ones whose scan runs
/// widened: their `Q̃` corrects their output, their `M` goes to the later ranks; the transition
/// of a fragment that starts on this rank multiplies nothing); with `cache`, the WY factors
/// stay for the backward (which reruns the state scan from the folded states). `Ok(None)`
/// where these kernels do not serve (not bf16, `KernelConfig::summaries` = `Fused`, or the
/// shape).
pub(crate) fn widened_forward(
    qk: QkIn,
    v: In,
    aux: In,
    call: &CudaCall,
    h0: &CudaSlice<f32>,
    incoming: Range<usize>,
    cache: Option<&super::cache::CacheSlot>,
) -> Result<Option<WidenedForward>> {
    let (sh, cfg) = (call.shape, call.kernels);
    let dev = qk.lead().0.device().clone();
    if wanted(qk.lead(), cfg).is_none() {
        return Ok(None);
    }
    let Some(widened) = Widened::plan_every(&dev, sh, &FWD_SCAN, cfg)? else {
        return Ok(None);
    };
    let inp = Bf16Inputs::new(qk, v, aux, sh, call.has_h0)?;
    let keep = match cache {
        Some(slot) if super::plan::split_backward_fits(&dev, sh, cfg)? => Some(slot),
        _ => None,
    };
    let h0w = widened_states_dev(&dev, Some((h0, 0)), sh)?;
    let wide = &widened.wide;
    // SAFETY: the scan writes o for every query row (`cu_seqlens` covers every token).
    let mut o = unsafe { dev.alloc::<bf16>(wide.o_len().max(1))? };
    let mut fin = dev.alloc_zeros::<f32>(wide.state_len().max(1))?;
    let dest = ScanDest {
        out: ScanOut::PlainFinal(&mut o, &mut fin),
        states: None,
        widened: Some(incoming),
    };
    let wy = widened.forward_scan(&inp, call.scale, &h0w, dest, keep.is_some(), cfg)?;
    if let Some(slot) = keep {
        slot.put(super::cache::ForwardCache::wy_only(wy));
    }
    Ok(Some(WidenedForward { o, fin }))
}

/// The spans `(first token row, tokens)` of `sh`'s sequences over its `B·T` token rows.
pub(super) fn token_spans(sh: &GdpShape) -> Vec<(usize, usize)> {
    sh.seqs
        .iter()
        .map(|s| (s.batch * sh.tokens + s.start, s.len))
        .collect()
}

/// The spans `(first chunk, chunks)` of `sh`'s sequences over the chunk table's chunks.
pub(crate) fn chunk_spans(sh: &GdpShape) -> Vec<(usize, usize)> {
    let mut at = 0;
    sh.chunks_per_seq()
        .into_iter()
        .map(|c| {
            at += c;
            (at - c, c)
        })
        .collect()
}

/// A rank's output from its [`WidenedForward`]: `o = o⁰ + Q̃ S` for the sequences `fixed`
/// (`s_in` f32 `[fixed.len(), H, K, V]`, the state their scan lacked), `o⁰` for the others;
/// with `plain` `o` alone in bf16, else the packed f32 `[o | final states]` with the final
/// states `ΔS + M S` (fixed) or `ΔS`.
pub(crate) fn finish_widened_forward(
    dev: &CudaDevice,
    wf: &WidenedForward,
    sh: &GdpShape,
    fixed: Range<usize>,
    s_in: Option<&CudaSlice<f32>>,
    plain: bool,
) -> Result<candle_core::CudaStorage> {
    use super::cp_fix::{fix_planned, FixDims};
    use crate::op::row_fix::{plan_rows, states_of_range};
    let (h, k, v) = (sh.heads, sh.dk, sh.dv);
    let dims = FixDims {
        heads: h,
        dk: k,
        dv: v,
    };
    let fixed = if s_in.is_some() { fixed } else { 0..0 };
    let state_of = states_of_range(sh.num_seqs(), fixed.clone());
    let plan = plan_rows(&token_spans(sh), sh.batch * sh.tokens, &state_of, 1)?;
    let x = wf.o.slice(..);
    let s = s_in.map(|s| s.slice(..));
    if plain {
        // SAFETY: the planned launches write every token row of o.
        let mut o = unsafe { dev.alloc::<bf16>(sh.o_len().max(1))? };
        fix_planned(dev, (&x, &mut o.slice_mut(..)), s.as_ref(), dims, &plan)?;
        return Ok(candle_core::CudaStorage::wrap_cuda_slice(o, dev.clone()));
    }
    let (o_len, s_len) = (sh.o_len(), sh.state_len());
    // SAFETY: the planned launches write o, the copies below every final state.
    let mut out = unsafe { dev.alloc::<f32>((o_len + s_len).max(1))? };
    fix_planned(
        dev,
        (&x, &mut out.slice_mut(..o_len)),
        s.as_ref(),
        dims,
        &plan,
    )?;
    // Final states: [ΔS | M] rows read as f32; ΔS + M S for the fixed sequences.
    let wide = v + k;
    let r = RowCopy {
        rows: sh.num_seqs() * h * k,
        width: v,
        src_stride: wide,
        dst_stride: v,
        src_off: 0,
        dst_off: o_len,
    };
    copy_rows_slice(dev, &wf.fin, &mut out, r)?;
    if let (Some(s_in), false) = (s_in, fixed.is_empty()) {
        let fin = super::device::tensor_of(dev, &wf.fin, &[sh.num_seqs(), h, k, wide])?;
        let s = super::device::tensor_of(dev, s_in, &[fixed.len(), h, k, v])?;
        let ht = corrected_summary(&fin, fixed.clone(), &s)?;
        super::device::copy_tensor_into(&ht, &mut out, o_len + fixed.start * h * k * v)?;
    }
    Ok(candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// A backward in one widened pass (a context-parallel rank's, or the plain op's over the
/// segments of long sequences): the state-gradient scan runs from `[dht | I_K]` on
/// `[do | 0_K]`, so its initial-state gradients are `[γ | Mᵀ]` (f32 `[N, H, K, V + K]`) and
/// every chunk row it writes is `[x⁰ | x̃]`. `exchange` exchanges or folds those and returns
/// the final-state gradients that the scanned sequences lacked ([`EndGrads`]), or `None`; the
/// chunk rows are then corrected with them (`x = x⁰ + x̃ dS`, [`super::cp_fix`]) and no
/// second state-gradient scan runs.
pub(crate) struct WidenedFold<'a> {
    /// The sequences whose scan runs widened: those whose final-state gradient comes later
    /// (their `x̃` corrects their chunk rows) or whose `Mᵀ` is wanted (a context-parallel
    /// rank's fragments that continue on a later rank, whose `Mᵀ` goes to the earlier ranks).
    pub outgoing: Range<usize>,
    /// The exchange or the fold, given `[γ | Mᵀ]`.
    pub exchange: Box<FoldFn<'a>>,
}

/// [`WidenedFold::exchange`]: `[γ | Mᵀ]` in, the final-state gradients the scan lacked out.
pub(crate) type FoldFn<'a> = dyn FnOnce(&CudaSlice<f32>) -> Result<Option<EndGrads>> + 'a;

/// The final-state gradients that a widened state-gradient scan lacked: `states` (f32
/// `[rows, H, K, V]`), and per scanned sequence its row of them (`None`: it lacked none).
pub(crate) struct EndGrads {
    pub states: CudaSlice<f32>,
    pub state_of: Vec<Option<usize>>,
}

impl EndGrads {
    /// `states` for the sequences `range` of `n`, in order.
    pub(crate) fn for_range(states: CudaSlice<f32>, n: usize, range: Range<usize>) -> Self {
        Self {
            states,
            state_of: crate::op::row_fix::states_of_range(n, range),
        }
    }
}

/// The widened state-gradient scan of a context-parallel rank ([`WidenedFold`]).
pub(super) struct WidenedDh<'a> {
    pub(super) inp: &'a Bf16Inputs<'a>,
    pub(super) table: &'a ChunkTable,
    pub(super) wy: &'a WyFactors,
    pub(super) sh: &'a GdpShape,
    /// `do` (bf16 `[B, T, H, V]`): its buffer and first element.
    pub(super) do_src: (&'a CudaSlice<bf16>, usize),
    /// `dht` (f32 `[N, H, K, V]`): its buffer and first element, when given.
    pub(super) dht_src: Option<(&'a CudaSlice<f32>, usize)>,
    /// Blocks of the states rerun beside the scan (0: none): the scan's tile leaves them room.
    pub(super) beside_blocks: usize,
    /// The sequences whose scan runs widened ([`WidenedFold::outgoing`]).
    pub(super) widened: Range<usize>,
    pub(super) cfg: &'a KernelConfig,
}

/// The buffers of a widened state-gradient scan, held by the caller so that they outlive the
/// side stream the scan runs on: its chunk rows `[x⁰ | x̃]` (bf16 `[slots, K, V + K]` and
/// `[slots, 64, V + K]`), its initial-state gradients `[γ | Mᵀ]` (f32 `[N, H, K, V + K]`) and
/// the end-state gradients it starts from, `[dht | I]`.
pub(super) struct WidenedBufs {
    dhs_w: CudaSlice<bf16>,
    ddn_w: CudaSlice<bf16>,
    dh0w: CudaSlice<f32>,
    dhtw: CudaSlice<f32>,
}

impl<'a> WidenedDh<'a> {
    /// The buffers of this scan ([`WidenedBufs`]), `[dht | I]` filled.
    pub(super) fn buffers(&self, dev: &CudaDevice) -> Result<WidenedBufs> {
        let sh = self.sh;
        let (k, v) = (sh.dk, sh.dv);
        let slots = self.table.slots(sh);
        let wide_states = sh.num_seqs() * sh.heads * k * (v + k);
        // SAFETY: the scan writes every element of every slot of the table's chunks; slots of
        // no chunk are never read.
        let (dhs_w, ddn_w) = unsafe {
            (
                dev.alloc::<bf16>(slots * k * (v + k))?,
                dev.alloc::<bf16>(slots * CHUNK * (v + k))?,
            )
        };
        Ok(WidenedBufs {
            dhs_w,
            ddn_w,
            dh0w: dev.alloc_zeros::<f32>(wide_states.max(1))?,
            dhtw: widened_states_dev(dev, self.dht_src, sh)?,
        })
    }

    /// Launches the widened scan into `bufs` ([`WidenedDh::buffers`]) on a side stream forked
    /// from the device's (what runs on the device's stream until [`WidenedRun::finish`] runs
    /// beside it); `bufs` stays borrowed until then.
    pub(super) fn launch<'b>(
        self,
        dev: &CudaDevice,
        bufs: &'b WidenedBufs,
    ) -> Result<WidenedRun<'a, 'b>>
    where
        'a: 'b,
    {
        let sh = self.sh;
        let (k, v) = (sh.dk, sh.dv);
        let wide = GdpShape {
            dv: v + k,
            ..sh.clone()
        };
        let (max_smem, sms) = smem_and_sms(dev, self.cfg.shared_memory_limit)?;
        let budget = sms.saturating_sub(self.beside_blocks);
        let forced = &self.cfg.tiles;
        let Some(plan) =
            super::plan::widened_scan_plan(&DH_SCAN, &wide, max_smem, sms, budget, forced)?
        else {
            candle_core::bail!(
                "gdp cuda: the widened state-gradient scan does not fit K = {k}, V = {v}, n = {}",
                sh.n
            );
        };
        let side = SideStream::fork(dev, self.cfg.side_streams)?;
        let dest = DhDest {
            chunks: Some((&bufs.dhs_w, &bufs.ddn_w)),
            dh0: Some(&bufs.dh0w),
            widened: Some(self.widened.clone()),
        };
        let src = DhInputs {
            inp: self.inp,
            table: self.table,
            wy: self.wy,
            dob: self.do_src,
            do_width: v,
            dht: Some((&bufs.dhtw, 0)),
        };
        run_dh_scan(side.on(), &src, &wide, &plan, dest, None, None)?;
        Ok(WidenedRun {
            sh,
            chunks: self.table.chunks,
            slots: self.table.slots(sh),
            side,
            bufs,
        })
    }
}

/// A launched [`WidenedDh`]: its side stream and the buffers it writes.
pub(super) struct WidenedRun<'a, 'b> {
    pub(super) sh: &'a GdpShape,
    pub(super) chunks: usize,
    pub(super) slots: usize,
    pub(super) side: SideStream<'b>,
    pub(super) bufs: &'b WidenedBufs,
}

impl WidenedRun<'_, '_> {
    /// Joins the scan, calls `fold` with its `[γ | Mᵀ]` and writes the corrected chunk rows into
    /// new buffers `dhs [slots, K, V]` and `ddn [slots, 64, V]` (bf16, for the gradient kernel);
    /// returns them and, with `want_dh0` (the op has initial states), the initial-state
    /// gradients f32 `[N, H, K, V]`.
    pub(super) fn finish(
        self,
        dev: &CudaDevice,
        fold: WidenedFold,
        want_dh0: bool,
    ) -> Result<(CudaSlice<bf16>, CudaSlice<bf16>, Option<Tensor>)> {
        use super::cp_fix::{fix_planned, FixDims};
        use crate::op::row_fix::plan_rows;
        let sh = self.sh;
        let (ns, h, k, v) = (sh.num_seqs(), sh.heads, sh.dk, sh.dv);
        self.side.join()?;
        let bufs = self.bufs;
        let folded = (fold.exchange)(&bufs.dh0w)?;
        let (s, state_of) = match &folded {
            Some(e) => (Some(e.states.slice(..)), e.state_of.clone()),
            None => (None, vec![None; ns]),
        };
        let spans = chunk_spans(sh);
        let dims = FixDims {
            heads: h,
            dk: k,
            dv: v,
        };
        // SAFETY: the corrections below write every row of every slot of the table's chunks
        // (the rows of the sequences not corrected copied); slots of no chunk are never read.
        let (mut dhs, mut ddn) = unsafe {
            (
                dev.alloc::<bf16>(self.slots * k * v)?,
                dev.alloc::<bf16>(self.slots * CHUNK * v)?,
            )
        };
        for (dst, src, inner) in [(&mut dhs, &bufs.dhs_w, k), (&mut ddn, &bufs.ddn_w, CHUNK)] {
            let rows = plan_rows(&spans, self.chunks, &state_of, inner)?;
            let src = src.slice(..);
            fix_planned(dev, (&src, &mut dst.slice_mut(..)), s.as_ref(), dims, &rows)?;
        }
        if !want_dh0 {
            return Ok((dhs, ddn, None));
        }
        // The initial-state gradients: γ⁰ + Mᵀ dS where a final-state gradient came.
        let t = super::device::tensor_of(dev, &bufs.dh0w, &[ns, h, k, v + k])?;
        let states = match &folded {
            Some(e) => {
                let rows = e.states.len() / (h * k * v).max(1);
                Some(super::device::tensor_of(dev, &e.states, &[rows, h, k, v])?)
            }
            None => None,
        };
        let dh0 = corrected_rows(&t, states.as_ref(), &state_of)?;
        Ok((dhs, ddn, Some(dh0)))
    }
}

/// `x⁰ + x̃ S` per sequence of a widened scan's per-sequence rows `t = [x⁰ | x̃]` (f32
/// `[N, H, K, V + K]`) whose state row `state_of` names (of `s`, f32 `[rows, H, K, V]`), `x⁰`
/// for the others: f32 `[N, H, K, V]`, one product per run of sequences with consecutive rows.
pub(super) fn corrected_rows(
    t: &Tensor,
    s: Option<&Tensor>,
    state_of: &[Option<usize>],
) -> Result<Tensor> {
    let v = t.dim(3)? - t.dim(2)?;
    let n = state_of.len();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < n {
        let mut j = i + 1;
        match state_of[i] {
            None => {
                while j < n && state_of[j].is_none() {
                    j += 1;
                }
                parts.push(t.narrow(0, i, j - i)?.narrow(3, 0, v)?);
            }
            Some(row) => {
                while j < n && state_of[j] == Some(row + j - i) {
                    j += 1;
                }
                let Some(s) = s else {
                    candle_core::bail!("gdp cuda: state row {row} named without states");
                };
                parts.push(corrected_summary(t, i..j, &s.narrow(0, row, j - i)?)?);
            }
        }
        i = j;
    }
    if parts.is_empty() {
        return t.narrow(3, 0, v)?.contiguous();
    }
    Tensor::cat(&parts, 0)
}

/// `x⁰ + x̃ S` for the sequences `fixed` of a widened scan's per-sequence rows `t = [x⁰ | x̃]`
/// (f32 `[N, H, K, V + K]`), given the state `s` they lacked (f32 `[fixed.len(), H, K, V]`):
/// `ΔS + M S_in` forward, `γ⁰ + Mᵀ dS_out` backward. f32 `[fixed.len(), H, K, V]`.
pub(super) fn corrected_summary(t: &Tensor, fixed: Range<usize>, s: &Tensor) -> Result<Tensor> {
    let (k, v) = (t.dim(2)?, s.dim(3)?);
    let part = t.narrow(0, fixed.start, fixed.len())?;
    part.narrow(3, 0, v)? + part.narrow(3, v, k)?.contiguous()?.matmul(s)?
}
