//! The Gated DeltaProduct token mixer, FLA's `GatedDeltaProduct`
//! (`fla/layers/gated_deltaproduct.py`).
//!
//! ```text
//! q = l2(silu(conv_q(q_proj x)))               [B, T, H, K]
//! k = l2(silu(conv_k(k_proj x)))               [B, T·n, H, K]   ('t (n h d) -> (t n) h d')
//! v = silu(conv_v(v_proj x))                   [B, T·n, Hv, V]
//! beta = sigmoid(b_proj x) (· 2 if allow_neg_eigval)             [B, T·n, Hv]
//! g = -exp(A_log) · softplus(a_proj x + dt_bias)  (f32; 0 without forget gate)  [B, T, Hv]
//! o = GDP(q, k, v, g, beta)                    [B, T, Hv, V]
//! y = o_proj( rmsnorm(o) · o_norm.weight · silu(g_proj x) )       [B, T, D]
//! ```
//!
//! `q_proj` and `k_proj` run as one matmul whose output, reshaped, is the packed
//! `qk [B, T, n+1, H, K]` layout of [`crate::gated_delta_product_packed`], so the op needs no
//! copy; likewise their two short convolutions run as one. With grouped value attention
//! (`num_v_heads = G · num_heads`) each q/k head is repeated `G` times, as FLA's
//! `repeat('... h d -> ... (h g) d')`.

use super::cache::LayerCache;
use super::config::GdpConfig;
use super::conv::ShortConv;
use super::norm::{l2_norm, softplus, GatedRmsNorm, RmsNorm};
use crate::error::GdpError;
use crate::op::recurrent::{gated_delta_product_step, gated_delta_product_step_fused};
use crate::{gated_delta_product_packed, GdpOptions};
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Init, Linear, VarBuilder};

/// Epsilon of the in-kernel L2 norm of q and k (inside the square root).
pub const QK_L2_EPS: f64 = 1e-6;

/// `softplus⁻¹(0.001)` and `softplus⁻¹(0.1)`: the range FLA draws `dt` from, mapped to `dt_bias`.
const DT_BIAS_RANGE: (f64, f64) = (-6.907255, -2.252168);

/// A bias-free linear map `weight [out, in]` with FLA's normal initialiser.
pub(crate) fn linear(
    in_dim: usize,
    out_dim: usize,
    cfg: &GdpConfig,
    vb: VarBuilder,
) -> Result<Linear> {
    Ok(Linear::new(weight(in_dim, out_dim, cfg, vb)?, None))
}

fn weight(in_dim: usize, out_dim: usize, cfg: &GdpConfig, vb: VarBuilder) -> Result<Tensor> {
    let init = Init::Randn {
        mean: 0.0,
        stdev: cfg.initializer_range,
    };
    vb.get_with_hints((out_dim, in_dim), "weight", init)
}

/// The output norm: gated (`FusedRMSNormGated`) with `use_output_gate`, plain `RMSNorm` without.
#[derive(Debug, Clone)]
enum OutNorm {
    Gated { g_proj: Linear, norm: GatedRmsNorm },
    Plain(RmsNorm),
}

/// The forget gate's parameters: `a_proj [Hv, D]`, `A_log [Hv]`, `dt_bias [Hv]`.
#[derive(Debug, Clone)]
struct ForgetGate {
    a_proj: Linear,
    a_log: Tensor,
    dt_bias: Tensor,
}

/// The short convolutions of q, k, v (FLA: `q_conv1d`, `k_conv1d`, `v_conv1d`).
#[derive(Debug, Clone)]
struct Convs {
    q: ShortConv,
    k: ShortConv,
    v: ShortConv,
}

/// One Gated DeltaProduct layer with FLA's parameter names (relative to its `vb`):
/// `q_proj.weight [H·K, D]`, `k_proj.weight [n·H·K, D]`, `v_proj.weight [n·Hv·V, D]`,
/// `b_proj.weight [n·Hv, D]`; with the forget gate `a_proj.weight [Hv, D]`, `A_log [Hv]`,
/// `dt_bias [Hv]`; with the short convolution `{q,k,v}_conv1d.weight [C, 1, W]`; with the
/// output gate `g_proj.weight [Hv·V, D]`; `o_norm.weight [V]`, `o_proj.weight [D, Hv·V]`.
#[derive(Debug, Clone)]
pub struct GatedDeltaProduct {
    q_proj: Tensor,
    k_proj: Tensor,
    v_proj: Linear,
    b_proj: Linear,
    gate: Option<ForgetGate>,
    convs: Option<Convs>,
    o_norm: OutNorm,
    o_proj: Linear,
    layer_idx: usize,
    hidden: usize,
    heads: usize,
    v_heads: usize,
    dk: usize,
    dv: usize,
    n: usize,
    allow_neg_eigval: bool,
}

