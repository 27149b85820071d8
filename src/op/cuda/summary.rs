//! Context parallelism's summaries alone ([`forward_summaries`], [`backward_summaries`]: final
//! states `[ΔS | M]` and initial-state gradients `[γ | Mᵀ]` of the boundary fragments), for a
//! rank whose backward takes the packed f32 path: on the bf16 chunked scans where they serve
//! (widened as in `widened.rs`), else the per-value-tile kernel's summary modes (`fused_bwd.rs`),
//! which redo the WY factors in every value tile; also under `KernelConfig::summaries = Fused`
//! (`Chunked` makes a shape these kernels do not serve an error).

use super::device::{check_inputs, view, In};
use super::dh_scan::{run_dh_scan, DhDest, DhInputs};
use super::fused_bwd::{summaries, Summary};
use super::fwd_scan::{ScanDest, ScanOut};
use super::inputs::{Bf16Inputs, ChunkTable, Cotangent, CudaCall, QkIn};
use super::module::On;
use super::plan::{DH_SCAN, STATES_SCAN};
use super::widened::{wanted, Widened};
use super::wy::WyFactors;
use crate::op::config::KernelPath;
use crate::op::shape::GdpShape;
use candle_core::backend::BackendStorage;
use candle_core::Result;
use half::bf16;

/// `Ok(None)` (the per-value-tile kernel), or under `KernelPath::Chunked` an error.
pub(super) fn not_served(path: KernelPath, sh: &GdpShape) -> Result<Option<Vec<f32>>> {
    if path == KernelPath::Chunked {
        candle_core::bail!(
            "gdp cuda: KernelConfig::summaries = Chunked does not fit K = {}, V = {}, n = {} (needs K <= \
             128 and the widened scans' shared memory)",
            sh.dk,
            sh.dv,
            sh.n
        );
    }
    Ok(None)
}

/// `[x | I_K]` per (fragment, head): the `[K, V]` blocks of `x` (one per sequence and head,
/// `[N, H, K, V]`) for the sequences `frags`, each widened by an identity.
pub(super) fn widened_states(x: &[f32], sh: &GdpShape, frags: &[usize]) -> Vec<f32> {
    let (h, k, v) = (sh.heads, sh.dk, sh.dv);
    let w = v + k;
    let mut out = vec![0.0f32; frags.len() * h * k * w];
    for (f, &s) in frags.iter().enumerate() {
        for hd in 0..h {
            let dst = (f * h + hd) * k * w;
            let src = (s * h + hd) * k * v;
            for r in 0..k {
                let row = &mut out[dst + r * w..dst + (r + 1) * w];
                row[..v].copy_from_slice(&x[src + r * v..src + (r + 1) * v]);
                row[v + r] = 1.0;
            }
        }
    }
    out
}

/// Forward summaries `[ΔS | M]` (`[K, V + K]` per head, in `(fragment, head)` order) of the
/// sequences `frags` from the initial states `h0 [N, H, K, V]` (host), on the bf16 chunked kernels;
/// `Ok(None)` where they do not serve (not bf16, `KernelConfig::summaries` = `Fused`, or the
/// shape).
fn forward_summaries_bf16(
    qk: In,
    v: In,
    aux: In,
    call: &CudaCall,
    frags: &[usize],
    h0: &[f32],
) -> Result<Option<Vec<f32>>> {
    let (sh, cfg) = (call.shape, call.kernels);
    let dev = qk.0.device().clone();
    let Some(path) = wanted(qk, cfg) else {
        return Ok(None);
    };
    let Some(widened) = Widened::plan(&dev, sh, frags, &STATES_SCAN, cfg)? else {
        return not_served(path, sh);
    };
    let inp = Bf16Inputs::new(QkIn::Packed(qk), v, aux, sh, call.has_h0)?;
    let h0w = dev.clone_htod(&widened_states(h0, sh, frags))?;
    let wide = &widened.wide;
    let mut fin = dev.alloc_zeros::<f32>(wide.state_len().max(1))?;
    let dest = ScanDest {
        out: ScanOut::Final(&mut fin),
        states: None,
        widened: None,
    };
    widened.forward_scan(&inp, call.scale, &h0w, dest, false, cfg)?;
    let mut all = dev.clone_dtoh(&fin)?;
    all.truncate(wide.state_len());
    Ok(Some(all))
}

