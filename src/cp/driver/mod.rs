//! The per-rank driver, run inside the op's forward and backward (`megatron_cp.md` §6,
//! `docs/cp.md`):
//!
//! * forward: `[ΔS | M]` of the trailing fragment (last local sequence); the preceding ranks'
//!   summaries fold into the initial state of the first local sequence;
//! * backward: `[γ | Mᵀ]` of the leading fragment (first local sequence); the following ranks'
//!   summaries fold into the final-state gradient of the last local sequence.
//!
//! Dense input (every batch row spans all ranks) treats every row as both fragments. A rank
//! runs its scans once, on value columns widened by the transition's `K`: the widened rows are
//! affine in the state the exchange brings, and are corrected once it is known (on CUDA bf16
//! in both directions, on the CPU in the forward; the CPU backward computes `γ` in a pass of
//! its own and sends the forward's `M` transposed).

use self::columns::{correct_rows, join_columns, run_columns, Columns};
use super::comm::Communicator;
use super::protocol::{backward_summary_with, compose_backward, compose_forward, Composition};
use super::summary::{summary_len, Backward, Direction, Forward, Gathered};
use crate::error::GdpError;
use crate::op::cpu::chunk::Dims;
use crate::op::cpu::subnormal::FlushSubnormals;
use crate::op::cpu::{self, PackedInputs};
#[cfg(feature = "cuda")]
use crate::op::link::CudaCall;
use crate::op::link::{CpuInputs, RankLink};
use crate::op::shape::GdpShape;
use candle_core::{Result, WithDType};
use rayon::prelude::*;
use std::ops::Range;
use std::sync::{Arc, Mutex};

