//! One recurrent decode step, `S ← step(S, q_t, k_t, v_t, g_t, beta_t)`, for generation after a
//! chunked prefill, in two forms: [`gated_delta_product_step`], ordinary Candle tensor ops in f32
//! (any device, differentiable), and [`gated_delta_product_step_fused`], one pass over the state
//! (one kernel on CUDA; no gradients), for decoding at memory speed.

use super::custom::cpu_slice;
use super::heads::expand_key_heads;
use crate::error::GdpError;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor, D};
use rayon::prelude::*;

/// Advances the state by one token and reads it.
///
/// * `state [B, H, K, V]` (f32; other float dtypes are cast), the state before the token;
/// * `q [B, Hk, K]`, `k [B, n, Hk, K]`, `v [B, n, H, V]`, `g [B, H]`, `beta [B, n, H]`, where
///   `Hk` divides `H` (grouped value heads: head `h` reads key head `h / (H / Hk)`; `Hk = H`
///   without grouping).
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
    let StepDims {
        b,
        h,
        groups,
        dk: _,
        dv: _,
        n,
        scale,
    } = validate_step(state, q, k, v, g, beta, scale)?;
    let q = &expand_key_heads(q, 1, groups)?;
    let k = &expand_key_heads(k, 2, groups)?;
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

/// Sizes of a decode step, checked by [`validate_step`].
struct StepDims {
    b: usize,
    h: usize,
    /// Value heads per key head.
    groups: usize,
    dk: usize,
    dv: usize,
    n: usize,
    scale: f64,
}