/// Backward summaries `[γ | Mᵀ]` (`[K, V + K]` per head, in `(fragment, head)` order) of the
/// sequences `frags` with the output gradients `do [B, T, H, V]` of `cot` (the first part of
/// the packed f32 `[do | dht]`, or the bf16 `do` alone) and the end-state gradients
/// `dht [N, H, K, V]` (host), on the bf16 chunked kernels; `Ok(None)` where they do not serve
/// (not bf16, `KernelConfig::summaries` = `Fused`, or the shape).
fn backward_summaries_bf16(
    qk: In,
    v: In,
    aux: In,
    cot: Cotangent,
    call: &CudaCall,
    frags: &[usize],
    dht: &[f32],
) -> Result<Option<Vec<f32>>> {
    let (sh, cfg) = (call.shape, call.kernels);
    let dev = qk.0.device().clone();
    let Some(path) = wanted(qk, cfg) else {
        return Ok(None);
    };
    let Some(Widened {
        sub, wide, plan, ..
    }) = Widened::plan(&dev, sh, frags, &DH_SCAN, cfg)?
    else {
        return not_served(path, sh);
    };
    let inp = Bf16Inputs::new(QkIn::Packed(qk), v, aux, sh, call.has_h0)?;
    let table = ChunkTable::new(&dev, &sub)?;
    let wy = WyFactors::compute(&dev, &inp, &table, &sub, call.scale, false)?;
    // do in bf16, the scan's operand type (read as [do | 0_K]).
    let o_len = sh.o_len();
    let converted;
    let (dob, at) = match cot {
        Cotangent::Packed(g) => {
            let g = super::device::view::<f32>(g.0, g.1, o_len + sh.state_len(), "grad")?;
            converted = super::copy::to_bf16(&dev, &g.slice(..o_len))?;
            (&converted, 0)
        }
        Cotangent::Plain(d) => {
            super::device::view::<bf16>(d.0, d.1, o_len, "do")?;
            (d.0.as_cuda_slice::<bf16>()?, d.1.start_offset())
        }
    };
    let dhtw = dev.clone_htod(&widened_states(dht, sh, frags))?;
    let out = dev.alloc_zeros::<f32>(wide.state_len().max(1))?;
    let dest = DhDest {
        chunks: None,
        dh0: Some(&out),
        widened: None,
    };
    let src = DhInputs {
        inp: &inp,
        table: &table,
        wy: &wy,
        dob: (dob, at),
        do_width: sh.dv,
        dht: Some((&dhtw, 0)),
    };
    let main = dev.cuda_stream();
    run_dh_scan(On::device(&main), &src, &wide, &plan, dest, None, None)?;
    let mut all = dev.clone_dtoh(&out)?;
    all.truncate(wide.state_len());
    Ok(Some(all))
}

/// Forward summaries `[ΔS | M]` (`[K, V + K]` per head, in `(fragment, head)` order) of the
/// sequences `frags`, from the initial states `h0 [N, H, K, V]` (see `cp::protocol`): on the
/// bf16 chunked kernels where they serve (`summary.rs`), else on the per-value-tile kernel.
pub(crate) fn forward_summaries(
    qk: In,
    v: In,
    aux: In,
    call: &CudaCall,
    frags: &[usize],
    h0: &[f32],
) -> Result<Vec<f32>> {
    let sh = call.shape;
    if frags.is_empty() {
        return Ok(vec![]);
    }
    check_inputs(qk, v, aux, None)?;
    if h0.len() != sh.state_len() {
        candle_core::bail!(
            "gdp cuda: {} initial-state values for the summaries, expected {}",
            h0.len(),
            sh.state_len()
        );
    }
    if let Some(s) = forward_summaries_bf16(qk, v, aux, call, frags, h0)? {
        return Ok(s);
    }
    let h0 = qk.0.device().clone_htod(h0)?;
    summaries(qk, v, aux, call, frags, Summary::Forward(&h0))
}

/// Backward summaries `[γ | Mᵀ]` (`[K, V + K]` per head, in `(fragment, head)` order) of the
/// sequences `frags`, with the output gradients and end-state gradients of `grad [do | dht]`
/// (`dht`, the same end-state gradients on the host): on the bf16 chunked kernels where they
/// serve (`summary.rs`), else on the per-value-tile kernel.
pub(crate) fn backward_summaries(
    qk: In,
    v: In,
    aux: In,
    grad: In,
    call: &CudaCall,
    frags: &[usize],
    dht: &[f32],
) -> Result<Vec<f32>> {
    let sh = call.shape;
    if frags.is_empty() {
        return Ok(vec![]);
    }
    check_inputs(qk, v, aux, Some(grad))?;
    if dht.len() != sh.state_len() {
        candle_core::bail!(
            "gdp cuda: {} end-state gradient values for the summaries, expected {}",
            dht.len(),
            sh.state_len()
        );
    }
    let cot = super::inputs::Cotangent::Packed(grad);
    if let Some(s) = backward_summaries_bf16(qk, v, aux, cot, call, frags, dht)? {
        return Ok(s);
    }
    summaries(qk, v, aux, call, frags, Summary::Backward(grad))
}

/// The gate buffer's initial states `[N, H, K, V]`, copied to the host.
pub fn initial_states_to_host(aux: In, sh: &GdpShape) -> Result<Vec<f32>> {
    let aux_v = view::<f32>(aux.0, aux.1, sh.aux_len(true), "gates")?;
    let off = sh.token_heads() * (1 + sh.n);
    aux.0
        .device()
        .clone_dtoh(&aux_v.slice(off..off + sh.state_len()))
}

/// The `dht` part of a gradient `[do | dht]`, copied to the host.
pub fn dht_to_host(grad: In, sh: &GdpShape) -> Result<Vec<f32>> {
    let o_len = sh.o_len();
    let g = view::<f32>(grad.0, grad.1, o_len + sh.state_len(), "grad")?;
    grad.0
        .device()
        .clone_dtoh(&g.slice(o_len..o_len + sh.state_len()))
}
