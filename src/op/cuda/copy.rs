//! Strided row copies on CUDA (`gdp_copy_rows`, `cuda/copy.cuh`): Candle's `copy2d`, 16 bytes
//! per thread where the rows allow it instead of one element per thread. The op's packing of
//! `q` and `k` into `qk` and its backward's cutting of `dq` and `dk` out of `dqk` are such copies,
//! over the whole of `q` and `k`. With grouped value heads, the backward's `dq` and `dk` per
//! value head are summed into their key heads here too (`gdp_sum_groups_bf16`).

use super::module::load_kernel;
use crate::op::kernel_params::{CastParams, CopyRowsParams, SumGroupsParams};
use crate::op::pack::RowCopy;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Result, Storage, Tensor};
use half::bf16;

/// Copies `r` from `src` to `dst` (same dtype, same device): `gdp_copy_rows` for 2- and 4-byte
/// dtypes, Candle's `copy2d` for the others.
pub(crate) fn copy_rows(src: &CudaStorage, dst: &mut CudaStorage, r: RowCopy) -> Result<()> {
    if src.dtype() != dst.dtype() {
        candle_core::bail!(
            "gdp cuda: row copy from {:?} to {:?}",
            src.dtype(),
            dst.dtype()
        );
    }
    match src.dtype() {
        DType::BF16 => launch::<half::bf16>(src, dst, r),
        DType::F16 => launch::<half::f16>(src, dst, r),
        DType::F32 => launch::<f32>(src, dst, r),
        _ => r.copy2d(src, dst),
    }
}

fn launch<T: CudaDType + DeviceRepr>(
    src: &CudaStorage,
    dst: &mut CudaStorage,
    r: RowCopy,
) -> Result<()> {
    let dev = src.device().clone();
    copy_rows_slice(
        &dev,
        src.as_cuda_slice::<T>()?,
        dst.as_cuda_slice_mut::<T>()?,
        r,
    )
}

