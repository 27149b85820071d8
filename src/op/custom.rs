//! The Candle custom ops: dispatch only. The forward is a `CustomOp3` over the packed inputs
//! `qk [B, T, n+1, H, K]`, `v [B, T·n, H, V]` and the f32 gate buffer `[g | beta | h0?]`. Its
//! one output is `o [B, T, H, V]` in the inputs' dtype, or, when the final state is wanted,
//! the packed f32 `[o | final state]` (a custom op has one output). Its backward applies
//! [`GdpBackward`], whose packed f32 output `[dqk | dv | dg | dbeta | dh0?]` is split back onto
//! the three inputs; on CUDA with bf16 the split backward writes the three gradients directly
//! (bf16 `dqk`, `dv`), skipping the f32 round trip that costs as much memory traffic as the
//! kernels.

use super::cpu;
use super::link::{CpuInputs, RankLink};
use super::shape::GdpShape;
use super::QueryKeys;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use std::sync::{Arc, Mutex};

/// Forward op. Holds the metadata that is not a tensor.
#[derive(Debug, Clone)]
pub(crate) struct GdpForward {
    pub shape: GdpShape,
    pub scale: f32,
    pub has_h0: bool,
    /// Context parallelism: this rank's link to its group (`None` for the plain op).
    pub cp: Option<Arc<dyn RankLink>>,
    /// The output is the packed f32 `[o | final state]`; otherwise `o` alone in the inputs'
    /// dtype.
    pub with_final_state: bool,
    /// CUDA kernel choices ([`crate::GdpOptions::kernels`]).
    #[cfg(feature = "cuda")]
    pub kernels: super::KernelConfig,
    /// Where the CUDA forward keeps its intermediates for the backward
    /// ([`crate::GdpOptions::save_intermediates`]).
    #[cfg(feature = "cuda")]
    pub cache: Option<Arc<super::cuda::CacheSlot>>,
}

/// Backward op: `grad` is the packed `[do | dht]` f32 gradient of the forward's output.
#[derive(Debug, Clone)]
pub(crate) struct GdpBackward {
    pub fwd: GdpForward,
    pub grad: Tensor,
}

/// A contiguous slice of a CPU storage, or an error naming the input.
pub(crate) fn cpu_slice<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
    name: &str,
) -> Result<&'a [T]> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("gdp: `{name}` must be contiguous")))?;
    Ok(&s.as_slice::<T>()?[a..b])
}

