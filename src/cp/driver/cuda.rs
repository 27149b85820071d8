//! The driver on CUDA storages (feature `cuda`): a rank's forward and backward on the bf16
//! chunked kernels in one widened pass per direction, the summaries exchanged and folded on
//! the device, else (other dtypes and shapes) the summaries of the per-value-tile kernel
//! through the host.

use super::{backward_before_forward, poisoned, CpLink, SavedStates};
use crate::cp::protocol::Composition;
use crate::cp::summary::summary_len;
use crate::op::link::CudaCall;
use crate::op::shape::GdpShape;
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::Result;
use std::ops::Range;

/// The same protocol on CUDA storages (feature `cuda`): the summaries of the boundary fragments
/// (the forward run on `[v | 0_K]` from `[h0 | I_K]`, the backward run with `[do | 0_K]`,
/// `[dht | I_K]`; on the chunked bf16 scans for bf16, else the per-value-tile backward kernel's
/// summary modes) go to the host for the all-gather and the fold, and the folded states come
/// back as the initial-state override / are added to the final-state gradient.
impl CpLink {
    /// The forward on this rank, like [`CpLink::forward`], on CUDA storages (with `plain`, `o`
    /// alone in the inputs' dtype, as [`cuda::forward`](crate::op::cuda::forward)); with a
    /// `cache` slot the bf16 chunked forward keeps its intermediates for the backward (they are
    /// of the folded initial states, which the backward uses too). FLA's `q`, `k` in place
    /// reach only the widened forward ([`crate::op::cuda::rank_reads_qk_in_place`]); the
    /// summaries of the other paths take the packed `qk`.
    pub(super) fn forward_cuda_impl(
        &self,
        qk: crate::op::cuda::QkIn,
        v: CudaIn,
        aux: CudaIn,
        call: &CudaCall,
        cache: Option<&crate::op::cuda::CacheSlot>,
    ) -> Result<candle_core::CudaStorage> {
        use crate::op::cuda;
        use candle_core::backend::BackendStorage;
        let (sh, has_h0) = (call.shape, call.has_h0);
        let widened = self.forward_cuda_widened(qk, v, aux, call, cache)?;
        if let Some(out) = widened {
            return Ok(out);
        }
        let cuda::QkIn::Packed(qk) = qk else {
            candle_core::bail!(
                "gdp cp: `q` and `k` in place, but the widened forward does not serve this shape"
            );
        };
        let dev = qk.0.device().clone();
        let (h, kv, sl, ns) = (
            sh.heads,
            sh.dk * sh.dv,
            summary_len(sh.dk, sh.dv),
            sh.num_seqs(),
        );
        let mut h0 = if has_h0 {
            cuda::initial_states_to_host(aux, sh)?
        } else {
            vec![0.0f32; ns * h * kv]
        };
        let incoming = self.continuing_in(ns);
        for &s in &incoming {
            h0[s * h * kv..(s + 1) * h * kv].fill(0.0);
        }
        let frags = self.fragments(ns, true);
        let local = if self.bwd_slice.is_empty() {
            vec![0.0; frags.len() * h * sl]
        } else {
            cuda::forward_summaries(qk, v, aux, call, &frags, &h0)?
        };
        let all = self.gather(local)?;
        self.fold_into_initial_states(&all, frags.len(), sh, &mut h0)?;
        let h0_dev = dev.clone_htod(&h0)?;
        let out = cuda::forward(cuda::QkIn::Packed(qk), v, aux, call, Some(&h0_dev), cache)?;
        *self.saved_h0.lock().map_err(|_| poisoned())? = Some(SavedStates::Host(h0));
        Ok(out)
    }

