//! Context parallelism (CP) for [`GdpForCausalLM`]: every rank holds a contiguous time shard
//! `input_ids [B, T_r]` of the same `B` rows (rank order = time order, every row spans all
//! ranks) and computes its logits `[B, T_r, vocab]` exactly (`megatron_cp.md` §7).
//!
//! Per GDP layer a rank needs two things from its peers, both exchanged inside differentiable
//! ops, so `loss.backward()` on every rank gives that rank's exact share of the gradient:
//!
//! * the short-convolution halo: the previous rank's last `W - 1` conv inputs (q, k and v in one
//!   exchange, [`halo_exchange`]); rank 0 gets zeros. Every shard needs `T_r >= W - 1`;
//! * the recurrent state, through [`crate::cp::cp_gated_delta_product_packed`].
//!
//! Embeddings, norms, MLPs and the LM head are per token. Weight gradients are then summed over
//! the ranks with [`all_reduce_grads`]; [`GdpForCausalLM::prefill_cp`] turns a CP prefill into
//! the [`Cache`] of a single-device decoder.
//!
//! # Ordering of collectives
//!
//! The ranks never address each other: every exchange is a collective that all ranks must enter
//! in the same order. Per [`GdpForCausalLM::forward_cp`] call that is one shape check, then per
//! layer one halo all-gather (with short convolutions) and one state all-gather; per backward,
//! per layer in reverse, one state and one halo all-gather. Candle orders its backward by a
//! depth-first walk of the graph that depends only on the graph's structure, and every rank
//! builds the same graph (rank 0 runs the halo op too, the last rank sends its tail too), so
//! the order agrees as long as every rank
//!
//! * calls `forward_cp` / `prefill_cp` with the same model configuration and batch size, the
//!   same number of times, in the same order, and
//! * runs `backward` (if at all) on losses built the same way from those logits, in the same
//!   order (a loss that ignores some logits on one rank only is not allowed).
//!
//! Guard: the halo and shape-check collectives carry a header (a per-context sequence number,
//! the direction, the payload length); when ranks disagree the group is aborted and every rank
//! gets [`GdpError::Comm`] naming the mismatch instead of silently wrong numbers. The
//! communicator also checks the kind and length of every collective.

mod exchange;

pub use exchange::{halo_exchange, CpContext};

use super::cache::{Cache, LayerCache};
use super::layer::GatedDeltaProduct;
use super::model::GdpForCausalLM;
use crate::cp::{cp_gated_delta_product_packed, Communicator, ContextParallel, CpRank, ShardPlan};
use crate::error::GdpError;
use crate::GdpOptions;
use candle_core::backprop::GradStore;
use candle_core::{DType, Module, Result, Tensor, Var};
use candle_nn::VarMap;
pub(crate) use exchange::check_shards;

/// The last `W` inputs `[B, C, W]` (FLA's conv-cache layout) of `[halo | x]`.
fn conv_state(halo: &Tensor, x: &Tensor, w: usize) -> Result<Tensor> {
    let full = Tensor::cat(&[halo, x], 1)?;
    let len = full.dim(1)?;
    full.narrow(1, len - w, w)?.transpose(1, 2)?.contiguous()
}