impl GdpForward {
    fn packed<'a, T: candle_core::WithDType>(
        &self,
        qk: (&'a CpuStorage, &Layout),
        v: (&'a CpuStorage, &Layout),
        aux: (&'a CpuStorage, &Layout),
    ) -> Result<cpu::PackedInputs<'a, T>> {
        Ok(cpu::PackedInputs {
            qk: cpu_slice::<T>(qk.0, qk.1, "qk")?,
            v: cpu_slice::<T>(v.0, v.1, "v")?,
            aux: cpu_slice::<f32>(aux.0, aux.1, "gates")?,
            has_h0: self.has_h0,
        })
    }

    fn output_shape(&self) -> Shape {
        let sh = &self.shape;
        if self.with_final_state {
            Shape::from(sh.o_len() + sh.state_len())
        } else {
            Shape::from((sh.batch, sh.tokens, sh.heads, sh.dv))
        }
    }

    /// The packed f32 `[do | dht]` that the backward kernels take, from the gradient of the
    /// output (`do` alone, in the inputs' dtype, when the output is `o` alone).
    fn packed_cotangent(&self, grad: &Tensor) -> Result<Tensor> {
        if self.with_final_state {
            return grad.contiguous();
        }
        let zeros = Tensor::zeros(self.shape.state_len(), DType::F32, grad.device())?;
        Tensor::cat(&[&grad.flatten_all()?.to_dtype(DType::F32)?, &zeros], 0)
    }

    /// `result`, after failing this rank's context-parallel group on an error (so that the
    /// peers waiting in a collective of their backward fail at once).
    fn aborting<T>(&self, result: Result<T>) -> Result<T> {
        if let (Err(e), Some(link)) = (&result, &self.cp) {
            link.abort(&e.to_string());
        }
        result
    }

    /// `(dqk, dv, d gate buffer)` from the gradient `grad_res` of the output: the direct bf16
    /// backward where it applies, else the packed f32 one split back onto the inputs.
    fn gradients(
        &self,
        qk: &Tensor,
        v: &Tensor,
        aux: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        if let Some((mut dqk, dv, daux)) =
            self.direct_backward(QueryKeys::Packed(qk), v, aux, grad_res)?
        {
            let Some(dqk) = dqk.pop() else {
                candle_core::bail!("gdp: the backward returned no query/key gradient");
            };
            return Ok((dqk, dv, daux));
        }
        let op = GdpBackward {
            fwd: self.clone(),
            grad: self.packed_cotangent(grad_res)?,
        };
        let packed = qk.apply_op3_no_bwd(v, aux, &op)?;
        let (qk_len, v_len) = (self.shape.qk_len(), self.shape.v_len());
        let dqk = packed
            .narrow(0, 0, qk_len)?
            .reshape(qk.shape())?
            .to_dtype(qk.dtype())?;
        let dv = packed
            .narrow(0, qk_len, v_len)?
            .reshape(v.shape())?
            .to_dtype(v.dtype())?;
        let daux = packed.narrow(0, qk_len + v_len, aux.elem_count())?;
        Ok((dqk, dv, daux))
    }

    /// What a rank's link is told about a CUDA call.
    #[cfg(feature = "cuda")]
    fn cuda_call(&self) -> super::link::CudaCall<'_> {
        super::link::CudaCall {
            shape: &self.shape,
            scale: self.scale,
            has_h0: self.has_h0,
            plain: !self.with_final_state,
            kernels: &self.kernels,
        }
    }

    /// The CUDA forward on the queries and keys `qk` (packed, or FLA's `q`, `k` read in place),
    /// `v` and the gate buffer.
    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self,
        qk: super::cuda::QkIn,
        v: (&candle_core::CudaStorage, &Layout),
        aux: (&candle_core::CudaStorage, &Layout),
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = match (&self.cp, qk) {
            (None, qk) => {
                let call = self.cuda_call();
                super::cuda::forward(qk, v, aux, &call, None, self.cache.as_deref())?
            }
            (Some(link), qk) => {
                let call = self.cuda_call();
                link.forward_cuda((qk, v, aux), &call, self.cache.as_deref())?
            }
        };
        Ok((out, self.output_shape()))
    }

    /// The split bf16 backward straight into bf16 gradients (CUDA; on a context-parallel rank
    /// after the protocol's backward step, whose summaries then run on the chunked kernels):
    /// the gradients of the query/key inputs (one or two), of `v` and of the gate buffer, or
    /// `Ok(None)` where it does not apply.
    #[cfg(feature = "cuda")]
    fn direct_backward(
        &self,
        qk: QueryKeys,
        v: &Tensor,
        aux: &Tensor,
        grad_res: &Tensor,
    ) -> Result<Option<(Vec<Tensor>, Tensor, Tensor)>> {
        let grad = grad_res.contiguous()?;
        let cp = match &self.cp {
            None => None,
            Some(link) => match self.cp_overrides(link.as_ref(), qk, v)? {
                Some(o) => Some(o),
                None => return Ok(None),
            },
        };
        let cache = self.cache.as_ref().and_then(|c| c.take());
        let call = self.cuda_call();
        let out = super::cuda::try_backward_tensors(qk, v, aux, &grad, &call, cache, cp)?;
        let cp_ran = self.cp.is_some();
        if cp_ran && out.is_none() {
            // The summaries were exchanged already: no other backward may run now.
            candle_core::bail!("gdp cp: the split bf16 backward did not run after the summaries");
        }
        Ok(out)
    }

    /// A context-parallel rank's overrides for [`Self::direct_backward`] (the protocol's
    /// backward step, run from inside the backward's widened scan), or `Ok(None)` where that
    /// path does not serve this rank, which then takes the packed f32 backward; decided before
    /// any collective, from the dtype and the shape only, so every rank takes one all-gather
    /// either way.
    #[cfg(feature = "cuda")]
    fn cp_overrides<'a>(
        &self,
        link: &'a dyn RankLink,
        qk: QueryKeys,
        v: &Tensor,
    ) -> Result<Option<super::cuda::CpOverrides<'a>>> {
        use super::cuda::{backward_summaries_served, split_backward_fits};
        let sh = &self.shape;
        let lead = match qk {
            QueryKeys::Packed(qk) | QueryKeys::Split(qk, _) => qk,
        };
        let candle_core::Device::Cuda(dev) = lead.device() else {
            return Ok(None);
        };
        if lead.dtype() != DType::BF16
            || v.dtype() != DType::BF16
            || !split_backward_fits(dev, sh, &self.kernels)?
            || !backward_summaries_served(dev, sh, &self.kernels)?
        {
            return Ok(None);
        }
        link.backward_overrides_cuda(dev, sh, self.has_h0).map(Some)
    }

    #[cfg(not(feature = "cuda"))]
    fn direct_backward(
        &self,
        _: QueryKeys,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> Result<Option<(Vec<Tensor>, Tensor, Tensor)>> {
        Ok(None)
    }
}

