//! Qwen's Gated DeltaNet hybrids, loaded from Hugging Face checkpoints: Qwen3.5 (dense and
//! MoE) and Qwen3-Next. Their linear-attention layers run this crate's op at `n = 1` with
//! grouped value heads; every fourth layer (by default) is gated softmax attention.
//!
//! * [`config`]: [`QwenConfig`], from `config.json`;
//! * [`gdn`]: the Gated DeltaNet layer and its projection layouts;
//! * [`attention`]: gated attention with partial RoPE and GQA;
//! * [`moe`]: the sparse mixture of experts with a shared expert;
//! * [`layers`]: the `(1 + w)` RMSNorm, partial RoPE, SwiGLU;
//! * [`model`]: [`QwenHybrid`] and its decode cache;
//! * [`cp`]: context-parallel prefill over several ranks;
//! * [`load`]: reading a checkpoint directory.

pub mod attention;
pub mod config;
pub mod cp;
pub mod gdn;
pub mod layers;
pub mod load;
pub mod model;
pub mod moe;

pub use config::{QwenArch, QwenConfig};
pub use cp::{prefill_context_parallel, QwenPrefill};
pub use load::load_dir;
pub use model::{Qwen3Next, Qwen3_5, QwenCache, QwenHybrid};
