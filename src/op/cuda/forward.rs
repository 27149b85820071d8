//! The forward: the WY kernel beside the state scan with the output fused in where the bf16
//! chunked kernels serve the shape ([`try_forward_bf16`]), else the one-kernel forward of the
//! inputs' dtype.

use super::cache::{CacheSlot, ChunkStates, ForwardCache};
use super::device::{check_states, smem_and_sms};
use super::fused_fwd::launch;
use super::fwd_scan::{ScanDest, ScanInputs, ScanOut};
use super::inputs::{Bf16Inputs, ChunkTable, CudaCall, QkIn};
use super::pipeline::{wy_then_scan, Pipeline};
use super::plan::{forward_scan_plan, wy_smem_bytes};
use super::segmented::SegmentPlan;
use super::wy::WyFactors;
use crate::op::config::{KernelConfig, KernelPath};
use crate::op::shape::GdpShape;
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{CudaStorage, DType, Device, Layout, Result, Tensor};
use half::bf16;

/// Forward on CUDA: `qk [B, T, n+1, H, K]` (or, for the bf16 chunked kernels, FLA's `q`, `k`:
/// [`QkIn`]), `v [B, T·n, H, V]` (f32, bf16 or f16, one dtype) and the f32 gate buffer
/// `[g | beta | h0?]`; returns the packed f32 `[o (B·T·H·V) | final state
/// (N·H·K·V)]`, or with `plain` only `o` in the dtype of `qk`. `h0_override [N, H, K, V]`
/// (f32, on the same device), when given, replaces the initial states of the gate buffer
/// (context parallelism). With a `cache` slot, the bf16 chunked forward leaves its
/// intermediates there for the split backward (see
/// [`super::cache::ForwardCache`]).
pub(crate) fn forward(
    qk: QkIn,
    v: (&CudaStorage, &Layout),
    aux: (&CudaStorage, &Layout),
    call: &CudaCall,
    h0_override: Option<&CudaSlice<f32>>,
    cache: Option<&CacheSlot>,
) -> Result<CudaStorage> {
    let (sh, plain) = (call.shape, call.plain);
    let lead = qk.lead();
    let dev = lead.0.device().clone();
    let mut others = vec![(v.0, "v"), (aux.0, "gates")];
    if let QkIn::Split(_, k) = qk {
        others.push((k.0, "k"));
    }
    for (s, name) in others {
        if !s.device().same_device(&dev) {
            candle_core::bail!("gdp cuda: `{name}` is on another device than `qk`");
        }
    }
    if v.0.dtype() != lead.0.dtype() {
        candle_core::bail!(
            "gdp cuda: `v` is {:?} but `qk` is {:?}",
            v.0.dtype(),
            lead.0.dtype()
        );
    }
    if aux.0.dtype() != DType::F32 {
        candle_core::bail!(
            "gdp cuda: the gate buffer must be f32, got {:?}",
            aux.0.dtype()
        );
    }
    let dtype = lead.0.dtype();
    if dtype == DType::BF16 {
        let out = try_forward_bf16(&dev, qk, v, aux, call, h0_override, cache)?;
        if let Some(out) = out {
            return Ok(out);
        }
    }
    let QkIn::Packed(qk) = qk else {
        candle_core::bail!(
            "gdp cuda: `q` and `k` read in place need the chunked bf16 forward, which does not \
             serve this shape (dtype {dtype:?}, K = {}, V = {}, KernelConfig::forward)",
            sh.dk,
            sh.dv
        );
    };
    // The one-kernel forward of `qk`'s dtype: the same arguments for every kernel.
    macro_rules! fused {
        ($t:ty, $kernel:literal) => {
            launch::<$t>($kernel, &dev, qk, v, aux, call, h0_override)
        };
    }
    let packed = match dtype {
        DType::F32 => fused!(f32, "gdp_fwd_f32"),
        DType::BF16 => fused!(half::bf16, "gdp_fwd_bf16"),
        DType::F16 => fused!(half::f16, "gdp_fwd_f16"),
        DType::F64 => candle_core::bail!(
            "gdp cuda: f64 inputs are not supported on CUDA; use f32, bf16 or f16 (or the CPU op)"
        ),
        dt => candle_core::bail!("gdp cuda: unsupported dtype {dt:?} for q/k/v"),
    }?;
    if plain {
        // `o` alone in the inputs' dtype, copied out of the packed f32 `[o | final state]`.
        packed.to_dtype(&Layout::contiguous(sh.o_len()), dtype)
    } else {
        Ok(packed)
    }
}