/// `o` alone, as `T`, from the packed f32 `[o | final state]` of the CPU kernels.
fn plain_cpu<T: candle_core::WithDType>(mut packed: Vec<f32>, o_len: usize) -> CpuStorage {
    packed.truncate(o_len);
    T::to_cpu_storage_owned(packed.into_iter().map(|x| T::from_f64(x as f64)).collect())
}

/// Runs `$body` with `$T` bound to the Rust type of `$dtype` (the float dtypes the op takes).
macro_rules! with_float_type {
    ($dtype:expr, $T:ident, $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            dt => candle_core::bail!("gdp: unsupported dtype {dt:?} for q/k/v"),
        }
    };
}

impl CustomOp3 for GdpForward {
    fn name(&self) -> &'static str {
        "gated-delta-product"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = with_float_type!(s1.dtype(), T, {
            let x = self.packed::<T>((s1, l1), (s2, l2), (s3, l3))?;
            let out = match &self.cp {
                None => cpu::forward(&x, &self.shape, self.scale, None)?,
                Some(link) => link.forward_cpu(CpuInputs::from(&x), &self.shape, self.scale)?,
            };
            if self.with_final_state {
                CpuStorage::F32(out)
            } else {
                plain_cpu::<T>(out, self.shape.o_len())
            }
        });
        Ok((out, self.output_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda_forward(super::cuda::QkIn::Packed((s1, l1)), (s2, l2), (s3, l3))
    }

    fn bwd(
        &self,
        qk: &Tensor,
        v: &Tensor,
        aux: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dqk, dv, daux) = self.aborting(self.gradients(qk, v, aux, grad_res))?;
        Ok((Some(dqk), Some(dv), Some(daux)))
    }
}

