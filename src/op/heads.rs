//! Grouped value heads (`Hv = r · Hk`), as in Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next) and
//! FLA's `num_v_heads`: the queries and keys have `Hk` heads, the values, gates, betas, states
//! and outputs `Hv`, and value head `h` reads key head `h / r` (the grouped order of Hugging Face
//! checkpoints and of FLA's `repeat(x, 'b t h d -> b t (h g) d')`, not the tiled `h % Hk`).

use super::pack::RowCopy;
use crate::error::GdpError;
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// Value heads per key head, `r = Hv / Hk`; an error unless `Hk` divides `Hv`. `what` names the
/// value-side tensor whose head count is `hv`.
pub(crate) fn key_groups(hk: usize, hv: usize, what: &str) -> Result<usize> {
    if hk == 0 || !hv.is_multiple_of(hk) {
        return Err(GdpError::Heads(format!(
            "`{what}` has {hv} heads, which must be a multiple of the {hk} heads of the queries \
             and keys (grouped value heads: value head h reads key head h / (Hv / Hk))"
        ))
        .into());
    }
    Ok(hv / hk)
}

/// `x` with its head axis `dim` (of `Hk` heads) repeated to `Hk · r` heads in grouped order:
/// head `h` of the result is head `h / r` of `x`. Differentiable: the gradient of a key head is
/// the sum over its group ([`sum_key_groups`], one pass on CUDA). `x` itself when `r = 1`.
pub(crate) fn expand_key_heads(x: &Tensor, dim: usize, r: usize) -> Result<Tensor> {
    if r == 1 {
        return Ok(x.clone());
    }
    x.contiguous()?.apply_op1(ExpandKeyHeads { dim, r })
}

/// The inverse of [`expand_key_heads`] for gradients: `dx` with `Hk · r` heads on axis `dim`
/// summed over each group of `r` into `Hk` heads, in f32 (rounded once to `dx`'s dtype).
pub(crate) fn sum_key_groups(dx: &Tensor, dim: usize, r: usize) -> Result<Tensor> {
    if r == 1 {
        return Ok(dx.clone());
    }
    let mut dims = dx.dims().to_vec();
    dims[dim] /= r;
    #[cfg(feature = "cuda")]
    if let Some(sum) = super::cuda::sum_groups_tensor(dx, groups(&dims, dim, r), &dims)? {
        return Ok(sum);
    }
    let mut grouped = dims.clone();
    grouped.insert(dim + 1, r);
    let wide = match dx.dtype() {
        DType::BF16 | DType::F16 => DType::F32,
        other => other,
    };
    dx.to_dtype(wide)?
        .reshape(grouped)?
        .sum(dim + 1)?
        .to_dtype(dx.dtype())
}

/// `(rows, r, d)` of the key-head axis `dim` of `dims` (the narrow shape): `rows` = the elements
/// before the axis times `Hk`, `d` = the elements after it; the wide tensor is
/// `[rows, r, d]`.
fn groups(dims: &[usize], dim: usize, r: usize) -> (usize, usize, usize) {
    let rows = dims[..=dim].iter().product();
    (rows, r, dims[dim + 1..].iter().product())
}

/// [`expand_key_heads`] as a custom op, so that its backward is [`sum_key_groups`] rather
/// than Candle's reduction over a broadcast axis (on CUDA one block of `r` threads per key-head
/// value).
struct ExpandKeyHeads {
    dim: usize,
    r: usize,
}

impl ExpandKeyHeads {
    /// The wide shape of a contiguous input laid out as `l`, and the `r` row copies that fill
    /// it: copy `j` puts every row of `d` values (key head `h`'s of one token) at value head
    /// `h · r + j`.
    fn copies(&self, l: &Layout) -> Result<(Shape, Vec<RowCopy>)> {
        let Some((start, _)) = l.contiguous_offsets() else {
            candle_core::bail!("gdp: expand_key_heads needs a contiguous input");
        };
        let mut dims = l.dims().to_vec();
        let (rows, r, d) = groups(&dims, self.dim, self.r);
        dims[self.dim] *= r;
        let copy = |j: usize| RowCopy {
            rows,
            width: d,
            src_stride: d,
            dst_stride: r * d,
            src_off: start,
            dst_off: j * d,
        };
        Ok((Shape::from(dims), (0..r).map(copy).collect()))
    }
}

impl CustomOp1 for ExpandKeyHeads {
    fn name(&self) -> &'static str {
        "gdp-expand-key-heads"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (shape, copies) = self.copies(l)?;
        // SAFETY: the `r` copies write every element (each row of the wide tensor once).
        let mut dst = unsafe { s.device().alloc_uninit(&shape, s.dtype())? };
        for c in copies {
            c.copy2d(s, &mut dst)?;
        }
        Ok((dst, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (shape, copies) = self.copies(l)?;
        // SAFETY: as in `cpu_fwd`.
        let mut dst = unsafe { s.device().alloc_uninit(&shape, s.dtype())? };
        for c in copies {
            super::cuda::copy_rows(s, &mut dst, c)?;
        }
        Ok((dst, shape))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(sum_key_groups(grad, self.dim, self.r)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn value_head_reads_key_head_h_over_r() -> Result<()> {
        // [1, 1, 2, 1]: key heads 10, 20; r = 3 gives 10, 10, 10, 20, 20, 20.
        let x = Tensor::new(&[10f32, 20.0], &Device::Cpu)?.reshape((1, 1, 2, 1))?;
        let e = expand_key_heads(&x, 2, 3)?;
        assert_eq!(
            e.flatten_all()?.to_vec1::<f32>()?,
            [10., 10., 10., 20., 20., 20.]
        );
        let s = sum_key_groups(&e, 2, 3)?;
        assert_eq!(s.flatten_all()?.to_vec1::<f32>()?, [30., 60.]);
        Ok(())
    }

    #[test]
    fn expansion_and_its_gradient_match_broadcasting() -> Result<()> {
        let dev = Device::Cpu;
        // q-like [B, T, Hk, K] at axis 2 and packed-qk-like [B, T, n+1, Hk, K] at axis 3.
        for (dims, dim) in [(vec![2, 3, 2, 5], 2), (vec![2, 3, 2, 2, 4], 3)] {
            let r = 3;
            let x = candle_core::Var::randn(0f64, 1.0, dims.as_slice(), &dev)?;
            let mut wide = dims.clone();
            wide[dim] *= r;
            let w = Tensor::randn(0f64, 1.0, wide.as_slice(), &dev)?;
            let e = expand_key_heads(x.as_tensor(), dim, r)?;
            let mut b = dims.clone();
            b.insert(dim + 1, r);
            let want = x.unsqueeze(dim + 1)?.broadcast_as(b)?.reshape(wide)?;
            let diff = (&e - &want)?.abs()?.max_all()?.to_scalar::<f64>()?;
            assert_eq!(diff, 0.0, "expanded values at axis {dim}");
            let grads = (&e * &w)?.sum_all()?.backward()?;
            let got = grads.get(x.as_tensor()).expect("a gradient of x");
            let want = sum_key_groups(&w, dim, r)?;
            let diff = (got - &want)?.abs()?.max_all()?.to_scalar::<f64>()?;
            assert!(diff < 1e-12, "gradient at axis {dim}: {diff}");
        }
        Ok(())
    }

    #[test]
    fn heads_must_divide() {
        let e = key_groups(4, 6, "v").unwrap_err().to_string();
        assert!(
            e.contains("`v` has 6 heads") && e.contains("multiple of the 4"),
            "{e}"
        );
        assert_eq!(key_groups(4, 12, "v").unwrap(), 3);
    }
}
