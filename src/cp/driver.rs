//! The per-rank driver, run inside the op's forward and backward: prepare the summaries of the
//! boundary fragments → all-gather → fold the causal slice → apply (`megatron_cp.md` §6).
//!
//! * forward: `[ΔS | M]` of the trailing fragment (last local sequence); the preceding ranks'
//!   summaries fold into the initial state of the first local sequence;
//! * backward: `[γ | Mᵀ]` of the leading fragment (first local sequence); the following ranks'
//!   summaries fold into the final-state gradient of the last local sequence.
//!
//! Dense input (every batch row spans all ranks) treats every row as both fragments.

use super::comm::Communicator;
use super::protocol::{
    backward_summary, compose_backward, compose_forward, forward_summary, summary_len, Composition,
};
use crate::error::GdpError;
use crate::op::cpu::chunk::Dims;
use crate::op::cpu::{self, PackedInputs};
use crate::op::shape::GdpShape;
use candle_core::{Result, WithDType};
use rayon::prelude::*;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// One rank's place in its context-parallel group, carried by the op from forward to backward.
pub struct CpLink {
    comm: Arc<dyn Communicator>,
    /// Ranks whose forward summaries fold into this rank's first sequence.
    fwd_slice: Range<usize>,
    /// Ranks whose backward summaries fold into this rank's last sequence.
    bwd_slice: Range<usize>,
    /// Packed sequences (fragments are the first and last sequence) or dense rows (all rows).
    packed: bool,
    /// How the gathered summaries are composed.
    composition: Composition,
    /// The initial states `[N, H, K, V]` the forward used, for the backward's recomputation.
    saved_h0: Mutex<Option<Vec<f32>>>,
}

impl std::fmt::Debug for CpLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpLink")
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("fwd_slice", &self.fwd_slice)
            .field("bwd_slice", &self.bwd_slice)
            .field("packed", &self.packed)
            .finish()
    }
}

impl CpLink {
    /// A link for `comm`'s rank with the causal slices of `megatron_cp.md` §5.1.
    pub fn new(
        comm: Arc<dyn Communicator>,
        preceding_rank_start: usize,
        following_rank_stop: usize,
        packed: bool,
        composition: Composition,
    ) -> Result<Self> {
        let (rank, world) = (comm.rank(), comm.world_size());
        if preceding_rank_start > rank || following_rank_stop <= rank || following_rank_stop > world
        {
            return Err(GdpError::Option {
                name: "rank metadata".into(),
                reason: format!(
                    "need preceding_rank_start <= rank < following_rank_stop <= world_size, got \
                     {preceding_rank_start} <= {rank} < {following_rank_stop} <= {world}"
                ),
            }
            .into());
        }
        Ok(Self {
            comm,
            fwd_slice: preceding_rank_start..rank,
            bwd_slice: rank + 1..following_rank_stop,
            packed,
            composition,
            saved_h0: Mutex::new(None),
        })
    }

    /// Sequences whose first token continues a sequence of an earlier rank.
    fn continuing_in(&self, n_seqs: usize) -> Vec<usize> {
        match (self.fwd_slice.is_empty(), self.packed) {
            (true, _) => vec![],
            (false, true) => vec![0],
            (false, false) => (0..n_seqs).collect(),
        }
    }

    /// Sequences that continue on a later rank.
    fn continuing_out(&self, n_seqs: usize) -> Vec<usize> {
        match (self.bwd_slice.is_empty(), self.packed) {
            (true, _) => vec![],
            (false, true) => vec![n_seqs - 1],
            (false, false) => (0..n_seqs).collect(),
        }
    }

    /// Trailing fragments (forward summaries) or leading fragments (backward summaries).
    fn fragments(&self, n_seqs: usize, trailing: bool) -> Vec<usize> {
        match (self.packed, trailing) {
            (true, true) => vec![n_seqs - 1],
            (true, false) => vec![0],
            (false, _) => (0..n_seqs).collect(),
        }
    }

