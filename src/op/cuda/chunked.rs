//! Launcher of the two-kernel bf16 forward of `cuda/gdp_fwd_chunked.cuh`: the WY factors of
//! every chunk in parallel (`gdp_fwd_wy_bf16`), then the state scan with the output fused in
//! (`gdp_fwd_scan_bf16_<BV>_<KPT>`: the state in registers, the next chunk's operands copied
//! with cp.async while the current one computes). The one-kernel forward of `launch.rs`
//! recomputes the V-independent WY factors in every value tile and keeps them on the sequential
//! path; this split takes them off it. It is the bf16 default wherever its shared memory fits
//! (K up to 128 for every n, K = 256 for n >= 2 on an H200); `GDP_CUDA_FWD=fused` forces the
//! one-kernel forward, `GDP_CUDA_FWD=chunked` this one (an error where it does not fit).
//! Timings in `docs/perf.md`.

use super::launch::{allow_smem, check_states, device_attr, shape_i32, to_i32, view};
use super::module::load_kernel;
use crate::op::shape::{GdpShape, CHUNK};
use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{CudaStorage, Layout, Result};

/// Threads per block of the WY kernel (`GDPC_THREADS`).
const THREADS: u32 = 128;

/// Which bf16 forward `GDP_CUDA_FWD` asks for: `fused` (the one-kernel forward of `launch.rs`),
/// `chunked` (this one, an error where it does not fit), or unset: this one where it fits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Choice {
    Auto,
    Fused,
    Chunked,
}

/// The `GDP_CUDA_FWD` setting.
pub fn choice() -> Result<Choice> {
    match std::env::var("GDP_CUDA_FWD") {
        Err(_) => Ok(Choice::Auto),
        Ok(v) => match v.trim() {
            "" | "auto" => Ok(Choice::Auto),
            "fused" => Ok(Choice::Fused),
            "chunked" => Ok(Choice::Chunked),
            other => candle_core::bail!(
                "gdp cuda: GDP_CUDA_FWD must be `fused`, `chunked` or `auto`, got {other:?}"
            ),
        },
    }
}

/// f32 row stride of the inverse's tiles (`GDP_INV_LD`).
const INV_LD: usize = 68;

/// Shared memory of the WY kernel, bytes (the carve-up at the top of `gdp_fwd_wy_bf16`).
pub fn wy_smem_bytes(dk: usize, dv: usize) -> usize {
    let c = CHUNK;
    let (kp, vp) = (dk.next_multiple_of(16), dv.next_multiple_of(16));
    4 * (2 * c * INV_LD + 6 * c) + 2 * c * ((kp + 8) + (kp + 8).max(vp + 8))
}

/// Query rows per chunk that the scan stages: 16-row tiles of `ceil(64 / n)`.
fn query_rows(n: usize) -> usize {
    CHUNK.div_ceil(n).next_multiple_of(16)
}

/// The scan's compile-time key tile (`KPT`): K padded to 64, 128 or 256.
fn key_tile(dk: usize) -> Option<usize> {
    [64, 128, 256].into_iter().find(|&t| dk <= t)
}

/// Threads per block of the scan (`NW` warps): 4 for 16 value columns, else 8.
fn scan_threads(bv: usize) -> u32 {
    if bv == 16 {
        128
    } else {
        256
    }
}

/// Shared memory of the scan kernel for `bv` value columns and `ns` stage buffers, bytes
/// (`gdp_fwd_scan_bf16_impl`: `ns` stages of `gdpc_stage_bytes`, the bf16 state twice, Delta
/// twice, `ns` chunks' row tables).
pub fn scan_smem_bytes(kpt: usize, n: usize, bv: usize, ns: usize) -> usize {
    let c = CHUNK;
    let qr = query_rows(n);
    let stage = 2 * ((2 * c + qr) * (kpt + 8) + qr * (c + 8) + c * (bv + 8)) + 4 * 3 * c;
    ns * stage + 2 * 2 * kpt * (bv + 8) + 2 * 2 * c * (bv + 8) + 8 * ns * 2 * c
}

/// The scan's launch plan: value columns per block, stage buffers, threads, shared memory and
/// kernel name.
struct ScanPlan {
    bv: usize,
    stages: usize,
    threads: u32,
    smem: usize,
    kernel: String,
}

