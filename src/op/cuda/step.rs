//! Launcher of the fused decode step `gdp_step_f32_k{32,64,128,256}` (`cuda/gdp.cu`).

use super::launch::{to_i32, view};
use super::module::load_kernel;
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result};

/// Value columns per block (`GDP_STEP_COLS`): one per thread of each row part.
const COLS: usize = 128;
/// Parts the K rows are split in, one per group of `COLS` threads (`GDP_STEP_PARTS`).
const PARTS: usize = 4;
/// Threads per block (`GDP_STEP_THREADS`).
const THREADS: u32 = (COLS * PARTS) as u32;
/// Largest K: rows per part (64 in `gdp_step_f32_k256`) times the parts.
const MAX_K: usize = 256;
/// Dynamic shared memory a launch may take without opting in.
const MAX_SMEM: usize = 48 * 1024;

/// Rows per part (`gdp_step_rows_per_part`): `K / PARTS` rounded up to a power of two, at
/// least 8; it names the kernel, `gdp_step_f32_k{PARTS · rows}`.
fn rows_per_part(k: usize) -> usize {
    k.div_ceil(PARTS).next_power_of_two().max(8)
}

/// Dynamic shared memory of the step kernel, bytes (`gdp_step_smem_floats`): q and k [n] of
/// the block's (batch row, head) zero-padded to `PARTS` parts of `rows_per_part` rows, v [n] of
/// its columns, beta [n] padded to 4, and two buffers of the dot partials.
fn smem_bytes(k: usize, n: usize) -> usize {
    4 * ((1 + n) * PARTS * rows_per_part(k) + n * COLS + n.div_ceil(4) * 4 + 2 * PARTS * COLS)
}

/// Whether the step kernel takes `K`, `n`: `K <= 256` and its shared memory under 48 KB.
pub fn step_fits(k: usize, n: usize) -> bool {
    k <= MAX_K && smem_bytes(k, n) <= MAX_SMEM
}

/// One fused step on CUDA: `state [B, H, K, V]` (f32) and the f32 buffer `[q | k | v | g | beta]`
/// of `small_len` elements; `dims = [B, H, K, V, n]`. Returns the f32 `[o | new state]`.
pub fn step(
    state: (&CudaStorage, &Layout),
    small: (&CudaStorage, &Layout),
    dims: [usize; 5],
    small_len: usize,
    scale: f32,
) -> Result<CudaStorage> {
    let [b, h, k, v, n] = dims;
    if k > MAX_K {
        candle_core::bail!(
            "gdp cuda step: K = {k} exceeds {MAX_K}; use the CPU or the unfused step"
        );
    }
    let smem = smem_bytes(k, n);
    if smem > MAX_SMEM {
        candle_core::bail!(
            "gdp cuda step: K = {k}, n = {n} need {smem} bytes of shared memory (at most \
             {MAX_SMEM}); use the unfused step"
        );
    }
    let dev = state.0.device().clone();
    if !small.0.device().same_device(&dev) {
        candle_core::bail!("gdp cuda step: the inputs are on another device than the state");
    }
    // A decode loop may never call the chunked op, which sets this too: without it every step's
    // 64 MB output (B64 H16 K=V=128) is mapped afresh after each synchronisation.
    super::memory::default_pool_policy(&dev)?;
    let st = view::<f32>(state.0, state.1, b * h * k * v, "state")?;
    let sm = view::<f32>(small.0, small.1, small_len, "q/k/v/g/beta")?;
    // SAFETY: the kernel writes every element (o for every (row, column), the whole new state).
    let mut out = unsafe { dev.alloc::<f32>(b * h * v + b * h * k * v)? };
    let rows = b * h;
    if rows == 0 || v == 0 {
        return Ok(CudaStorage::wrap_cuda_slice(out, dev));
    }
    if rows > i32::MAX as usize {
        candle_core::bail!("gdp cuda step: B·H = {rows} is too large");
    }
    let args_i32 = [
        to_i32(b, "B")?,
        to_i32(h, "H")?,
        to_i32(k, "K")?,
        to_i32(v, "V")?,
        to_i32(n, "n")?,
    ];
    let name = match rows_per_part(k) {
        8 => "gdp_step_f32_k32",
        16 => "gdp_step_f32_k64",
        32 => "gdp_step_f32_k128",
        _ => "gdp_step_f32_k256",
    };
    let func = load_kernel(&dev, name)?;
    let mut args = func.builder();
    args.arg(&st);
    args.arg(&sm);
    args.arg(&mut out);
    for x in &args_i32 {
        args.arg(x);
    }
    args.arg(&scale);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, v.div_ceil(COLS) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: the arguments match `gdp_step_impl` (state and buffer lengths checked above against
    // the sizes passed; the output holds o and the new state); the dynamic shared memory is
    // `smem_bytes`, within the default limit.
    unsafe { args.launch(cfg) }.w()?;
    drop(args);
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
