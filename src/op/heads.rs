//! Grouped value heads (`Hv = r · Hk`), as in Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next) and
//! FLA's `num_v_heads`: the queries and keys have `Hk` heads, the values, gates, betas, states
//! and outputs `Hv`, and value head `h` reads key head `h / r` (the grouped order of Hugging Face
//! checkpoints and of FLA's `repeat(x, 'b t h d -> b t (h g) d')`, not the tiled `h % Hk`).

use crate::error::GdpError;
use candle_core::{Result, Tensor};

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
/// the sum over its group. `x` itself when `r = 1`.
pub(crate) fn expand_key_heads(x: &Tensor, dim: usize, r: usize) -> Result<Tensor> {
    if r == 1 {
        return Ok(x.clone());
    }
    let mut dims = x.dims().to_vec();
    let mut wide = dims.clone();
    wide.insert(dim + 1, r);
    dims[dim] *= r;
    x.unsqueeze(dim + 1)?.broadcast_as(wide)?.reshape(dims)
}

/// The inverse of [`expand_key_heads`] for gradients: `dx` with `Hk · r` heads on axis `dim`
/// summed over each group of `r` into `Hk` heads.
pub(crate) fn sum_key_groups(dx: &Tensor, dim: usize, r: usize) -> Result<Tensor> {
    if r == 1 {
        return Ok(dx.clone());
    }
    let mut dims = dx.dims().to_vec();
    dims[dim] /= r;
    dims.insert(dim + 1, r);
    dx.reshape(dims)?.sum(dim + 1)
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
    fn heads_must_divide() {
        let e = key_groups(4, 6, "v").unwrap_err().to_string();
        assert!(
            e.contains("`v` has 6 heads") && e.contains("multiple of the 4"),
            "{e}"
        );
        assert_eq!(key_groups(4, 12, "v").unwrap(), 3);
    }
}