/// Checks the arguments of a decode step (shapes, dtypes, devices, scale).
fn validate_step(
    state: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    scale: Option<f64>,
) -> Result<StepDims> {
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
    // Grouped value heads: `q` and `k` may have `Hk` heads, a divisor of the state's `H`
    // (else `q` is checked against `H` heads, and its error names it).
    let hk = match *q.dims() {
        [_, hk, _] if hk > 0 && h.is_multiple_of(hk) => hk,
        _ => h,
    };
    let groups = h.checked_div(hk).unwrap_or(1);
    for (x, name, want, layout) in [
        (q, "q", vec![b, hk, dk], "[B, Hk, K], Hk dividing H"),
        (k, "k", vec![b, n, hk, dk], "[B, n, Hk, K]"),
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
    super::check_scale(scale)?;
    Ok(StepDims {
        b,
        h,
        groups,
        dk,
        dv,
        n,
        scale,
    })
}

/// [`gated_delta_product_step`] as one fused pass over the state: the state is read once and the
/// new state written once (on a GPU one CUDA kernel, which reads `q`, `k`, `v` in bf16 or f16
/// as they are; on the CPU a loop over the heads, on rayon's threads from 65536 state
/// elements). Same arguments and results (`o [B, H, V]` in `q`'s dtype, the new state
/// `[B, H, K, V]` in f32), computed in f32; not differentiable (it is a decode-time op). Shapes
/// the CUDA kernel does not take (`K > 256`) run [`gated_delta_product_step`] instead.
pub fn gated_delta_product_step_fused(
    state: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    scale: Option<f64>,
) -> Result<(Tensor, Tensor)> {
    let d = validate_step(state, q, k, v, g, beta, scale)?;
    if d.dk == 0 || d.dv == 0 {
        // An empty state: the output `q·S` is all zeros and the new state is empty.
        let dev = state.device();
        let o = Tensor::zeros((d.b, d.h, d.dv), q.dtype(), dev)?;
        let s = Tensor::zeros((d.b, d.h, d.dk, d.dv), DType::F32, dev)?;
        return Ok((o, s));
    }
    #[cfg(feature = "cuda")]
    if state.device().is_cuda() && !super::cuda::step_fits(d.dk, d.n) {
        return gated_delta_product_step(state, q, k, v, g, beta, scale);
    }
    // The CUDA kernel reads `q`, `k`, `v` in bf16 or f16 as they are where the three share the
    // dtype; else (f64, mixed dtypes, the CPU) they become f32, as the gates always do (casts
    // that lose nothing but f64's precision).
    let qkv = match q.dtype() {
        DType::BF16 | DType::F16
            if state.device().is_cuda() && k.dtype() == q.dtype() && v.dtype() == q.dtype() =>
        {
            q.dtype()
        }
        _ => DType::F32,
    };
    let input = |x: &Tensor, dtype| x.to_dtype(dtype)?.contiguous();
    let st = state.to_dtype(DType::F32)?.contiguous()?;
    let (q, k) = (
        &expand_key_heads(q, 1, d.groups)?,
        &expand_key_heads(k, 2, d.groups)?,
    );
    let op = FusedStep {
        inputs: [
            input(q, qkv)?,
            input(k, qkv)?,
            input(v, qkv)?,
            input(g, DType::F32)?,
            input(beta, DType::F32)?,
        ],
        b: d.b,
        h: d.h,
        dk: d.dk,
        dv: d.dv,
        n: d.n,
        scale: d.scale as f32,
    };
    let out = st.apply_op1_no_bwd(&op)?;
    let (bh, dk, dv) = (d.b * d.h, d.dk, d.dv);
    let o = out
        .narrow(0, 0, bh * dv)?
        .reshape((d.b, d.h, dv))?
        .to_dtype(q.dtype())?;
    let s = out
        .narrow(0, bh * dv, bh * dk * dv)?
        .reshape((d.b, d.h, dk, dv))?;
    Ok((o, s))
}

/// State elements (`B·H·K·V`) from which the CPU step runs its heads on rayon's threads.
const PARALLEL_STEP_ELEMENTS: usize = 1 << 16;

/// The fused step as a Candle op over the f32 state, with its other inputs `q [B, H, K]`,
/// `k [B, n, H, K]`, `v [B, n, H, V]`, `g [B, H]`, `beta [B, n, H]` held here (Candle's custom
/// ops take at most three tensors), contiguous: `q`, `k`, `v` in f32, or on CUDA all three in
/// bf16 or f16; the gates in f32. Output: the f32 `[o (B H V) | new state (B H K V)]`.
struct FusedStep {
    inputs: [Tensor; 5],
    b: usize,
    h: usize,
    dk: usize,
    dv: usize,
    n: usize,
    scale: f32,
}

/// Names of the fused step's small inputs ([`FusedStep::inputs`]), in the kernels' order.
pub(crate) const STEP_INPUTS: [&str; 5] = ["q", "k", "v", "g", "beta"];

/// Elements of each of [`STEP_INPUTS`] for `dims = [B, H, K, V, n]`.
pub(crate) fn step_input_lens([b, h, k, v, n]: [usize; 5]) -> [usize; 5] {
    [b * h * k, b * n * h * k, b * n * h * v, b * h, b * n * h]
}

impl FusedStep {
    /// `[B, H, K, V, n]`.
    fn dims(&self) -> [usize; 5] {
        [self.b, self.h, self.dk, self.dv, self.n]
    }
}

impl CustomOp1 for FusedStep {
    fn name(&self) -> &'static str {
        "gated-delta-product-step"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout) -> Result<(CpuStorage, Shape)> {
        let (bh, dk, dv, n, hh) = (self.b * self.h, self.dk, self.dv, self.n, self.h);
        let sized = |s, l, len, name| -> Result<&[f32]> {
            let x = cpu_slice::<f32>(s, l, name)?;
            if x.len() != len {
                candle_core::bail!(
                    "gdp step: `{name}` holds {} elements, expected {len}",
                    x.len()
                );
            }
            Ok(x)
        };
        // One output buffer `[o | new state]`, the state copied into it and updated in place.
        let state = sized(s1, l1, bh * dk * dv, "state")?;
        let guards = self.inputs.each_ref().map(|x| x.storage_and_layout());
        let lens = step_input_lens(self.dims());
        let mut small = [&[][..]; 5];
        for (i, (storage, layout)) in guards.iter().enumerate() {
            let Storage::Cpu(s) = &**storage else {
                candle_core::bail!("gdp step: `{}` is not on the CPU", STEP_INPUTS[i]);
            };
            small[i] = sized(s, layout, lens[i], STEP_INPUTS[i])?;
        }
        let [q, k, v, g, beta] = small;
        let mut out = Vec::with_capacity(bh * dv + state.len());
        out.resize(bh * dv, 0.0f32);
        out.extend_from_slice(state);
        let (o, new_state) = out.split_at_mut(bh * dv);
        let one_head = |idx: usize, (s, o): (&mut [f32], &mut [f32])| {
            let (b, h) = (idx / hh, idx % hh);
            let decay = g[idx].exp();
            s.iter_mut().for_each(|x| *x *= decay);
            let mut col = vec![0.0f32; dv];
            for j in 0..n {
                let row = (b * n + j) * hh + h;
                let kj = &k[row * dk..(row + 1) * dk];
                column_dot(s, kj, &mut col);
                let vj = &v[row * dv..(row + 1) * dv];
                for (c, &x) in col.iter_mut().zip(vj) {
                    *c = beta[row] * (x - *c);
                }
                for (srow, &kr) in s.chunks_mut(dv).zip(kj) {
                    srow.iter_mut().zip(&col).for_each(|(x, &d)| *x += kr * d);
                }
            }
            column_dot(s, &q[idx * dk..(idx + 1) * dk], o);
            o.iter_mut().for_each(|x| *x *= self.scale);
        };
        // Rayon's hand-off costs tens of microseconds, more than a small step's arithmetic.
        if rayon::current_num_threads() > 1 && state.len() >= PARALLEL_STEP_ELEMENTS {
            new_state
                .par_chunks_mut(dk * dv)
                .zip(o.par_chunks_mut(dv))
                .enumerate()
                .for_each(|(idx, pair)| one_head(idx, pair));
        } else {
            new_state
                .chunks_mut(dk * dv)
                .zip(o.chunks_mut(dv))
                .enumerate()
                .for_each(|(idx, pair)| one_head(idx, pair));
        }
        let len = out.len();
        Ok((CpuStorage::F32(out), Shape::from(len)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (bh, dk, dv) = (self.b * self.h, self.dk, self.dv);
        let guards = self.inputs.each_ref().map(|x| x.storage_and_layout());
        let mut inputs = [(s1, l1); 5];
        for (i, (storage, layout)) in guards.iter().enumerate() {
            let Storage::Cuda(s) = &**storage else {
                candle_core::bail!("gdp step: `{}` is not on a CUDA device", STEP_INPUTS[i]);
            };
            inputs[i] = (s, *layout);
        }
        let out = super::cuda::step((s1, l1), inputs, self.dims(), self.scale)?;
        Ok((out, Shape::from(bh * dv + bh * dk * dv)))
    }
}

/// `out[c] = Σ_r x[r] s[r][c]` for a row-major `s [K, V]`.
fn column_dot(s: &[f32], x: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    for (srow, &xr) in s.chunks(out.len()).zip(x) {
        out.iter_mut().zip(srow).for_each(|(o, &v)| *o += xr * v);
    }
}
