//! Normalisations and small activations as FLA computes them (in f32, result cast back):
//! `RMSNorm` (`fla/modules/layernorm.py`), `FusedRMSNormGated` (`fla/modules/fused_norm_gate.py`),
//! the in-kernel L2 norm of q and k (`fla/modules/l2norm.py`), and a stable softplus. All are
//! plain tensor ops, hence differentiable on every device.

use crate::error::GdpError;
use candle_core::{DType, Result, Tensor, D};
use candle_nn::{Init, VarBuilder};

/// FLA's `RMSNorm`: `y = x / sqrt(mean(x²) + eps) · weight` over the last axis, with
/// `weight [N]` (no bias).
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// Loads `weight [size]` from `vb` (ones when fresh).
    pub fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let weight = vb.get_with_hints(size, "weight", Init::Const(1.0))?;
        Ok(Self { weight, eps })
    }

    /// `x [..., N] -> [..., N]` in `x`'s dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        check_last(x, "x", self.weight.dim(0)?)?;
        let y = normalise(x, self.eps)?.broadcast_mul(&self.weight.to_dtype(DType::F32)?)?;
        y.to_dtype(x.dtype())
    }
}

/// FLA's `FusedRMSNormGated` with its default `activation='swish'`:
/// `y = x / sqrt(mean(x²) + eps) · weight · silu(gate)` over the last axis.
#[derive(Debug, Clone)]
pub struct GatedRmsNorm {
    norm: RmsNorm,
}

impl GatedRmsNorm {
    /// Loads `weight [size]` from `vb` (ones when fresh).
    pub fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            norm: RmsNorm::new(size, eps, vb)?,
        })
    }

    /// `x [..., N]`, `gate` of the same shape `-> [..., N]` in `x`'s dtype.
    pub fn forward(&self, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        check_last(x, "x", self.norm.weight.dim(0)?)?;
        if gate.dims() != x.dims() {
            return Err(GdpError::Shape {
                name: "gate".into(),
                expected: x.dims().to_vec(),
                layout: "the shape of x",
                got: gate.dims().to_vec(),
            }
            .into());
        }
        let y = normalise(x, self.norm.eps)?
            .broadcast_mul(&self.norm.weight.to_dtype(DType::F32)?)?
            .mul(&gate.to_dtype(DType::F32)?.silu()?)?;
        y.to_dtype(x.dtype())
    }
}

/// `x / sqrt(mean(x²) + eps)` over the last axis, in f32.
fn normalise(x: &Tensor, eps: f64) -> Result<Tensor> {
    let xf = x.to_dtype(DType::F32)?;
    let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
    xf.broadcast_div(&(ms + eps)?.sqrt()?)
}

/// L2 normalisation over the last axis with the epsilon *inside* the square root, as FLA's
/// `use_qk_l2norm_in_kernel`: `x / sqrt(Σ x² + eps)`. Computed in f32, returned in `x`'s dtype.
pub fn l2_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    let xf = x.to_dtype(DType::F32)?;
    let ss = xf.sqr()?.sum_keepdim(D::Minus1)?;
    xf.broadcast_div(&(ss + eps)?.sqrt()?)?.to_dtype(x.dtype())
}

/// `softplus(x) = log(1 + exp(x))`, computed stably as `max(x, 0) + log(1 + exp(-|x|))`.
pub fn softplus(x: &Tensor) -> Result<Tensor> {
    let tail = (x.abs()?.neg()?.exp()? + 1.0)?.log()?;
    x.relu()? + tail
}

fn check_last(x: &Tensor, name: &str, n: usize) -> Result<()> {
    if x.dims().last() != Some(&n) {
        let mut want = x.dims().to_vec();
        match want.last_mut() {
            Some(l) => *l = n,
            None => want.push(n),
        }
        return Err(GdpError::Shape {
            name: name.into(),
            expected: want,
            layout: "[..., N]",
            got: x.dims().to_vec(),
        }
        .into());
    }
    Ok(())
}
