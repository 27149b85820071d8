//! CUDA kernels of the operator (feature `cuda`): the chunked forward and backward of
//! `cuda/gdp.cu` (`cuda/gdp_bwd.cuh`, `cuda/gdp_fwd_chunked.cuh`, `cuda/gdp_bwd_chunked.cuh`), compiled to a fat binary by
//! `build.rs` and loaded lazily per device (`module.rs`), the context-parallel summaries (on the
//! chunked bf16 scans, `summary.rs`, else the per-value-tile backward kernel), and the fused
//! decode step.

mod backward;
mod chunked;
mod chunked_bwd;
mod copy;
mod launch;
mod memory;
mod module;
mod pipeline;
mod side;
mod step;
mod summary;

pub use backward::{
    backward, backward_len, backward_summaries, bwd_smem_bytes, dht_to_host, forward_summaries,
    initial_states_to_host, BwdPlan,
};
pub use chunked::{reads_qk_in_place, CacheSlot, ForwardCache, QkIn};
pub(crate) use chunked_bwd::{split_backward_fits, try_backward_tensors, Cotangent, CpOverrides};
pub(crate) use copy::copy_rows;
pub use launch::{forward, smem_bytes, LaunchPlan, THREADS};
pub use memory::retain_freed_memory;
pub use step::{step, step_fits};
pub(crate) use summary::{backward_summaries_bf16, backward_summaries_served};
