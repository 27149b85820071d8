//! The op with an explicit backward, outside Candle's autograd: the forward returns its outputs
//! and a [`GdpVjp`] that turns their cotangents into every input's gradient, as FLA's
//! `chunk_gated_delta_product_fwd` / `_bwd` pair does under PyTorch's `autograd.Function`.
//!
//! For training loops that manage gradients themselves (a hand-written backward, gradient
//! checkpointing across layers, another framework's autograd): the same kernels as
//! [`super::gated_delta_product`] without a graph node, so none of the gradients passes
//! through Candle's `GradStore` (whose first gradient per tensor is added into a fresh zero
//! tensor in Candle 0.11, 0.74–1.90 ms of forward+backward at the benchmark shapes on an H200:
//! `docs/cuda.md`).

use super::custom::GdpForwardSplit;
use super::heads::sum_key_groups;
use super::{forward_op, gate_buffer, kernel_keys, split_output, validate_fla, GdpOptions};
use crate::autograd::check_cotangent;
use crate::error::GdpError;
use candle_core::{DType, Result, Tensor};

/// The outputs of [`gated_delta_product_vjp`] and what its backward needs.
#[derive(Debug)]
pub struct GdpVjp {
    /// `o [B, T, H, V]` in `q`'s dtype.
    pub o: Tensor,
    /// The final state `[N, H, K, V]` (f32) with `output_final_state`.
    pub final_state: Option<Tensor>,
    op: GdpForwardSplit,
    inputs: Inputs,
}

/// Detached, contiguous inputs, kept for the backward.
#[derive(Debug)]
struct Inputs {
    /// `q` and `k` as the kernels read them ([`kernel_keys`]): in place, or with their key
    /// heads repeated to the value heads.
    q: Tensor,
    k: Tensor,
    /// The groups of repeated key heads whose gradients sum here (1 where the kernels read
    /// `q`, `k` in place and their backward sums them).
    groups: usize,
    g: (DType, Vec<usize>),
    beta: (DType, Vec<usize>),
    h0: Option<(DType, Vec<usize>)>,
}

/// Gradients of every input of [`gated_delta_product_vjp`], each in its input's dtype and shape.
#[derive(Debug, Clone)]
pub struct GdpGrads {
    /// `dq [B, T, Hk, K]`.
    pub dq: Tensor,
    /// `dk [B, T·n, Hk, K]`.
    pub dk: Tensor,
    /// `dv [B, T·n, H, V]`.
    pub dv: Tensor,
    /// `dg [B, T, H]`.
    pub dg: Tensor,
    /// `dbeta [B, T·n, H]`.
    pub dbeta: Tensor,
    /// `dh0 [N, H, K, V]`, given an initial state.
    pub dh0: Option<Tensor>,
}

