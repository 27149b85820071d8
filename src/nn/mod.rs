//! A Gated DeltaProduct language model in Candle with flash-linear-attention's weight names, so
//! FLA checkpoints (`GatedDeltaProductForCausalLM`, safetensors) load as they are.
//!
//! * [`config`]: [`GdpConfig`], FLA's `config.json` keys and defaults;
//! * [`conv`]: [`ShortConv`], the depthwise causal short convolution + SiLU (with a halo input
//!   for context-parallel shards);
//! * [`norm`]: RMSNorm, gated RMSNorm, L2 norm, softplus as FLA computes them;
//! * [`layer`]: [`GatedDeltaProduct`], the token mixer (chunked prefill, recurrent decode);
//! * [`cache`]: [`LayerCache`], [`Cache`], the decode state;
//! * [`model`]: [`GdpForCausalLM`], blocks with SwiGLU MLPs, final norm, LM head;
//! * [`cp`]: the context-parallel model forward, prefill and gradient all-reduce.

pub mod cache;
pub mod config;
pub mod conv;
pub mod cp;
pub mod layer;
pub mod model;
pub mod norm;

pub use cache::{Cache, LayerCache};
pub use config::GdpConfig;
pub use conv::ShortConv;
pub use cp::{
    all_reduce_grads, all_reduce_var_grads, halo_exchange, prefill_context_parallel, CpContext,
    CpPrefill,
};
pub use layer::GatedDeltaProduct;
pub use model::{GatedMlp, GdpBlock, GdpForCausalLM};
pub use norm::{GatedRmsNorm, RmsNorm};
