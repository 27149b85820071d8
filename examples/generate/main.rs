//! Generates text with a byte-level Gated DeltaProduct model written by the `finetune`
//! example: chunked prefill of the prompt into the decode cache, then one token at a time with
//! temperature and nucleus (top-p) sampling, printed as it comes. Reports prefill and decode
//! tokens/s. See `README.md` beside this file.

#[path = "../common/mod.rs"]
mod common;

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use candle_gdp::nn::Cache;
use clap::Parser;
use common::{Sampler, Utf8Stream};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Sample from a byte-level Gated DeltaProduct checkpoint (CPU)")]
struct Args {
    /// Directory with `model.safetensors` and `config.json` (the finetune example's `--out`).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Text to continue.
    #[arg(long, default_value = "LOVE, n.  ")]
    prompt: String,
    /// Bytes to generate.
    #[arg(long, default_value_t = 400)]
    max_tokens: usize,
    /// Softmax temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Nucleus sampling: draw from the smallest set of tokens whose mass reaches this.
    #[arg(long, default_value_t = 0.95)]
    top_p: f64,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 299_792_458)]
    seed: u64,
    /// Prompt tokens per prefill call (bounds the prefill's memory; larger is faster).
    #[arg(long, default_value_t = 256)]
    prefill_chunk: usize,
    /// CPU threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    common::set_threads(args.threads)?;
    let device = Device::Cpu;
    let mut sampler = Sampler::new(args.seed, args.temperature, args.top_p)?;

    let t_load = Instant::now();
    let (cfg, model) = common::load_checkpoint(&args.checkpoint, &device)?;
    eprintln!(
        "loaded {} in {:.2?}: D={} layers={} H={} K={} V={} n={} vocab={}",
        args.checkpoint.display(),
        t_load.elapsed(),
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_heads,
        cfg.head_k_dim(),
        cfg.head_v_dim(),
        cfg.num_householder,
        cfg.vocab_size
    );
    if cfg.vocab_size < common::BYTE_VOCAB {
        bail!(
            "this example tokenises bytes (vocabulary 256); the checkpoint's vocabulary is {}",
            cfg.vocab_size
        );
    }

    // Byte-level tokenisation: the prompt's UTF-8 bytes are the token ids.
    let prompt: Vec<u32> = args.prompt.bytes().map(u32::from).collect();
    let mut cache = Cache::new(&cfg, 1, DType::F32, &device)?;
    print!("{}", args.prompt);

    let t_prefill = Instant::now();
    let mut logits = common::prefill(&model, &mut cache, &prompt, args.prefill_chunk, &device)?;
    let prefill_s = t_prefill.elapsed().as_secs_f64();

    let mut out = Utf8Stream::default();
    let t_decode = Instant::now();
    for i in 0..args.max_tokens {
        let next = sampler.sample(&logits)?;
        out.push(next as u8)?;
        if i + 1 < args.max_tokens {
            logits = common::decode_step(&model, &mut cache, next, &device)?;
        }
    }
    let decode_s = t_decode.elapsed().as_secs_f64();
    out.finish()?;

    eprintln!(
        "prefill: {} tokens in {:.1} ms ({:.0} tokens/s, chunks of {})",
        prompt.len(),
        prefill_s * 1e3,
        prompt.len() as f64 / prefill_s,
        args.prefill_chunk
    );
    eprintln!(
        "decode: {} tokens in {:.2} s ({:.0} tokens/s, sampling included)",
        args.max_tokens,
        decode_s,
        args.max_tokens as f64 / decode_s
    );
    Ok(())
}
