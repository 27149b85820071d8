//! The chunked bf16 op over segments of long sequences ([`Segments`]): where the scans' blocks
//! would leave most multiprocessors idle, each sequence is split into segments that one
//! widened scan runs side by side.
//!
//! Forward: the scan runs every segment from `[0 | I_K]` on `[U | 0_K]` (a context-parallel
//! rank's pass, [`super::widened`]), writing `[o⁰ | Q̃]` and `[ΔS | M]`. A short fold over each
//! sequence's segments, `S_{j+1} = ΔS_j + M_j S_j` from the initial state, gives their incoming
//! states, and the output is `o = o⁰ + Q̃ S_j` ([`super::cp_fix`]). The incoming states stay
//! for the backward ([`SegmentStates`]).
//!
//! Backward (`super::backward` with the forward's [`SegmentStates`]): the states rerun runs
//! every segment from its incoming state, the state-gradient scan every segment from
//! `[dht | I_K]` (`dht` at a sequence's last segment, zero before it) on `[do | 0_K]`, writing
//! `[x⁰ | x̃]` and `[γ | Mᵀ]`; the reverse fold `e_j = γ_{j+1} + Mᵀ_{j+1} e_{j+1}` gives the
//! end-state gradient each segment's scan lacked, the chunk rows are corrected
//! (`x = x⁰ + x̃ e_j`) and the gradient kernel runs over the segments' chunks, which are the
//! unsplit ones. Both chains of dependent chunk steps shrink by the segment count, for twice
//! the scans' columns and the corrections.

use super::cache::{CacheSlot, ForwardCache, SegmentStates};
use super::cp_fix::{fix_planned, FixDims, FixOut};
use super::device::{initial_states_device, smem_and_sms, In};
use super::fold::{fold_chains, DeviceChains, FoldDims};
use super::fwd_scan::{ScanDest, ScanOut};
use super::inputs::{Bf16Inputs, CudaCall};
use super::plan::{split_backward_fits, split_plan, DH_SCAN, FWD_SCAN};
use super::widened::{token_spans, widened_states_dev, Widened};
use super::widened::{EndGrads, WidenedFold};
use crate::op::config::{KernelConfig, Segments};
use crate::op::row_fix::plan_rows;
use crate::op::segments;
use crate::op::shape::GdpShape;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{CudaStorage, Result, Tensor};
use half::bf16;
use std::ops::Range;

/// A forward split into segments: the widened scan over the segments (the sequences of its
/// sub-problem, each original sequence's in order, so that the chunk table's chunks are the
/// unsplit one's) and the segments of each original sequence.
pub(super) struct SegmentPlan {
    widened: Widened,
    owners: Vec<Range<usize>>,
}

impl SegmentPlan {
    /// The split of `sh` that `cfg.segments` asks for on `dev`; `None` where nothing is split
    /// (`Off`, `Auto` with blocks enough, sequences of at most one segment) or, under `Auto`,
    /// where the widened kernels do not fit. A forced count that the kernels cannot run is an
    /// error.
    pub(super) fn new(dev: &CudaDevice, sh: &GdpShape, cfg: &KernelConfig) -> Result<Option<Self>> {
        if cfg.segments == Segments::Off {
            return Ok(None); // no device query on the default path
        }
        let (_, sms) = smem_and_sms(dev, cfg.shared_memory_limit)?;
        let Some(segments::Split { segments, owners }) = segments::plan(sh, cfg, sms)? else {
            return Ok(None);
        };
        let seg = GdpShape {
            seqs: segments,
            ..sh.clone()
        };
        match Widened::plan_every(dev, &seg, &FWD_SCAN, cfg)? {
            Some(widened) => Ok(Some(Self { widened, owners })),
            None if matches!(cfg.segments, Segments::Count(_)) => candle_core::bail!(
                "gdp cuda: KernelConfig::segments = {:?}: the widened forward scan does not fit \
                 K = {}, V = {}, n = {} on this device",
                cfg.segments,
                sh.dk,
                sh.dv,
                sh.n
            ),
            None => Ok(None),
        }
    }

