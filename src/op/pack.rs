//! The copy of FLA-layout `q [B, T, H, K]` and `k [B, T·n, H, K]` into the packed
//! `qk [B, T, n+1, H, K]` of the op, as one custom op whose backward returns contiguous `dq`
//! and `dk`. A `Tensor::cat` of `q.unsqueeze(2)` and `k` reshaped would do the same forward,
//! but its backward hands strided views of the `qk` gradient to two extra graph nodes, and
//! Candle's gradient accumulation (a zero tensor plus an add per node) over strided views was
//! several times slower than the op's own backward kernels on CUDA (`docs/perf.md`).

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

/// `qk[b, t, 0] = q[b, t]`, `qk[b, t, 1 + j] = k[b, t·n + j]`, rows of `H·K` elements.
pub(crate) struct PackQk {
    /// `B·T` tokens.
    pub tokens: usize,
    /// Keys per token.
    pub n: usize,
    /// Elements per `[H, K]` row.
    pub row: usize,
}

impl PackQk {
    fn shape(&self, q: &Layout) -> Shape {
        let d = q.dims();
        Shape::from(vec![d[0], d[1], self.n + 1, d[2], d[3]])
    }

    /// Copies `q` and `k` (contiguous) into `dst` with two strided 2-D copies.
    fn pack<S: BackendStorage>(
        &self,
        q: (&S, &Layout),
        k: (&S, &Layout),
        dst: &mut S,
    ) -> Result<()> {
        let offset = |l: &Layout, name: &str| {
            l.contiguous_offsets().map(|(a, _)| a).ok_or_else(|| {
                candle_core::Error::Msg(format!("gdp pack: `{name}` is not contiguous"))
            })
        };
        if q.0.dtype() != k.0.dtype() {
            candle_core::bail!(
                "gdp pack: `q` is {:?} but `k` is {:?}",
                q.0.dtype(),
                k.0.dtype()
            );
        }
        let (rows, n, row) = (self.tokens, self.n, self.row);
        let slots = (n + 1) * row;
        q.0.copy2d(dst, rows, row, row, slots, offset(q.1, "q")?, 0)?;
        k.0.copy2d(dst, rows, n * row, n * row, slots, offset(k.1, "k")?, row)
    }
}

impl CustomOp2 for PackQk {
    fn name(&self) -> &'static str {
        "gdp-pack-qk"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let shape = self.shape(l1);
        // SAFETY: every element is written by the two copies below (slot 0 and slots 1..=n of
        // every token row).
        let mut dst = unsafe { s1.device().alloc_uninit(&shape, s1.dtype())? };
        self.pack((s1, l1), (s2, l2), &mut dst)?;
        Ok((dst, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let shape = self.shape(l1);
        // SAFETY: as in `cpu_fwd`.
        let mut dst = unsafe { s1.device().alloc_uninit(&shape, s1.dtype())? };
        self.pack((s1, l1), (s2, l2), &mut dst)?;
        Ok((dst, shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dq = grad.narrow(2, 0, 1)?.contiguous()?.reshape(q.shape())?;
        let dk = grad
            .narrow(2, 1, self.n)?
            .contiguous()?
            .reshape(k.shape())?;
        Ok((Some(dq), Some(dk)))
    }
}