impl GatedDeltaProduct {
    /// Builds layer `layer_idx` from `vb` (e.g. `vb.pp("model.layers.3.attn")`). Fresh weights
    /// follow FLA's initialisers: linear weights `N(0, initializer_range)`, `A_log = log A` with
    /// `A` log-uniform in `[1, 16]` (FLA: `A ~ U(0, 16)`), `dt_bias` uniform over
    /// `softplus⁻¹([0.001, 0.1])` (FLA: `dt` log-uniform there), norm weights 1.
    pub fn new(cfg: &GdpConfig, layer_idx: usize, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let (d, n) = (cfg.hidden_size, cfg.num_householder());
        let (kd, vd, hv) = (cfg.key_dim(), cfg.value_dim(), cfg.num_v_heads());
        let gate = if cfg.use_forget_gate {
            Some(ForgetGate {
                a_proj: linear(d, hv, cfg, vb.pp("a_proj"))?,
                a_log: vb.get_with_hints(
                    hv,
                    "A_log",
                    Init::Uniform {
                        lo: 0.0,
                        up: 16f64.ln(),
                    },
                )?,
                dt_bias: vb.get_with_hints(
                    hv,
                    "dt_bias",
                    Init::Uniform {
                        lo: DT_BIAS_RANGE.0,
                        up: DT_BIAS_RANGE.1,
                    },
                )?,
            })
        } else {
            None
        };
        let convs = if cfg.use_short_conv {
            let (w, bias) = (cfg.conv_size, cfg.conv_bias);
            Some(Convs {
                q: ShortConv::new(kd, w, bias, vb.pp("q_conv1d"))?,
                k: ShortConv::new(n * kd, w, bias, vb.pp("k_conv1d"))?,
                v: ShortConv::new(n * vd, w, bias, vb.pp("v_conv1d"))?,
            })
        } else {
            None
        };
        let o_norm = if cfg.use_output_gate {
            OutNorm::Gated {
                g_proj: linear(d, vd, cfg, vb.pp("g_proj"))?,
                norm: GatedRmsNorm::new(cfg.head_v_dim(), cfg.norm_eps, vb.pp("o_norm"))?,
            }
        } else {
            OutNorm::Plain(RmsNorm::new(
                cfg.head_v_dim(),
                cfg.norm_eps,
                vb.pp("o_norm"),
            )?)
        };
        Ok(Self {
            q_proj: weight(d, kd, cfg, vb.pp("q_proj"))?,
            k_proj: weight(d, n * kd, cfg, vb.pp("k_proj"))?,
            v_proj: linear(d, n * vd, cfg, vb.pp("v_proj"))?,
            b_proj: linear(d, n * hv, cfg, vb.pp("b_proj"))?,
            gate,
            convs,
            o_norm,
            o_proj: linear(vd, d, cfg, vb.pp("o_proj"))?,
            layer_idx,
            hidden: d,
            heads: cfg.num_heads,
            v_heads: hv,
            dk: cfg.head_k_dim(),
            dv: cfg.head_v_dim(),
            n,
            allow_neg_eigval: cfg.allow_neg_eigval,
        })
    }

    /// Index of this layer in its model.
    pub fn layer_idx(&self) -> usize {
        self.layer_idx
    }

