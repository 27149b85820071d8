//! Device-memory setting for throughput: keep freed memory in CUDA's pool.

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::CudaDevice;
use candle_core::Device;
use candle_core::Result;

/// Keeps the memory that Candle frees on `device` mapped in the GPU's default stream-ordered
/// memory pool (release threshold: unlimited), instead of handing it back to the driver at each
/// synchronisation. Candle allocates with `cuMemAllocAsync` from that pool, whose default
/// threshold is 0: after every synchronisation a large allocation may map fresh pages. The
/// op's per-call scratch is large (the bf16 backward's: about 140 KB per 64-row chunk and
/// head; a decode step's output at B64 H16 K = V = 128: 64 MB), and on an H200 this setting
/// made the op 0.2-1.4 ms faster forward and 2-8 ms faster forward+backward at the benchmark
/// shapes (`docs/perf-log.md`). PyTorch's caching allocator keeps freed memory the
/// same way.
///
/// The crate never calls it on its own: it changes process-wide state for that GPU (every
/// context that allocates from its default pool), and the memory stays reserved for the
/// process until it exits. Call it once per device at start-up where throughput matters (the
/// `gdp` tool and the benchmarks do). A no-op on the CPU.
pub fn retain_freed_memory(device: &Device) -> Result<()> {
    match device {
        Device::Cuda(dev) => retain(dev),
        _ => Ok(()),
    }
}

fn retain(dev: &CudaDevice) -> Result<()> {
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
