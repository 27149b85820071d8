//! Backpropagation from given output gradients, PyTorch's `out.backward(grad)`.
//!
//! Candle's [`Tensor::backward`] starts from a scalar. The usual way to backpropagate a given
//! cotangent `c` from an output `y` is a scalar loss `(y * c).sum_all()`, whose backward
//! materialises products, reductions and their gradients over the whole output. Here each
//! output is attached to a zero scalar by a custom op whose backward hands back `c` itself, so
//! the gradients of `Σ ⟨y_i, c_i⟩` cost no more than the graph below the outputs.

use crate::error::GdpError;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

/// A zero scalar depending on one output; its backward returns the cotangent it holds. Only
/// sound where the gradient reaching the scalar is exactly one (see [`backward_with`]).
struct Seed {
    cotangent: Tensor,
}

impl CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "gdp-seed"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok(zero_scalar_cpu())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        zero_scalar_cuda(s)
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, _grad_res: &Tensor) -> Result<Option<Tensor>> {
        // `backward_with` sums the seeds into the loss it backpropagates, so the gradient
        // reaching every seed is one and the output's gradient is the cotangent itself.
        Ok(Some(self.cotangent.clone()))
    }
}

/// The f32 zero scalar that a graph-tying custom op ([`Seed`], the op's gate tie) outputs.
pub(crate) fn zero_scalar_cpu() -> (CpuStorage, Shape) {
    (CpuStorage::F32(vec![0.0]), Shape::from(()))
}

/// [`zero_scalar_cpu`] on the CUDA device of `s`.
#[cfg(feature = "cuda")]
pub(crate) fn zero_scalar_cuda(
    s: &candle_core::CudaStorage,
) -> Result<(candle_core::CudaStorage, Shape)> {
    use candle_core::backend::{BackendDevice, BackendStorage};
    let zero = s
        .device()
        .zeros_impl(&Shape::from(()), candle_core::DType::F32)?;
    Ok((zero, Shape::from(())))
}

/// Checks that the cotangent `c` (called `name`) has the shape and device of its output `y`
/// (called `reference`).
pub(crate) fn check_cotangent(c: &Tensor, name: &str, y: &Tensor, reference: &str) -> Result<()> {
    if y.dims() != c.dims() {
        return Err(GdpError::Shape {
            name: name.into(),
            expected: y.dims().to_vec(),
            layout: "(the shape of its output)",
            got: c.dims().to_vec(),
        }
        .into());
    }
    if !c.device().same_device(y.device()) {
        return Err(GdpError::Device {
            name: name.into(),
            reference: reference.into(),
            expected: format!("{:?}", y.device().location()),
            got: format!("{:?}", c.device().location()),
        }
        .into());
    }
    Ok(())
}

/// Gradients of `Σ_i ⟨outputs_i, cotangents_i⟩` with respect to every variable the outputs
/// depend on: PyTorch's `torch.autograd.backward(outputs, cotangents)`.
///
/// Each pair is `(output, cotangent)` with equal shapes on one device; a cotangent is cast to
/// its output's dtype. At least one pair is needed.
pub fn backward_with(pairs: &[(&Tensor, &Tensor)]) -> Result<GradStore> {
    let mut loss: Option<Tensor> = None;
    for (i, (y, c)) in pairs.iter().enumerate() {
        check_cotangent(c, &format!("cotangent {i}"), y, &format!("output {i}"))?;
        let seed = y.apply_op1(Seed {
            cotangent: c.to_dtype(y.dtype())?.contiguous()?.detach(),
        })?;
        loss = Some(match loss {
            None => seed,
            Some(l) => (l + seed)?,
        });
    }
    let loss = loss.ok_or_else(|| GdpError::Option {
        name: "pairs".into(),
        reason: "backward_with needs at least one (output, cotangent) pair".into(),
    })?;
    loss.backward()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn gradients_equal_those_of_the_inner_product_loss() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::new(&[[1.0f32, -2.0, 3.0], [0.5, 4.0, -1.0]], &dev)?;
        let y1 = (x.as_tensor().sqr()? * 3.0)?;
        let y2 = x.as_tensor().sum_keepdim(1)?;
        let c1 = Tensor::new(&[[0.1f32, 0.2, -0.3], [1.0, 2.0, 3.0]], &dev)?;
        let c2 = Tensor::new(&[[2.0f32], [-1.0]], &dev)?;
        let got = backward_with(&[(&y1, &c1), (&y2, &c2)])?;
        let loss = ((&y1 * &c1)?.sum_all()? + (&y2 * &c2)?.sum_all()?)?;
        let want = loss.backward()?;
        let (g, w) = (got.get(&x).expect("grad"), want.get(&x).expect("grad"));
        let diff = (g - w)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "max difference {diff}");
        Ok(())
    }

    #[test]
    fn mismatched_shapes_and_empty_input_are_errors() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::new(&[1.0f32, 2.0], &dev)?;
        let c = Tensor::new(&[1.0f32, 2.0, 3.0], &dev)?;
        let e = backward_with(&[(x.as_tensor(), &c)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("cotangent 0") && e.contains("[3]"), "{e}");
        assert!(backward_with(&[]).is_err());
        Ok(())
    }
}