impl CustomOp3 for GdpBackward {
    fn name(&self) -> &'static str {
        "gated-delta-product-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (gs, gl) = self.grad.storage_and_layout();
        let grad = match &*gs {
            candle_core::Storage::Cpu(c) => cpu_slice::<f32>(c, gl, "grad")?,
            _ => candle_core::bail!("gdp backward: the gradient is not on the CPU"),
        };
        let out = with_float_type!(s1.dtype(), T, {
            let x = self.fwd.packed::<T>((s1, l1), (s2, l2), (s3, l3))?;
            let (sh, scale) = (&self.fwd.shape, self.fwd.scale);
            match &self.fwd.cp {
                None => cpu::backward(&x, sh, scale, grad, None)?,
                Some(link) => link.backward_cpu(CpuInputs::from(&x), sh, scale, grad)?,
            }
        });
        let n = out.len();
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    // --- CUDA backward (feature `cuda`; owned by the CUDA kernel work, see src/op/cuda) ---
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (gs, gl) = self.grad.storage_and_layout();
        let grad = match &*gs {
            candle_core::Storage::Cuda(c) => c,
            _ => candle_core::bail!("gdp backward: the gradient is not on a CUDA device"),
        };
        let (sh, has_h0) = (&self.fwd.shape, self.fwd.has_h0);
        let out = match &self.fwd.cp {
            None => {
                let call = self.fwd.cuda_call();
                let none = super::cuda::SplitExtras::default();
                let (q, v, x, g) = ((s1, l1), (s2, l2), (s3, l3), (grad, gl));
                super::cuda::backward(q, v, x, g, &call, none, &[])?
            }
            Some(link) => {
                let cache = self.fwd.cache.as_ref().and_then(|c| c.take());
                let ins = ((s1, l1), (s2, l2), (s3, l3), (grad, gl));
                link.backward_cuda(ins, &self.fwd.cuda_call(), cache)?
            }
        };
        Ok((out, Shape::from(super::cuda::backward_len(sh, has_h0))))
    }
    // --- end CUDA backward ---
}

/// The forward over FLA's separate `q` and `k`, as graph inputs `(q, k, tie)` with
/// `tie = GradTie(v, gates)`: a custom op takes at most three inputs, and a packed `qk` graph
/// node would cost its own zero tensor plus add of `dqk` in Candle's gradient accumulation
/// (about as much memory traffic as the pack itself). The CUDA bf16 chunked
/// kernels read `q` and `k` in place; elsewhere the kernels run on a packed copy held outside
/// the graph and the backward cuts `dq`, `dk` out of `dqk`. The backward hands `dv`, `dgates`
/// to the tie through `stash`.
#[derive(Debug, Clone)]
pub(crate) struct GdpForwardSplit {
    pub op: GdpForward,
    /// `qk [B, T, n+1, H, K]` packed from `q` and `k` (not a graph node), or `None` where the
    /// kernels read the op's inputs `q`, `k` in place ([`super::kernel_keys`]).
    pub qk: Option<Tensor>,
    pub v: Tensor,
    /// The f32 gate buffer `[g | beta | h0?]`.
    pub aux: Tensor,
    pub pack: super::pack::PackQk,
    pub stash: Arc<Mutex<Option<(Tensor, Tensor)>>>,
}

impl GdpForwardSplit {
    /// The split op over contiguous `q`, `k`, `v` and the gate buffer: with `in_place` (from
    /// [`super::kernel_keys`]: CUDA bf16 chunked kernels) the kernels read `q [B, T, Hk, K]`,
    /// `k [B, T·n, Hk, K]` themselves; else `q [B, T, H, K]`, `k [B, T·n, H, K]` go into a
    /// packed copy made here, outside the graph.
    pub fn new(
        op: GdpForward,
        q: &Tensor,
        k: &Tensor,
        v: Tensor,
        aux: Tensor,
        in_place: bool,
    ) -> Result<Self> {
        let pack = super::pack::PackQk::of(&op.shape);
        let qk = if in_place {
            None
        } else {
            Some(q.detach().apply_op2(&k.detach(), pack)?)
        };
        Ok(Self {
            op,
            qk,
            v,
            aux,
            pack,
            stash: Arc::new(Mutex::new(None)),
        })
    }