/// Picks the scan's value tile: `GDP_CUDA_SCAN_BV` (16, 32 or 64) when set; else the widest
/// tile that still gives about one block per multiprocessor (fewer, wider blocks stage each
/// chunk's W, K and Q fewer times), or 16. Three stage buffers (copies two chunks ahead) where
/// they fit, else two. `None` where nothing fits (K > 256, or shared memory).
fn scan_plan(sh: &GdpShape, max_smem: usize, sms: usize) -> Result<Option<ScanPlan>> {
    let Some(kpt) = key_tile(sh.dk) else {
        return Ok(None);
    };
    // The state lives in registers: at most 32 f32 per thread (kernels exist for these).
    let ok = |bv: usize| !(kpt == 256 && bv == 64) && scan_smem_bytes(kpt, sh.n, bv, 2) <= max_smem;
    let plan = |bv: usize| {
        let stages = if scan_smem_bytes(kpt, sh.n, bv, 3) <= max_smem {
            3
        } else {
            2
        };
        ScanPlan {
            bv,
            stages,
            threads: scan_threads(bv),
            smem: scan_smem_bytes(kpt, sh.n, bv, stages),
            kernel: format!("gdp_fwd_scan_bf16_{bv}_{kpt}"),
        }
    };
    if let Ok(s) = std::env::var("GDP_CUDA_SCAN_BV") {
        let bv: usize = s.trim().parse().unwrap_or(0);
        if !matches!(bv, 16 | 32 | 64) || !ok(bv) {
            candle_core::bail!(
                "gdp cuda: GDP_CUDA_SCAN_BV must be 16, 32 or 64 and fit (K = {}, n = {}, \
                 {max_smem} bytes of shared memory), got {s:?}",
                sh.dk,
                sh.n
            );
        }
        return Ok(Some(plan(bv)));
    }
    let rows = sh.num_seqs() * sh.heads;
    let fitting: Vec<usize> = [64, 32, 16].into_iter().filter(|&bv| ok(bv)).collect();
    let enough = |bv: usize| 10 * rows * sh.dv.div_ceil(bv) >= 9 * sms;
    Ok(fitting
        .iter()
        .copied()
        .find(|&bv| enough(bv))
        .or(fitting.last().copied())
        .map(plan))
}

/// Runs the two-kernel bf16 forward if `GDP_CUDA_FWD` allows it and it fits this shape;
/// `Ok(None)` means: use the one-kernel forward.
#[allow(clippy::too_many_arguments)]
pub fn try_forward_bf16(
    dev: &CudaDevice,
    qk: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    aux: (&CudaStorage, &Layout),
    sh: &GdpShape,
    scale: f32,
    has_h0: bool,
    h0_override: Option<&CudaSlice<f32>>,
) -> Result<Option<CudaStorage>> {
    let choice = choice()?;
    if choice == Choice::Fused {
        return Ok(None);
    }
    let max_smem = device_attr(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    )?;
    let sms = device_attr(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )?;
    let wy_smem = wy_smem_bytes(sh.dk, sh.dv);
    let plan = scan_plan(sh, max_smem, sms)?.filter(|_| wy_smem <= max_smem);
    match (plan, choice) {
        (Some(plan), _) => forward_bf16(
            dev,
            qk,
            v,
            aux,
            sh,
            scale,
            has_h0,
            h0_override,
            &plan,
            wy_smem,
        )
        .map(Some),
        (None, Choice::Chunked) => candle_core::bail!(
            "gdp cuda: GDP_CUDA_FWD=chunked does not fit K = {}, V = {}, n = {} in {max_smem} \
             bytes of shared memory",
            sh.dk,
            sh.dv,
            sh.n
        ),
        (None, _) => Ok(None),
    }
}

