//! CUDA kernels of the operator (feature `cuda`): `cuda/gdp.cu` and the headers it includes,
//! compiled to a fat binary by `build.rs` and loaded lazily per device (`module.rs`).
//!
//! The modules form layers, each importing only from the ones above it: launch plumbing and
//! planning (`device`, `module`, `side`, `memory`, `copy`, `plan`: every kernel's shared memory
//! and tiles); one module per kernel family (`wy`, `fwd_scan`, `dh_scan`, `grads`, the fused
//! one-kernel paths `fused_fwd` / `fused_bwd`, `cp_fix`, `fold` (summaries folded into states), the
//! decode `step`, and `pipeline`, which runs the WY kernel beside a scan); and the stages
//! composed, as FLA's `chunk.py` composes its kernels: `forward`, `widened` (a
//! context-parallel rank's widened passes), `segmented` (the op in segments), `summary` (the
//! rank's summaries alone), `backward`, and `tensors` (the split backward straight into bf16
//! gradient tensors).

// Launch plumbing and planning (no kernel of their own, or a helper kernel).
mod copy;
mod device;
mod memory;
mod module;
mod plan;
mod side;
// One module per kernel family.
mod cache;
mod cp_fix;
mod dh_scan;
mod fold;
mod fused_bwd;
mod fused_fwd;
mod fwd_scan;
mod grads;
mod inputs;
mod pipeline;
mod step;
mod wy;
// The stages composed: forward, backward, context parallelism's summaries.
mod backward;
mod forward;
mod segmented;
mod summary;
mod tensors;
mod widened;

pub(crate) use backward::{backward, SplitExtras};
pub use cache::{CacheSlot, ForwardCache};
pub(crate) use copy::{copy_rows, sum_groups_tensor};
pub use device::In;
pub(crate) use device::{initial_states_device, slice_of, tensor_of};
pub(crate) use fold::{fold_gathered, DeviceChains};
pub(crate) use forward::forward;
pub use forward::reads_qk_in_place;
pub use fused_bwd::{backward_len, bwd_smem_bytes, BwdPlan};
pub use fused_fwd::{smem_bytes, LaunchPlan, THREADS};
pub(crate) use inputs::CudaCall;
pub use inputs::QkIn;
pub use memory::retain_freed_memory;
pub(crate) use plan::split_backward_fits;
pub use step::{step, step_fits};
pub(crate) use summary::{backward_summaries, forward_summaries};
pub use summary::{dht_to_host, initial_states_to_host};
pub(crate) use tensors::{try_backward_tensors, CpFinalGrads, CpOverrides};
pub use widened::rank_reads_qk_in_place;
pub(crate) use widened::{
    backward_summaries_served, finish_widened_forward, widened_forward, EndGrads, WidenedFold,
};