    /// `x [B, T, D] -> [B, T, D]`.
    ///
    /// Without a cache: one chunked prefill from a zero state. With a cache: the conv histories
    /// and the recurrent state are read and replaced, `seen_tokens` grows by `T`; `T == 1` takes
    /// the recurrent decode step, `T > 1` the chunked op with the cached state as initial state.
    /// The decode step is the fused one pass over the state
    /// ([`gated_delta_product_step_fused`]) unless its inputs track gradients (weights held as
    /// `Var`s, a cached state in a graph): then the differentiable tensor-op step.
    /// The cache is only updated when the whole call succeeds.
    pub fn forward(&self, x: &Tensor, cache: Option<&mut LayerCache>) -> Result<Tensor> {
        let (b, t) = self.check_input(x, cache.as_deref())?;
        let n = self.n;
        let (qk, v) = self.project(x)?;
        // New conv histories, committed to the cache only once the whole call has succeeded.
        let mut new_conv = None;
        let (qk, v) = match (self.short_convs()?, cache.as_deref()) {
            (None, _) => (qk.silu()?, v.silu()?),
            (Some((qk_conv, v_conv)), None) => {
                (qk_conv.forward(&qk, None)?, v_conv.forward(&v, None)?)
            }
            (Some((qk_conv, v_conv)), Some(lc)) => {
                let (Some(cq), Some(ck), Some(cv)) = (&lc.conv_q, &lc.conv_k, &lc.conv_v) else {
                    return Err(GdpError::Option {
                        name: "cache".into(),
                        reason: "has no conv states, but the layer has short convolutions".into(),
                    }
                    .into());
                };
                let mut s_qk = Tensor::cat(&[cq, ck], 1)?;
                let mut s_v = cv.clone();
                let qk = qk_conv.forward(&qk, Some(&mut s_qk))?;
                let v = v_conv.forward(&v, Some(&mut s_v))?;
                new_conv = Some(self.split_qk_state(&s_qk, s_v)?);
                (qk, v)
            }
        };
        let (qk, v, g, beta) = self.op_inputs(x, &qk, &v)?;
        let (hv, dk, dv) = (self.v_heads, self.dk, self.dv);

        let (o, new_state) = match cache.as_deref() {
            Some(lc) if t == 1 => {
                let q = qk.narrow(2, 0, 1)?.reshape((b, hv, dk))?;
                let k = qk.narrow(2, 1, n)?.reshape((b, n, hv, dk))?;
                let v = v.reshape((b, n, hv, dv))?;
                let g = g.reshape((b, hv))?;
                let beta = beta.reshape((b, n, hv))?;
                let args = [&lc.recurrent, &q, &k, &v, &g, &beta];
                let step = if args.iter().any(|t| t.track_op()) {
                    gated_delta_product_step
                } else {
                    gated_delta_product_step_fused
                };
                let (o, s) = step(&lc.recurrent, &q, &k, &v, &g, &beta, None)?;
                (o.unsqueeze(1)?, Some(s))
            }
            Some(lc) => {
                let opts = GdpOptions {
                    num_householder: Some(n),
                    initial_state: Some(&lc.recurrent),
                    output_final_state: true,
                    ..Default::default()
                };
                gated_delta_product_packed(&qk, &v, &g, &beta, &opts)?
            }
            None => {
                let opts = GdpOptions {
                    num_householder: Some(n),
                    ..Default::default()
                };
                gated_delta_product_packed(&qk, &v, &g, &beta, &opts)?
            }
        };
        let y = self.output(x, &o)?;

        // Everything succeeded: commit the new conv histories and state.
        if let Some(lc) = cache {
            if let Some((q, k, v)) = new_conv {
                (lc.conv_q, lc.conv_k, lc.conv_v) = (Some(q), Some(k), Some(v));
            }
            lc.recurrent = new_state
                .ok_or_else(|| candle_core::Error::Msg("the op returned no final state".into()))?;
            lc.seen_tokens += t;
        }
        Ok(y)
    }

    // --- Pieces of `forward`, shared with the context-parallel forward (`super::cp`). ---

    /// Householder sub-steps per token `n`.
    pub(super) fn num_householder(&self) -> usize {
        self.n
    }

    /// The input projections, before the convolutions: `x [B, T, D] ->` (`qk [B, T, (1+n)·H·K]`
    /// from one matmul of the live `[q_proj | k_proj]` weights, `v [B, T, n·Hv·V]`).
    pub(super) fn project(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let w_qk = Tensor::cat(&[&self.q_proj, &self.k_proj], 0)?;
        let qk = Linear::new(w_qk, None).forward(x)?;
        Ok((qk, self.v_proj.forward(x)?))
    }

    /// The short convolutions as (fused `q|k` over `(1+n)·H·K` channels, `v` over `n·Hv·V`),
    /// built from the live weights; `None` without short convolutions.
    pub(super) fn short_convs(&self) -> Result<Option<(ShortConv, ShortConv)>> {
        match &self.convs {
            None => Ok(None),
            Some(c) => Ok(Some((ShortConv::cat(&[&c.q, &c.k])?, c.v.clone()))),
        }
    }