/// [`super::gated_delta_product`] with an explicit backward: same inputs, options, checks and
/// kernels, no graph node. Returns `o [B, T, H, V]`, the final state `[N, H, K, V]` when
/// asked for, and the means to get every input's gradient from their cotangents
/// ([`GdpVjp::backward`]). The inputs' own graphs are not followed: gradients stop at them.
/// [`GdpOptions::save_intermediates`] applies as if the inputs tracked gradients.
///
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_gdp::{gated_delta_product_vjp, GdpOptions};
/// # fn main() -> candle_core::Result<()> {
/// let (b, t, h, k, v, n) = (1, 10, 2, 8, 6, 2);
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 0.3, (b, t, h, k), &dev)?;
/// let keys = Tensor::randn(0f32, 0.3, (b, t * n, h, k), &dev)?;
/// let values = Tensor::randn(0f32, 1.0, (b, t * n, h, v), &dev)?;
/// let g = Tensor::full(-0.1f32, (b, t, h), &dev)?;
/// let beta = Tensor::full(0.5f32, (b, t * n, h), &dev)?;
/// let vjp = gated_delta_product_vjp(&q, &keys, &values, &g, &beta, &GdpOptions::default())?;
/// let d_o = vjp.o.ones_like()?;
/// let grads = vjp.backward(&d_o, None)?;
/// assert_eq!(grads.dk.dims(), keys.dims());
/// assert_eq!(grads.dbeta.dtype(), DType::F32);
/// # Ok(())
/// # }
/// ```
pub fn gated_delta_product_vjp(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    opts: &GdpOptions,
) -> Result<GdpVjp> {
    let sh = validate_fla(q, k, v, g, beta, opts)?;
    // The backward sums the gradients of repeated key heads here, of key heads read in place
    // in the kernels' backward.
    let r = sh.heads / q.dim(2)?;
    let (q, k, in_place) = kernel_keys(&q.detach(), &k.detach(), &sh, opts, false)?;
    let groups = if in_place { 1 } else { r };
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.detach().contiguous()?);
    let h0 = opts.initial_state.map(|h| h.detach());
    let aux = gate_buffer(&g.detach(), &beta.detach(), h0.as_ref())?;
    let op = forward_op(sh.clone(), opts, None, true, q.device())?;
    let op = GdpForwardSplit::new(op, &q, &k, v.clone(), aux, in_place)?;
    let out = q.apply_op3_no_bwd(&k, &v, &op)?;
    let (o, final_state) = split_output(out, &sh, q.dtype(), opts.output_final_state)?;
    let layout = |x: &Tensor| (x.dtype(), x.dims().to_vec());
    let inputs = Inputs {
        g: layout(g),
        beta: layout(beta),
        h0: h0.as_ref().map(layout),
        q,
        k,
        groups,
    };
    Ok(GdpVjp {
        o,
        final_state,
        op,
        inputs,
    })
}

impl GdpVjp {
    /// Every input's gradient for the cotangents `d_o [B, T, H, V]` of `o` and, when the
    /// forward returned the final state, `d_final_state [N, H, K, V]` of it (zero when
    /// `None`); any float dtype, on the inputs' device. Consumes the forward's intermediates.
    pub fn backward(self, d_o: &Tensor, d_final_state: Option<&Tensor>) -> Result<GdpGrads> {
        let sh = &self.op.op.shape;
        check_cotangent(d_o, "d_o", &self.o, "o")?;
        let grad = match (&self.final_state, d_final_state) {
            (None, Some(_)) => {
                return Err(GdpError::Option {
                    name: "d_final_state".into(),
                    reason: "given, but the forward ran without `output_final_state`".into(),
                }
                .into())
            }
            (None, None) => d_o.to_dtype(self.o.dtype())?.contiguous()?,
            (Some(ht), dht) => {
                // As autograd does: `d_o` in `o`'s dtype, then the packed f32 `[do | dht]`.
                let d_o = d_o.to_dtype(self.o.dtype())?.flatten_all()?;
                let dht = match dht {
                    Some(dht) => {
                        check_cotangent(dht, "d_final_state", ht, "the final state")?;
                        dht.flatten_all()?.to_dtype(DType::F32)?
                    }
                    None => Tensor::zeros(sh.state_len(), DType::F32, ht.device())?,
                };
                Tensor::cat(&[&d_o.to_dtype(DType::F32)?, &dht], 0)?
            }
        };
        let x = &self.inputs;
        let (dq, dk, dv, daux) = self.op.gradients(&x.q, &x.k, &grad)?;
        let (Some(dq), Some(dk)) = (dq, dk) else {
            candle_core::bail!("gdp: the backward returned no query or key gradient");
        };
        let len = |(_, dims): &(DType, Vec<usize>)| dims.iter().product::<usize>();
        let (g_len, beta_len) = (len(&x.g), len(&x.beta));
        let part = |start: usize, (dtype, dims): &(DType, Vec<usize>)| -> Result<Tensor> {
            let len = dims.iter().product();
            daux.narrow(0, start, len)?
                .reshape(dims.as_slice())?
                .to_dtype(*dtype)
        };
        Ok(GdpGrads {
            dq: sum_key_groups(&dq, 2, x.groups)?,
            dk: sum_key_groups(&dk, 2, x.groups)?,
            dv,
            dg: part(0, &x.g)?,
            dbeta: part(g_len, &x.beta)?,
            dh0: x
                .h0
                .as_ref()
                .map(|h0| part(g_len + beta_len, h0))
                .transpose()?,
        })
    }
}
