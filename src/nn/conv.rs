//! Depthwise causal short convolution with SiLU: FLA's `ShortConvolution`
//! (`fla/modules/convolution.py`, an `nn.Conv1d` with `groups = C`, `padding = W - 1`,
//! `activation = 'silu'`).
//!
//! Per channel `c`, with weight `w [C, W]` (stored `[C, 1, W]` as in PyTorch):
//!
//! ```text
//! y[t, c] = silu( Σ_{i<W} w[c, i] · x[t - (W-1) + i, c]  (+ bias[c]) )
//! ```
//!
//! where inputs before the first token come from a history: zeros, a decode cache, or the halo
//! of a previous context-parallel shard. Computed in f32 from ordinary tensor ops, so it runs on
//! any device and is differentiable in `x`, the weights and the history.

use crate::error::GdpError;
use candle_core::{DType, Result, Tensor};
use candle_nn::{Init, VarBuilder};

/// A depthwise causal convolution of width `W` over `C` channels, followed by SiLU.
///
/// Weights: `weight [C, 1, W]` and, only with `bias = true`, `bias [C]` (FLA's GDP layers have
/// none).
#[derive(Debug, Clone)]
pub struct ShortConv {
    /// `[C, W]`: tap `W - 1` multiplies the current token.
    weight: Tensor,
    bias: Option<Tensor>,
    channels: usize,
    kernel: usize,
}

impl ShortConv {
    /// Loads `weight [C, 1, W]` (and `bias [C]` when `bias`) from `vb`, e.g. `vb.pp("q_conv1d")`.
    /// Fresh weights are uniform in `±1/√W`, PyTorch's `Conv1d` default.
    pub fn new(channels: usize, kernel: usize, bias: bool, vb: VarBuilder) -> Result<Self> {
        if channels == 0 || kernel == 0 {
            return Err(GdpError::Option {
                name: "ShortConv".into(),
                reason: format!("channels ({channels}) and kernel ({kernel}) must be >= 1"),
            }
            .into());
        }
        let bound = (kernel as f64).powf(-0.5);
        let init = Init::Uniform {
            lo: -bound,
            up: bound,
        };
        let weight = vb
            .get_with_hints((channels, 1, kernel), "weight", init)?
            .reshape((channels, kernel))?;
        let bias = if bias {
            Some(vb.get_with_hints(channels, "bias", init)?)
        } else {
            None
        };
        Ok(Self {
            weight,
            bias,
            channels,
            kernel,
        })
    }

    /// Channels `C`.
    pub fn channels(&self) -> usize {
        self.channels
    }

    /// Kernel width `W`.
    pub fn kernel(&self) -> usize {
        self.kernel
    }

    /// The weights as `[C, W]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// One convolution over the concatenated channels of `convs` (all of the same width and
    /// bias-ness), equal to running each on its own slice of the channels. Built from the live
    /// weights on each call, so it stays correct while an optimiser updates them.
    pub fn cat(convs: &[&ShortConv]) -> Result<Self> {
        let first = convs.first().ok_or_else(|| GdpError::Option {
            name: "ShortConv::cat".into(),
            reason: "needs at least one convolution".into(),
        })?;
        if convs
            .iter()
            .any(|c| c.kernel != first.kernel || c.bias.is_some() != first.bias.is_some())
        {
            return Err(GdpError::Option {
                name: "ShortConv::cat".into(),
                reason: "all convolutions must share kernel width and bias".into(),
            }
            .into());
        }
        let weights: Vec<&Tensor> = convs.iter().map(|c| &c.weight).collect();
        let bias = match first.bias {
            Some(_) => {
                let b: Vec<&Tensor> = convs.iter().filter_map(|c| c.bias.as_ref()).collect();
                Some(Tensor::cat(&b, 0)?)
            }
            None => None,
        };
        Ok(Self {
            weight: Tensor::cat(&weights, 0)?,
            bias,
            channels: convs.iter().map(|c| c.channels).sum(),
            kernel: first.kernel,
        })
    }

    /// A zero decode cache `[B, C, W]` in FLA's layout, i.e. no history.
    pub fn zero_state(
        &self,
        batch: usize,
        dtype: DType,
        dev: &candle_core::Device,
    ) -> Result<Tensor> {
        Tensor::zeros((batch, self.channels, self.kernel), dtype, dev)
    }

    /// Prefill: `x [B, T, C] -> y [B, T, C]`.
    ///
    /// With `cache = Some(state)`, `state [B, C, W]` (FLA's conv cache layout: column `W - 1`
    /// is the latest input, columns `1..W` are the history the next token sees, column 0 is
    /// kept for FLA compatibility) supplies the inputs before `x`, and is replaced by the last
    /// `W` inputs (history included when `T < W`). Without a cache the history is zeros.
    pub fn forward(&self, x: &Tensor, cache: Option<&mut Tensor>) -> Result<Tensor> {
        let (b, _, _) = self.check_x(x)?;
        match cache {
            None => Ok(self.conv(x, None)?.0),
            Some(state) => {
                self.check_dims(
                    state,
                    "conv_state",
                    &[b, self.channels, self.kernel],
                    "[B, C, W]",
                )?;
                let prev = state.transpose(1, 2)?.to_dtype(DType::F32)?;
                let (y, full) = self.conv(x, Some(&prev))?;
                let t = full.dim(1)?;
                let dt = state.dtype();
                *state = full
                    .narrow(1, t - self.kernel, self.kernel)?
                    .transpose(1, 2)?
                    .contiguous()?
                    .to_dtype(dt)?;
                Ok(y)
            }
        }
    }