mod columns;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
use cuda::CudaIn;

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
    saved_h0: Mutex<Option<SavedStates>>,
    /// The CPU forward's transitions `M` (`[N, H, K, K]`; rows of sequences that continue from
    /// an earlier rank), whose transposes the backward summaries send.
    saved_m: Mutex<Option<Vec<f32>>>,
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
            saved_m: Mutex::new(None),
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
    fn fold_into_initial_states(
        &self,
        all: &[f32],
        frags: usize,
        sh: &GdpShape,
        h0: &mut [f32],
    ) -> Result<()> {
        let seqs = self.continuing_in(sh.num_seqs());
        let folded = self.fold_per_head(
            all,
            frags,
            sh,
            seqs.len(),
            |all: Gathered<Forward>, f, hd| {
                let from = self.fwd_slice.clone().map(|r| all.get(r, f, hd));
                compose_forward(from, sh.dk, sh.dv, self.composition)
            },
        )?;
        let (kv, h) = (sh.dk * sh.dv, sh.heads);
        for (i, s_in) in folded.into_iter().enumerate() {
            let at = (seqs[i / h] * h + i % h) * kv;
            h0[at..at + kv].copy_from_slice(&s_in);
        }
        Ok(())
    }

    /// Apply step of the backward: adds the fold of the following ranks' gathered `[γ | Mᵀ]`
    /// summaries (`all`: `[ranks, frags, H, K, V+K]`) to the final-state gradients
    /// `dht [N, H, K, V]` of the sequences that continue on a later rank.
    fn fold_into_final_grads(
        &self,
        all: &[f32],
        frags: usize,
        sh: &GdpShape,
        dht: &mut [f32],
    ) -> Result<()> {
        let seqs = self.continuing_out(sh.num_seqs());
        let folded = self.fold_per_head(
            all,
            frags,
            sh,
            seqs.len(),
            |all: Gathered<Backward>, f, hd| {
                let from = self.bwd_slice.clone().map(|r| all.get(r, f, hd));
                compose_backward(from, sh.dk, sh.dv, self.composition)
            },
        )?;
        let (kv, h) = (sh.dk * sh.dv, sh.heads);
        for (i, ds_out) in folded.into_iter().enumerate() {
            let at = (seqs[i / h] * h + i % h) * kv;
            dht[at..at + kv]
                .iter_mut()
                .zip(&ds_out)
                .for_each(|(g, d)| *g += d);
        }
        Ok(())
    }

    /// `fold(all, fragment, head)` for each of the first `count` fragments and each head, in
    /// (fragment, head) order, in parallel, over the gathered summaries `all`
    /// (`[ranks, frags, H, K, V+K]`).
    fn fold_per_head<D: Direction>(
        &self,
        all: &[f32],
        frags: usize,
        sh: &GdpShape,
        count: usize,
        fold: impl Fn(Gathered<'_, D>, usize, usize) -> Vec<f32> + Sync,
    ) -> Result<Vec<Vec<f32>>> {
        let world = self.comm.world_size();
        let all = Gathered::<D>::new(all, world, frags, sh.heads, (sh.dk, sh.dv))?;
        let h = sh.heads;
        Ok((0..count * h)
            .into_par_iter()
            .map(|i| {
                let _flush = FlushSubnormals::new();
                fold(all, i / h, i % h)
            })
            .collect())
    }

    /// The initial states this rank's forward folded (what its backward runs from).
    fn saved_initial_states(&self) -> Result<Vec<f32>> {
        match self.saved_h0.lock().map_err(|_| poisoned())?.as_ref() {
            Some(SavedStates::Host(h0)) => Ok(h0.clone()),
            #[cfg(feature = "cuda")]
            Some(SavedStates::Device(h0)) => {
                h0.stream().clone_dtoh(h0).map_err(candle_core::Error::wrap)
            }
            None => Err(backward_before_forward()),
        }
    }

    /// All-gathers `local` (`frags · H` summaries); a group of one skips the collective. The
    /// folds read the result through [`Gathered`], which rejects a buffer of the wrong length
    /// (a faulty transport); the error aborts the group like any other error of a rank's op.
    fn gather(&self, local: Vec<f32>) -> Result<Vec<f32>> {
        if self.comm.world_size() == 1 {
            return Ok(local);
        }
        self.comm.all_gather(&local)
    }

    /// The forward on this rank: returns `[o | final states]` like [`cpu::forward()`], in one
    /// pass. A sequence that continues from an earlier rank runs once on the widened values
    /// `[v | 0_K]` from `[0 | I_K]`, which gives `[o⁰ | Q̃]` per token and `[ΔS | M]` at its
    /// end; after the exchange its output is `o⁰ + Q̃ S_in` and its final state `ΔS + M S_in`.
    /// Every other sequence runs as in the plain op (its `M` would multiply a zero state on the
    /// following rank, so it is sent as zeros).
    pub fn forward<T: WithDType>(
        &self,
        x: &PackedInputs<T>,
        sh: &GdpShape,
        scale: f32,
    ) -> Result<Vec<f32>> {
        let (h, k, v, ns) = (sh.heads, sh.dk, sh.dv, sh.num_seqs());
        let (kv, sl, wide) = (k * v, summary_len(k, v), v + k);
        let incoming = self.continuing_in(ns);
        let d = dims(sh, scale);
        // The recurrence is separable over value columns: with threads to spare, a continuing
        // sequence's `V` columns (from zero) and its `K` identity columns run as two tasks side
        // by side instead of one widened task.
        let split = rayon::current_num_threads() >= (ns + incoming.len()) * h;
        let jobs: Vec<(usize, usize, Columns)> = (0..ns)
            .flat_map(|s| (0..h).map(move |hd| (s, hd)))
            .flat_map(|(s, hd)| {
                let parts: &[Columns] = match (incoming.contains(&s), split) {
                    (false, _) => &[Columns::Plain],
                    (true, false) => &[Columns::Widened],
                    (true, true) => &[Columns::Values, Columns::Transition],
                };
                parts.iter().map(move |&c| (s, hd, c))
            })
            .collect();
        let results: Vec<(Vec<f32>, Vec<f32>)> = jobs
            .par_iter()
            .map(|&(s, hd, cols)| {
                let _flush = FlushSubnormals::new();
                run_columns(x, sh, &d, s, hd, cols)
            })
            .collect();
        // Per (sequence, head): the token rows (`[len, V]`, or `[len, V + K]` widened) and the
        // final state (`[K, V]`, or `[ΔS | M]`).
        let mut runs: Vec<(Vec<f32>, Vec<f32>)> = Vec::with_capacity(ns * h);
        let mut it = jobs.iter().zip(results);
        while let Some((&(s, _, cols), run)) = it.next() {
            if cols != Columns::Values {
                runs.push(run);
                continue;
            }
            let Some((_, tr)) = it.next() else {
                return Err(candle_core::Error::Msg(
                    "gdp cp: a transition run is missing".into(),
                ));
            };
            let len = sh.seqs[s].len;
            runs.push((
                join_columns(&run.0, &tr.0, len, v, k),
                join_columns(&run.1, &tr.1, k, v, k),
            ));
        }
        // Exchange: the trailing fragments' `[ΔS | M]` (zeros where no later rank reads them).
        let frags = self.fragments(ns, true);
        let needed = !self.bwd_slice.is_empty();
        let mut local = vec![0.0f32; frags.len() * h * sl];
        if needed {
            for (f, &s) in frags.iter().enumerate() {
                for hd in 0..h {
                    let fin = &runs[s * h + hd].1;
                    let dst = &mut local[(f * h + hd) * sl..(f * h + hd + 1) * sl];
                    if fin.len() == sl {
                        dst.copy_from_slice(fin);
                    } else {
                        for r in 0..k {
                            dst[r * wide..r * wide + v].copy_from_slice(&fin[r * v..(r + 1) * v]);
                        }
                    }
                }
            }
        }
        let all = self.gather(local)?;
        // Fold the preceding ranks into the incoming states, then correct: o = o⁰ + Q̃ S_in.
        let mut h0 = vec![0.0f32; ns * h * kv];
        self.fold_into_initial_states(&all, frags.len(), sh, &mut h0)?;
        let o_len = sh.o_len();
        let mut out = vec![0.0f32; o_len + sh.state_len()];
        let mut m_all = vec![0.0f32; ns * h * k * k];
        for (i, (_, fin)) in runs.iter().enumerate() {
            if fin.len() == sl {
                for r in 0..k {
                    m_all[(i * k + r) * k..(i * k + r + 1) * k]
                        .copy_from_slice(&fin[r * wide + v..(r + 1) * wide]);
                }
            }
        }
        *self.saved_m.lock().map_err(|_| poisoned())? = Some(m_all);
        let finished: Vec<(Vec<f32>, Vec<f32>)> = runs
            .into_par_iter()
            .enumerate()
            .map(|(i, (o, fin))| {
                let _flush = FlushSubnormals::new();
                let (s, hd) = (i / h, i % h);
                if !incoming.contains(&s) {
                    return (o, fin);
                }
                let s_in = &h0[(s * h + hd) * kv..(s * h + hd + 1) * kv];
                let len = sh.seqs[s].len;
                (
                    correct_rows(&o, len, s_in, k, v),
                    correct_rows(&fin, k, s_in, k, v),
                )
            })
            .collect();
        for (i, (o, fin)) in finished.into_iter().enumerate() {
            let (s, hd) = (i / h, i % h);
            let seq = &sh.seqs[s];
            for t in 0..seq.len {
                let tok = seq.batch * sh.tokens + seq.start + t;
                out[(tok * h + hd) * v..(tok * h + hd + 1) * v]
                    .copy_from_slice(&o[t * v..(t + 1) * v]);
            }
            out[o_len + i * kv..o_len + (i + 1) * kv].copy_from_slice(&fin);
        }
        // The initial states the backward reruns from.
        for s in 0..ns {
            if !incoming.contains(&s) {
                for hd in 0..h {
                    let at = (s * h + hd) * kv;
                    h0[at..at + kv].copy_from_slice(&x.initial_state(sh, None, s, hd));
                }
            }
        }
        *self.saved_h0.lock().map_err(|_| poisoned())? = Some(SavedStates::Host(h0));
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
        // A leading fragment that continues from an earlier rank ran widened in the forward:
        // its `Mᵀ` is the transpose of the `M` kept then.
        let saved_m = self.saved_m.lock().map_err(|_| poisoned())?.take();
        let incoming = self.continuing_in(ns);
        let kk = sh.dk * sh.dk;
        let h0 = self.saved_initial_states()?;
        // With a thread for each, one parallel pass runs both kinds of work that need no
        // exchange: the leading fragments' summaries and every (sequence, head)'s chunk start
        // states for the backward's reverse pass (its rerun of the forward scan from `h0`),
        // which then need not wait for the exchange. (With fewer threads the tasks would not
        // all run at once, and every task's states would be held at once: the reverse pass
        // reruns them itself then.)
        let summaries = if needed { pairs(&frags, h) } else { vec![] };
        let all_pairs = pairs(&(0..ns).collect::<Vec<_>>(), h);
        let overlap = needed && summaries.len() + all_pairs.len() <= rayon::current_num_threads();
        let rerun = if overlap { all_pairs } else { vec![] };
        let jobs: Vec<(bool, (usize, usize))> = summaries
            .iter()
            .map(|&p| (true, p))
            .chain(rerun.into_iter().map(|p| (false, p)))
            .collect();
        let mut results: Vec<Vec<f32>> = jobs
            .par_iter()
            .map(|&(summary, (s, hd))| {
                if !summary {
                    return cpu::head_start_states(x, sh, scale, Some(&h0), (s, hd));
                }
                let _flush = FlushSubnormals::new();
                let m = saved_m
                    .as_ref()
                    .filter(|_| incoming.contains(&s))
                    .map(|m| &m[(s * h + hd) * kk..(s * h + hd + 1) * kk]);
                let seq = &sh.seqs[s];
                let mut dout = Vec::with_capacity(seq.len * dv);
                for t in 0..seq.len {
                    let off = ((seq.batch * sh.tokens + seq.start + t) * h + hd) * dv;
                    dout.extend_from_slice(&grad[off..off + dv]);
                }
                let st = o_len + (s * h + hd) * kv;
                let ds_end = &grad[st..st + kv];
                backward_summary_with(&x.gather(sh, seq, hd), &d, &dout, ds_end, m).into_rows()
            })
            .collect();
        let states = results.split_off(summaries.len());
        let local = if needed {
            results.concat()
        } else {
            vec![0.0; frags.len() * h * sl]
        };
        let all = self.gather(local)?;
        let mut grad = grad.to_vec();
        self.fold_into_final_grads(&all, frags.len(), sh, &mut grad[o_len..])?;
        let states = overlap.then_some(states.as_slice());
        let mut out = cpu::backward_from(x, sh, scale, &grad, Some(&h0), states)?;
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

fn backward_before_forward() -> candle_core::Error {
    candle_core::Error::Msg("gdp cp: backward before forward".into())
}

/// The initial states a rank's forward ran from, kept for its backward.
enum SavedStates {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Device(candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>),
}

fn poisoned() -> candle_core::Error {
    GdpError::Comm("the op's saved state lock is poisoned".into()).into()
}

impl RankLink for CpLink {
    fn abort(&self, reason: &str) {
        self.comm.abort(reason);
    }

    fn forward_cpu(&self, x: CpuInputs<'_>, sh: &GdpShape, scale: f32) -> Result<Vec<f32>> {
        match x {
            CpuInputs::F32(x) => self.forward(x, sh, scale),
            CpuInputs::F64(x) => self.forward(x, sh, scale),
            CpuInputs::Bf16(x) => self.forward(x, sh, scale),
            CpuInputs::F16(x) => self.forward(x, sh, scale),
        }
    }

    fn backward_cpu(
        &self,
        x: CpuInputs<'_>,
        sh: &GdpShape,
        scale: f32,
        grad: &[f32],
    ) -> Result<Vec<f32>> {
        match x {
            CpuInputs::F32(x) => self.backward(x, sh, scale, grad),
            CpuInputs::F64(x) => self.backward(x, sh, scale, grad),
            CpuInputs::Bf16(x) => self.backward(x, sh, scale, grad),
            CpuInputs::F16(x) => self.backward(x, sh, scale, grad),
        }
    }

    #[cfg(feature = "cuda")]
    fn forward_cuda(
        &self,
        (qk, v, aux): (crate::op::cuda::QkIn, CudaIn, CudaIn),
        call: &CudaCall,
        cache: Option<&crate::op::cuda::CacheSlot>,
    ) -> Result<candle_core::CudaStorage> {
        self.forward_cuda_impl(qk, v, aux, call, cache)
    }

    #[cfg(feature = "cuda")]
    fn backward_cuda(
        &self,
        ins: (CudaIn, CudaIn, CudaIn, CudaIn),
        call: &CudaCall,
        cache: Option<crate::op::cuda::ForwardCache>,
    ) -> Result<candle_core::CudaStorage> {
        self.backward_cuda_impl(ins, call, cache)
    }

    #[cfg(feature = "cuda")]
    fn backward_overrides_cuda<'a>(
        &'a self,
        dev: &candle_core::CudaDevice,
        sh: &GdpShape,
        has_h0: bool,
    ) -> Result<crate::op::cuda::CpOverrides<'a>> {
        self.backward_overrides_cuda_impl(dev, sh, has_h0)
    }
}