    /// The forward on this rank in one widened pass ([`crate::op::cuda`]'s widened forward:
    /// `[o⁰ | Q̃]` and `[ΔS | M]` from one scan), the summaries gathered and folded on the
    /// device, and the output corrected as `o = o⁰ + Q̃ S_in`; `Ok(None)` where the bf16
    /// chunked kernels do not serve (then nothing was exchanged).
    fn forward_cuda_widened(
        &self,
        qk: crate::op::cuda::QkIn,
        v: CudaIn,
        aux: CudaIn,
        call: &CudaCall,
        cache: Option<&crate::op::cuda::CacheSlot>,
    ) -> Result<Option<candle_core::CudaStorage>> {
        use crate::op::cuda;
        use candle_core::backend::BackendStorage;
        let (sh, has_h0, plain) = (call.shape, call.has_h0, call.plain);
        let dev = qk.lead().0.device().clone();
        let (ns, h, k, v_dim) = (sh.num_seqs(), sh.heads, sh.dk, sh.dv);
        let kv = k * v_dim;
        // The initial states the scan starts from: the given ones, zeros where the sequence
        // continues from an earlier rank.
        let mut h0 = if has_h0 {
            cuda::initial_states_device(aux, sh)?
        } else {
            dev.alloc_zeros::<f32>(sh.state_len().max(1))?
        };
        let incoming = seq_range(&self.continuing_in(ns));
        if !incoming.is_empty() {
            let mut part = h0.slice_mut(incoming.start * h * kv..incoming.end * h * kv);
            dev.cuda_stream()
                .memset_zeros(&mut part)
                .map_err(candle_core::Error::wrap)?;
        }
        let frags = seq_range(&self.fragments(ns, true));
        let fold = match incoming.is_empty() {
            true => None,
            false => Some(RankFold::new(
                &dev,
                self.fwd_slice.clone(),
                frags.len(),
                self.composition,
            )?),
        };
        let from = incoming.clone();
        let Some(wf) = cuda::widened_forward(qk, v, aux, call, &h0, from, cache)? else {
            return Ok(None);
        };
        let fin = cuda::tensor_of(&dev, &wf.fin, &[ns, h, k, v_dim + k])?;
        let local = if self.bwd_slice.is_empty() {
            fin.narrow(0, frags.start, frags.len())?.zeros_like()?
        } else {
            fin.narrow(0, frags.start, frags.len())?
        };
        let all = self.gather_tensor(&local)?;
        let s_in = match &fold {
            Some(f) => Some(f.apply(&all, k, v_dim)?),
            None => None,
        };
        let out =
            cuda::finish_widened_forward(&dev, &wf, sh, incoming.clone(), s_in.as_ref(), plain)?;
        if let Some(s) = &s_in {
            let mut part = h0.slice_mut(incoming.start * h * kv..incoming.end * h * kv);
            dev.cuda_stream()
                .memcpy_dtod(&s.slice(..incoming.len() * h * kv), &mut part)
                .map_err(candle_core::Error::wrap)?;
        }
        *self.saved_h0.lock().map_err(|_| poisoned())? = Some(SavedStates::Device(h0));
        Ok(Some(out))
    }

    /// All-gathers `local` on its device into `[world, *local.dims()]` (a group of one skips
    /// the collective); a result of another shape (a faulty transport) is an error, which
    /// aborts the group like any other error of a rank's op.
    fn gather_tensor(&self, local: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        let world = self.comm.world_size();
        if world == 1 {
            return local.unsqueeze(0);
        }
        let all = self.comm.all_gather_tensor(&local.contiguous()?)?;
        let mut want = vec![world];
        want.extend_from_slice(local.dims());
        if all.dims() != want.as_slice() {
            return Err(crate::error::GdpError::Comm(format!(
                "summaries gathered on the device: expected shape {want:?}, got {:?}",
                all.dims()
            ))
            .into());
        }
        Ok(all)
    }

    /// The backward on this rank, like [`CpLink::backward`], on CUDA storages `(qk, v, aux,
    /// grad)`; `grad` is `[do | dht]`; `cache`, what [`CpLink::forward_cuda_impl`] kept.
    pub(super) fn backward_cuda_impl(
        &self,
        (qk, v, aux, grad): (CudaIn, CudaIn, CudaIn, CudaIn),
        call: &CudaCall,
        cache: Option<crate::op::cuda::ForwardCache>,
    ) -> Result<candle_core::CudaStorage> {
        use crate::op::cuda;
        use candle_core::backend::BackendStorage;
        let (sh, has_h0) = (call.shape, call.has_h0);
        let dev = qk.0.device().clone();
        let (h, sl, ns) = (sh.heads, summary_len(sh.dk, sh.dv), sh.num_seqs());
        let frags = self.fragments(ns, false);
        let dht = cuda::dht_to_host(grad, sh)?;
        let local = if self.fwd_slice.is_empty() {
            vec![0.0; frags.len() * h * sl]
        } else {
            cuda::backward_summaries(qk, v, aux, grad, call, &frags, &dht)?
        };
        let o = self.cuda_overrides(local, frags.len(), dht, sh, has_h0, &dev)?;
        let cuda::CpFinalGrads::Folded(dht) = &o.dht else {
            candle_core::bail!("gdp cp: the packed backward needs folded final-state gradients");
        };
        let extras = cuda::SplitExtras {
            cache,
            h0: Some(&o.h0),
            dht: Some(dht),
            widened: None,
        };
        cuda::backward(qk, v, aux, grad, call, extras, &o.zero_dh0)
    }
}

