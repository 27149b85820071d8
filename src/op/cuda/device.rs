//! Launch plumbing shared by every kernel: device views of storages, the shape as kernel
//! integers, device attributes, shared-memory opt-in, device buffers as tensors and back.

use crate::op::shape::GdpShape;
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::sys::{
    CUdevice_attribute, CUfunction_attribute_enum,
};
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaSlice, CudaView};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result};

/// The contiguous view of a storage slice, checked against the expected element count.
pub(super) fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    len: usize,
    name: &str,
) -> Result<CudaView<'a, T>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("gdp cuda: `{name}` must be contiguous")))?;
    if b - a != len {
        candle_core::bail!(
            "gdp cuda: `{name}` holds {} elements, expected {len}",
            b - a
        );
    }
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

/// The kernels' i32 size arguments `[B, T, H, K, V, n]` (every index the kernels form from
/// them is 64-bit); fails where a size, or `T·n`, exceeds i32.
pub(super) fn shape_i32(sh: &GdpShape) -> Result<[i32; 6]> {
    to_i32(sh.tokens * sh.n, "T·n")?;
    Ok([
        to_i32(sh.batch, "B")?,
        to_i32(sh.tokens, "T")?,
        to_i32(sh.heads, "H")?,
        to_i32(sh.dk, "K")?,
        to_i32(sh.dv, "V")?,
        to_i32(sh.n, "n")?,
    ])
}

/// Checks that a state buffer passed to a kernel (`name`) holds one `[K, V]` state per
/// (sequence, head).
pub(super) fn check_states(x: Option<&CudaSlice<f32>>, sh: &GdpShape, name: &str) -> Result<()> {
    match x {
        Some(x) if x.len() < sh.state_len() => candle_core::bail!(
            "gdp cuda: the {name} holds {} elements, expected {}",
            x.len(),
            sh.state_len()
        ),
        _ => Ok(()),
    }
}

/// Lets `func` use `smem` bytes of dynamic shared memory (over the default 48 KiB).
pub(super) fn allow_smem(func: &CudaFunction, smem: usize) -> Result<()> {
    func.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .w()?;
    Ok(())
}

pub(super) fn to_i32(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x)
        .map_err(|_| candle_core::Error::Msg(format!("gdp cuda: {what} = {x} exceeds i32")))
}

/// CUDA's largest grid dimension x (`2^31 - 1`).
pub(super) const GRID_X: usize = i32::MAX as usize;
/// CUDA's largest grid dimensions y and z.
pub(super) const GRID_YZ: usize = 65_535;

/// A grid dimension as the `u32` a launch takes, checked against `u32` and CUDA's `max`
/// ([`GRID_X`] or [`GRID_YZ`]); the error names the grid dimension (`what`).
pub(super) fn grid_dim(x: usize, what: &str, max: usize) -> Result<u32> {
    u32::try_from(x)
        .ok()
        .filter(|&g| g as usize <= max)
        .ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "gdp cuda: grid dimension {what} = {x} exceeds CUDA's limit {max}"
            ))
        })
}

pub(super) fn device_attr(dev: &CudaDevice, attr: CUdevice_attribute) -> Result<usize> {
    let v = dev.cuda_stream().context().attribute(attr).w()?;
    Ok(v.max(0) as usize)
}

/// The shared memory one block may use (the device's opt-in limit, capped by `limit`, see
/// [`KernelConfig::shared_memory_limit`](crate::op::KernelConfig::shared_memory_limit)) and the
/// device's multiprocessor count.
pub(super) fn smem_and_sms(dev: &CudaDevice, limit: Option<usize>) -> Result<(usize, usize)> {
    let optin = device_attr(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    )?;
    let sms = device_attr(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )?;
    Ok((limit.map_or(optin, |l| l.min(optin)), sms))
}

/// A storage and its layout.
pub type In<'a> = (&'a CudaStorage, &'a Layout);

/// Checks that the inputs share `qk`'s device and dtype (gates: f32); returns the device.
pub(super) fn check_inputs(qk: In, v: In, aux: In, grad: Option<In>) -> Result<CudaDevice> {
    let dev = qk.0.device().clone();
    for (s, name) in [(v.0, "v"), (aux.0, "gates")]
        .into_iter()
        .chain(grad.map(|g| (g.0, "gradient")))
    {
        if !s.device().same_device(&dev) {
            candle_core::bail!("gdp cuda: `{name}` is on another device than `qk`");
        }
    }
    if v.0.dtype() != qk.0.dtype() {
        candle_core::bail!(
            "gdp cuda: `v` is {:?} but `qk` is {:?}",
            v.0.dtype(),
            qk.0.dtype()
        );
    }
    if aux.0.dtype() != DType::F32 {
        candle_core::bail!(
            "gdp cuda: the gate buffer must be f32, got {:?}",
            aux.0.dtype()
        );
    }
    if let Some(g) = grad {
        if g.0.dtype() != DType::F32 {
            candle_core::bail!("gdp cuda: the gradient must be f32, got {:?}", g.0.dtype());
        }
    }
    Ok(dev)
}

