//! Whole-model throughput of a Qwen3.5-style hybrid (3 Gated DeltaNet layers to 1 attention
//! layer, grouped value heads) of small width with random weights: prefill tokens/s through
//! the chunked op into the decode cache, against the token-by-token recurrent prefill that
//! Rust implementations without a chunked kernel run (measured in the same run), and decode
//! tokens/s.
//!
//! Run: `cargo bench --bench qwen` (CPU); `-- --device cuda:0 --dtype bf16 --tokens 8192` with
//! `--features cuda`; `--help` for the model's sizes.

use candle_core::{DType, Device, Tensor};
use candle_gdp::models::qwen::{QwenConfig, QwenHybrid};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;
use std::time::Instant;

#[derive(Parser, Debug)]
struct Args {
    /// `cpu` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Prompt tokens of the chunked prefill.
    #[arg(long, default_value_t = 2048)]
    tokens: usize,
    /// Prompt tokens of the token-by-token baseline.
    #[arg(long, default_value_t = 128)]
    baseline_tokens: usize,
    /// Decoded tokens.
    #[arg(long, default_value_t = 64)]
    decode: usize,
    /// Model width.
    #[arg(long, default_value_t = 512)]
    hidden: usize,
    /// Decoder layers (every fourth is attention).
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// GDN key heads `Hk` (value heads: twice as many), head dims 64.
    #[arg(long, default_value_t = 4)]
    key_heads: usize,
    /// Ignored (`cargo bench` passes it).
    #[arg(long)]
    bench: bool,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let device = match a.device.as_str() {
        "cpu" => Device::Cpu,
        d => Device::new_cuda(d.strip_prefix("cuda:").unwrap_or("0").parse()?)?,
    };
    let dtype = match a.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        d => anyhow::bail!("--dtype: f32, bf16 or f16, got {d}"),
    };
    let cfg = QwenConfig::from_json(&format!(
        r#"{{"model_type": "qwen3_5_text", "vocab_size": 4096, "hidden_size": {d},
            "num_hidden_layers": {l}, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 64, "linear_num_key_heads": {hk}, "linear_num_value_heads": {hv},
            "linear_key_head_dim": 64, "linear_value_head_dim": 64, "intermediate_size": {i}}}"#,
        d = a.hidden,
        l = a.layers,
        hk = a.key_heads,
        hv = 2 * a.key_heads,
        i = 3 * a.hidden,
    ))?;
    let varmap = VarMap::new();
    let model = QwenHybrid::new(
        &cfg,
        VarBuilder::from_varmap(&varmap, dtype, &device),
        "model",
    )?;
    println!(
        "{} {:?}: D {} layers {} GDN Hk {} Hv {} dk = dv = 64, random weights",
        a.device,
        dtype,
        a.hidden,
        a.layers,
        a.key_heads,
        2 * a.key_heads
    );
    let ids: Vec<u32> = (0..a.tokens.max(a.baseline_tokens) as u32)
        .map(|i| (i * 7919) % 4096)
        .collect();
    let prompt = |n: usize| Tensor::new(&ids[..n], &device)?.unsqueeze(0);

    // Warm-up, then the chunked prefill.
    model.forward(&prompt(64)?, Some(&mut model.empty_cache(1)?))?;
    let mut cache = model.empty_cache(1)?;
    let t0 = Instant::now();
    let logits = model.forward(&prompt(a.tokens)?, Some(&mut cache))?;
    device.synchronize()?;
    let chunked = a.tokens as f64 / t0.elapsed().as_secs_f64();

    // Token by token through the same cache path (the recurrent step per token).
    let mut base_cache = model.empty_cache(1)?;
    let t1 = Instant::now();
    for &id in &ids[..a.baseline_tokens] {
        model.forward(&Tensor::new(&[[id]], &device)?, Some(&mut base_cache))?;
    }
    device.synchronize()?;
    let recurrent = a.baseline_tokens as f64 / t1.elapsed().as_secs_f64();

    // Decode after the chunked prefill (greedy).
    let mut next: u32 = logits
        .squeeze(0)?
        .get(a.tokens - 1)?
        .argmax(0)?
        .to_scalar()?;
    let t2 = Instant::now();
    for _ in 0..a.decode {
        let l = model.forward(&Tensor::new(&[[next]], &device)?, Some(&mut cache))?;
        next = l.squeeze(0)?.squeeze(0)?.argmax(0)?.to_scalar()?;
    }
    device.synchronize()?;
    let decode = a.decode as f64 / t2.elapsed().as_secs_f64();
    println!(
        "prefill {} tokens: {chunked:.0} tokens/s chunked, {recurrent:.0} tokens/s token by token \
         ({} tokens), ratio {:.1}x",
        a.tokens,
        a.baseline_tokens,
        chunked / recurrent
    );
    println!(
        "decode {} tokens: {decode:.1} tokens/s (greedy, argmax on the host)",
        a.decode
    );
    Ok(())
}