    /// The forward of `call` over the segments: the packed f32 `[o | final states]`, or with
    /// `call.plain` `o` alone in bf16. With `cache` (a slot for the WY factors alone), the WY
    /// factors stay for the backward, and with them the segments' incoming states where the
    /// backward in segments fits ([`SegmentStates`]; else it reruns the states unsplit).
    pub(super) fn forward(
        &self,
        inp: &Bf16Inputs,
        aux: In,
        call: &CudaCall,
        cache: Option<&CacheSlot>,
    ) -> Result<CudaStorage> {
        let (sh, cfg, dev) = (call.shape, call.kernels, &inp.dev);
        let (seg, wide) = (&self.widened.sub, &self.widened.wide);
        let keep = match cache {
            Some(slot) if split_backward_fits(dev, sh, cfg)? => Some(slot),
            _ => None,
        };
        let h0w = widened_states_dev(dev, None, seg)?;
        let chains =
            DeviceChains::upload(dev, &segments::forward_chains(&self.owners, &seg.seqs)?)?;
        // SAFETY: the scan writes `[o⁰ | Q̃]` for every query row (the segments cover every
        // token of every sequence, as `cu_seqlens` covers every token).
        let mut o = unsafe { dev.alloc::<bf16>(wide.o_len().max(1))? };
        let mut fin = dev.alloc_zeros::<f32>(wide.state_len().max(1))?;
        let dest = ScanDest {
            out: ScanOut::PlainFinal(&mut o, &mut fin),
            states: None,
            widened: Some(0..seg.num_seqs()),
        };
        let wy = self
            .widened
            .forward_scan(inp, call.scale, &h0w, dest, keep.is_some(), cfg)?;
        let Folded {
            incoming,
            state_of,
            finals,
        } = self.fold(dev, &fin, &chains, aux, call)?;
        let x = o.slice(..);
        let s = incoming.slice(..);
        let dims = FixDims {
            heads: sh.heads,
            dk: sh.dk,
            dv: sh.dv,
        };
        let out = if call.plain {
            // SAFETY: the corrections below write every token row of o.
            let mut out = unsafe { dev.alloc::<bf16>(sh.o_len().max(1))? };
            let y = &mut out.slice_mut(..);
            fix_segments(dev, &x, y, &s, &state_of, seg, dims)?;
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        } else {
            let o_len = sh.o_len();
            // SAFETY: the corrections write every token row of o, the copy every final state.
            let mut out = unsafe { dev.alloc::<f32>((o_len + sh.state_len()).max(1))? };
            fix_segments(
                dev,
                &x,
                &mut out.slice_mut(..o_len),
                &s,
                &state_of,
                seg,
                dims,
            )?;
            let len = sh.state_len();
            if let Some(finals) = finals.filter(|_| len > 0) {
                dev.cuda_stream()
                    .memcpy_dtod(&finals.slice(..len), &mut out.slice_mut(o_len..o_len + len))
                    .map_err(candle_core::Error::wrap)?;
            }
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        };
        if let Some(slot) = keep {
            let segments = self.backward_fits(dev, cfg)?.then(|| SegmentStates {
                sub: seg.clone(),
                owners: self.owners.clone(),
                incoming,
            });
            slot.put(ForwardCache {
                wy,
                states: None,
                segments,
            });
        }
        Ok(out)
    }

    /// Whether the backward runs in these segments too: the split backward and its widened
    /// state-gradient scan fit them.
    fn backward_fits(&self, dev: &CudaDevice, cfg: &KernelConfig) -> Result<bool> {
        let seg = &self.widened.sub;
        Ok(split_plan(dev, seg, cfg)?.is_some()
            && Widened::plan_every(dev, seg, &DH_SCAN, cfg)?.is_some())
    }

    /// The state each segment starts from and, unless `call.plain`, each sequence's final
    /// state, folded in f32 on the device ([`fold_chains`] along `chains`, the uploaded
    /// [`segments::forward_chains`]) from the segments' `[ΔS | M]` (`fin`, `[segments, H, K, V
    /// + K]`) and the initial states of `aux`.
    fn fold(
        &self,
        dev: &CudaDevice,
        fin: &CudaSlice<f32>,
        chains: &DeviceChains,
        aux: In,
        call: &CudaCall,
    ) -> Result<Folded> {
        let sh = call.shape;
        let seg = &self.widened.sub;
        let h0 = match call.has_h0 {
            true => Some(initial_states_device(aux, sh)?),
            false => None,
        };
        let mut state_of = Vec::with_capacity(seg.num_seqs());
        for segments in &self.owners {
            let mut has = call.has_h0;
            for j in segments.clone() {
                state_of.push(has.then_some(j));
                has |= seg.seqs[j].len > 0; // an empty segment passes the state on
            }
        }
        let dims = FoldDims {
            heads: sh.heads,
            dk: sh.dk,
            dv: sh.dv,
        };
        let h0 = h0.as_ref().map(|h| h.slice(..));
        let out = fold_chains(
            dev,
            &fin.slice(..),
            h0.as_ref(),
            chains,
            dims,
            seg.num_seqs(),
            !call.plain,
        )?;
        Ok(Folded {
            incoming: out.states,
            state_of,
            finals: out.finals,
        })
    }
}

