//! Models people run, built on this crate's op: [`qwen`], the Gated DeltaNet hybrids Qwen3.5
//! and Qwen3-Next, from Hugging Face checkpoints.

pub mod qwen;