    /// Prefill of one context-parallel shard: `x [B, T, C]` with an optional `halo
    /// [B, W - 1, C]`, the last `W - 1` inputs before this shard (time-major, as they sit in the
    /// previous shard's `x`; zeros when `None`, i.e. for the first shard).
    ///
    /// Returns `y [B, T, C]` and this shard's tail `[B, W - 1, C]` (the last `W - 1` inputs,
    /// reaching into the halo when `T < W - 1`), the halo of the next shard. Differentiable in
    /// the halo.
    pub fn forward_with_halo(&self, x: &Tensor, halo: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let (b, _, c) = self.check_x(x)?;
        let w1 = self.kernel - 1;
        let prev = match halo {
            None => None,
            Some(h) => {
                self.check_dims(h, "halo", &[b, w1, c], "[B, W - 1, C]")?;
                let pad = Tensor::zeros((b, 1, c), DType::F32, x.device())?;
                Some(Tensor::cat(&[&pad, &h.to_dtype(DType::F32)?], 1)?)
            }
        };
        let (y, full) = self.conv(x, prev.as_ref())?;
        let t = full.dim(1)?;
        let tail = full.narrow(1, t - w1, w1)?.to_dtype(x.dtype())?;
        Ok((y, tail))
    }

    /// One decode step: `x [B, C]` (or `[B, 1, C]`) with `state [B, C, W]`; returns
    /// `y [B, C]` and the new state (the old one shifted left by one, `x` in column `W - 1`).
    pub fn step(&self, x: &Tensor, state: &Tensor) -> Result<(Tensor, Tensor)> {
        let x3 = match x.rank() {
            2 => x.unsqueeze(1)?,
            _ => x.clone(),
        };
        let mut s = state.clone();
        let y = self.forward(&x3, Some(&mut s))?;
        Ok((y.squeeze(1)?, s))
    }

    /// The convolution proper. `prev [B, W, C]` (f32) holds the `W` inputs before `x`
    /// (row `W - 1` the latest); returns `y` in `x`'s dtype and the f32 sequence
    /// `[prev | x]` of length `W + T`.
    fn conv(&self, x: &Tensor, prev: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let (b, t, c) = x.dims3()?;
        let w = self.kernel;
        let xf = x.to_dtype(DType::F32)?;
        let prev = match prev {
            Some(p) => p.clone(),
            None => Tensor::zeros((b, w, c), DType::F32, x.device())?,
        };
        let full = Tensor::cat(&[&prev, &xf], 1)?; // [B, W + T, C]
        let wf = self.weight.to_dtype(DType::F32)?;
        let mut acc: Option<Tensor> = None;
        for i in 0..w {
            // Tap i reads input t - (W - 1) + i, which sits at row t + 1 + i of `full`.
            let tap = full
                .narrow(1, 1 + i, t)?
                .broadcast_mul(&wf.narrow(1, i, 1)?.squeeze(1)?)?;
            acc = Some(match acc {
                None => tap,
                Some(a) => (a + tap)?,
            });
        }
        let mut y = acc.ok_or_else(|| candle_core::Error::Msg("empty kernel".into()))?;
        if let Some(bias) = &self.bias {
            y = y.broadcast_add(&bias.to_dtype(DType::F32)?)?;
        }
        Ok((y.silu()?.to_dtype(x.dtype())?, full))
    }

    fn check_x(&self, x: &Tensor) -> Result<(usize, usize, usize)> {
        let (b, t, c) = x.dims3().map_err(|_| GdpError::Rank {
            name: "x".into(),
            expected: 3,
            layout: "[B, T, C]",
            got: x.dims().to_vec(),
        })?;
        if c != self.channels || b == 0 || t == 0 {
            return Err(GdpError::Shape {
                name: "x".into(),
                expected: vec![b.max(1), t.max(1), self.channels],
                layout: "[B, T, C] with B, T >= 1",
                got: x.dims().to_vec(),
            }
            .into());
        }
        if !x.dtype().is_float() {
            return Err(GdpError::DType {
                name: "x".into(),
                expected: "a float dtype",
                got: x.dtype(),
            }
            .into());
        }
        Ok((b, t, c))
    }

    fn check_dims(
        &self,
        s: &Tensor,
        name: &str,
        want: &[usize],
        layout: &'static str,
    ) -> Result<()> {
        if s.dims() != want {
            return Err(GdpError::Shape {
                name: name.into(),
                expected: want.to_vec(),
                layout,
                got: s.dims().to_vec(),
            }
            .into());
        }
        if !s.device().same_device(self.weight.device()) {
            return Err(GdpError::Device {
                name: name.into(),
                reference: "conv weight".into(),
                expected: format!("{:?}", self.weight.device().location()),
                got: format!("{:?}", s.device().location()),
            }
            .into());
        }
        Ok(())
    }
}