/// One GDP layer on a shard: `x [B, T_r, D] -> [B, T_r, D]`; with `keep`, also the layer's
/// conv histories and final state (true ones on the last rank), `seen_tokens = total`.
fn mixer_cp(
    layer: &GatedDeltaProduct,
    x: &Tensor,
    ctx: &CpContext,
    keep: Option<usize>,
) -> Result<(Tensor, Option<LayerCache>)> {
    let (_, t) = layer.check_input(x, None)?;
    let (qk, v) = layer.project(x)?;
    let mut convs = None;
    let (qk, v) = match layer.short_convs()? {
        None => (qk.silu()?, v.silu()?),
        Some((c_qk, c_v)) => {
            let (w, cq) = (c_qk.kernel(), c_qk.channels());
            let w1 = w - 1;
            let start = t.checked_sub(w1).ok_or_else(|| GdpError::Option {
                name: "x".into(),
                reason: format!("a CP shard needs at least W - 1 = {w1} tokens, got {t}"),
            })?;
            let halo = if w1 == 0 {
                None
            } else {
                // One exchange for q, k and v: [qk tail | v tail].
                let tail = Tensor::cat(&[qk.narrow(1, start, w1)?, v.narrow(1, start, w1)?], 2)?;
                let halo = halo_exchange(&tail, ctx)?;
                Some((halo.narrow(2, 0, cq)?, halo.narrow(2, cq, c_v.channels())?))
            };
            if keep.is_some() {
                let (h_qk, h_v) = match &halo {
                    Some((a, b)) => (a.clone(), b.clone()),
                    None => (qk.narrow(1, 0, 0)?, v.narrow(1, 0, 0)?),
                };
                let s_v = conv_state(&h_v, &v, w)?;
                convs = Some(layer.split_qk_state(&conv_state(&h_qk, &qk, w)?, s_v)?);
            }
            let (h_qk, h_v) = (halo.as_ref().map(|h| &h.0), halo.as_ref().map(|h| &h.1));
            (
                c_qk.forward_with_halo(&qk, h_qk)?.0,
                c_v.forward_with_halo(&v, h_v)?.0,
            )
        }
    };
    let (qk, v, g, beta) = layer.op_inputs(x, &qk, &v)?;
    let opts = GdpOptions {
        num_householder: Some(layer.num_householder()),
        output_final_state: keep.is_some(),
        ..Default::default()
    };
    let rank = CpRank {
        comm: ctx.comm().clone(),
        meta: ctx.rank_meta(t),
        composition: Default::default(),
    };
    let (o, ht) = cp_gated_delta_product_packed(&qk, &v, &g, &beta, &opts, &rank)?;
    let y = layer.output(x, &o)?;
    let cache = match (keep, ht) {
        (Some(total), Some(recurrent)) => {
            let (conv_q, conv_k, conv_v) = match convs {
                Some((q, k, v)) => (Some(q), Some(k), Some(v)),
                None => (None, None, None),
            };
            Some(LayerCache {
                conv_q,
                conv_k,
                conv_v,
                recurrent,
                seen_tokens: total,
            })
        }
        _ => None,
    };
    Ok((y, cache))
}

/// The last position's logits and the decode cache of a context-parallel prefill.
#[derive(Debug, Clone)]
pub struct CpPrefill {
    /// Logits of the prompt's last token, `[B, vocab]`.
    pub last_logits: Tensor,
    /// The caches a single-device decoder continues from, equal to those of one prefill of the
    /// whole prompt with [`GdpForCausalLM::forward`]: conv histories `[B, C, W]` in the model's
    /// dtype, recurrent states `[B, Hv, K, V]` f32, `seen_tokens = T`.
    pub cache: Cache,
}

impl GdpForCausalLM {
    /// Context-parallel logits: `input_ids [B, T_r]` (this rank's contiguous time shard of the
    /// same `B` rows on every rank, `T_r >= conv_size - 1`, shards may differ in length)
    /// `-> [B, T_r, vocab]`, equal to this shard's positions of the single-device
    /// [`Self::forward`] of the whole sequence.
    /// Differentiable; a collective (see the module docs for the ordering rules).
    pub fn forward_cp(&self, input_ids: &Tensor, ctx: &CpContext) -> Result<Tensor> {
        Ok(self.run_cp(input_ids, ctx, false)?.0)
    }

    /// Context-parallel prefill (forward only): on the last rank, the last position's logits
    /// and the [`Cache`] of the whole prompt for a single-device decoder (final recurrent
    /// states and conv histories from the last shard); `None` on the other ranks.
    pub fn prefill_cp(&self, input_ids: &Tensor, ctx: &CpContext) -> Result<Option<CpPrefill>> {
        let (logits, layers) = self.run_cp(input_ids, ctx, true)?;
        if ctx.comm().rank() + 1 != ctx.comm().world_size() {
            return Ok(None);
        }
        let t = logits.dim(1)?;
        Ok(Some(CpPrefill {
            last_logits: logits.narrow(1, t - 1, 1)?.squeeze(1)?,
            cache: Cache { layers },
        }))
    }

    fn run_cp(
        &self,
        input_ids: &Tensor,
        ctx: &CpContext,
        keep: bool,
    ) -> Result<(Tensor, Vec<LayerCache>)> {
        let (b, t) = self.check_ids(input_ids)?;
        let total: usize = check_shards(
            ctx,
            b,
            t,
            self.config().conv_size,
            self.config().use_short_conv,
        )?
        .iter()
        .sum();
        let (embeddings, blocks, norm, lm_head) = self.parts();
        let mut x = embeddings.forward(input_ids)?;
        let mut layers = Vec::new();
        for block in blocks {
            x = block.forward_with(&x, |attn, h| {
                let (y, lc) = mixer_cp(attn, h, ctx, keep.then_some(total))?;
                layers.extend(lc);
                Ok(y)
            })?;
        }
        Ok((lm_head.forward(&norm.forward(&x)?)?, layers))
    }
}

