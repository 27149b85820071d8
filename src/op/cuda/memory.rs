//! Device-memory setting for throughput: keep freed memory in CUDA's pool.

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::{Device, Result};

/// Keeps the memory that Candle frees on `device` mapped in the GPU's default stream-ordered
/// memory pool (release threshold: unlimited), instead of handing it back to the driver at each
/// synchronisation. Candle allocates with `cuMemAllocAsync` from that pool, whose default
/// threshold is 0: after every synchronisation a large allocation may map fresh pages. The
/// bf16 forward's scratch (W, U and P of every chunk: about 40 MB per 1024 tokens at H16
/// K=V=128, n=2) is allocated per call, and on an H200 the op took 0.6-1.9 ms longer than its
/// kernels at the benchmark shapes, growing with that scratch (`docs/perf.md`); whether this
/// setting removes that gap is not yet measured. PyTorch's caching allocator keeps freed
/// memory the same way.
///
/// Process-wide for that GPU (every context that allocates from its default pool); the memory
/// stays reserved for the process until it exits. A no-op on the CPU.
pub fn retain_freed_memory(device: &Device) -> Result<()> {
    let Device::Cuda(dev) = device else {
        return Ok(());
    };
    let cu_device = dev.cuda_stream().context().cu_device();
    let mut pool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: plain driver calls on a valid device handle; the attribute value is a u64 that
    // lives across the call.
    unsafe {
        check(sys::cuDeviceGetDefaultMemPool(&mut pool, cu_device))?;
        check(sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        ))
    }
}

fn check(r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        candle_core::bail!("gdp cuda: setting the memory pool's release threshold failed: {r:?}")
    }
}
