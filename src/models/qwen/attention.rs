//! The full-attention layers of Qwen's hybrids (`self_attn`): softmax attention whose query
//! projection also gives an output gate.
//!
//! ```text
//! [q | gate] = q_proj(x) per head           # [B, T, Hq, 2·hd]: q then gate, per head
//! q, k = q_norm(q), k_norm(k_proj(x))        # (1 + w) RMSNorms over hd
//! q, k = rope(q), rope(k)                    # the first hd · partial_rotary_factor dims
//! o    = softmax(q kᵀ / √hd + causal) v      # GQA: key/value head j serves Hq / Hkv heads
//! y    = o_proj(o · sigmoid(gate))
//! ```

use super::config::QwenConfig;
use super::layers::{OffsetRmsNorm, PartialRope};
use candle_core::{DType, Result, Tensor};
use candle_nn::{Linear, Module, VarBuilder};

/// The keys and values an attention layer has seen, `[B, Hkv, S, hd]` each (none yet: `None`).
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Rotated keys `[B, Hkv, S, hd]`.
    pub k: Option<Tensor>,
    /// Values `[B, Hkv, S, hd]`.
    pub v: Option<Tensor>,
}

impl KvCache {
    /// Tokens held.
    pub fn len(&self) -> usize {
        self.k.as_ref().and_then(|k| k.dim(2).ok()).unwrap_or(0)
    }

    /// Whether no token is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One gated softmax-attention layer.
#[derive(Debug, Clone)]
pub struct GatedAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: OffsetRmsNorm,
    k_norm: OffsetRmsNorm,
    rope: PartialRope,
    hq: usize,
    hkv: usize,
    hd: usize,
}

impl GatedAttention {
    /// Loads `q_proj`, `k_proj`, `v_proj`, `o_proj` (with biases where `attention_bias`),
    /// `q_norm`, `k_norm` from `vb` (`…layers.{i}.self_attn`).
    pub fn new(cfg: &QwenConfig, vb: VarBuilder) -> Result<Self> {
        let (hq, hkv, hd, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.hidden_size,
        );
        let linear = |rows: usize, cols: usize, name: &str| -> Result<Linear> {
            let vb = vb.pp(name);
            let bias = if cfg.attention_bias {
                Some(vb.get(rows, "bias")?)
            } else {
                None
            };
            Ok(Linear::new(vb.get((rows, cols), "weight")?, bias))
        };
        Ok(Self {
            q_proj: linear(2 * hq * hd, d, "q_proj")?,
            k_proj: linear(hkv * hd, d, "k_proj")?,
            v_proj: linear(hkv * hd, d, "v_proj")?,
            o_proj: linear(d, hq * hd, "o_proj")?,
            q_norm: OffsetRmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("q_norm"))?,
            k_norm: OffsetRmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("k_norm"))?,
            rope: PartialRope::new(cfg.rotary_dim(), cfg.rope_theta, vb.device())?,
            hq,
            hkv,
            hd,
        })
    }

    /// `x [B, T, D] -> [B, T, D]` for the tokens at positions `cache.len()..`; the cache (empty
    /// without one) supplies the earlier keys and values and receives these.
    pub fn forward(&self, x: &Tensor, cache: Option<&mut KvCache>) -> Result<Tensor> {
        let offset = cache.as_ref().map_or(0, |c| c.len());
        let p = self.project(x, offset)?;
        let (k, v) = match cache {
            None => (p.k.clone(), p.v.clone()),
            Some(c) => {
                let (k, v) = match (&c.k, &c.v) {
                    (Some(pk), Some(pv)) => {
                        (Tensor::cat(&[pk, &p.k], 2)?, Tensor::cat(&[pv, &p.v], 2)?)
                    }
                    _ => (p.k.clone(), p.v.clone()),
                };
                c.k = Some(k.clone());
                c.v = Some(v.clone());
                (k, v)
            }
        };
        self.attend(&p, &k, &v, offset)
    }

    /// The queries, keys and values of `x [B, T, D]` at positions `offset..offset + T`, rotated
    /// (`[B, H, T, hd]`), and the output gate.
    pub(super) fn project(&self, x: &Tensor, offset: usize) -> Result<Projected> {
        let (b, t, _) = x.dims3()?;
        let (hq, hkv, hd) = (self.hq, self.hkv, self.hd);
        let qg = self.q_proj.forward(x)?.reshape((b, t, hq, 2 * hd))?;
        let gate = qg.narrow(3, hd, hd)?.reshape((b, t, hq * hd))?;
        let q = self
            .q_norm
            .forward(&qg.narrow(3, 0, hd)?)?
            .transpose(1, 2)?;
        let k = self.k_proj.forward(x)?.reshape((b, t, hkv, hd))?;
        let k = self.k_norm.forward(&k)?.transpose(1, 2)?;
        let v = self
            .v_proj
            .forward(x)?
            .reshape((b, t, hkv, hd))?
            .transpose(1, 2)?;
        Ok(Projected {
            q: self.rope.forward(&q.contiguous()?, offset)?,
            k: self.rope.forward(&k.contiguous()?, offset)?,
            v: v.contiguous()?,
            gate,
        })
    }

    /// The output `[B, T, D]` of the queries of `p` (at positions `offset..`) attending to the
    /// keys and values `[B, Hkv, S, hd]` of positions `0..S` (causally: up to their own).
    pub(super) fn attend(
        &self,
        p: &Projected,
        k: &Tensor,
        v: &Tensor,
        offset: usize,
    ) -> Result<Tensor> {
        let (b, _, t, _) = p.q.dims4()?;
        let (hq, hkv, hd) = (self.hq, self.hkv, self.hd);
        let (r, s) = (hq / hkv, k.dim(2)?);
        // GQA without repeating the keys and values: query head g·r + j is row j·T + i of its
        // key/value head g's group, `[B, Hkv, r·T, hd]`.
        // CUDA's matmul takes contiguous operands (or their transposes) only.
        let q = p.q.reshape((b, hkv, r * t, hd))?.to_dtype(DType::F32)?;
        let k = k.to_dtype(DType::F32)?.contiguous()?;
        let scores = (q.contiguous()?.matmul(&k.t()?)? * (hd as f64).powf(-0.5))?;
        let mask = causal_mask(t, s, offset, p.q.device())?;
        let scores = scores
            .reshape((b, hkv, r, t, s))?
            .broadcast_add(&mask)?
            .reshape((b, hkv, r * t, s))?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(v.dtype())?;
        let o = probs
            .matmul(&v.contiguous()?)?
            .reshape((b, hq, t, hd))?
            .transpose(1, 2)?
            .reshape((b, t, hq * hd))?;
        self.o_proj
            .forward(&(o * candle_nn::ops::sigmoid(&p.gate)?)?)
    }
}

/// An attention layer's projections of one input ([`GatedAttention::project`]).
pub(super) struct Projected {
    /// `[B, Hq, T, hd]`, rotated.
    pub q: Tensor,
    /// `[B, Hkv, T, hd]`, rotated.
    pub k: Tensor,
    /// `[B, Hkv, T, hd]`.
    pub v: Tensor,
    /// `[B, T, Hq·hd]`.
    pub gate: Tensor,
}

/// The additive causal mask `[T, S]` (f32) of `T` queries at positions `past..past + T`
/// over `S` keys at positions `0..S`.
fn causal_mask(t: usize, s: usize, past: usize, dev: &candle_core::Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..s).map(move |j| {
                if j <= past + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Tensor::from_vec(mask, (t, s), dev)
}
