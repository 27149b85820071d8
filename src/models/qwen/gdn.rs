//! The Gated DeltaNet layer of Qwen's hybrids (`linear_attn`): this crate's op at `n = 1` with
//! grouped value heads.
//!
//! ```text
//! [qkv | z | b | a] = x · W                       # one projection, rows permuted at load
//! qkv  = silu(causal depthwise conv over time)    # channels [q | k | v], width W
//! q, k = l2norm(q), l2norm(k)   (eps 1e-6)        # [B, T, Hk, dk]; v [B, T, Hv, dv]
//! beta = sigmoid(b);  g = -exp(A_log) · softplus(a + dt_bias)
//! o    = gated_delta_product(q, k, v, g, beta)    # value head h reads key head h / (Hv / Hk)
//! y    = out_proj(norm.weight · rmsnorm(o) · silu(z))
//! ```
//!
//! Qwen3.5 stores the projections flat (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
//! `in_proj_a`); Qwen3-Next stores `in_proj_qkvz` and `in_proj_ba` interleaved per key-head
//! group (`[q_g | k_g | v of the group's heads | z of them]`, `[b | a]` per group). Their rows
//! are permuted once at load into one matrix `[qkv | z | b | a]`; the convolution's channels
//! are flat `[q | k | v]` in both, so it is never permuted.

use super::config::{QwenArch, QwenConfig};
use crate::nn::norm::{l2_norm, softplus};
use crate::nn::{GatedRmsNorm, ShortConv};
use crate::op::recurrent::gated_delta_product_step_fused;
use crate::{gated_delta_product, GdpOptions};
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Linear, Module, VarBuilder};

/// What a GDN layer carries between calls: the convolution's last `W` inputs
/// `conv [B, C, W]` (the model's dtype) and the recurrent state `state [B, Hv, dk, dv]` (f32).
#[derive(Debug, Clone)]
pub struct GdnCache {
    pub conv: Tensor,
    pub state: Tensor,
}

/// One Gated DeltaNet layer.
#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    /// `[qkv | z | b | a]`: `[C + Hv·dv + 2·Hv, D]`.
    in_proj: Linear,
    conv: ShortConv,
    /// `-exp(A_log)`, f32 `[Hv]`.
    neg_a: Tensor,
    /// f32 `[Hv]`.
    dt_bias: Tensor,
    norm: GatedRmsNorm,
    out_proj: Linear,
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
}

impl GatedDeltaNet {
    /// Loads the layer's weights from `vb` (`…layers.{i}.linear_attn`) in `cfg.arch`'s layout.
    pub fn new(cfg: &QwenConfig, vb: VarBuilder) -> Result<Self> {
        let (hk, hv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads);
        let (dk, dv, d) = (
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
            cfg.hidden_size,
        );
        let c = cfg.conv_channels();
        let in_proj = match cfg.arch {
            QwenArch::Qwen3_5 => Tensor::cat(
                &[
                    vb.get((c, d), "in_proj_qkv.weight")?,
                    vb.get((hv * dv, d), "in_proj_z.weight")?,
                    vb.get((hv, d), "in_proj_b.weight")?,
                    vb.get((hv, d), "in_proj_a.weight")?,
                ],
                0,
            )?,
            QwenArch::Qwen3Next => {
                let qkvz = vb.get((c + hv * dv, d), "in_proj_qkvz.weight")?;
                let ba = vb.get((2 * hv, d), "in_proj_ba.weight")?;
                let (rows_qkvz, rows_ba) = grouped_row_order(hk, hv / hk, dk, dv);
                let dev = qkvz.device();
                Tensor::cat(
                    &[
                        qkvz.index_select(&Tensor::new(rows_qkvz.as_slice(), dev)?, 0)?,
                        ba.index_select(&Tensor::new(rows_ba.as_slice(), dev)?, 0)?,
                    ],
                    0,
                )?
            }
        };
        let f32 = |name: &str| vb.get(hv, name)?.to_dtype(DType::F32);
        Ok(Self {
            in_proj: Linear::new(in_proj, None),
            conv: ShortConv::new(c, cfg.linear_conv_kernel_dim, false, vb.pp("conv1d"))?,
            neg_a: f32("A_log")?.exp()?.neg()?,
            dt_bias: f32("dt_bias")?,
            norm: GatedRmsNorm::new(dv, cfg.rms_norm_eps, vb.pp("norm"))?,
            out_proj: Linear::new(vb.get((d, hv * dv), "out_proj.weight")?, None),
            hk,
            hv,
            dk,
            dv,
        })
    }

