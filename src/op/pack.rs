//! The copy of FLA-layout `q [B, T, H, K]` and `k [B, T·n, H, K]` into the packed
//! `qk [B, T, n+1, H, K]` of the op, as one custom op whose backward returns contiguous `dq`
//! and `dk`, each cut out of `dqk` by one strided 2-D copy. A `Tensor::cat` of
//! `q.unsqueeze(2)` and `k` reshaped would do the same forward, but its backward hands strided
//! views of the `qk` gradient to two extra graph nodes, and Candle's gradient accumulation (a
//! zero tensor plus an add per node) over strided views, like its generic strided copy
//! (`contiguous()` of a narrowed view), was several times slower than the op's own backward
//! kernels on an H200. The op applies it outside the graph (to detached `q`, `k`)
//! and calls its backward itself, so that no packed graph node costs a zero-plus-add of `dqk`
//! (`custom::GdpForwardSplit`).

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// One strided 2-D copy: `rows` rows of `width` elements, row `r` from `src_off + r ·
/// src_stride` to `dst_off + r · dst_stride` (elements of the storages' shared dtype). On CUDA
/// it runs as `op::cuda::copy_rows` (16 bytes per thread), elsewhere as Candle's `copy2d`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowCopy {
    pub rows: usize,
    pub width: usize,
    pub src_stride: usize,
    pub dst_stride: usize,
    pub src_off: usize,
    pub dst_off: usize,
}

impl RowCopy {
    /// The copy through the backend's `copy2d`.
    pub fn copy2d<S: BackendStorage>(&self, src: &S, dst: &mut S) -> Result<()> {
        src.copy2d(
            dst,
            self.rows,
            self.width,
            self.src_stride,
            self.dst_stride,
            self.src_off,
            self.dst_off,
        )
    }
}

/// `qk[b, t, 0] = q[b, t]`, `qk[b, t, 1 + j] = k[b, t·n + j]`, rows of `H·K` elements.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PackQk {
    /// `B·T` tokens.
    pub tokens: usize,
    /// Keys per token.
    pub n: usize,
    /// Elements per `[H, K]` row.
    pub row: usize,
}

impl PackQk {
    /// The pack of the op with geometry `sh`.
    pub fn of(sh: &super::shape::GdpShape) -> Self {
        Self {
            tokens: sh.batch * sh.tokens,
            n: sh.n,
            row: sh.heads * sh.dk,
        }
    }

    fn shape(&self, q: &Layout) -> Shape {
        let d = q.dims();
        Shape::from(vec![d[0], d[1], self.n + 1, d[2], d[3]])
    }

    /// The copies of `q` and `k` (contiguous, with these layouts) into the packed buffer.
    fn copies(&self, q: &Layout, k: &Layout, dtypes: (DType, DType)) -> Result<[RowCopy; 2]> {
        let offset = |l: &Layout, name: &str| {
            l.contiguous_offsets().map(|(a, _)| a).ok_or_else(|| {
                candle_core::Error::Msg(format!("gdp pack: `{name}` is not contiguous"))
            })
        };
        if dtypes.0 != dtypes.1 {
            candle_core::bail!("gdp pack: `q` is {:?} but `k` is {:?}", dtypes.0, dtypes.1);
        }
        let (rows, n, row) = (self.tokens, self.n, self.row);
        let slots = (n + 1) * row;
        Ok([
            RowCopy {
                rows,
                width: row,
                src_stride: row,
                dst_stride: slots,
                src_off: offset(q, "q")?,
                dst_off: 0,
            },
            RowCopy {
                rows,
                width: n * row,
                src_stride: n * row,
                dst_stride: slots,
                src_off: offset(k, "k")?,
                dst_off: row,
            },
        ])
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
        let [cq, ck] = self.copies(l1, l2, (s1.dtype(), s2.dtype()))?;
        // SAFETY: every element is written by the two copies below (slot 0 and slots 1..=n of
        // every token row).
        let mut dst = unsafe { s1.device().alloc_uninit(&shape, s1.dtype())? };
        cq.copy2d(s1, &mut dst)?;
        ck.copy2d(s2, &mut dst)?;
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
        use super::cuda::copy_rows;
        let shape = self.shape(l1);
        let [cq, ck] = self.copies(l1, l2, (s1.dtype(), s2.dtype()))?;
        // SAFETY: as in `cpu_fwd`.
        let mut dst = unsafe { s1.device().alloc_uninit(&shape, s1.dtype())? };
        copy_rows(s1, &mut dst, cq)?;
        copy_rows(s2, &mut dst, ck)?;
        Ok((dst, shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let slots = |first: usize, count: usize, like: &Tensor| {
            let op = UnpackSlots {
                tokens: self.tokens,
                slots: self.n + 1,
                row: self.row,
                first,
                count,
                shape: like.shape().clone(),
            };
            grad.apply_op1_no_bwd(&op)
        };
        Ok((Some(slots(0, 1, q)?), Some(slots(1, self.n, k)?)))
    }
}

/// Slots `first .. first + count` of every token of a contiguous `[tokens, slots, row]`
/// tensor, as a new contiguous tensor of `shape` (one strided 2-D copy).
struct UnpackSlots {
    tokens: usize,
    slots: usize,
    row: usize,
    first: usize,
    count: usize,
    shape: Shape,
}

impl UnpackSlots {
    /// The copy of the slots out of a source with layout `l` (into all of `shape`).
    fn copy(&self, l: &Layout) -> Result<RowCopy> {
        let (start, _) = l.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("gdp unpack: the gradient is not contiguous".into())
        })?;
        let width = self.count * self.row;
        Ok(RowCopy {
            rows: self.tokens,
            width,
            src_stride: self.slots * self.row,
            dst_stride: width,
            src_off: start + self.first * self.row,
            dst_off: 0,
        })
    }
}

impl CustomOp1 for UnpackSlots {
    fn name(&self) -> &'static str {
        "gdp-unpack-slots"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let copy = self.copy(l)?;
        // SAFETY: the copy writes every element (`tokens` rows of `count · row`).
        let mut dst = unsafe { s.device().alloc_uninit(&self.shape, s.dtype())? };
        copy.copy2d(s, &mut dst)?;
        Ok((dst, self.shape.clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let copy = self.copy(l)?;
        // SAFETY: as in `cpu_fwd`.
        let mut dst = unsafe { s.device().alloc_uninit(&self.shape, s.dtype())? };
        super::cuda::copy_rows(s, &mut dst, copy)?;
        Ok((dst, self.shape.clone()))
    }
}