/// Whether the bf16 chunked kernels serve this shape both ways under `cfg` (the two-kernel
/// forward, and the split backward), so that the op can give them FLA's `q`, `k` in place
/// instead of a packed copy. `q` says the device and dtype.
pub fn reads_qk_in_place(q: &Tensor, sh: &GdpShape, cfg: &KernelConfig) -> Result<bool> {
    let Device::Cuda(dev) = q.device() else {
        return Ok(false);
    };
    if q.dtype() != DType::BF16 || cfg.forward == KernelPath::Fused {
        return Ok(false);
    }
    let (max_smem, sms) = smem_and_sms(dev, cfg.shared_memory_limit)?;
    let forward = wy_smem_bytes(sh.dk, sh.dv) <= max_smem
        && forward_scan_plan(sh, max_smem, sms, &cfg.tiles)?.is_some();
    Ok(forward && super::plan::split_backward_fits(dev, sh, cfg)?)
}

/// Runs the two-kernel bf16 forward if `cfg.forward` allows it and it fits this shape: the
/// packed f32 `[o | final state]`, or with `plain` only `o` in bf16; `Ok(None)` means: use the
/// one-kernel forward.
pub(crate) fn try_forward_bf16(
    dev: &CudaDevice,
    qk: QkIn,
    v: (&CudaStorage, &Layout),
    aux: (&CudaStorage, &Layout),
    call: &CudaCall,
    h0_override: Option<&CudaSlice<f32>>,
    cache: Option<&CacheSlot>,
) -> Result<Option<CudaStorage>> {
    let CudaCall {
        shape: sh,
        scale,
        has_h0,
        plain,
        kernels: cfg,
    } = *call;
    if cfg.forward == KernelPath::Fused {
        return Ok(None);
    }
    let (max_smem, sms) = smem_and_sms(dev, cfg.shared_memory_limit)?;
    let wy_smem = wy_smem_bytes(sh.dk, sh.dv);
    let plan = forward_scan_plan(sh, max_smem, sms, &cfg.tiles)?.filter(|_| wy_smem <= max_smem);
    match (plan, cfg.forward) {
        (Some(plan), _) => {
            let inp = Bf16Inputs::new(qk, v, aux, sh, has_h0)?;
            check_states(h0_override, sh, "initial-state override")?;
            // Segments where the scan would leave the GPU idle; not for a context-parallel
            // rank's override, nor where the backward wants the chunk states kept.
            if h0_override.is_none() && cache.is_none_or(|slot| !slot.states) {
                if let Some(segments) = SegmentPlan::new(dev, sh, cfg)? {
                    return segments.forward(&inp, aux, call, cache).map(Some);
                }
            }
            let table = ChunkTable::new(dev, sh)?;
            // Keep the intermediates only where the split backward will read them.
            let cache = match cache {
                Some(slot) if super::plan::split_backward_fits(dev, sh, cfg)? => Some(slot),
                _ => None,
            };
            let order = sh.chunks_time_major();
            let pipeline = Pipeline::plan(dev, sh, &table, &plan, order, cfg)?;
            let wy = WyFactors::alloc(dev, &table, sh, cache.is_some())?;
            let mut states = cache
                .filter(|slot| slot.states)
                .map(|_| ChunkStates::alloc(dev, &table, sh))
                .transpose()?;
            let scan = |out: ScanOut, states: Option<&mut ChunkStates>| {
                let dest = ScanDest {
                    out,
                    states,
                    widened: None,
                };
                let src = ScanInputs {
                    inp: &inp,
                    table: &table,
                    h0_override,
                };
                wy_then_scan(pipeline.as_ref(), &src, &wy, sh, scale, &plan, dest)
            };
            let out = if plain {
                // SAFETY: the scan writes o for every query row (`cu_seqlens` covers every
                // token); with no (sequence, head) pair it is empty.
                let mut o = unsafe { dev.alloc::<bf16>(sh.o_len())? };
                scan(ScanOut::Plain(&mut o), states.as_mut())?;
                CudaStorage::wrap_cuda_slice(o, dev.clone())
            } else {
                let mut out = dev.alloc_zeros::<f32>(sh.o_len() + sh.state_len())?;
                scan(ScanOut::Packed(&mut out), states.as_mut())?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            };
            if let Some(slot) = cache {
                slot.put(ForwardCache {
                    wy,
                    states,
                    segments: None,
                });
            }
            Ok(Some(out))
        }
        (None, KernelPath::Chunked) => candle_core::bail!(
            "gdp cuda: KernelConfig::forward = Chunked does not fit K = {}, V = {}, n = {} in {max_smem} \
             bytes of shared memory",
            sh.dk,
            sh.dv,
            sh.n
        ),
        (None, _) => Ok(None),
    }
}