    /// An empty cache for `batch` sequences: zero convolution history in `dtype`, zero state.
    pub fn empty_cache(&self, batch: usize, dtype: DType, device: &Device) -> Result<GdnCache> {
        Ok(GdnCache {
            conv: self.conv.zero_state(batch, dtype, device)?,
            state: Tensor::zeros((batch, self.hv, self.dk, self.dv), DType::F32, device)?,
        })
    }

    /// `x [B, T, D] -> [B, T, D]`. With `cache`, starts from its history and state and leaves
    /// the new ones there; a single token then takes the fused recurrent step.
    pub fn forward(&self, x: &Tensor, cache: Option<&mut GdnCache>) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (hk, hv, dk, dv) = (self.hk, self.hv, self.dk, self.dv);
        let c = self.conv.channels();
        let proj = self.in_proj.forward(x)?;
        let mixed = proj.narrow(2, 0, c)?;
        let z = proj.narrow(2, c, hv * dv)?.reshape((b, t, hv, dv))?;
        let beta = candle_nn::ops::sigmoid(&proj.narrow(2, c + hv * dv, hv)?)?;
        let a = proj.narrow(2, c + hv * dv + hv, hv)?.to_dtype(DType::F32)?;
        let g = softplus(&a.broadcast_add(&self.dt_bias)?)?.broadcast_mul(&self.neg_a)?;
        let mut cache = cache;
        let mixed = self
            .conv
            .forward(&mixed, cache.as_mut().map(|cc| &mut cc.conv))?;
        let q = l2_norm(&mixed.narrow(2, 0, hk * dk)?.reshape((b, t, hk, dk))?, 1e-6)?;
        let k = l2_norm(
            &mixed.narrow(2, hk * dk, hk * dk)?.reshape((b, t, hk, dk))?,
            1e-6,
        )?;
        let v = mixed
            .narrow(2, 2 * hk * dk, hv * dv)?
            .reshape((b, t, hv, dv))?;
        let o = match cache.as_mut() {
            Some(cc) if t == 1 => {
                let (o, state) = gated_delta_product_step_fused(
                    &cc.state,
                    &q.squeeze(1)?,
                    &k,
                    &v,
                    &g.squeeze(1)?,
                    &beta,
                    None,
                )?;
                cc.state = state;
                o.unsqueeze(1)?
            }
            _ => {
                let state = cache.as_ref().map(|cc| cc.state.clone());
                let opts = GdpOptions {
                    initial_state: state.as_ref(),
                    output_final_state: cache.is_some(),
                    ..Default::default()
                };
                let (o, ht) = gated_delta_product(&q, &k, &v, &g, &beta, &opts)?;
                if let (Some(cc), Some(ht)) = (cache, ht) {
                    cc.state = ht;
                }
                o
            }
        };
        let y = self.norm.forward(&o, &z)?.reshape((b, t, hv * dv))?;
        self.out_proj.forward(&y)
    }
}

/// The rows of Qwen3-Next's `in_proj_qkvz` and `in_proj_ba` in the flat order `[all q | all k |
/// all v | all z]` and `[all b | all a]`: per key-head group `g` (of `hk`), `qkvz` holds
/// `q_g (dk) | k_g (dk) | v of its r heads (r·dv) | z of them (r·dv)` and `ba` holds
/// `b (r) | a (r)`.
fn grouped_row_order(hk: usize, r: usize, dk: usize, dv: usize) -> (Vec<u32>, Vec<u32>) {
    let block = 2 * dk + 2 * r * dv;
    let part = |start: usize, len: usize| -> Vec<u32> {
        (0..hk)
            .flat_map(|g| (0..len).map(move |i| (g * block + start + i) as u32))
            .collect()
    };
    let mut qkvz = part(0, dk);
    qkvz.extend(part(dk, dk));
    qkvz.extend(part(2 * dk, r * dv));
    qkvz.extend(part(2 * dk + r * dv, r * dv));
    let ba = |start: usize| {
        (0..hk).flat_map(move |g| (0..r).map(move |i| (g * 2 * r + start + i) as u32))
    };
    let mut rows_ba: Vec<u32> = ba(0).collect();
    rows_ba.extend(ba(r));
    (qkvz, rows_ba)
}

#[cfg(test)]
mod tests {
    use super::grouped_row_order;

    #[test]
    fn qwen3_next_rows_become_flat() {
        // hk = 2 groups, r = 2, dk = 1, dv = 1: per group [q k v v z z].
        let (qkvz, ba) = grouped_row_order(2, 2, 1, 1);
        assert_eq!(qkvz, [0, 6, 1, 7, 2, 3, 8, 9, 4, 5, 10, 11]);
        assert_eq!(ba, [0, 1, 4, 5, 2, 3, 6, 7]);
    }
}