    /// Apply step of the forward: folds the preceding ranks' gathered `[ΔS | M]` summaries
    /// (`all`: `[ranks, frags, H, K, V+K]`) into the initial states `h0 [N, H, K, V]` of the
    /// sequences that continue from an earlier rank.
    fn fold_into_initial_states(&self, all: &[f32], frags: usize, sh: &GdpShape, h0: &mut [f32]) {
        let (h, kv, sl) = (sh.heads, sh.dk * sh.dv, summary_len(sh.dk, sh.dv));
        let per_rank = frags * h * sl;
        for (f, &s) in self.continuing_in(sh.num_seqs()).iter().enumerate() {
            for hd in 0..h {
                let at = |r: usize| &all[r * per_rank + (f * h + hd) * sl..][..sl];
                let s_in = compose_forward(
                    self.fwd_slice.clone().map(at),
                    sh.dk,
                    sh.dv,
                    self.composition,
                );
                h0[(s * h + hd) * kv..(s * h + hd + 1) * kv].copy_from_slice(&s_in);
            }
        }
    }

    /// Apply step of the backward: adds the fold of the following ranks' gathered `[γ | Mᵀ]`
    /// summaries to the final-state gradients `dht [N, H, K, V]` of the sequences that continue
    /// on a later rank.
    fn fold_into_final_grads(&self, all: &[f32], frags: usize, sh: &GdpShape, dht: &mut [f32]) {
        let (h, kv, sl) = (sh.heads, sh.dk * sh.dv, summary_len(sh.dk, sh.dv));
        let per_rank = frags * h * sl;
        for (f, &s) in self.continuing_out(sh.num_seqs()).iter().enumerate() {
            for hd in 0..h {
                let at = |r: usize| &all[r * per_rank + (f * h + hd) * sl..][..sl];
                let ds_out = compose_backward(
                    self.bwd_slice.clone().map(at),
                    sh.dk,
                    sh.dv,
                    self.composition,
                );
                let st = (s * h + hd) * kv;
                dht[st..st + kv]
                    .iter_mut()
                    .zip(&ds_out)
                    .for_each(|(g, d)| *g += d);
            }
        }
    }

    /// The initial states this rank's forward folded (what its backward runs from).
    fn saved_initial_states(&self) -> Result<Vec<f32>> {
        self.saved_h0
            .lock()
            .map_err(|_| poisoned())?
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("gdp cp: backward before forward".into()))
    }

    /// All-gathers `local` (`frags · H` summaries); a group of one skips the collective.
    fn gather(&self, local: Vec<f32>) -> Result<Vec<f32>> {
        if self.comm.world_size() == 1 {
            return Ok(local);
        }
        self.comm.all_gather(&local)
    }

    /// The forward on this rank: returns `[o | final states]` like [`cpu::forward()`].
    pub fn forward<T: WithDType>(
        &self,
        x: &PackedInputs<T>,
        sh: &GdpShape,
        scale: f32,
    ) -> Result<Vec<f32>> {
        let d = dims(sh, scale);
        let (h, kv, sl, ns) = (
            sh.heads,
            sh.dk * sh.dv,
            summary_len(sh.dk, sh.dv),
            sh.num_seqs(),
        );
        let mut h0 = vec![0.0f32; ns * h * kv];
        if x.has_h0 {
            for s in 0..ns {
                for hd in 0..h {
                    let off = (s * h + hd) * kv;
                    h0[off..off + kv].copy_from_slice(&x.initial_state(sh, None, s, hd));
                }
            }
        }
        let incoming = self.continuing_in(ns);
        for &s in &incoming {
            h0[s * h * kv..(s + 1) * h * kv].fill(0.0);
        }
        // Prepare: only needed when a later rank continues our last sequence.
        let frags = self.fragments(ns, true);
        let needed = !self.bwd_slice.is_empty();
        let local: Vec<f32> = pairs(&frags, h)
            .into_par_iter()
            .flat_map_iter(|(s, hd)| {
                if !needed {
                    return vec![0.0; sl];
                }
                let off = (s * h + hd) * kv;
                forward_summary(&x.gather(sh, &sh.seqs[s], hd), &d, &h0[off..off + kv])
            })
            .collect();
        let all = self.gather(local)?;
        // Apply: fold the preceding ranks into the initial state of the continuing sequences.
        self.fold_into_initial_states(&all, frags.len(), sh, &mut h0);
        let out = cpu::forward(x, sh, scale, Some(&h0));
        *self.saved_h0.lock().map_err(|_| poisoned())? = Some(h0);
        Ok(out)
    }

    /// The backward on this rank, like [`cpu::backward()`]; `grad` is `[do | dht]`.
    pub fn backward<T: WithDType>(
        &self,
        x: &PackedInputs<T>,
        sh: &GdpShape,
        scale: f32,
        grad: &[f32],
    ) -> Result<Vec<f32>> {
        let d = dims(sh, scale);
        let (h, kv, sl, ns) = (
            sh.heads,
            sh.dk * sh.dv,
            summary_len(sh.dk, sh.dv),
            sh.num_seqs(),
        );
        let (dv, o_len) = (sh.dv, sh.o_len());
        let frags = self.fragments(ns, false);
        let needed = !self.fwd_slice.is_empty();
        let local: Vec<f32> = pairs(&frags, h)
            .into_par_iter()
            .flat_map_iter(|(s, hd)| {
                if !needed {
                    return vec![0.0; sl];
                }
                let seq = &sh.seqs[s];
                let mut dout = Vec::with_capacity(seq.len * dv);
                for t in 0..seq.len {
                    let off = ((seq.batch * sh.tokens + seq.start + t) * h + hd) * dv;
                    dout.extend_from_slice(&grad[off..off + dv]);
                }
                let st = o_len + (s * h + hd) * kv;
                backward_summary(&x.gather(sh, seq, hd), &d, &dout, &grad[st..st + kv])
            })
            .collect();
        let all = self.gather(local)?;
        let mut grad = grad.to_vec();
        self.fold_into_final_grads(&all, frags.len(), sh, &mut grad[o_len..]);
        let h0 = self.saved_initial_states()?;
        let mut out = cpu::backward(x, sh, scale, &grad, Some(&h0));
        if x.has_h0 {
            // The initial state of a continuing sequence came from earlier ranks; its gradient
            // travelled there as γ, so the given initial-state row gets none.
            let dh0 = out.len() - sh.state_len();
            for s in self.continuing_in(ns) {
                out[dh0 + s * h * kv..dh0 + (s + 1) * h * kv].fill(0.0);
            }
        }
        Ok(out)
    }
}

