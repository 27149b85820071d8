//! # candle-gdp
//!
//! Gated DeltaProduct (GDP) linear attention for [Candle](https://github.com/huggingface/candle),
//! with the exact semantics of flash-linear-attention's `chunk_gated_delta_product`, forward and
//! backward, plus context parallelism over several Candle devices.
//!
//! Per (sequence, head), with state `S ∈ R^{K×V}` and `n` Householder sub-steps per token:
//!
//! ```text
//! for t in 0..T:
//!     S ← exp(g_t) · S                              # gate once, before the sub-steps
//!     for j in 0..n:  p = t·n + j
//!         S ← S + β_p · k_p (v_p − Sᵀ k_p)ᵀ         # generalised Householder update
//!     o_t = scale · Sᵀ q_t                          # read once, after the last sub-step
//! ```
//!
//! # Features
//!
//! None is on by default: the default build is the CPU library, and needs neither nvcc nor clap.
//!
//! - `cli`: the `gdp` command-line tool (`cargo build --release --features cli --bin gdp`, or
//!   `cargo install candle-gdp --features cli`). Adds `clap` and the binary; no library item.
//! - `cuda`: the CUDA kernels, used for tensors on a `Device::Cuda` (turns on `candle-core/cuda`
//!   and `candle-nn/cuda`). Needs `nvcc` at build time: `build.rs` compiles `cuda/*.cu` into a
//!   fat binary, for sm_80, sm_89 and sm_90 by default (`GDP_CUDA_COMPUTE_CAP` or
//!   `CUDA_COMPUTE_CAP` chooses others; see `build.rs`).
//! - `nccl`: implies `cuda`; adds `cp::NcclComm`, the NCCL communicator for context parallelism
//!   with one process per GPU (links `libnccl.so.2`).

pub mod autograd;
pub mod cp;
pub mod error;
pub mod models;
pub mod nn;
pub mod op;

pub use autograd::backward_with;
pub use cp::{ContextParallel, Cotangents};
pub use error::GdpError;
pub use op::{
    gated_delta_product, gated_delta_product_packed, gated_delta_product_vjp, GdpGrads, GdpOptions,
    GdpVjp, SaveIntermediates,
};
