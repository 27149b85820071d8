//! CUDA kernels of the operator (feature `cuda`): the chunked forward and backward of
//! `cuda/gdp.cu` (`cuda/gdp_bwd.cuh`, `cuda/gdp_fwd_chunked.cuh`, `cuda/gdp_bwd_chunked.cuh`), compiled to a fat binary by
//! `build.rs` and loaded lazily per device (`module.rs`), the context-parallel summaries (on the
//! chunked bf16 scans, `summary.rs`, else the per-value-tile backward kernel), and the fused
//! decode step.

mod backward;
mod chunked;
mod chunked_bwd;
mod copy;
mod cp_fix;
mod launch;
mod memory;
mod module;
mod pipeline;
mod side;
mod step;
mod summary;

pub use backward::{
    backward, backward_len, backward_summaries, bwd_smem_bytes, dht_to_host, forward_summaries,
    initial_states_to_host, BwdPlan, In,
};
pub use chunked::{reads_qk_in_place, CacheSlot, ForwardCache, QkIn};
pub(crate) use chunked_bwd::{
    split_backward_fits, try_backward_tensors, CpFinalGrads, CpOverrides,
};
pub(crate) use copy::copy_rows;
pub use launch::{forward, smem_bytes, LaunchPlan, THREADS};
pub use memory::retain_freed_memory;
pub use step::{step, step_fits};
pub(crate) use summary::{backward_summaries_served, finish_widened_forward, widened_forward};

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
    let st = candle_core::CudaStorage::wrap_cuda_slice(copy, dev.clone());
    let t = candle_core::Tensor::from_storage(
        candle_core::Storage::Cuda(st),
        candle_core::Shape::from(vec![len.max(1)]),
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
    let all = launch::view::<f32>(aux.0, aux.1, sh.aux_len(true), "gates")?;
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
