//! One recurrent decode step, `S ← step(S, q_t, k_t, v_t, g_t, beta_t)`, for generation after a
//! chunked prefill. Written with ordinary Candle tensor ops in f32, so it runs on any device and
//! is differentiable.

use crate::error::GdpError;
use candle_core::{DType, Result, Tensor, D};

/// Advances the state by one token and reads it.
///
/// * `state [B, H, K, V]` (f32; other float dtypes are cast), the state before the token;
/// * `q [B, H, K]`, `k [B, n, H, K]`, `v [B, n, H, V]`, `g [B, H]`, `beta [B, n, H]`.
///
/// Returns `o [B, H, V]` in `q`'s dtype and the new state `[B, H, K, V]` in f32. Equal to
/// [`crate::gated_delta_product`] on a one-token sequence with that initial state.
pub fn gated_delta_product_step(
    state: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    scale: Option<f64>,
) -> Result<(Tensor, Tensor)> {
    let (b, h, dk, dv) = state.dims4().map_err(|_| GdpError::Rank {
        name: "state".into(),
        expected: 4,
        layout: "[B, H, K, V]",
        got: state.dims().to_vec(),
    })?;
    let n = match *k.dims() {
        [_, n, _, _] if n >= 1 => n,
        _ => {
            return Err(GdpError::Rank {
                name: "k".into(),
                expected: 4,
                layout: "[B, n, H, K] with n >= 1",
                got: k.dims().to_vec(),
            }
            .into())
        }
    };
    for (x, name, want, layout) in [
        (q, "q", vec![b, h, dk], "[B, H, K]"),
        (k, "k", vec![b, n, h, dk], "[B, n, H, K]"),
        (v, "v", vec![b, n, h, dv], "[B, n, H, V]"),
        (g, "g", vec![b, h], "[B, H]"),
        (beta, "beta", vec![b, n, h], "[B, n, H]"),
    ] {
        if x.dims() != want.as_slice() {
            return Err(GdpError::Shape {
                name: name.into(),
                expected: want,
                layout,
                got: x.dims().to_vec(),
            }
            .into());
        }
        if !matches!(
            x.dtype(),
            DType::F32 | DType::F16 | DType::BF16 | DType::F64
        ) {
            return Err(GdpError::DType {
                name: name.into(),
                expected: "a float dtype (f32, bf16, f16 or f64)",
                got: x.dtype(),
            }
            .into());
        }
        if !x.device().same_device(state.device()) {
            return Err(GdpError::Device {
                name: name.into(),
                reference: "state".into(),
                expected: format!("{:?}", state.device().location()),
                got: format!("{:?}", x.device().location()),
            }
            .into());
        }
    }
    if !matches!(
        state.dtype(),
        DType::F32 | DType::F16 | DType::BF16 | DType::F64
    ) {
        return Err(GdpError::DType {
            name: "state".into(),
            expected: "a float dtype (f32, bf16, f16 or f64)",
            got: state.dtype(),
        }
        .into());
    }
    let scale = scale.unwrap_or((dk as f64).powf(-0.5));
    if !scale.is_finite() {
        return Err(GdpError::Option {
            name: "scale".into(),
            reason: format!("must be finite, got {scale}"),
        }
        .into());
    }
    let f32 = |x: &Tensor| x.to_dtype(DType::F32);
    let decay = f32(g)?.exp()?.reshape((b, h, 1, 1))?;
    let mut s = f32(state)?.broadcast_mul(&decay)?;
    let (k, v, beta) = (f32(k)?, f32(v)?, f32(beta)?);
    for j in 0..n {
        let kj = k.narrow(1, j, 1)?.squeeze(1)?.contiguous()?; // [B, H, K]
        let vj = v.narrow(1, j, 1)?.squeeze(1)?.contiguous()?; // [B, H, V]
        let bj = beta.narrow(1, j, 1)?.squeeze(1)?.unsqueeze(D::Minus1)?; // [B, H, 1]
        let pred = kj.unsqueeze(2)?.matmul(&s)?.squeeze(2)?; // Sᵀ k: [B, H, V]
        let delta = (vj - pred)?.broadcast_mul(&bj)?;
        s = (s + kj.unsqueeze(3)?.matmul(&delta.unsqueeze(2)?)?)?;
    }
    let o = (f32(q)?.contiguous()?.unsqueeze(2)?.matmul(&s)?.squeeze(2)? * scale)?
        .to_dtype(q.dtype())?;
    Ok((o, s))
}