impl CpLink {
    /// What this rank's direct bf16 backward (the split backward straight into bf16 gradients)
    /// needs from the protocol: the initial states its forward folded, the sequences whose
    /// initial-state gradient went to earlier ranks, and the exchange of the backward
    /// summaries, run from inside the backward's widened state-gradient scan
    /// ([`crate::op::cuda::WidenedFold`]): its `[γ | Mᵀ]` rows of the leading fragments are
    /// all-gathered and the following ranks' folded on the device into the final-state
    /// gradients of the sequences that continue on a later rank. The caller checked
    /// [`crate::op::cuda::backward_summaries_served`].
    pub(super) fn backward_overrides_cuda_impl<'a>(
        &'a self,
        dev: &candle_core::CudaDevice,
        sh: &GdpShape,
        has_h0: bool,
    ) -> Result<crate::op::cuda::CpOverrides<'a>> {
        use crate::op::cuda::{self, CpFinalGrads, CpOverrides};
        let (ns, h, k, v) = (sh.num_seqs(), sh.heads, sh.dk, sh.dv);
        let leading = seq_range(&self.fragments(ns, false));
        let outgoing = seq_range(&self.continuing_out(ns));
        let dev2 = dev.clone();
        let wide = outgoing.clone();
        let fold = match outgoing.is_empty() {
            true => None,
            false => {
                let order = self.bwd_slice.clone().rev();
                Some(RankFold::new(dev, order, leading.len(), self.composition)?)
            }
        };
        let exchange = move |dh0w: &candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>| {
            let t = cuda::tensor_of(&dev2, dh0w, &[ns, h, k, v + k])?;
            let part = t.narrow(0, leading.start, leading.len())?;
            let local = if self.fwd_slice.is_empty() {
                part.zeros_like()?
            } else {
                part
            };
            let all = self.gather_tensor(&local)?;
            let Some(fold) = &fold else {
                return Ok(None);
            };
            let states = fold.apply(&all, k, v)?;
            Ok(Some(cuda::EndGrads::for_range(
                states,
                ns,
                outgoing.clone(),
            )))
        };
        Ok(CpOverrides {
            h0: self.saved_initial_states_device(dev)?,
            dht: CpFinalGrads::Widened(cuda::WidenedFold {
                outgoing: wide,
                exchange: Box::new(exchange),
            }),
            zero_dh0: if has_h0 {
                self.continuing_in(ns)
            } else {
                vec![]
            },
        })
    }

    /// The initial states this rank's forward ran from, on `dev`.
    fn saved_initial_states_device(
        &self,
        dev: &candle_core::CudaDevice,
    ) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>> {
        match self.saved_h0.lock().map_err(|_| poisoned())?.as_ref() {
            Some(SavedStates::Host(h0)) => dev.clone_htod(h0),
            Some(SavedStates::Device(h0)) => {
                // SAFETY: the copy below writes every element.
                let mut out = unsafe { dev.alloc::<f32>(h0.len())? };
                dev.cuda_stream()
                    .memcpy_dtod(h0, &mut out)
                    .map_err(candle_core::Error::wrap)?;
                Ok(out)
            }
            None => Err(backward_before_forward()),
        }
    }

    /// The backward step after the summaries, on CUDA: all-gathers this rank's `local`
    /// summaries (of `frags` fragments), folds the following ranks' into the final-state
    /// gradients `dht` (host), and puts them and the initial states the forward folded on the
    /// device, with the sequences whose initial-state gradient went to earlier ranks as γ (so
    /// the given initial-state rows get none).
    fn cuda_overrides(
        &self,
        local: Vec<f32>,
        frags: usize,
        mut dht: Vec<f32>,
        sh: &GdpShape,
        has_h0: bool,
        dev: &candle_core::CudaDevice,
    ) -> Result<crate::op::cuda::CpOverrides<'static>> {
        let all = self.gather(local)?;
        self.fold_into_final_grads(&all, frags, sh, &mut dht)?;
        Ok(crate::op::cuda::CpOverrides {
            h0: self.saved_initial_states_device(dev)?,
            dht: crate::op::cuda::CpFinalGrads::Folded(dev.clone_htod(&dht)?),
            zero_dh0: if has_h0 {
                self.continuing_in(sh.num_seqs())
            } else {
                vec![]
            },
        })
    }
}