/// A device buffer's first elements as an f32 tensor of `dims` (a device copy).
pub(crate) fn tensor_of(
    dev: &candle_core::CudaDevice,
    s: &candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
    dims: &[usize],
) -> candle_core::Result<candle_core::Tensor> {
    let len: usize = dims.iter().product();
    if s.len() < len {
        candle_core::bail!(
            "gdp cuda: a buffer of {} elements viewed as {dims:?}",
            s.len()
        );
    }
    // SAFETY: the copy below writes all `len` elements that the tensor covers.
    let mut copy = unsafe { dev.alloc::<f32>(len.max(1))? };
    dev.cuda_stream()
        .memcpy_dtod(&s.slice(..len), &mut copy.slice_mut(..len))
        .map_err(candle_core::Error::wrap)?;
    tensor_from(dev, copy, dims)
}

/// A device buffer's first elements as an f32 tensor of `dims`, the buffer itself (no copy).
pub(crate) fn tensor_from(
    dev: &candle_core::CudaDevice,
    s: candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
    dims: &[usize],
) -> candle_core::Result<candle_core::Tensor> {
    let (len, have): (usize, usize) = (dims.iter().product(), s.len());
    if have < len {
        candle_core::bail!("gdp cuda: a buffer of {have} elements viewed as {dims:?}");
    }
    let st = candle_core::CudaStorage::wrap_cuda_slice(s, dev.clone());
    let t = candle_core::Tensor::from_storage(
        candle_core::Storage::Cuda(st),
        candle_core::Shape::from(vec![have]),
        candle_core::op::BackpropOp::none(),
        false,
    );
    t.narrow(0, 0, len)?.reshape(dims)
}

/// Copies the f32 tensor `t` (on this CUDA device) into `dst` from element `at` on.
pub(crate) fn copy_tensor_into(
    t: &candle_core::Tensor,
    dst: &mut candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
    at: usize,
) -> candle_core::Result<()> {
    use candle_core::backend::BackendStorage;
    let t = t.contiguous()?;
    let n = t.elem_count();
    if at + n > dst.len() {
        candle_core::bail!(
            "gdp cuda: copying {n} elements to {at} of a {}-element buffer",
            dst.len()
        );
    }
    let (st, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(c) = &*st else {
        candle_core::bail!("gdp cuda: expected a CUDA tensor");
    };
    let src = c.as_cuda_slice::<f32>()?;
    let off = layout.start_offset();
    c.device()
        .cuda_stream()
        .memcpy_dtod(&src.slice(off..off + n), &mut dst.slice_mut(at..at + n))
        .map_err(candle_core::Error::wrap)?;
    Ok(())
}

/// A contiguous device copy of the f32 CUDA tensor `t`.
pub(crate) fn slice_of(
    t: &candle_core::Tensor,
) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>> {
    let candle_core::Device::Cuda(dev) = t.device() else {
        candle_core::bail!("gdp cuda: expected a CUDA tensor");
    };
    let n = t.elem_count();
    // SAFETY: `copy_tensor_into` writes all `n` elements.
    let mut out = unsafe { dev.alloc::<f32>(n.max(1))? };
    copy_tensor_into(t, &mut out, 0)?;
    Ok(out)
}

/// The initial states `[N, H, K, V]` of the gate buffer `[g | beta | h0]`, as a device copy.
pub(crate) fn initial_states_device(
    aux: (&candle_core::CudaStorage, &candle_core::Layout),
    sh: &crate::op::shape::GdpShape,
) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>> {
    use candle_core::backend::BackendStorage;
    let all = view::<f32>(aux.0, aux.1, sh.aux_len(true), "gates")?;
    let off = sh.token_heads() * (1 + sh.n);
    let dev = aux.0.device();
    // SAFETY: the copy below writes every element.
    let mut out = unsafe { dev.alloc::<f32>(sh.state_len().max(1))? };
    dev.cuda_stream()
        .memcpy_dtod(
            &all.slice(off..off + sh.state_len()),
            &mut out.slice_mut(..sh.state_len()),
        )
        .map_err(candle_core::Error::wrap)?;
    Ok(out)
}
