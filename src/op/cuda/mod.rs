//! CUDA kernels of the operator (feature `cuda`): the chunked forward and backward of
//! `cuda/gdp.cu` (`cuda/gdp_bwd.cuh`), compiled to PTX by `build.rs` and loaded lazily per
//! device, and the context-parallel summaries built on the backward kernel.

mod backward;
mod chunked;
mod launch;
mod memory;
mod step;

pub use backward::{
    backward, backward_len, backward_summaries, bwd_smem_bytes, dht_to_host, forward_summaries,
    initial_states_to_host, BwdPlan,
};
pub use launch::{forward, smem_bytes, LaunchPlan, THREADS};
pub use memory::retain_freed_memory;
pub use step::step;

/// PTX of `cuda/gdp.cu` (nvcc `--ptx -arch=compute_XX`, see `build.rs`).
pub(crate) const GDP_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gdp.ptx"));

/// Name under which the module is cached in each `CudaDevice`.
pub(crate) const MODULE: &str = "candle_gdp";
