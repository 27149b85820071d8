//! The boundary through which a context-parallel rank takes part in the op. The op knows
//! nothing of groups, summaries or communicators: a rank's op holds a [`RankLink`], which the
//! context-parallel layer implements, and hands it the call's inputs where the
//! plain op would run its kernels.

use super::cpu::PackedInputs;
use super::shape::GdpShape;
use candle_core::Result;

/// The packed CPU inputs of one call in their dtype (the link's methods cannot be generic).
pub(crate) enum CpuInputs<'a> {
    F32(&'a PackedInputs<'a, f32>),
    F64(&'a PackedInputs<'a, f64>),
    Bf16(&'a PackedInputs<'a, half::bf16>),
    F16(&'a PackedInputs<'a, half::f16>),
}

macro_rules! cpu_inputs_from {
    ($($t:ty => $variant:ident),*) => {$(
        impl<'a> From<&'a PackedInputs<'a, $t>> for CpuInputs<'a> {
            fn from(x: &'a PackedInputs<'a, $t>) -> Self {
                Self::$variant(x)
            }
        }
    )*};
}
cpu_inputs_from!(f32 => F32, f64 => F64, half::bf16 => Bf16, half::f16 => F16);

#[cfg(feature = "cuda")]
pub(crate) use super::cuda::CudaCall;

/// A context-parallel rank's part in the op: the op's forward and backward on this rank's
/// shard, exchanging state summaries with the other ranks.
pub(crate) trait RankLink: std::fmt::Debug + Send + Sync {
    /// Fails the rank's group with `reason` (this rank's error), so that its peers stop
    /// waiting for it; the op calls it on any error of a rank's backward.
    fn abort(&self, reason: &str);

    /// The rank's forward on the CPU: the packed f32 `[o | final states]`, as
    /// [`super::cpu::forward()`] returns for the plain op.
    fn forward_cpu(&self, x: CpuInputs<'_>, sh: &GdpShape, scale: f32) -> Result<Vec<f32>>;

    /// The rank's backward on the CPU (`grad` is `[do | dht]`): the packed f32
    /// `[dqk | dv | dg | dbeta | dh0?]`, as [`super::cpu::backward()`] returns.
    fn backward_cpu(
        &self,
        x: CpuInputs<'_>,
        sh: &GdpShape,
        scale: f32,
        grad: &[f32],
    ) -> Result<Vec<f32>>;

    /// The rank's forward on CUDA storages `(queries and keys, v, gates)` (FLA's `q`, `k` in
    /// place only where [`super::cuda::rank_reads_qk_in_place`] said so); with a `cache` slot
    /// the bf16 chunked forward keeps its intermediates for the backward.
    #[cfg(feature = "cuda")]
    fn forward_cuda(
        &self,
        ins: (super::cuda::QkIn, super::cuda::In, super::cuda::In),
        call: &CudaCall,
        cache: Option<&super::cuda::CacheSlot>,
    ) -> Result<candle_core::CudaStorage>;

    /// The rank's packed f32 backward on CUDA storages `(qk, v, gates, grad)`, `grad` being
    /// `[do | dht]`; `cache`, what the forward kept.
    #[cfg(feature = "cuda")]
    fn backward_cuda(
        &self,
        ins: (
            super::cuda::In,
            super::cuda::In,
            super::cuda::In,
            super::cuda::In,
        ),
        call: &CudaCall,
        cache: Option<super::cuda::ForwardCache>,
    ) -> Result<candle_core::CudaStorage>;

    /// What the rank's direct bf16 backward needs: the initial states its forward used and the
    /// exchange of the backward summaries, run from inside the backward's widened scan.
    #[cfg(feature = "cuda")]
    fn backward_overrides_cuda<'a>(
        &'a self,
        dev: &candle_core::CudaDevice,
        sh: &GdpShape,
        has_h0: bool,
    ) -> Result<super::cuda::CpOverrides<'a>>;
}
