//! The layers around the token mixers of Qwen's hybrids: the zero-centred RMSNorm
//! `x · rsqrt(mean x² + eps) · (1 + w)` of every decoder, final, q and k norm, partial rotary
//! embeddings, and the SwiGLU MLP.

use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::{Linear, Module, VarBuilder};

/// RMSNorm with the weight stored as an offset from one: `x · rsqrt(mean(x²) + eps) · (1 + w)`
/// over the last axis, in f32, cast back to `x`'s dtype (transformers' `Qwen3_5RMSNorm`).
#[derive(Debug, Clone)]
pub struct OffsetRmsNorm {
    /// `1 + w`, f32.
    scale: Tensor,
    eps: f64,
}

impl OffsetRmsNorm {
    /// Loads `weight [size]` from `vb`.
    pub fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let w = vb.get(size, "weight")?.to_dtype(DType::F32)?;
        Ok(Self {
            scale: (w + 1.0)?,
            eps,
        })
    }

    /// `x [..., N] -> [..., N]` in `x`'s dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let xf = x.to_dtype(DType::F32)?;
        let ms = xf.sqr()?.mean_keepdim(D::Minus1)?;
        xf.broadcast_div(&(ms + self.eps)?.sqrt()?)?
            .broadcast_mul(&self.scale)?
            .to_dtype(x.dtype())
    }
}

/// Rotary embeddings on the first `dim` dimensions of each head (rotate-half style), base
/// `theta`; the other dimensions pass through.
#[derive(Debug, Clone)]
pub struct PartialRope {
    /// `theta^(-2i / dim)`, `i < dim / 2`, f32.
    inv_freq: Tensor,
    dim: usize,
}

impl PartialRope {
    /// Rotary embeddings of `dim` (even) dimensions with base `theta`.
    pub fn new(dim: usize, theta: f64, device: &Device) -> Result<Self> {
        let inv: Vec<f32> = (0..dim / 2)
            .map(|i| theta.powf(-((2 * i) as f64) / dim as f64) as f32)
            .collect();
        Ok(Self {
            inv_freq: Tensor::from_vec(inv, dim / 2, device)?,
            dim,
        })
    }

    /// `x [B, H, T, hd]` at positions `offset..offset + T`; the result is contiguous.
    pub fn forward(&self, x: &Tensor, offset: usize) -> Result<Tensor> {
        if self.dim == 0 {
            return x.contiguous();
        }
        let (_, _, t, hd) = x.dims4()?;
        let pos = Tensor::arange(offset as u32, (offset + t) as u32, x.device())?
            .to_dtype(DType::F32)?
            .unsqueeze(1)?;
        let freqs = pos.broadcast_mul(&self.inv_freq.unsqueeze(0)?)?; // [T, dim / 2]
        let (cos, sin) = (
            freqs.cos()?.to_dtype(x.dtype())?,
            freqs.sin()?.to_dtype(x.dtype())?,
        );
        let rot =
            candle_nn::rotary_emb::rope(&x.narrow(3, 0, self.dim)?.contiguous()?, &cos, &sin)?;
        if self.dim == hd {
            return Ok(rot);
        }
        // Both parts contiguous, so the concatenation is too (CUDA's matmul needs that).
        let pass = x.narrow(3, self.dim, hd - self.dim)?.contiguous()?;
        Tensor::cat(&[&rot, &pass], 3)
    }
}

/// SwiGLU: `down(silu(gate(x)) · up(x))`, the weights `gate_proj`, `up_proj` `[I, D]` and
/// `down_proj` `[D, I]`, no biases.
#[derive(Debug, Clone)]
pub struct SwiGlu {
    gate_up: Linear,
    down: Linear,
    width: usize,
}

impl SwiGlu {
    /// Loads `gate_proj`, `up_proj`, `down_proj` of width `width` from `vb`; the gate and up
    /// projections become one matrix `[2I, D]`.
    pub fn new(hidden: usize, width: usize, vb: VarBuilder) -> Result<Self> {
        let gate = vb.get((width, hidden), "gate_proj.weight")?;
        let up = vb.get((width, hidden), "up_proj.weight")?;
        let down = vb.get((hidden, width), "down_proj.weight")?;
        Ok(Self::from_weights(Tensor::cat(&[gate, up], 0)?, down))
    }

    /// From `gate_up [2I, D]` (the gate rows first) and `down [D, I]`.
    pub fn from_weights(gate_up: Tensor, down: Tensor) -> Self {
        let width = gate_up.dim(0).unwrap_or(0) / 2;
        Self {
            gate_up: Linear::new(gate_up, None),
            down: Linear::new(down, None),
            width,
        }
    }

    /// `x [..., D] -> [..., D]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.gate_up.forward(x)?;
        let last = h.rank() - 1;
        let gate = h.narrow(last, 0, self.width)?;
        let up = h.narrow(last, self.width, self.width)?;
        self.down.forward(&(candle_nn::ops::silu(&gate)? * up)?)
    }
}
