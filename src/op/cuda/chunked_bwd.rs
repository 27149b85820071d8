//! Launcher of the bf16 backward in FLA's split (`cuda/gdp_bwd_chunked.cuh`): the WY factors
//! and the forward scan rerun to get every chunk's start state h and Delta, one reverse scan of
//! the state gradient (`gdp_bwd_dh_bf16_<BV>_<KPT>`: dS in registers, cp.async staging, like the
//! forward scan), then every gradient of every (chunk, head) in parallel
//! (`gdp_bwd_grads_bf16_<KP>_<VP>`). The per-value-tile kernel of `backward.rs` redoes the WY
//! factors and all the chunk's gradient products on its sequential path; this takes them off
//! it. The bf16 default where it fits (K, V <= 128); `GDP_CUDA_BWD=fused` forces the other,
//! `GDP_CUDA_BWD=chunked` this one (an error where it does not fit).

use super::chunked::{
    choice, key_tile, query_rows, run_scan, scan_plan, smem_and_sms, wy_smem_bytes, Bf16Inputs,
    Choice, ChunkTable, ScanDest, ScanKind, WyFactors, FWD_SCAN,
};
use super::launch::{allow_smem, check_states, shape_i32, to_i32, view};
use super::module::load_kernel;
use crate::op::shape::{GdpShape, CHUNK};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{CudaStorage, Layout, Result};
use half::bf16;

/// Threads per block of the gradient kernel (`GDPG_THREADS`) and its column groups
/// (`GDPG_GROUPS`).
const GRAD_THREADS: u32 = 512;
const GRAD_GROUPS: usize = 4;

/// Shared memory of the state-gradient scan, bytes (`gdp_bwd_dh_bf16_impl`: `ns` stages of
/// `gdpd_stage_bytes`, the bf16 state gradient twice, -dDelta, coef_q ⊙ dO, `ns` chunks' row
/// tables).
pub fn dh_smem_bytes(kpt: usize, n: usize, bv: usize, ns: usize) -> usize {
    let c = CHUNK;
    let qr = query_rows(n);
    let lb = bv + 8;
    let stage = 2 * ((2 * c + qr) * (kpt + 8) + qr * (c + 8) + qr * lb) + 4 * 3 * c;
    ns * stage + 2 * (2 * kpt * lb + c * lb + qr * lb) + 8 * ns * 3 * c
}

/// The state-gradient scan (`gdp_bwd_dh_bf16_<BV>_<KPT>`, K up to 128).
const DH_SCAN: ScanKind = ScanKind {
    prefix: "gdp_bwd_dh_bf16",
    smem: dh_smem_bytes,
    max_kpt: 128,
    env: "GDP_CUDA_DH_BV",
};

/// Shared memory of the gradient kernel, bytes (`gdpg_smem_bytes` in the kernel file).
pub fn grads_smem_bytes(kp: usize, vp: usize, qr: usize) -> usize {
    let c = CHUNK;
    2 * ((c + qr) * (kp + 8) + (kp + 4 * c + qr) * (vp + 8) + (c + qr) * (c + 8))
        + 4 * (c * 68 + 5 * c + 6 * GRAD_GROUPS * c + c + 8)
}

/// K or V padded to the gradient kernel's tiles (64 or 128).
fn grad_tile(d: usize) -> Option<usize> {
    [64, 128].into_iter().find(|&t| d <= t)
}

