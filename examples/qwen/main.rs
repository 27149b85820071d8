//! Runs Qwen's Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) from a Hugging Face
//! checkpoint directory: `qwen generate` prefills the prompt in chunks into the decode cache
//! (or over `--cp-size` context-parallel ranks), then decodes one token at a time, with a
//! progress bar and tokens/s for each phase. See `README.md` beside this file.

#[path = "../common/mod.rs"]
mod common;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_gdp::models::qwen::{load_dir, prefill_context_parallel, QwenCache, QwenHybrid};
use candle_gdp::ContextParallel;
use clap::{Parser, Subcommand, ValueEnum};
use common::Sampler;
use indicatif::{ProgressBar, ProgressStyle};
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Qwen3.5 / Qwen3-Next (Gated DeltaNet hybrids) on candle-gdp")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Continues a prompt: chunked (or context-parallel) prefill, then cached decoding.
    Generate(GenerateArgs),
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum DTypeArg {
    F32,
    Bf16,
    F16,
}

impl DTypeArg {
    fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
        }
    }
}

#[derive(clap::Args, Debug)]
struct GenerateArgs {
    /// Checkpoint directory: `config.json`, `model.safetensors` or the sharded
    /// `model.safetensors.index.json`, and (for `--prompt`) `tokenizer.json`.
    #[arg(long)]
    model: PathBuf,
    /// Text to continue (tokenised with the checkpoint's `tokenizer.json`).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Token ids to continue, comma-separated, instead of `--prompt`.
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// Greedy decoding (argmax); else temperature and top-p sampling.
    #[arg(long)]
    greedy: bool,
    /// Softmax temperature of the sampler.
    #[arg(long, default_value_t = 0.7)]
    temperature: f64,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 0.9)]
    top_p: f64,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// `cpu` or `cuda:N` (`cuda` builds need `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Weights' and activations' dtype.
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    dtype: DTypeArg,
    /// Prompt tokens per prefill call (bounds the prefill's activation memory).
    #[arg(long, default_value_t = 2048)]
    prefill_chunk: usize,
    /// Prefill over this many context-parallel ranks (threads on the same device).
    #[arg(long, default_value_t = 1)]
    cp_size: usize,
    /// Writes `prefill_logits [T, vocab]` (f32) and, with `--greedy`, `decode_ids [N]` (i64)
    /// and `decode_logits [N, vocab]` (row i chose `decode_ids[i]`) to this safetensors file.
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// CPU threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Generate(args) => generate(args),
    }
}

fn open_device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::new_cuda(0)?),
        _ => match name.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => Ok(Device::new_cuda(n)?),
            None => bail!("--device: expected cpu or cuda:N, got `{name}`"),
        },
    }
}

