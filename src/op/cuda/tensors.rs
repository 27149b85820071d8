//! The split bf16 backward on tensors, for the op's `bwd` ([`try_backward_tensors`]): straight
//! into bf16 gradients, without the packed f32 detour of [`super::backward()`]; and a
//! context-parallel rank's replacements in it ([`CpOverrides`]).

use super::backward::{try_backward_bf16, zero_state_grads, SplitExtras};
use super::cache::ForwardCache;
use super::grads::{GradLayout, Grads, QkGrads};
use super::inputs::{Cotangent, CudaCall, QkIn};
use super::widened::WidenedFold;
use crate::op::heads::sum_key_groups;
use crate::op::QueryKeys;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Result, Shape, Storage, Tensor};
use half::bf16;

/// Context parallelism's replacements in a rank's backward: the folded initial states (f32
/// `[N, H, K, V]`, on the device), the final-state gradients from the following ranks, and the
/// sequences whose initial-state gradient went to earlier ranks as γ (their `dh0` rows are
/// zeroed).
pub(crate) struct CpOverrides<'a> {
    pub h0: CudaSlice<f32>,
    pub dht: CpFinalGrads<'a>,
    pub zero_dh0: Vec<usize>,
}

/// What the following ranks send into a rank's final-state gradients: folded already (added
/// to `dht`, f32 `[N, H, K, V]`), or exchanged from inside the backward's widened scan.
pub(crate) enum CpFinalGrads<'a> {
    Folded(CudaSlice<f32>),
    Widened(WidenedFold<'a>),
}

/// The split bf16 backward on tensors, for the op's `bwd`: the queries and keys (the packed `qk`,
/// or FLA's `q`, `k`), `v` (bf16), the gate buffer and the output's gradient `grad` (the packed f32
/// `[do | dht]`, or with `plain` the bf16 `do [B, T, H, V]`) on one CUDA device; returns the
/// gradients of the query/key inputs (one or two, in their shapes: FLA's `q`, `k` may have fewer
/// heads than `v`, grouped value heads, whose gradients sum over each group) and of `v` (bf16) and
/// of the gate buffer (f32), without the packed f32 detour of
/// [`backward`](super::backward::backward). `Ok(None)` where this path does not apply (not CUDA,
/// not bf16, or the split backward does not fit). `cp`: a context-parallel rank's overrides.
pub(crate) fn try_backward_tensors(
    qk: QueryKeys,
    v: &Tensor,
    aux: &Tensor,
    grad: &Tensor,
    call: &CudaCall,
    cache: Option<ForwardCache>,
    cp: Option<CpOverrides>,
) -> Result<Option<(Vec<Tensor>, Tensor, Tensor)>> {
    let (sh, has_h0) = (call.shape, call.has_h0);
    let inputs: Vec<&Tensor> = match qk {
        QueryKeys::Packed(qk) => vec![qk],
        QueryKeys::Split(q, k) => vec![q, k],
    };
    let lead = inputs[0];
    if lead.dtype() != DType::BF16 || v.dtype() != DType::BF16 || !lead.device().is_cuda() {
        return Ok(None);
    }
    let guards: Vec<_> = inputs.iter().map(|t| t.storage_and_layout()).collect();
    let mut cuda = vec![];
    for (s, l) in &guards {
        match &**s {
            Storage::Cuda(s) => cuda.push((s, *l)),
            _ => return Ok(None),
        }
    }
    let qk_in = match cuda[..] {
        [qk] => QkIn::Packed(qk),
        [q, k] => QkIn::Split(q, k),
        _ => candle_core::bail!("gdp cuda: one or two query/key inputs expected"),
    };
    let (vs, vl) = v.storage_and_layout();
    let (xs, xl) = aux.storage_and_layout();
    let (gs, gl) = grad.storage_and_layout();
    let (Storage::Cuda(vs), Storage::Cuda(xs), Storage::Cuda(gs)) = (&*vs, &*xs, &*gs) else {
        return Ok(None);
    };
    let dev = vs.device().clone();
    let cot = if call.plain {
        Cotangent::Plain((gs, gl))
    } else {
        Cotangent::Packed((gs, gl))
    };
    let (h0, dht, widened, zero_dh0) = match cp {
        None => (None, None, None, vec![]),
        Some(CpOverrides { h0, dht, zero_dh0 }) => match dht {
            CpFinalGrads::Folded(d) => (Some(h0), Some(d), None, zero_dh0),
            CpFinalGrads::Widened(f) => (Some(h0), None, Some(f), zero_dh0),
        },
    };
    let extras = SplitExtras {
        cache,
        h0: h0.as_ref(),
        dht: dht.as_ref(),
        widened,
    };
    let layout = GradLayout::Parts;
    let grads = try_backward_bf16(qk_in, (vs, vl), (xs, xl), cot, call, extras, layout)?;
    let Some(Grads::Parts { dqk, dv, mut daux }) = grads else {
        return Ok(None);
    };
    if has_h0 {
        let at = sh.aux_len(true) - sh.state_len();
        zero_state_grads(&dev, &mut daux, at, sh, &zero_dh0)?;
    }
    let tensor = |s: CudaStorage, shape: &Shape| {
        Tensor::from_storage(Storage::Cuda(s), shape.clone(), BackpropOp::none(), false)
    };
    let bf16_tensor = |s: CudaSlice<bf16>, t: &Tensor| {
        tensor(CudaStorage::wrap_cuda_slice(s, dev.clone()), t.shape())
    };
    let dqk = match dqk {
        QkGrads::Packed(dqk) => vec![bf16_tensor(dqk, inputs[0])],
        QkGrads::Split { dq, dk } => {
            // Written per value head; with grouped value heads (`q`, `k` of Hk < H heads),
            // summed over each group in f32.
            let per_value_head = |s: CudaSlice<bf16>, t: &Tensor| -> Result<Tensor> {
                let (b, rows, hk, d) = t.dims4()?;
                let wide = tensor(
                    CudaStorage::wrap_cuda_slice(s, dev.clone()),
                    &Shape::from((b, rows, sh.heads, d)),
                );
                sum_key_groups(&wide, 2, sh.heads / hk)
            };
            vec![
                per_value_head(dq, inputs[0])?,
                per_value_head(dk, inputs[1])?,
            ]
        }
    };
    let dv = bf16_tensor(dv, v);
    let daux = tensor(CudaStorage::wrap_cuda_slice(daux, dev.clone()), aux.shape());
    Ok(Some((dqk, dv, daux)))
}
