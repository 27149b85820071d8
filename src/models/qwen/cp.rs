//! Context-parallel prefill of a [`QwenHybrid`]: a long prompt split along time over the ranks
//! of a [`ContextParallel`] group, with the same logits and the same decode cache as one
//! prefill on one device.
//!
//! Per layer a rank needs from its peers:
//! * GDN layers: the convolution halo (the previous rank's last `W - 1` inputs,
//!   [`halo_exchange`]) and the recurrent state, through the crate's context-parallel op
//!   ([`cp_gated_delta_product`]: one all-gather of state summaries);
//! * attention layers: every earlier key and value: the ranks all-gather theirs (padded to the
//!   longest shard) and attend causally from their own offset.
//!
//! Embeddings, norms, MLPs and the LM head are per token. Forward only (inference): the
//! key/value gather is not differentiable. Every rank must call [`QwenHybrid::prefill_cp`] with
//! the same model and batch size, in the same order.

use super::attention::KvCache;
use super::model::{LayerCache, Mixer, QwenCache, QwenHybrid};
use crate::cp::{cp_gated_delta_product, ContextParallel, CpRank};
use crate::error::GdpError;
use crate::nn::cp::{check_shards, run_shards};
use crate::nn::{halo_exchange, CpContext};
use crate::GdpOptions;
use candle_core::{Result, Tensor};

/// What a context-parallel prefill gives: the logits of every prompt position and the cache a
/// single-device decoder continues from.
#[derive(Debug, Clone)]
pub struct QwenPrefill {
    /// `[B, T, vocab]`, f32.
    pub logits: Tensor,
    /// Equal to the cache of one [`QwenHybrid::forward`] over the whole prompt.
    pub cache: QwenCache,
}

impl QwenHybrid {
    /// This rank's part of a context-parallel prefill: `input_ids [B, T_r]` (u32), this rank's
    /// contiguous shard of the prompt (`T_r >= W - 1`; shards may differ in length) `->` its
    /// logits `[B, T_r, vocab]` and, on the last rank, the decode cache of the whole prompt.
    /// A collective over `ctx`'s group.
    pub fn prefill_cp(
        &self,
        input_ids: &Tensor,
        ctx: &CpContext,
    ) -> Result<(Tensor, Option<QwenCache>)> {
        let (b, t) = input_ids.dims2()?;
        let cfg = self.config();
        let w = cfg.linear_conv_kernel_dim;
        let lens = check_shards(ctx, b, t, w, true)?;
        let total: usize = lens.iter().sum();
        let comm = ctx.comm();
        let (rank, world) = (comm.rank(), comm.world_size());
        let offset: usize = lens[..rank].iter().sum();
        let last = rank + 1 == world;
        let mut x = self.embed_tokens(input_ids)?;
        let mut caches = Vec::new();
        for (i, layer) in self.decoder_layers().iter().enumerate() {
            let h = layer.input_norm.forward(&x)?;
            let (y, cache) = match &layer.mixer {
                Mixer::Linear(gdn) => {
                    let p = gdn.project(&h)?;
                    let tail = p.mixed.narrow(1, t - (w - 1), w - 1)?;
                    let halo = halo_exchange(&tail, ctx)?;
                    let conv = gdn.conv();
                    let (mixed, _) = conv.forward_with_halo(&p.mixed, Some(&halo))?;
                    let (q, k, v) = gdn.split_heads(&mixed)?;
                    let opts = GdpOptions {
                        output_final_state: true,
                        ..Default::default()
                    };
                    let rank_meta = CpRank {
                        comm: comm.clone(),
                        meta: ctx.rank_meta(t),
                        composition: Default::default(),
                    };
                    let (o, ht) =
                        cp_gated_delta_product(&q, &k, &v, &p.g, &p.beta, &opts, &rank_meta)?;
                    let state = ht.ok_or_else(|| {
                        GdpError::Comm(format!("layer {i}: the rank's op returned no final state"))
                    })?;
                    // The last W conv inputs of [halo | x], in the cache's [B, C, W] layout.
                    let all = Tensor::cat(&[&halo, &p.mixed], 1)?;
                    let n = all.dim(1)?;
                    let conv_state = all.narrow(1, n - w, w)?.transpose(1, 2)?.contiguous()?;
                    let cache = super::gdn::GdnCache {
                        conv: conv_state,
                        state,
                    };
                    (gdn.output(&o, &p)?, LayerCache::Linear(cache))
                }
                Mixer::Full(attn) => {
                    let p = attn.project(&h, offset)?;
                    let k = gather_time(&p.k, &lens, ctx)?;
                    let v = gather_time(&p.v, &lens, ctx)?;
                    let y = attn.attend(&p, &k, &v, offset)?;
                    let cache = KvCache {
                        k: Some(k),
                        v: Some(v),
                    };
                    (y, LayerCache::Full(cache))
                }
            };
            x = (x + y)?;
            let h = layer.post_norm.forward(&x)?;
            x = (&x + layer.ffn.forward(&h)?)?;
            if last {
                caches.push(cache);
            }
        }
        let logits = self.head(&x)?;
        let cache = last.then_some(QwenCache {
            layers: caches,
            seen_tokens: total,
        });
        Ok((logits, cache))
    }
}

/// `x [B, H, T_r, d]` of every rank, concatenated along time in rank order (`lens`: the ranks'
/// `T_r`): one all-gather of the shards padded to the longest.
fn gather_time(x: &Tensor, lens: &[usize], ctx: &CpContext) -> Result<Tensor> {
    let longest = lens.iter().copied().max().unwrap_or(0);
    let (b, h, t, d) = x.dims4()?;
    let padded = if t < longest {
        let pad = Tensor::zeros((b, h, longest - t, d), x.dtype(), x.device())?;
        Tensor::cat(&[x, &pad], 2)?
    } else {
        x.clone()
    };
    let all = ctx.comm().all_gather_tensor(&padded.contiguous()?)?; // [world, B, H, longest, d]
    let parts = lens
        .iter()
        .enumerate()
        .map(|(r, &len)| all.get(r)?.narrow(2, 0, len))
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts, 2)?.to_dtype(x.dtype())?.contiguous()
}

/// Prefills `input_ids [B, T]` (u32) over the ranks of `cp` (near-equal contiguous shards) and
/// returns every position's logits and the decode cache, equal to one [`QwenHybrid::forward`]
/// with a cache on one device. The ranks share `model`, so every rank's device must be the
/// model's (e.g. [`ContextParallel::cpu`] for a CPU model, or one CUDA device repeated).
pub fn prefill_context_parallel(
    model: &QwenHybrid,
    cp: &ContextParallel,
    input_ids: &Tensor,
) -> Result<QwenPrefill> {
    input_ids.dims2()?;
    let outs = run_shards(cp, model.device(), input_ids, |shard, ctx| {
        model.prefill_cp(shard, ctx)
    })?;
    let mut logits = Vec::with_capacity(outs.len());
    let mut cache = None;
    for (l, c) in outs {
        logits.push(l);
        cache = cache.or(c);
    }
    Ok(QwenPrefill {
        logits: Tensor::cat(&logits, 1)?,
        cache: cache
            .ok_or_else(|| GdpError::Comm("the last rank returned no decode cache".into()))?,
    })
}