fn pairs(frags: &[usize], heads: usize) -> Vec<(usize, usize)> {
    frags
        .iter()
        .flat_map(|&s| (0..heads).map(move |h| (s, h)))
        .collect()
}

fn dims(sh: &GdpShape, scale: f32) -> Dims {
    Dims {
        dk: sh.dk,
        dv: sh.dv,
        n: sh.n,
        scale,
    }
}

fn poisoned() -> candle_core::Error {
    GdpError::Comm("the op's saved state lock is poisoned".into()).into()
}

/// The same protocol on CUDA storages (feature `cuda`): the summaries of the boundary fragments
/// (the forward run on `[v | 0_K]` from `[h0 | I_K]`, the backward run with `[do | 0_K]`,
/// `[dht | I_K]`; on the chunked bf16 scans for bf16, else the per-value-tile backward kernel's
/// summary modes) go to the host for the all-gather and the fold, and the folded states come
/// back as the initial-state override / are added to the final-state gradient.
#[cfg(feature = "cuda")]
impl CpLink {
    /// The forward on this rank, like [`CpLink::forward`], on CUDA storages (with `plain`, `o`
    /// alone in the inputs' dtype, as [`cuda::forward`](crate::op::cuda::forward)); with a
    /// `cache` slot the bf16 chunked forward keeps its intermediates for
    /// [`CpLink::backward_cuda`] (they are of the folded initial states, which the backward
    /// uses too).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_cuda(
        &self,
        qk: CudaIn,
        v: CudaIn,
        aux: CudaIn,
        sh: &GdpShape,
        scale: f32,
        has_h0: bool,
        plain: bool,
        cache: Option<&crate::op::cuda::CacheSlot>,
    ) -> Result<candle_core::CudaStorage> {
        use crate::op::cuda;
        use candle_core::backend::BackendStorage;
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
            cuda::forward_summaries(qk, v, aux, sh, scale, has_h0, &frags, &h0)?
        };
        let all = self.gather(local)?;
        self.fold_into_initial_states(&all, frags.len(), sh, &mut h0);
        let h0_dev = dev.clone_htod(&h0)?;
        let out = cuda::forward(
            cuda::QkIn::Packed(qk),
            v,
            aux,
            sh,
            scale,
            has_h0,
            Some(&h0_dev),
            plain,
            cache,
        )?;
        *self.saved_h0.lock().map_err(|_| poisoned())? = Some(h0);
        Ok(out)
    }

    /// The backward on this rank, like [`CpLink::backward`], on CUDA storages `(qk, v, aux,
    /// grad)`; `grad` is `[do | dht]`; `cache`, what [`CpLink::forward_cuda`] kept.
    pub fn backward_cuda(
        &self,
        (qk, v, aux, grad): (CudaIn, CudaIn, CudaIn, CudaIn),
        sh: &GdpShape,
        scale: f32,
        has_h0: bool,
        cache: Option<crate::op::cuda::ForwardCache>,
    ) -> Result<candle_core::CudaStorage> {
        use crate::op::cuda;
        use candle_core::backend::BackendStorage;
        let dev = qk.0.device().clone();
        let (h, sl, ns) = (sh.heads, summary_len(sh.dk, sh.dv), sh.num_seqs());
        let frags = self.fragments(ns, false);
        let dht = cuda::dht_to_host(grad, sh)?;
        let local = if self.fwd_slice.is_empty() {
            vec![0.0; frags.len() * h * sl]
        } else {
            cuda::backward_summaries(qk, v, aux, grad, sh, scale, has_h0, &frags, &dht)?
        };
        let o = self.cuda_overrides(local, frags.len(), dht, sh, has_h0, &dev)?;
        cuda::backward(
            qk,
            v,
            aux,
            grad,
            sh,
            scale,
            has_h0,
            Some(&o.h0),
            Some(&o.dht),
            &o.zero_dh0,
            cache,
        )
    }
}

