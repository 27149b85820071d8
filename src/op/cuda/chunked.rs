//! Launcher of the two-kernel bf16 forward of `cuda/gdp_fwd_chunked.cuh`: the WY factors of
//! every chunk in parallel (`gdp_fwd_wy_bf16`), then the state scan with the output fused in
//! (`gdp_fwd_scan_bf16`). The one-kernel forward of `launch.rs` recomputes the V-independent WY
//! factors in every value tile and keeps them on the sequential path; this split takes them off
//! it.
//!
//! Opt-in (`GDP_CUDA_FWD=chunked`) until it is measured faster: its first version (per-element
//! 64-bit index arithmetic in the staging loops) took 16.3 ms against the one-kernel forward's
//! 8.8 ms at B4 T4096 H16 K=V=128 n2 bf16 on an H200; this version stages whole rows from
//! per-chunk offset tables with 16-byte loads, passed the GPU tests (2026-11-29) and was not yet
//! timed (`docs/perf.md`).

use super::launch::{allow_smem, check_states, device_attr, shape_i32, to_i32, view};
use super::{GDP_PTX, MODULE};
use crate::op::shape::{GdpShape, CHUNK};
use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{CudaStorage, Layout, Result};

/// Threads per block of both kernels (`GDPC_THREADS`).
const THREADS: u32 = 128;

/// Whether the bf16 forward takes this path (`GDP_CUDA_FWD=chunked`).
pub fn enabled() -> bool {
    std::env::var("GDP_CUDA_FWD").is_ok_and(|v| v.trim() == "chunked")
}

/// Shared memory of the WY kernel, bytes (the carve-up at the top of `gdp_fwd_wy_bf16`).
pub fn wy_smem_bytes(dk: usize, dv: usize) -> usize {
    let c = CHUNK;
    let (kp, kn, vn) = (
        dk.next_multiple_of(16),
        dk.next_multiple_of(32),
        dv.next_multiple_of(32),
    );
    let (lk, lc) = (kp + 8, c + 8);
    4 * (2 * c * c + 4 * c) + 8 * 2 * c + 2 * (2 * c * lk + (kn + vn) * lc + c * lc)
}

/// Shared memory of the scan kernel for `bv` value columns, bytes (`gdp_fwd_scan_bf16`).
pub fn scan_smem_bytes(dk: usize, bv: usize) -> usize {
    let c = CHUNK;
    let kp = dk.next_multiple_of(16);
    let (lk, lc) = (kp + 8, c + 8);
    4 * ((kp + c) * (bv + 4) + 3 * c)
        + 8 * 2 * c
        + 2 * (bv * lk + 2 * c * lk + c * lc + kp * lc + bv * lc)
}

/// Value tile of the scan: `GDP_CUDA_SCAN_BV` (32 or 64) when set, else 32 (two blocks per SM
/// at K = 128, twice the blocks of 64 for small batch x heads), or 64 where 32 does not fit.
fn scan_bv(dk: usize, max_smem: usize) -> Result<usize> {
    let fits = |bv: usize| scan_smem_bytes(dk, bv) <= max_smem;
    if let Ok(s) = std::env::var("GDP_CUDA_SCAN_BV") {
        let bv: usize = s.trim().parse().unwrap_or(0);
        if !(bv == 32 || bv == 64) || !fits(bv) {
            candle_core::bail!(
                "gdp cuda: GDP_CUDA_SCAN_BV must be 32 or 64 and fit in {max_smem} bytes of \
                 shared memory, got {s:?}"
            );
        }
        return Ok(bv);
    }
    if fits(32) {
        Ok(32)
    } else {
        candle_core::bail!(
            "gdp cuda: K = {dk} needs {} bytes of shared memory in the scan, the device allows \
             {max_smem}",
            scan_smem_bytes(dk, 32)
        )
    }
}

/// The bf16 forward: same contract as [`super::forward`] (packed f32 `[o | final state]`).
#[allow(clippy::too_many_arguments)]
pub fn forward_bf16(
    dev: &CudaDevice,
    qk: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    aux: (&CudaStorage, &Layout),
    sh: &GdpShape,
    scale: f32,
    has_h0: bool,
    h0_override: Option<&CudaSlice<f32>>,
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

    let max_smem = device_attr(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    )?;
    let wy_smem = wy_smem_bytes(sh.dk, sh.dv);
    if wy_smem > max_smem {
        candle_core::bail!(
            "gdp cuda: K = {}, V = {} need {wy_smem} bytes of shared memory, the device allows \
             {max_smem}",
            sh.dk,
            sh.dv
        );
    }
    let bv = scan_bv(sh.dk, max_smem)?;
    let scan_smem = scan_smem_bytes(sh.dk, bv);
    if total_chunks > i32::MAX as usize || sh.heads > 65_535 {
        candle_core::bail!(
            "gdp cuda: {total_chunks} chunks x {} heads is too large",
            sh.heads
        );
    }

    if total_chunks > 0 {
        let wy = dev.get_or_load_custom_func("gdp_fwd_wy_bf16", MODULE, GDP_PTX)?;
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

    let scan = dev.get_or_load_custom_func("gdp_fwd_scan_bf16", MODULE, GDP_PTX)?;
    allow_smem(&scan, scan_smem)?;
    let use_override = i32::from(h0_override.is_some());
    let has_h0 = i32::from(has_h0);
    let bv_i = bv as i32;
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
    for x in [&b, &t, &h, &k, &vd, &n, &has_h0, &bv_i] {
        args.arg(x);
    }
    let rows = sh.num_seqs() * sh.heads;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, sh.dv.div_ceil(bv) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: scan_smem as u32,
    };
    // SAFETY: the arguments match `gdp_fwd_scan_bf16`; the scratch buffers were filled by the
    // WY launch on the same stream; the dynamic shared memory is `scan_smem_bytes`.
    unsafe { args.launch(cfg) }.w()?;
    drop(args);
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}