    /// Splits a fused `q|k` conv state `[B, (1+n)·H·K, W]` into the cache's
    /// (`conv_q [B, H·K, W]`, `conv_k [B, n·H·K, W]`, `conv_v`).
    pub(super) fn split_qk_state(
        &self,
        s_qk: &Tensor,
        s_v: Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let kd = self.heads * self.dk;
        Ok((
            s_qk.narrow(1, 0, kd)?.contiguous()?,
            s_qk.narrow(1, kd, self.n * kd)?.contiguous()?,
            s_v,
        ))
    }

    /// The op's inputs from the convolved (or SiLU'd) projections `qk [B, T, (1+n)·H·K]`,
    /// `v [B, T, n·Hv·V]` and the layer input `x [B, T, D]`: (`qk [B, T, n+1, Hv, K]`
    /// L2-normed and repeated over value-head groups, `v [B, T·n, Hv, V]`, `g [B, T, Hv]` f32,
    /// `beta [B, T·n, Hv]`).
    pub(super) fn op_inputs(
        &self,
        x: &Tensor,
        qk: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let (n, h, hv, dk, dv) = (self.n, self.heads, self.v_heads, self.dk, self.dv);
        let qk = l2_norm(&qk.reshape((b, t, n + 1, h, dk))?, QK_L2_EPS)?;
        let qk = if hv > h {
            let groups = hv / h;
            qk.unsqueeze(4)?
                .broadcast_as((b, t, n + 1, h, groups, dk))?
                .reshape((b, t, n + 1, hv, dk))?
        } else {
            qk
        };
        let v = v.reshape((b, t * n, hv, dv))?;
        let mut beta = candle_nn::ops::sigmoid(&self.b_proj.forward(x)?)?;
        if self.allow_neg_eigval {
            beta = (beta * 2.0)?;
        }
        let beta = beta.reshape((b, t * n, hv))?;
        let g = match &self.gate {
            Some(fg) => {
                let a = fg.a_log.to_dtype(DType::F32)?.exp()?.neg()?;
                let dt = fg
                    .a_proj
                    .forward(x)?
                    .to_dtype(DType::F32)?
                    .broadcast_add(&fg.dt_bias.to_dtype(DType::F32)?)?;
                softplus(&dt)?.broadcast_mul(&a)?
            }
            None => Tensor::zeros((b, t, hv), DType::F32, x.device())?,
        };
        Ok((qk, v, g, beta))
    }

    /// The output norm (gated by `g_proj x` with the output gate) and `o_proj`:
    /// `o [B, T, Hv, V] -> y [B, T, D]`.
    pub(super) fn output(&self, x: &Tensor, o: &Tensor) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (hv, dv) = (self.v_heads, self.dv);
        let o = match &self.o_norm {
            OutNorm::Gated { g_proj, norm } => {
                let gate = g_proj.forward(x)?.reshape((b, t, hv, dv))?;
                norm.forward(o, &gate)?
            }
            OutNorm::Plain(norm) => norm.forward(o)?,
        };
        self.o_proj.forward(&o.reshape((b, t, hv * dv))?)
    }

    /// Checks `x [B, T, D]` (and the cache's state shape); returns `(B, T)`.
    pub(super) fn check_input(
        &self,
        x: &Tensor,
        cache: Option<&LayerCache>,
    ) -> Result<(usize, usize)> {
        let (b, t, d) = x.dims3().map_err(|_| GdpError::Rank {
            name: "x".into(),
            expected: 3,
            layout: "[B, T, D]",
            got: x.dims().to_vec(),
        })?;
        if d != self.hidden || b == 0 || t == 0 {
            return Err(GdpError::Shape {
                name: "x".into(),
                expected: vec![b.max(1), t.max(1), self.hidden],
                layout: "[B, T, D] with B, T >= 1",
                got: x.dims().to_vec(),
            }
            .into());
        }
        if let Some(lc) = cache {
            let want = [b, self.v_heads, self.dk, self.dv];
            if lc.recurrent.dims() != want {
                return Err(GdpError::Shape {
                    name: "cache.recurrent".into(),
                    expected: want.to_vec(),
                    layout: "[B, Hv, K, V]",
                    got: lc.recurrent.dims().to_vec(),
                }
                .into());
            }
        }
        Ok((b, t))
    }
}
