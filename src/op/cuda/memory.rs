//! Device-memory setting for throughput: keep freed memory in CUDA's pool.

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::cuda_backend::CudaDevice;
use candle_core::Device;
use candle_core::{DeviceLocation, Result};
use std::sync::Mutex;

/// Keeps the memory that Candle frees on `device` mapped in the GPU's default stream-ordered
/// memory pool (release threshold: unlimited), instead of handing it back to the driver at each
/// synchronisation. Candle allocates with `cuMemAllocAsync` from that pool, whose default
/// threshold is 0: after every synchronisation a large allocation may map fresh pages. The
/// op's per-call scratch is large (the bf16 backward's: about 140 KB per 64-row chunk and
/// head), and on an H200 this setting made the op 0.2-1.4 ms faster forward and 2-8 ms faster
/// forward+backward at the benchmark shapes (`docs/perf.md`, 2026-11-30). PyTorch's caching
/// allocator keeps freed memory the same way.
///
/// The CUDA op applies it to each device it runs on (once per device) unless the environment
/// sets `GDP_RETAIN_POOL=0`. Process-wide for that GPU (every context that allocates from its
/// default pool); the memory stays reserved for the process until it exits. A no-op on the
/// CPU.
pub fn retain_freed_memory(device: &Device) -> Result<()> {
    match device {
        Device::Cuda(dev) => retain(dev),
        _ => Ok(()),
    }
}

/// The op's default: [`retain_freed_memory`] on `dev`, once per device, unless
/// `GDP_RETAIN_POOL=0`.
pub(super) fn default_pool_policy(dev: &CudaDevice) -> Result<()> {
    static DONE: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    let DeviceLocation::Cuda { gpu_id } = dev.location() else {
        return Ok(());
    };
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    if done.contains(&gpu_id) {
        return Ok(());
    }
    done.push(gpu_id);
    if std::env::var("GDP_RETAIN_POOL").is_ok_and(|v| v.trim() == "0") {
        return Ok(());
    }
    retain(dev)
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