/// The bf16 forward: same contract as [`super::forward`] (packed f32 `[o | final state]`).
#[allow(clippy::too_many_arguments)]
fn forward_bf16(
    dev: &CudaDevice,
    qk: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    aux: (&CudaStorage, &Layout),
    sh: &GdpShape,
    scale: f32,
    has_h0: bool,
    h0_override: Option<&CudaSlice<f32>>,
    plan: &ScanPlan,
    wy_smem: usize,
) -> Result<CudaStorage> {
    let qk_v = view::<half::bf16>(qk.0, qk.1, sh.qk_len(), "qk")?;
    let v_v = view::<half::bf16>(v.0, v.1, sh.v_len(), "v")?;
    let aux_v = view::<f32>(aux.0, aux.1, sh.aux_len(has_h0), "gates")?;
    check_states(h0_override, sh, "initial-state override")?;
    let [b, t, h, k, vd, n] = shape_i32(sh)?;
    let nseq = to_i32(sh.num_seqs(), "N")?;

    // Table: per sequence (batch, start, len, first chunk), then per chunk (sequence, index).
    let mut table = Vec::with_capacity(4 * sh.num_seqs());
    let mut chunks = vec![];
    for (si, s) in sh.seqs.iter().enumerate() {
        let nch = (s.len * sh.n).div_ceil(CHUNK);
        table.extend([
            to_i32(s.batch, "batch")?,
            to_i32(s.start, "start")?,
            to_i32(s.len, "len")?,
            to_i32(chunks.len() / 2, "chunks")?,
        ]);
        for ci in 0..nch {
            chunks.extend([si as i32, ci as i32]);
        }
    }
    let total_chunks = chunks.len() / 2;
    table.extend(chunks);
    let table = dev.clone_htod(&table)?;

    let mut out = dev.alloc_zeros::<f32>(sh.o_len() + sh.state_len())?;
    // With only empty sequences there is no chunk: the WY launch is skipped and the scan copies
    // the initial states (the scratch buffers keep one slot so that their pointers are valid).
    let slots = total_chunks.max(1) * sh.heads;
    // SAFETY (both allocations): every element is written by the WY kernel before the scan
    // reads it (rows past a chunk's end as zeros).
    let mut wg = unsafe { dev.alloc::<half::bf16>(slots * CHUNK * sh.dk)? };
    let mut ug = unsafe { dev.alloc::<half::bf16>(slots * CHUNK * sh.dv)? };
    let mut pg = unsafe { dev.alloc::<half::bf16>(slots * CHUNK * CHUNK)? };
    let mut cg = unsafe { dev.alloc::<f32>(slots * 3 * CHUNK)? };

    if total_chunks > i32::MAX as usize || sh.heads > 65_535 {
        candle_core::bail!(
            "gdp cuda: {total_chunks} chunks x {} heads is too large",
            sh.heads
        );
    }

    if total_chunks > 0 {
        let wy = load_kernel(dev, "gdp_fwd_wy_bf16")?;
        allow_smem(&wy, wy_smem)?;
        let mut args = wy.builder();
        args.arg(&qk_v);
        args.arg(&v_v);
        args.arg(&aux_v);
        args.arg(&table);
        args.arg(&mut wg);
        args.arg(&mut ug);
        args.arg(&mut pg);
        args.arg(&mut cg);
        for x in [&b, &t, &h, &k, &vd, &n, &nseq] {
            args.arg(x);
        }
        args.arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: (total_chunks as u32, sh.heads as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: wy_smem as u32,
        };
        // SAFETY: the arguments match `gdp_fwd_wy_bf16` (buffers sized above from the same shape
        // and chunk table the kernel indexes with); the dynamic shared memory is `wy_smem_bytes`.
        unsafe { args.launch(cfg) }.w()?;
        drop(args);
    }

    let scan = load_kernel(dev, &plan.kernel)?;
    allow_smem(&scan, plan.smem)?;
    let use_override = i32::from(h0_override.is_some());
    let has_h0 = i32::from(has_h0);
    let qr = query_rows(sh.n) as i32;
    let stages = plan.stages as i32;
    let mut args = scan.builder();
    args.arg(&qk_v);
    args.arg(&aux_v);
    args.arg(&table);
    args.arg(&wg);
    args.arg(&ug);
    args.arg(&pg);
    args.arg(&cg);
    match h0_override {
        Some(h0) => args.arg(h0),
        // Never read (the flag is 0), but the kernel wants a valid pointer.
        None => args.arg(&aux_v),
    };
    args.arg(&use_override);
    args.arg(&mut out);
    for x in [&b, &t, &h, &k, &vd, &n, &has_h0, &qr, &stages] {
        args.arg(x);
    }
    let rows = sh.num_seqs() * sh.heads;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, sh.dv.div_ceil(plan.bv) as u32, 1),
        block_dim: (plan.threads, 1, 1),
        shared_mem_bytes: plan.smem as u32,
    };
    // SAFETY: the arguments match `gdp_fwd_scan_bf16_impl`; the scratch buffers were filled by the
    // WY launch on the same stream; the dynamic shared memory is `scan_smem_bytes`.
    unsafe { args.launch(cfg) }.w()?;
    drop(args);
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}
