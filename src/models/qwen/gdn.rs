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
    /// The last `W` pre-convolution inputs `[B, C, W]`, oldest first.
    pub conv: Tensor,
    /// The recurrent state `[B, Hv, dk, dv]`, f32.
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
        let p = self.project(x)?;
        let mut cache = cache;
        let mixed = self
            .conv
            .forward(&p.mixed, cache.as_mut().map(|cc| &mut cc.conv))?;
        let (q, k, v) = self.split_heads(&mixed)?;
        let o = match cache.as_mut() {
            Some(cc) if p.t == 1 => {
                let (o, state) = gated_delta_product_step_fused(
                    &cc.state,
                    &q.squeeze(1)?,
                    &k,
                    &v,
                    &p.g.squeeze(1)?,
                    &p.beta,
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
                let (o, ht) = gated_delta_product(&q, &k, &v, &p.g, &p.beta, &opts)?;
                if let (Some(cc), Some(ht)) = (cache, ht) {
                    cc.state = ht;
                }
                o
            }
        };
        self.output(&o, &p)
    }

    /// The projections of `x [B, T, D]`: the convolution's input, and `z`, `beta`, `g`.
    pub(super) fn project(&self, x: &Tensor) -> Result<Projected> {
        let (b, t, _) = x.dims3()?;
        let (hv, dv) = (self.hv, self.dv);
        let c = self.conv.channels();
        let proj = self.in_proj.forward(x)?;
        let z = proj.narrow(2, c, hv * dv)?.reshape((b, t, hv, dv))?;
        let beta = candle_nn::ops::sigmoid(&proj.narrow(2, c + hv * dv, hv)?)?;
        let a = proj.narrow(2, c + hv * dv + hv, hv)?.to_dtype(DType::F32)?;
        let g = softplus(&a.broadcast_add(&self.dt_bias)?)?.broadcast_mul(&self.neg_a)?;
        Ok(Projected {
            mixed: proj.narrow(2, 0, c)?,
            z,
            beta,
            g,
            b,
            t,
        })
    }

    /// The convolution's output `[B, T, C]` as the op's `q`, `k` (L2-normalised, `[B, T, Hk,
    /// dk]`) and `v [B, T, Hv, dv]`.
    pub(super) fn split_heads(&self, mixed: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = mixed.dims3()?;
        let (hk, hv, dk, dv) = (self.hk, self.hv, self.dk, self.dv);
        let head = |start: usize, heads: usize, dim: usize| {
            mixed
                .narrow(2, start, heads * dim)?
                .reshape((b, t, heads, dim))
        };
        Ok((
            l2_norm(&head(0, hk, dk)?, 1e-6)?,
            l2_norm(&head(hk * dk, hk, dk)?, 1e-6)?,
            head(2 * hk * dk, hv, dv)?,
        ))
    }

    /// `out_proj(norm(o) · silu(z))` for the op's output `o [B, T, Hv, dv]`: `[B, T, D]`.
    pub(super) fn output(&self, o: &Tensor, p: &Projected) -> Result<Tensor> {
        let y = self.norm.forward(o, &p.z)?;
        self.out_proj
            .forward(&y.reshape((p.b, p.t, self.hv * self.dv))?)
    }

    /// The short convolution.
    pub(super) fn conv(&self) -> &ShortConv {
        &self.conv
    }
}

/// A GDN layer's projections of one input ([`GatedDeltaNet::project`]).
pub(super) struct Projected {
    /// The convolution's input `[B, T, C]`.
    pub mixed: Tensor,
    /// The output gate `[B, T, Hv, dv]`.
    pub z: Tensor,
    /// `[B, T, Hv]`.
    pub beta: Tensor,
    /// f32 `[B, T, Hv]`.
    pub g: Tensor,
    pub b: usize,
    pub t: usize,
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
