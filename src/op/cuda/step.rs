//! Launcher of the fused decode step `gdp_step_{f32,bf16,f16}_k{32,64,128,256}`
//! (`cuda/gdp.cu`).

use super::device::{grid_dim, to_i32, view, GRID_X, GRID_YZ};
use super::module::{load_kernel, GdpFunc};
use crate::op::kernel_params::StepParams;
use crate::op::recurrent::{step_input_lens, STEP_INPUTS};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaStorage, DType, Layout, Result};
use half::{bf16, f16};

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

/// Dynamic shared memory of the step kernel, bytes (`gdp_step_smem_floats`): q and k `[n]` of
/// the block's (batch row, head) zero-padded to `PARTS` parts of `rows_per_part` rows, v `[n]` of
/// its columns, beta `[n]` padded to 4, and two buffers of the dot partials.
fn smem_bytes(k: usize, n: usize) -> usize {
    4 * ((1 + n) * PARTS * rows_per_part(k) + n * COLS + n.div_ceil(4) * 4 + 2 * PARTS * COLS)
}

/// Whether the step kernel takes `K`, `n`: `K <= 256` and its shared memory under 48 KB.
pub fn step_fits(k: usize, n: usize) -> bool {
    k <= MAX_K && smem_bytes(k, n) <= MAX_SMEM
}

/// One fused step on CUDA: `state [B, H, K, V]` (f32) and `inputs` = `q [B, H, K]`,
/// `k [B, n, H, K]`, `v [B, n, H, V]` (one dtype: f32, bf16 or f16), `g [B, H]`,
/// `beta [B, n, H]` (f32), contiguous; `dims = [B, H, K, V, n]`. Returns the f32
/// `[o | new state]` of one launch.
pub fn step(
    state: (&CudaStorage, &Layout),
    inputs: [(&CudaStorage, &Layout); 5],
    dims: [usize; 5],
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
    let dtype = inputs[0].0.dtype();
    let tag = match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => candle_core::bail!("gdp cuda step: no kernel for {other:?} inputs"),
    };
    for (i, ((s, _), name)) in inputs.iter().zip(STEP_INPUTS).enumerate() {
        if !s.device().same_device(&dev) {
            candle_core::bail!("gdp cuda step: `{name}` is on another device than the state");
        }
        let want = if i < 3 { dtype } else { DType::F32 };
        if s.dtype() != want {
            candle_core::bail!(
                "gdp cuda step: `{name}` is {:?}, expected {want:?}",
                s.dtype()
            );
        }
    }
    let st = view::<f32>(state.0, state.1, b * h * k * v, "state")?;
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
    let name = format!("gdp_step_{tag}_k{}", PARTS * rows_per_part(k));
    let func = load_kernel(&dev, &name)?;
    let cfg = LaunchConfig {
        grid_dim: (
            grid_dim(rows, "B x H", GRID_X)?,
            grid_dim(v.div_ceil(COLS), "value tiles", GRID_YZ)?,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let launch = Launch {
        func: &func,
        cfg,
        state: &st,
        inputs,
        lens: step_input_lens(dims),
        sizes: args_i32,
        scale,
    };
    match dtype {
        DType::F32 => launch.run::<f32>(&mut out)?,
        DType::BF16 => launch.run::<bf16>(&mut out)?,
        _ => launch.run::<f16>(&mut out)?,
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// One launch of a step kernel, its inputs' dtype still to be named.
struct Launch<'a> {
    func: &'a GdpFunc,
    cfg: LaunchConfig,
    state: &'a CudaView<'a, f32>,
    inputs: [(&'a CudaStorage, &'a Layout); 5],
    lens: [usize; 5],
    sizes: [i32; 5],
    scale: f32,
}

impl Launch<'_> {
    /// Launches the kernel over the inputs as `T` (the dtype of the kernel's name).
    fn run<T: CudaDType + DeviceRepr>(&self, out: &mut CudaSlice<f32>) -> Result<()> {
        let [q, k, v, g, beta] = self.inputs;
        let (q, k, v) = (
            view::<T>(q.0, q.1, self.lens[0], STEP_INPUTS[0])?,
            view::<T>(k.0, k.1, self.lens[1], STEP_INPUTS[1])?,
            view::<T>(v.0, v.1, self.lens[2], STEP_INPUTS[2])?,
        );
        let g = view::<f32>(g.0, g.1, self.lens[3], STEP_INPUTS[3])?;
        let beta = view::<f32>(beta.0, beta.1, self.lens[4], STEP_INPUTS[4])?;
        let [batch, heads, dk, dv, n] = self.sizes;
        let mut args = self.func.args();
        let params = StepParams {
            state: args.read(self.state),
            q: args.read(&q),
            k: args.read(&k),
            v: args.read(&v),
            g: args.read(&g),
            beta: args.read(&beta),
            out: args.write(out),
            batch,
            heads,
            dk,
            dv,
            n,
            scale: self.scale,
        };
        // SAFETY: `gdp_step_*` takes `GdpStepParams`, the inputs in the kernel's `T` (the
        // state's and inputs' lengths checked against the sizes passed; the output holds o and
        // the new state); the dynamic shared memory is `smem_bytes`, within the default limit.
        unsafe { args.launch(self.cfg, &params) }?;
        Ok(())
    }
}