#[cfg(feature = "cuda")]
impl CpLink {
    /// What this rank's direct bf16 backward (the split backward straight into bf16 gradients)
    /// needs from the protocol: the backward summaries of its leading fragment on the chunked
    /// kernels (from the output gradient `cot`: the bf16 `do`, or the packed f32 `[do | dht]`),
    /// all-gathered and folded into its final-state gradients; the initial states its forward
    /// folded; the sequences whose initial-state gradient went to earlier ranks. The caller
    /// checked [`crate::op::cuda::backward_summaries_served`].
    pub(crate) fn backward_overrides_cuda(
        &self,
        (qk, v, aux): (CudaIn, CudaIn, CudaIn),
        cot: crate::op::cuda::Cotangent,
        sh: &GdpShape,
        scale: f32,
        has_h0: bool,
    ) -> Result<crate::op::cuda::CpOverrides> {
        use crate::op::cuda::{self, Cotangent};
        use candle_core::backend::BackendStorage;
        let dev = qk.0.device().clone();
        let (h, sl, ns) = (sh.heads, summary_len(sh.dk, sh.dv), sh.num_seqs());
        let frags = self.fragments(ns, false);
        let dht = match cot {
            Cotangent::Packed(g) => cuda::dht_to_host(g, sh)?,
            Cotangent::Plain(_) => vec![0.0; sh.state_len()],
        };
        let local = if self.fwd_slice.is_empty() || frags.is_empty() {
            vec![0.0; frags.len() * h * sl]
        } else {
            cuda::backward_summaries_bf16(qk, v, aux, cot, sh, scale, has_h0, &frags, &dht)?
                .ok_or_else(|| {
                    candle_core::Error::Msg(
                        "gdp cp: the bf16 backward summaries do not run on this shape".into(),
                    )
                })?
        };
        self.cuda_overrides(local, frags.len(), dht, sh, has_h0, &dev)
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
    ) -> Result<crate::op::cuda::CpOverrides> {
        let all = self.gather(local)?;
        self.fold_into_final_grads(&all, frags, sh, &mut dht);
        let h0 = self.saved_initial_states()?;
        Ok(crate::op::cuda::CpOverrides {
            h0: dev.clone_htod(&h0)?,
            dht: dev.clone_htod(&dht)?,
            zero_dh0: if has_h0 {
                self.continuing_in(sh.num_seqs())
            } else {
                vec![]
            },
        })
    }
}

/// A CUDA storage and its layout.
#[cfg(feature = "cuda")]
type CudaIn<'a> = (&'a candle_core::CudaStorage, &'a candle_core::Layout);