    /// `(dq, dk, dv, d gate buffer)` from the gradient `grad_res` of the forward's output.
    pub fn gradients(
        &self,
        q: &Tensor,
        k: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Tensor, Tensor)> {
        Ok(match &self.qk {
            None => {
                let split = QueryKeys::Split(q, k);
                let Some((dqk, dv, daux)) = self
                    .op
                    .direct_backward(split, &self.v, &self.aux, grad_res)?
                else {
                    candle_core::bail!("gdp: the CUDA backward did not take `q`, `k` in place");
                };
                let mut dqk = dqk.into_iter();
                (dqk.next(), dqk.next(), dv, daux)
            }
            Some(qk) => {
                let (dqk, dv, daux) = self.op.gradients(qk, &self.v, &self.aux, grad_res)?;
                let (dq, dk) = candle_core::CustomOp2::bwd(&self.pack, q, k, qk, &dqk)?;
                (dq, dk, dv, daux)
            }
        })
    }
}

impl CustomOp3 for GdpForwardSplit {
    fn name(&self) -> &'static str {
        "gated-delta-product-split"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        use candle_core::Storage::Cpu;
        let Some(qk) = &self.qk else {
            candle_core::bail!("gdp: `q` and `k` in place are read by the CUDA kernels only");
        };
        let [(s1, l1), (s2, l2), (s3, l3)] =
            [qk, &self.v, &self.aux].map(|t| t.storage_and_layout());
        match (&*s1, &*s2, &*s3) {
            (Cpu(s1), Cpu(s2), Cpu(s3)) => self.op.cpu_fwd(s1, l1, s2, l2, s3, l3),
            _ => candle_core::bail!("gdp: the held inputs are not on the CPU"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::QkIn;
        use candle_core::Storage::Cuda;
        let [(vs, vl), (xs, xl)] = [&self.v, &self.aux].map(|t| t.storage_and_layout());
        let (Cuda(vs), Cuda(xs)) = (&*vs, &*xs) else {
            candle_core::bail!("gdp: the held inputs are not on one CUDA device");
        };
        match &self.qk {
            None => self
                .op
                .cuda_forward(QkIn::Split((s1, l1), (s2, l2)), (vs, vl), (xs, xl)),
            Some(qk) => {
                let (qs, ql) = qk.storage_and_layout();
                let Cuda(qs) = &*qs else {
                    candle_core::bail!("gdp: the held inputs are not on one CUDA device");
                };
                self.op
                    .cuda_forward(QkIn::Packed((qs, ql)), (vs, vl), (xs, xl))
            }
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        tie: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, dv, daux) = self.op.aborting(self.gradients(q, k, grad_res))?;
        if tie.track_op() {
            *lock_stash(&self.stash)? = Some((dv, daux));
        }
        Ok((dq, dk, Some(tie.zeros_like()?)))
    }
}

fn lock_stash(
    stash: &Mutex<Option<(Tensor, Tensor)>>,
) -> Result<std::sync::MutexGuard<'_, Option<(Tensor, Tensor)>>> {
    stash
        .lock()
        .map_err(|_| candle_core::Error::Msg("gdp: gradient stash poisoned".into()))
}

/// A zero scalar that ties `v` and the gate buffer into the graph of [`GdpForwardSplit`]; its
/// backward hands out the gradients that the split op's backward (which Candle runs first: it
/// consumes the tie) left in `stash`.
#[derive(Debug, Clone)]
pub(crate) struct GradTie {
    pub stash: Arc<Mutex<Option<(Tensor, Tensor)>>>,
}

impl candle_core::CustomOp2 for GradTie {
    fn name(&self) -> &'static str {
        "gdp-grad-tie"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok(crate::autograd::zero_scalar_cpu())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::autograd::zero_scalar_cuda(s)
    }

    fn bwd(
        &self,
        _v: &Tensor,
        _aux: &Tensor,
        _res: &Tensor,
        _grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        match lock_stash(&self.stash)?.take() {
            Some((dv, daux)) => Ok((Some(dv), Some(daux))),
            None => candle_core::bail!("gdp: the tie's gradients were not computed"),
        }
    }
}