/// [`copy_rows`] between two device buffers of one dtype (`gdp_copy_rows`).
pub(crate) fn copy_rows_slice<T: DeviceRepr>(
    dev: &CudaDevice,
    src: &CudaSlice<T>,
    dst: &mut CudaSlice<T>,
    r: RowCopy,
) -> Result<()> {
    if r.rows == 0 || r.width == 0 {
        return Ok(());
    }
    let last = |off: usize, stride: usize| off + (r.rows - 1) * stride + r.width;
    if last(r.src_off, r.src_stride) > src.len() || last(r.dst_off, r.dst_stride) > dst.len() {
        candle_core::bail!(
            "gdp cuda: row copy out of bounds ({r:?}, source {} and destination {} elements)",
            src.len(),
            dst.len()
        );
    }
    let func = load_kernel(dev, "gdp_copy_rows")?;
    let elem = std::mem::size_of::<T>();
    let s = src.slice(r.src_off..);
    let mut d = dst.slice_mut(r.dst_off..);
    let bytes = |x: usize| (x * elem) as i64;
    let (rows, width) = (r.rows as i64, bytes(r.width));
    let (src_ld, dst_ld) = (bytes(r.src_stride), bytes(r.dst_stride));
    // One thread per 16 bytes of a row (the kernel loops where it must copy narrower units).
    let threads = 256u32;
    let gx = (r.width * elem)
        .div_ceil(16 * threads as usize)
        .clamp(1, 1024) as u32;
    let gy = r.rows.min(65_535) as u32;
    let mut args = func.args();
    let params = CopyRowsParams {
        src: args.read(&s),
        dst: args.write(&mut d),
        rows,
        width,
        src_ld,
        dst_ld,
    };
    let cfg = LaunchConfig {
        grid_dim: (gx, gy, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `gdp_copy_rows` takes `GdpCopyRowsParams` (sizes in bytes); every row read or
    // written lies inside the slices (checked above).
    unsafe { args.launch(cfg, &params) }?;
    Ok(())
}

/// `src` rounded to bf16, in a new buffer.
pub(super) fn to_bf16(
    dev: &CudaDevice,
    src: &candle_core::cuda_backend::cudarc::driver::CudaView<f32>,
) -> Result<CudaSlice<half::bf16>> {
    let len = src.len();
    // SAFETY: the conversion below writes every element.
    let mut dst = unsafe { dev.alloc::<half::bf16>(len.max(1))? };
    if len == 0 {
        return Ok(dst);
    }
    let cvt = load_kernel(dev, "gdp_f32_to_bf16")?;
    let mut args = cvt.args();
    let params = CastParams {
        src: args.read(src),
        dst: args.write(&mut dst),
        len: len as i64,
    };
    let cfg = LaunchConfig {
        grid_dim: (len.div_ceil(256).min(65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `gdp_f32_to_bf16` takes `GdpCastParams`; both buffers hold `len` elements.
    unsafe { args.launch(cfg, &params) }?;
    Ok(dst)
}

/// The dtypes of `gdp_sum_groups_*`.
trait GroupSumDType: CudaDType + DeviceRepr {
    /// The kernel's name.
    const SUM_GROUPS: &'static str;
}
impl GroupSumDType for bf16 {
    const SUM_GROUPS: &'static str = "gdp_sum_groups_bf16";
}
impl GroupSumDType for f32 {
    const SUM_GROUPS: &'static str = "gdp_sum_groups_f32";
}

/// `src` (`[rows · r, d]`: `rows` groups of `r` consecutive rows) summed over each group in
/// f32 and rounded to `T`, in a new buffer `[rows, d]`: the gradient of key heads that `r`
/// value heads each read (`[B, T, Hk·r, D]` into `[B, T, Hk, D]`), in one pass, the same bits
/// run to run.
fn sum_groups<T: GroupSumDType>(
    dev: &CudaDevice,
    src: &CudaView<T>,
    rows: usize,
    r: usize,
    d: usize,
) -> Result<CudaSlice<T>> {
    let len = rows * d;
    if src.len() < len * r {
        candle_core::bail!(
            "gdp cuda: group sum of {rows} rows of {r} x {d} values from {} elements",
            src.len()
        );
    }
    // SAFETY: the kernel writes every element.
    let mut dst = unsafe { dev.alloc::<T>(len.max(1))? };
    if len == 0 {
        return Ok(dst);
    }
    let func = load_kernel(dev, T::SUM_GROUPS)?;
    let mut args = func.args();
    let params = SumGroupsParams {
        src: args.read(src),
        dst: args.write(&mut dst),
        rows: rows as i64,
        r: i32::try_from(r).map_err(candle_core::Error::wrap)?,
        d: i32::try_from(d).map_err(candle_core::Error::wrap)?,
    };
    // One thread per eight values (the kernel loops where it takes one at a time).
    let threads = 256usize;
    let cfg = LaunchConfig {
        grid_dim: (len.div_ceil(8 * threads).clamp(1, 65_535) as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `gdp_sum_groups_*` takes `GdpSumGroupsParams<T>`; `src` holds `rows · r · d`
    // elements (checked above) and `dst` `rows · d`.
    unsafe { args.launch(cfg, &params) }?;
    Ok(dst)
}

/// [`sum_groups`] on a contiguous CUDA tensor of `rows · r · d` elements, into a new tensor of
/// shape `dims`; `None` where the tensor is not on CUDA, not contiguous, or neither bf16 nor f32
/// (the caller then sums with Candle).
pub(crate) fn sum_groups_tensor(
    x: &Tensor,
    groups: (usize, usize, usize),
    dims: &[usize],
) -> Result<Option<Tensor>> {
    let (storage, layout) = x.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Ok(None);
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Ok(None);
    };
    let range = start..end;
    let out = match x.dtype() {
        DType::BF16 => sum_groups_storage::<bf16>(cs, range, groups)?,
        DType::F32 => sum_groups_storage::<f32>(cs, range, groups)?,
        _ => return Ok(None),
    };
    Ok(Some(Tensor::from_storage(
        Storage::Cuda(out),
        dims,
        BackpropOp::none(),
        false,
    )))
}

/// [`sum_groups`] over elements `range` of a CUDA storage of `T`, `groups` = `(rows, r, d)`.
fn sum_groups_storage<T: GroupSumDType>(
    cs: &CudaStorage,
    range: std::ops::Range<usize>,
    (rows, r, d): (usize, usize, usize),
) -> Result<CudaStorage> {
    let dev = cs.device().clone();
    let src = cs.as_cuda_slice::<T>()?.slice(range);
    let sum = sum_groups(&dev, &src, rows, r, d)?;
    Ok(CudaStorage::wrap_cuda_slice(sum, dev))
}
