//! CUDA kernels of the operator (feature `cuda`): the chunked forward of `cuda/gdp.cu`, compiled
//! to PTX by `build.rs` and loaded lazily per device. The backward has no CUDA kernel yet.

mod launch;

pub use launch::{forward, smem_bytes, LaunchPlan, THREADS};

/// PTX of `cuda/gdp.cu` (nvcc `--ptx -arch=compute_XX`, see `build.rs`).
pub(crate) const GDP_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gdp.ptx"));

/// Name under which the module is cached in each `CudaDevice`.
pub(crate) const MODULE: &str = "candle_gdp";