/// A CUDA storage and its layout.
pub(super) type CudaIn<'a> = (&'a candle_core::CudaStorage, &'a candle_core::Layout);

/// The sequences `seqs` (consecutive indices) as a range.
fn seq_range(seqs: &[usize]) -> Range<usize> {
    match (seqs.first(), seqs.last()) {
        (Some(&a), Some(&b)) => a..b + 1,
        _ => 0..0,
    }
}

/// How a rank folds the summaries it gathers on the device: the ranks `order` (first applied
/// first) of `[ranks, F, H, K, V + K]` into the states `[F, H, K, V]` they carry, `S ←
/// P[.., V:] S + P[.., :V]` from `S = 0`. Made before the rank's kernels are queued, so that
/// [`Composition::Fold`]'s chains are on the device before the exchange
/// ([`crate::op::cuda::DeviceChains`]).
struct RankFold {
    order: Vec<usize>,
    /// [`Composition::Fold`]: the ranks' chains for `gdp_fold_chains`; `None`:
    /// [`Composition::Scan`].
    chains: Option<crate::op::cuda::DeviceChains>,
}

impl RankFold {
    fn new(
        dev: &candle_core::CudaDevice,
        order: impl IntoIterator<Item = usize>,
        frags: usize,
        composition: Composition,
    ) -> Result<Self> {
        let order: Vec<usize> = order.into_iter().collect();
        let chains = match composition {
            Composition::Fold => {
                let plan = crate::op::segments::rank_chains(&order, frags)?;
                Some(crate::op::cuda::DeviceChains::upload(dev, &plan)?)
            }
            Composition::Scan => None,
        };
        Ok(Self { order, chains })
    }

    /// The states f32 `[F, H, K, V]` that the gathered summaries `all` (f32 `[ranks, F, H, K,
    /// V + K]` on the device) carry: one kernel ([`Composition::Fold`]), or a balanced tree of
    /// pairs `[ΔS₂ + M₂ΔS₁ | M₂M₁]` of batched products ([`Composition::Scan`]).
    fn apply(&self, all: &candle_core::Tensor, dk: usize, dv: usize) -> Result<CudaSlice<f32>> {
        let ranks = all.dim(0)?;
        if let Some(r) = self.order.iter().find(|&&r| r >= ranks) {
            candle_core::bail!("gdp cp: folding rank {r} of {ranks} gathered summaries");
        }
        if let Some(chains) = &self.chains {
            return crate::op::cuda::fold_gathered(all, chains, dk, dv);
        }
        let mut level: Vec<(candle_core::Tensor, candle_core::Tensor)> = self
            .order
            .iter()
            .map(|&r| {
                let p = all.get(r)?;
                Ok((p.narrow(3, 0, dv)?, p.narrow(3, dv, dk)?.contiguous()?))
            })
            .collect::<Result<_>>()?;
        while level.len() > 1 {
            let mut next = Vec::with_capacity(level.len().div_ceil(2));
            let mut it = level.into_iter();
            while let Some((a1, m1)) = it.next() {
                match it.next() {
                    Some((a2, m2)) => {
                        let a = (a2 + m2.matmul(&a1.contiguous()?)?)?;
                        next.push((a, m2.matmul(&m1)?));
                    }
                    None => next.push((a1, m1)),
                }
            }
            level = next;
        }
        let s = match level.pop() {
            Some((a, _)) => a,
            None => {
                let d = all.dims();
                candle_core::Tensor::zeros((d[1], d[2], dk, dv), all.dtype(), all.device())?
            }
        };
        crate::op::cuda::slice_of(&s)
    }
}