/// Runs the split bf16 backward if `GDP_CUDA_BWD` allows it and it fits this shape (same
/// contract as [`super::backward`], without `zero_dh0`); `Ok(None)` means: use the
/// per-value-tile backward.
#[allow(clippy::too_many_arguments)]
pub fn try_backward_bf16(
    dev: &CudaDevice,
    qk: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    aux: (&CudaStorage, &Layout),
    grad: (&CudaStorage, &Layout),
    sh: &GdpShape,
    scale: f32,
    has_h0: bool,
    h0_override: Option<&CudaSlice<f32>>,
    dht_override: Option<&CudaSlice<f32>>,
    total: usize,
) -> Result<Option<CudaSlice<f32>>> {
    let choice = choice("GDP_CUDA_BWD")?;
    if choice == Choice::Fused {
        return Ok(None);
    }
    let (max_smem, sms) = smem_and_sms(dev)?;
    let qr = query_rows(sh.n);
    let tiles = grad_tile(sh.dk)
        .zip(grad_tile(sh.dv))
        .filter(|&(kp, vp)| grads_smem_bytes(kp, vp, qr) <= max_smem);
    let fits = wy_smem_bytes(sh.dk, sh.dv) <= max_smem && key_tile(sh.dk).is_some();
    let fwd = scan_plan(&FWD_SCAN, sh, max_smem, sms)?;
    let dh = scan_plan(&DH_SCAN, sh, max_smem, sms)?;
    let (Some((kp, vp)), Some(fwd), Some(dh), true) = (tiles, fwd, dh, fits) else {
        if choice == Choice::Chunked {
            candle_core::bail!(
                "gdp cuda: GDP_CUDA_BWD=chunked does not fit K = {}, V = {}, n = {} (needs \
                 K, V <= 128 and {max_smem} bytes of shared memory)",
                sh.dk,
                sh.dv,
                sh.n
            );
        }
        return Ok(None);
    };
    let inp = Bf16Inputs::new(qk, v, aux, sh, has_h0)?;
    check_states(h0_override, sh, "initial-state override")?;
    check_states(dht_override, sh, "dht override")?;
    let (o_len, s_len) = (sh.o_len(), sh.state_len());
    let grad_v = view::<f32>(grad.0, grad.1, o_len + s_len, "grad")?;
    let table = ChunkTable::new(dev, sh)?;
    let slots = table.slots(sh);
    let kv = sh.dk * sh.dv;
    // SAFETY: the kernels below write every element of `out`: `cu_seqlens` covers every token
    // (`validate_cu_seqlens`), and the gradient kernel writes dq, dk, dv, dβ and dg of every
    // row of every chunk (each once), the state-gradient scan dh0 of every (sequence, head)
    // when the layout has it. With no (sequence, head) pair `total` is zero.
    let mut out = unsafe { dev.alloc::<f32>(total)? };
    if sh.num_seqs() * sh.heads == 0 {
        return Ok(Some(out));
    }

    // 1-2. WY factors with Ainv; every chunk's start state and Delta.
    let wy = WyFactors::compute(dev, &inp, &table, sh, scale, true)?;
    // SAFETY (hs, dn, dhs, ddn, dob): the scans write every element of every slot of the
    // table's chunks, and the conversion every element of dob, before the gradient kernel reads
    // them; slots of no chunk (none, or the one placeholder slot) are never read.
    let mut hs = unsafe { dev.alloc::<bf16>(slots * kv)? };
    let mut dn = unsafe { dev.alloc::<bf16>(slots * CHUNK * sh.dv)? };
    let dest = ScanDest::States {
        hs: &mut hs,
        dn: &mut dn,
    };
    run_scan(dev, &inp, &table, &wy, sh, has_h0, h0_override, &fwd, dest)?;

    // dO in bf16 (the tensor cores' operand type).
    let mut dob = unsafe { dev.alloc::<bf16>(o_len.max(1))? };
    if o_len > 0 {
        let cvt = load_kernel(dev, "gdp_f32_to_bf16")?;
        let len = o_len as i64;
        let mut args = cvt.builder();
        let src = grad_v.slice(0..o_len);
        args.arg(&src);
        args.arg(&mut dob);
        args.arg(&len);
        let blocks = o_len.div_ceil(256).min(65_535) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `gdp_f32_to_bf16(src, dst, len)` with both buffers holding `len` elements.
        unsafe { args.launch(cfg) }.w()?;
    }

    // 3. The state-gradient scan.
    let [b, t, h, k, vd, n] = shape_i32(sh)?;
    let mut dhs = unsafe { dev.alloc::<bf16>(slots * kv)? };
    let mut ddn = unsafe { dev.alloc::<bf16>(slots * CHUNK * sh.dv)? };
    {
        let func = load_kernel(dev, &dh.kernel)?;
        allow_smem(&func, dh.smem)?;
        let dht_grad = grad_v.slice(o_len..o_len + s_len);
        let has_dht = 1i32;
        let write_dh0 = i32::from(has_h0);
        let dh0_at = total - if has_h0 { s_len } else { 0 };
        let mut dh0 = out.slice_mut(dh0_at..);
        let (qr_i, ns) = (qr as i32, dh.stages as i32);
        let mut args = func.builder();
        args.arg(&inp.qk);
        args.arg(&table.table);
        args.arg(&wy.w);
        args.arg(&wy.p);
        args.arg(&wy.coef);
        args.arg(&dob);
        match dht_override {
            Some(d) => args.arg(d),
            None => args.arg(&dht_grad),
        };
        args.arg(&has_dht);
        args.arg(&mut dhs);
        args.arg(&mut ddn);
        args.arg(&mut dh0);
        args.arg(&write_dh0);
        for x in [&b, &t, &h, &k, &vd, &n, &qr_i, &ns] {
            args.arg(x);
        }
        let cfg = LaunchConfig {
            grid_dim: (
                (sh.num_seqs() * sh.heads) as u32,
                sh.dv.div_ceil(dh.bv) as u32,
                1,
            ),
            block_dim: (dh.threads, 1, 1),
            shared_mem_bytes: dh.smem as u32,
        };
        // SAFETY: the arguments match `gdp_bwd_dh_bf16_impl`: the WY factors and the bf16 dO
        // come from launches on this stream; dht and dh0 hold one state per (sequence, head)
        // (dh0 is written only with `write_dh0`, then at the end of `out`); the dynamic shared
        // memory is `dh_smem_bytes`.
        unsafe { args.launch(cfg) }.w()?;
    }

    // 4. Every gradient, per (chunk, head).
    if table.chunks > 0 {
        let name = format!("gdp_bwd_grads_bf16_{kp}_{vp}");
        let smem = grads_smem_bytes(kp, vp, qr);
        let func = load_kernel(dev, &name)?;
        allow_smem(&func, smem)?;
        let ainv = wy
            .ainv
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("gdp cuda: Ainv was not kept".into()))?;
        let nseq = to_i32(sh.num_seqs(), "N")?;
        let qr_i = qr as i32;
        let mut args = func.builder();
        args.arg(&inp.qk);
        args.arg(&inp.v);
        args.arg(&inp.aux);
        args.arg(&table.table);
        args.arg(ainv);
        args.arg(&hs);
        args.arg(&dhs);
        args.arg(&dn);
        args.arg(&ddn);
        args.arg(&dob);
        args.arg(&mut out);
        for x in [&b, &t, &h, &k, &vd, &n, &nseq] {
            args.arg(x);
        }
        args.arg(&scale);
        args.arg(&qr_i);
        let cfg = LaunchConfig {
            grid_dim: (table.chunks as u32, sh.heads as u32, 1),
            block_dim: (GRAD_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: the arguments match `gdp_bwd_grads_bf16_impl`: every per-slot buffer was
        // sized from the same table and filled above on this stream; `out` holds the packed
        // gradient layout of `backward_len`; the dynamic shared memory is `grads_smem_bytes`.
        unsafe { args.launch(cfg) }.w()?;
    }
    Ok(Some(out))
}