/// Sums every variable's gradient over the CP group in place (one all-reduce of all gradients,
/// in name order, so all ranks agree), so each rank ends with the full-sequence gradient. A
/// variable without a gradient contributes zeros and then gets the sum. A collective.
pub fn all_reduce_grads(
    grads: &mut GradStore,
    varmap: &VarMap,
    comm: &dyn Communicator,
) -> Result<()> {
    let vars: Vec<Var> = {
        let data = varmap
            .data()
            .lock()
            .map_err(|_| candle_core::Error::Msg("the VarMap lock is poisoned".into()))?;
        let mut named: Vec<(&String, &Var)> = data.iter().collect();
        named.sort_by(|a, b| a.0.cmp(b.0));
        named.into_iter().map(|(_, v)| v.clone()).collect()
    };
    all_reduce_var_grads(grads, &vars, comm)
}

/// [`all_reduce_grads`] over `vars`, which every rank must list in the same order (all on one
/// device).
pub fn all_reduce_var_grads(
    grads: &mut GradStore,
    vars: &[Var],
    comm: &dyn Communicator,
) -> Result<()> {
    let Some(first) = vars.first() else {
        return Ok(());
    };
    let dev = first.device();
    let flat = vars
        .iter()
        .map(|v| match grads.get(v.as_tensor()) {
            Some(g) => g.to_dtype(DType::F32)?.flatten_all()?.to_device(dev),
            None => Tensor::zeros(v.elem_count(), DType::F32, dev),
        })
        .collect::<Result<Vec<_>>>()?;
    let sum = comm.all_reduce_sum_tensor(&Tensor::cat(&flat, 0)?)?;
    let mut off = 0;
    for v in vars {
        let n = v.elem_count();
        let g = sum
            .narrow(0, off, n)?
            .reshape(v.shape())?
            .to_dtype(v.dtype())?;
        grads.insert(v.as_tensor(), g);
        off += n;
    }
    Ok(())
}

/// Whole-problem driver of [`GdpForCausalLM::prefill_cp`]: shards `input_ids [B, T]` over the
/// ranks of `cp` (near-equal, contiguous), prefills, and returns the last rank's result. The
/// model is shared by the ranks, so every rank's device must be the model's (e.g.
/// [`ContextParallel::cpu`] for a CPU model); otherwise build one model per device and call
/// `prefill_cp` from [`ContextParallel::run`].
pub fn prefill_context_parallel(
    model: &GdpForCausalLM,
    cp: &ContextParallel,
    input_ids: &Tensor,
) -> Result<CpPrefill> {
    model.check_ids(input_ids)?;
    let dev = model.parts().0.embeddings().device().clone();
    let outs = run_shards(cp, &dev, input_ids, |shard, ctx| {
        model.prefill_cp(shard, ctx)
    })?;
    outs.into_iter()
        .flatten()
        .next()
        .ok_or_else(|| GdpError::Comm("the last rank returned no prefill".into()).into())
}

/// Shards `input_ids [B, T]` along time over the ranks of `cp` (near-equal, contiguous), moves
/// each shard to `dev` and runs `f` on every rank with a fresh [`CpContext`]; the results in
/// rank order. The ranks share one model's weights, so every rank's device must be `dev`.
pub(crate) fn run_shards<T: Send>(
    cp: &ContextParallel,
    dev: &candle_core::Device,
    input_ids: &Tensor,
    f: impl Fn(&Tensor, &CpContext) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    if let Some(d) = cp.devices().iter().find(|d| !d.same_device(dev)) {
        return Err(GdpError::Device {
            name: "CP rank".into(),
            reference: "the model's weights".into(),
            expected: format!("{:?}", dev.location()),
            got: format!("{:?}", d.location()),
        }
        .into());
    }
    let plan = ShardPlan::new(input_ids.dim(1)?, cp.cp_size())?;
    cp.run(|comm, _| {
        let range = plan.range(comm.rank())?;
        let shard = input_ids
            .narrow(1, range.start, range.len())?
            .to_device(dev)?;
        f(&shard, &CpContext::new(comm))
    })
}