/// [`SegmentPlan::fold`]'s result.
struct Folded {
    /// Each segment's incoming state, f32 `[segments, H, K, V]` (zero where none).
    incoming: CudaSlice<f32>,
    /// Per segment, its row of `incoming` where it has an incoming state.
    state_of: Vec<Option<usize>>,
    /// The sequences' final states, f32 `[N, H, K, V]`, where the call returns them.
    finals: Option<CudaSlice<f32>>,
}

/// `y = x[.., :V] + x[.., V:] · S_j` over the token rows of every segment `j` of `seg` with an
/// incoming state (row `state_of[j]` of `s`), a copy of `x[.., :V]` elsewhere.
fn fix_segments<T: FixOut>(
    dev: &CudaDevice,
    x: &CudaView<bf16>,
    y: &mut CudaViewMut<T>,
    s: &CudaView<f32>,
    state_of: &[Option<usize>],
    seg: &GdpShape,
    dims: FixDims,
) -> Result<()> {
    let plan = plan_rows(&token_spans(seg), seg.batch * seg.tokens, state_of, 1)?;
    fix_planned(dev, (x, y), Some(s), dims, &plan)
}

/// The backward's side of a forward in segments ([`SegmentStates`]).
impl SegmentStates {
    /// The final-state gradients the widened state-gradient scan starts from, f32
    /// `[segments, H, K, V]`: each sequence's (f32 `[N, H, K, V]` from element `at` of `dht`)
    /// at its last segment, zero before it; `None` where no `dht` is given.
    pub(super) fn scatter_dht(
        &self,
        dev: &CudaDevice,
        dht: Option<(&CudaSlice<f32>, usize)>,
    ) -> Result<Option<CudaSlice<f32>>> {
        let Some((src, at)) = dht else {
            return Ok(None);
        };
        let per_seq = self.sub.heads * self.sub.dk * self.sub.dv;
        let n = self.owners.len();
        if src.len() < at + n * per_seq {
            candle_core::bail!(
                "gdp cuda: dht of {} elements from {at} for {n} sequences",
                src.len()
            );
        }
        let mut out = dev.alloc_zeros::<f32>((self.sub.num_seqs() * per_seq).max(1))?;
        for (i, segments) in self.owners.iter().enumerate() {
            let last = segments.end - 1;
            let from = src.slice(at + i * per_seq..at + (i + 1) * per_seq);
            let mut to = out.slice_mut(last * per_seq..(last + 1) * per_seq);
            dev.cuda_stream()
                .memcpy_dtod(&from, &mut to)
                .map_err(candle_core::Error::wrap)?;
        }
        Ok(Some(out))
    }

    /// The fold of the widened state-gradient scan over every segment: from each sequence's
    /// last segment back, `e_j = γ_{j+1} + Mᵀ_{j+1} e_{j+1}` (none for the last), the
    /// end-state gradient that segment `j`'s scan lacked. Its chains are uploaded here, before
    /// the backward's kernels ([`DeviceChains`]).
    pub(super) fn fold<'a>(&'a self, dev: &CudaDevice) -> Result<WidenedFold<'a>> {
        let sub = &self.sub;
        let (ns, h, k, v) = (sub.num_seqs(), sub.heads, sub.dk, sub.dv);
        let state_of = segments::end_grad_rows(&self.owners, ns);
        let rows = state_of.iter().flatten().count();
        let chains = match rows {
            0 => None,
            _ => Some(DeviceChains::upload(
                dev,
                &segments::backward_chains(&self.owners, ns)?,
            )?),
        };
        let dev = dev.clone();
        let exchange = move |dh0w: &CudaSlice<f32>| -> Result<Option<EndGrads>> {
            let Some(chains) = &chains else {
                return Ok(None);
            };
            let dims = FoldDims {
                heads: h,
                dk: k,
                dv: v,
            };
            let out = fold_chains(&dev, &dh0w.slice(..), None, chains, dims, rows, false)?;
            Ok(Some(EndGrads {
                states: out.states,
                state_of,
            }))
        };
        Ok(WidenedFold {
            outgoing: 0..ns,
            exchange: Box::new(exchange),
        })
    }

    /// Each sequence's initial-state gradient, f32 `[N, H, K, V]`: the corrected `γ` of its
    /// first segment, from `dh0` (f32 `[segments, H, K, V]`).
    pub(super) fn first_segments(&self, dh0: &Tensor) -> Result<Tensor> {
        let firsts: Vec<u32> = self.owners.iter().map(|r| r.start as u32).collect();
        let idx = Tensor::new(firsts.as_slice(), dh0.device())?;
        dh0.index_select(&idx, 0)
    }
}
