//! The chunked bf16 forward over segments of long sequences ([`Segments`]): where the forward
//! scan's blocks would leave most multiprocessors idle, each sequence is split into segments
//! that one widened scan runs side by side, each from `[0 | I_K]` on `[U | 0_K]` (a
//! context-parallel rank's pass, [`super::widened`]), writing `[o⁰ | Q̃]` and `[ΔS | M]`. A
//! short fold over each sequence's segments, `S_{j+1} = ΔS_j + M_j S_j` from the initial state,
//! gives their incoming states, and the output is `o = o⁰ + Q̃ S_j` ([`super::cp_fix`]). The
//! chain of dependent chunk steps shrinks by the segment count, for twice the scan's columns.

use super::cache::{CacheSlot, ForwardCache};
use super::cp_fix::{fix_planned, FixDims, FixOut, FixRows};
use super::device::{copy_tensor_into, In};
use super::device::{initial_states_device, slice_of, smem_and_sms, tensor_from};
use super::fwd_scan::{ScanDest, ScanOut};
use super::inputs::{Bf16Inputs, CudaCall};
use super::plan::{split_backward_fits, FWD_SCAN};
use super::widened::{corrected_summary, token_spans, widened_states_dev, Widened};
use crate::op::config::{KernelConfig, Segments};
use crate::op::segments;
use crate::op::shape::GdpShape;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{CudaStorage, DType, Device, Result, Tensor};
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
        let every: Vec<usize> = (0..seg.num_seqs()).collect();
        match Widened::plan(dev, &seg, &every, &FWD_SCAN, cfg)? {
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
    /// factors stay for the backward, which reruns the states unsplit.
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
        if let Some(slot) = keep {
            slot.put(ForwardCache::wy_only(wy));
        }
        let Folded { incoming, finals } = self.fold(dev, fin, aux, call)?;
        let x = o.slice(..);
        let dims = FixDims {
            heads: sh.heads,
            dk: sh.dk,
            dv: sh.dv,
        };
        let spans = token_spans(seg);
        if call.plain {
            // SAFETY: the corrections below write every token row of o.
            let mut out = unsafe { dev.alloc::<bf16>(sh.o_len().max(1))? };
            fix_segments(dev, &x, &mut out.slice_mut(..), &incoming, &spans, dims)?;
            return Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()));
        }
        let o_len = sh.o_len();
        // SAFETY: the corrections write every token row of o, the copy every final state.
        let mut out = unsafe { dev.alloc::<f32>((o_len + sh.state_len()).max(1))? };
        fix_segments(
            dev,
            &x,
            &mut out.slice_mut(..o_len),
            &incoming,
            &spans,
            dims,
        )?;
        if sh.num_seqs() > 0 {
            copy_tensor_into(&Tensor::cat(&finals, 0)?, &mut out, o_len)?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    /// The state each segment starts from (`None`: zero, so that its output needs no
    /// correction) and each sequence's final state, folded in f32 from the segments' `[ΔS | M]`
    /// (`fin`, `[segments, H, K, V + K]`, taken without a copy) and the initial states of `aux`.
    fn fold(
        &self,
        dev: &CudaDevice,
        fin: CudaSlice<f32>,
        aux: In,
        call: &CudaCall,
    ) -> Result<Folded> {
        let sh = call.shape;
        let (h, k, v) = (sh.heads, sh.dk, sh.dv);
        let seg = &self.widened.sub;
        let fin = tensor_from(dev, fin, &[seg.num_seqs(), h, k, v + k])?;
        let h0 = match call.has_h0 {
            true => {
                let states = initial_states_device(aux, sh)?;
                Some(tensor_from(dev, states, &[sh.num_seqs(), h, k, v])?)
            }
            false => None,
        };
        let mut incoming = Vec::with_capacity(seg.num_seqs());
        let mut finals = Vec::with_capacity(sh.num_seqs());
        for (i, segments) in self.owners.iter().enumerate() {
            let mut s = h0.as_ref().map(|h0| h0.narrow(0, i, 1)).transpose()?;
            for j in segments.clone() {
                incoming.push(s.as_ref().map(slice_of).transpose()?);
                if seg.seqs[j].len == 0 {
                    continue; // an empty sequence: its state passes unchanged
                }
                s = Some(match &s {
                    Some(s) => corrected_summary(&fin, j..j + 1, s)?,
                    None => fin.narrow(0, j, 1)?.narrow(3, 0, v)?.contiguous()?,
                });
            }
            let zero = || Tensor::zeros((1, h, k, v), DType::F32, &Device::Cuda(dev.clone()));
            finals.push(s.map_or_else(zero, Ok)?);
        }
        Ok(Folded { incoming, finals })
    }
}

/// [`SegmentPlan::fold`]'s result.
struct Folded {
    /// Per segment, the state it starts from (`None`: zero).
    incoming: Vec<Option<CudaSlice<f32>>>,
    /// Per sequence, its final state `[1, H, K, V]`.
    finals: Vec<Tensor>,
}

/// `y = x[.., :V] + x[.., V:] · S` over each segment's token rows (`spans`: first row and
/// rows), with the segment's incoming state `S`, or a copy of `x[.., :V]` where it is zero.
fn fix_segments<T: FixOut>(
    dev: &CudaDevice,
    x: &CudaView<bf16>,
    y: &mut CudaViewMut<T>,
    incoming: &[Option<CudaSlice<f32>>],
    spans: &[(usize, usize)],
    dims: FixDims,
) -> Result<()> {
    for (s, &(first, rows)) in incoming.iter().zip(spans) {
        let rows = FixRows {
            outer0: first,
            outer_per_seq: rows,
            inner: 1,
            seqs: 1,
        };
        let s = s.as_ref().map(|s| s.slice(..));
        fix_planned(dev, (x, &mut *y), s.as_ref(), dims, &[(rows, s.is_some())])?;
    }
    Ok(())
}