fn bar(len: u64, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    let style =
        ProgressStyle::with_template("{prefix:>8} [{bar:30}] {pos}/{len} tokens {per_sec} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
    pb.set_style(style);
    pb.set_prefix(what.to_string());
    pb
}

fn generate(args: GenerateArgs) -> Result<()> {
    if args.prefill_chunk == 0 || args.cp_size == 0 {
        bail!("--prefill-chunk and --cp-size must be at least 1");
    }
    common::set_threads(args.threads)?;
    let device = open_device(&args.device)?;
    let t_load = Instant::now();
    let model = load_dir(&args.model, args.dtype.dtype(), &device)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let cfg = model.config();
    eprintln!(
        "loaded {} ({:?}, {} layers, D {}, GDN Hk {} / Hv {} dk {} dv {}) in {:.2?}",
        args.model.display(),
        cfg.arch,
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
        t_load.elapsed()
    );
    let tokenizer = match args.model.join("tokenizer.json") {
        p if p.exists() => Some(
            tokenizers::Tokenizer::from_file(&p)
                .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?,
        ),
        _ => None,
    };
    let prompt: Vec<u32> = match (&args.prompt_ids, &args.prompt, &tokenizer) {
        (Some(ids), _, _) => ids.clone(),
        (None, Some(text), Some(tok)) => tok
            .encode(text.as_str(), false)
            .map_err(|e| anyhow::anyhow!("tokenising the prompt: {e}"))?
            .get_ids()
            .to_vec(),
        (None, Some(_), None) => bail!(
            "--prompt needs {}/tokenizer.json; pass --prompt-ids instead",
            args.model.display()
        ),
        (None, None, _) => bail!("give --prompt or --prompt-ids"),
    };
    if prompt.is_empty() {
        bail!("the prompt has no tokens");
    }
    if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= cfg.vocab_size) {
        bail!(
            "token id {bad} is outside the vocabulary ({})",
            cfg.vocab_size
        );
    }
    let keep_all = args.logits_out.is_some();

    // Prefill.
    let t0 = Instant::now();
    let pb = bar(prompt.len() as u64, "prefill");
    let (prefill_logits, mut cache) = if args.cp_size > 1 {
        let ids = Tensor::new(prompt.as_slice(), &device)?.unsqueeze(0)?;
        let cp = ContextParallel::new(vec![device.clone(); args.cp_size])?;
        let out = prefill_context_parallel(&model, &cp, &ids)?;
        pb.set_position(prompt.len() as u64);
        (out.logits.squeeze(0)?, out.cache)
    } else {
        chunked_prefill(&model, &prompt, args.prefill_chunk, keep_all, &pb)?
    };
    device.synchronize()?;
    let prefill_s = t0.elapsed().as_secs_f64();
    pb.finish_with_message(format!(
        "{:.0} tokens/s{}",
        prompt.len() as f64 / prefill_s,
        if args.cp_size > 1 {
            format!(" over {} ranks", args.cp_size)
        } else {
            String::new()
        }
    ));

    // Decode.
    let temperature = if args.greedy { 0.0 } else { args.temperature };
    let mut sampler = Sampler::new(args.seed, temperature, args.top_p)?;
    let t = prefill_logits.dim(0)?;
    let mut logits = prefill_logits.get(t - 1)?;
    let (mut ids, mut rows) = (vec![], vec![]);
    let pb = bar(args.max_new_tokens as u64, "decode");
    let mut printed = 0;
    let t1 = Instant::now();
    for i in 0..args.max_new_tokens {
        let next = sampler.sample(&logits)?;
        ids.push(next);
        rows.push(logits.clone());
        if let Some(tok) = &tokenizer {
            let text = tok
                .decode(&ids, true)
                .map_err(|e| anyhow::anyhow!("decoding: {e}"))?;
            if text.len() > printed && text.is_char_boundary(printed) {
                pb.suspend(|| {
                    print!("{}", &text[printed..]);
                    std::io::stdout().flush().ok();
                });
                printed = text.len();
            }
        }
        pb.inc(1);
        if i + 1 < args.max_new_tokens {
            let step = Tensor::new(&[[next]], &device)?;
            logits = model
                .forward(&step, Some(&mut cache))?
                .squeeze(0)?
                .squeeze(0)?;
        }
    }
    device.synchronize()?;
    let decode_s = t1.elapsed().as_secs_f64();
    pb.finish_with_message(format!(
        "{:.1} tokens/s (sampling included)",
        ids.len() as f64 / decode_s.max(1e-9)
    ));
    if tokenizer.is_some() {
        println!();
    } else {
        println!(
            "{}",
            ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
        );
    }
    eprintln!(
        "prefill: {} tokens in {:.1} ms ({:.0} tokens/s); decode: {} tokens in {:.1} ms ({:.1} tokens/s)",
        prompt.len(),
        prefill_s * 1e3,
        prompt.len() as f64 / prefill_s,
        ids.len(),
        decode_s * 1e3,
        ids.len() as f64 / decode_s.max(1e-9)
    );

    if let Some(path) = &args.logits_out {
        let mut out = HashMap::new();
        out.insert(
            "prefill_logits".to_string(),
            prefill_logits.to_device(&Device::Cpu)?,
        );
        if args.greedy && !ids.is_empty() {
            let n = ids.len();
            let as_i64: Vec<i64> = ids.iter().map(|&x| x as i64).collect();
            out.insert(
                "decode_ids".into(),
                Tensor::from_vec(as_i64, n, &Device::Cpu)?,
            );
            out.insert(
                "decode_logits".into(),
                Tensor::stack(&rows, 0)?.to_device(&Device::Cpu)?,
            );
        }
        candle_core::safetensors::save(&out, path)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// Prefills `prompt` in calls of `chunk` tokens into a fresh cache; returns the logits of every
/// prompt position (`keep_all`) or of the last one only, `[rows, vocab]` f32.
fn chunked_prefill(
    model: &QwenHybrid,
    prompt: &[u32],
    chunk: usize,
    keep_all: bool,
    pb: &ProgressBar,
) -> Result<(Tensor, QwenCache)> {
    let mut cache = model.empty_cache(1)?;
    let mut kept = vec![];
    for part in prompt.chunks(chunk) {
        let ids = Tensor::new(part, model.device())?.unsqueeze(0)?;
        let logits = model.forward(&ids, Some(&mut cache))?.squeeze(0)?;
        let n = logits.dim(0)?;
        kept.push(if keep_all {
            logits
        } else {
            logits.narrow(0, n - 1, 1)?
        });
        if !keep_all && kept.len() > 1 {
            kept.remove(0);
        }
        pb.inc(part.len() as u64);
    }
    Ok((Tensor::cat(&kept, 0)?.to_dtype(DType::F32)?, cache))
}
