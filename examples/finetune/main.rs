//! Trains a small byte-level Gated DeltaProduct language model on the bundled public-domain
//! text (Ambrose Bierce, *The Devil's Dictionary*) with AdamW, then writes
//!
//! * `OUT/model.safetensors`: the weights under FLA's parameter names (`VarMap::save`);
//! * `OUT/config.json`: the `GdpConfig` (FLA's `GatedDeltaProductConfig` keys);
//! * `OUT/loss.svg`, `OUT/loss.csv`: the loss curve (training and held-out loss);
//!
//! and prints a short sample. See `README.md` beside this file for the command and numbers.

#[path = "../common/mod.rs"]
mod common;
mod plot;

use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_gdp::nn::{Cache, GdpConfig, GdpForCausalLM};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use clap::Parser;
use common::{ByteCorpus, Sampler, Utf8Stream};
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Train a byte-level Gated DeltaProduct LM on a text file (CPU)")]
struct Args {
    /// Optimisation steps.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// Peak learning rate (linear warm-up, then cosine decay to a tenth).
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Bytes per training window.
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// Windows per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Output directory for the checkpoint, config and loss curve.
    #[arg(long, default_value = "gdp-run")]
    out: PathBuf,
    /// Seed of the initial weights, the windows and the sample.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// CPU threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Training text (default: the bundled `examples/data/devils_dictionary.txt`).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Model width `D`.
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    /// Number of blocks.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Heads `H`.
    #[arg(long, default_value_t = 2)]
    heads: usize,
    /// Key head dimension `K` (values: `V = 2K`).
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Householder sub-steps per token `n`.
    #[arg(long, default_value_t = 2)]
    householder: usize,
    /// AdamW weight decay.
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Clip the global gradient norm to this value (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// Evaluate on held-out windows every this many steps.
    #[arg(long, default_value_t = 25)]
    eval_every: usize,
    /// Prompt of the sample printed at the end.
    #[arg(long, default_value = "LOVE, n.  ")]
    prompt: String,
    /// Bytes to sample at the end (0: no sample).
    #[arg(long, default_value_t = 300)]
    sample_len: usize,
}

/// The model: byte vocabulary, forget gate and negative eigenvalues on, no special tokens.
fn byte_config(a: &Args) -> GdpConfig {
    GdpConfig {
        hidden_size: a.hidden,
        num_hidden_layers: a.layers,
        num_heads: a.heads,
        head_dim: a.head_dim,
        expand_v: 2.0,
        num_householder: a.householder,
        use_forget_gate: true,
        allow_neg_eigval: true,
        vocab_size: common::BYTE_VOCAB,
        bos_token_id: None,
        eos_token_id: None,
        max_position_embeddings: a.seq_len,
        ..GdpConfig::default()
    }
}

/// What one optimisation step reports.
struct StepStats {
    /// Mean cross-entropy of the batch, nats/byte.
    loss: f32,
    /// Global gradient norm before clipping.
    grad_norm: f32,
}

/// Mean next-byte cross-entropy (nats/byte) of `inputs [B, T]` against `targets [B, T]`.
fn lm_loss(model: &GdpForCausalLM, inputs: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logits = model.forward(inputs, None)?; // [B, T, vocab]
    let (b, t, v) = logits.dims3()?;
    let loss =
        candle_nn::loss::cross_entropy(&logits.reshape((b * t, v))?, &targets.reshape(b * t)?)?;
    Ok(loss)
}

/// Scales `grads` so that their global L2 norm is at most `clip`; returns the norm before.
fn clip_grad_norm(grads: &mut GradStore, vars: &[Var], clip: f64) -> Result<f32> {
    let mut sq = 0f32;
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            sq += g.sqr()?.sum_all()?.to_scalar::<f32>()?;
        }
    }
    let norm = sq.sqrt();
    if !norm.is_finite() {
        bail!("the gradient norm is {norm}: training diverged (lower --lr?)");
    }
    if clip > 0.0 && norm as f64 > clip {
        let scale = clip / norm as f64;
        for v in vars {
            if let Some(g) = grads.get(v.as_tensor()) {
                let scaled = (g * scale)?;
                grads.insert(v.as_tensor(), scaled);
            }
        }
    }
    Ok(norm)
}

/// One optimisation step on one batch of windows: forward, loss, backward, gradient clipping,
/// AdamW update. A context-parallel variant keeps this signature (same batch in, same
/// statistics out) and only changes how the forward and backward are computed.
fn train_step(
    model: &GdpForCausalLM,
    opt: &mut AdamW,
    vars: &[Var],
    (inputs, targets): (&Tensor, &Tensor),
    clip: f64,
) -> Result<StepStats> {
    let loss = lm_loss(model, inputs, targets)?;
    let mut grads = loss.backward()?;
    let grad_norm = clip_grad_norm(&mut grads, vars, clip)?;
    opt.step(&grads)?;
    Ok(StepStats {
        loss: loss.to_scalar::<f32>()?,
        grad_norm,
    })
}

/// Mean loss over fixed held-out batches (forward only).
fn evaluate(model: &GdpForCausalLM, batches: &[(Tensor, Tensor)]) -> Result<f32> {
    let mut total = 0f32;
    for (x, y) in batches {
        total += lm_loss(model, x, y)?.to_scalar::<f32>()?;
    }
    Ok(total / batches.len().max(1) as f32)
}

/// Linear warm-up over `warmup` steps, then cosine decay from `peak` to `peak / 10`.
fn learning_rate(step: usize, steps: usize, peak: f64) -> f64 {
    let warmup = (steps / 10).clamp(1, 30);
    if step <= warmup {
        return peak * step as f64 / warmup as f64;
    }
    let progress = (step - warmup) as f64 / (steps - warmup).max(1) as f64;
    let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    peak * (0.1 + 0.9 * cosine)
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.steps == 0 || args.batch == 0 || args.seq_len == 0 || args.eval_every == 0 {
        bail!("--steps, --batch, --seq-len and --eval-every must be at least 1");
    }
    common::set_threads(args.threads)?;
    let device = Device::Cpu;
    let data_path = args
        .data
        .clone()
        .unwrap_or_else(|| PathBuf::from(common::DEFAULT_DATA));
    let corpus = ByteCorpus::load(&data_path, 0.05)?;

    let cfg = byte_config(&args);
    let varmap = VarMap::new();
    let model = GdpForCausalLM::new(
        &cfg,
        VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &device),
    )?;
    common::seed_vars(&varmap, &cfg, args.seed)?;
    let vars = common::sorted_vars(&varmap)?;
    let n_params: usize = vars.iter().map(|v| v.elem_count()).sum();
    let mut opt = AdamW::new(
        vars.clone(),
        ParamsAdamW {
            lr: args.lr,
            weight_decay: args.weight_decay,
            ..Default::default()
        },
    )?;
    println!(
        "data: {} ({} bytes train, {} held out)",
        data_path.display(),
        corpus.train.len(),
        corpus.valid.len()
    );
    println!(
        "model: D={} layers={} H={} K={} V={} n={} ({:.2}M parameters), {} threads",
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_heads,
        cfg.head_k_dim(),
        cfg.head_v_dim(),
        cfg.num_householder,
        n_params as f64 / 1e6,
        candle_core::utils::get_num_threads()
    );
    println!(
        "training: {} steps x {} windows x {} bytes, AdamW lr {:e}",
        args.steps, args.batch, args.seq_len, args.lr
    );

    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut eval_rng = StdRng::seed_from_u64(args.seed.wrapping_add(1));
    let eval_batches = (0..4)
        .map(|_| {
            common::sample_windows(
                &corpus.valid,
                args.batch,
                args.seq_len,
                &mut eval_rng,
                &device,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let mut train_curve: Vec<(f64, f64)> = Vec::with_capacity(args.steps);
    let mut val_curve = vec![(0.0, evaluate(&model, &eval_batches)? as f64)];
    println!(
        "step 0: held-out loss {:.3} (ln 256 = 5.545)",
        val_curve[0].1
    );

    let pb = ProgressBar::new(args.steps as u64).with_style(ProgressStyle::with_template(
        "{elapsed_precise} [{bar:30}] {pos}/{len} {msg}",
    )?);
    let tokens_per_step = (args.batch * args.seq_len) as f64;
    let (mut train_secs, mut ema_tok_s) = (0f64, 0f64);
    let t_start = Instant::now();
    for step in 1..=args.steps {
        opt.set_learning_rate(learning_rate(step, args.steps, args.lr));
        let (x, y) =
            common::sample_windows(&corpus.train, args.batch, args.seq_len, &mut rng, &device)?;
        let t0 = Instant::now();
        let stats = train_step(&model, &mut opt, &vars, (&x, &y), args.clip)?;
        let dt = t0.elapsed().as_secs_f64();
        train_secs += dt;
        let tok_s = tokens_per_step / dt;
        ema_tok_s = if step == 1 {
            tok_s
        } else {
            0.9 * ema_tok_s + 0.1 * tok_s
        };
        train_curve.push((step as f64, stats.loss as f64));
        pb.set_message(format!(
            "loss {:.3} | {:.0} tok/s | lr {:.1e} | |g| {:.2}",
            stats.loss,
            ema_tok_s,
            opt.learning_rate(),
            stats.grad_norm
        ));
        pb.inc(1);
        if step % args.eval_every == 0 || step == args.steps {
            let val = evaluate(&model, &eval_batches)?;
            val_curve.push((step as f64, val as f64));
            let recent = &train_curve[train_curve.len().saturating_sub(args.eval_every)..];
            let train_avg = recent.iter().map(|p| p.1).sum::<f64>() / recent.len() as f64;
            pb.suspend(|| {
                println!(
                    "step {step}: train loss {train_avg:.3} (mean of last {}), held-out {val:.3}, {:.0} tok/s, {:.0}s",
                    recent.len(),
                    tokens_per_step * step as f64 / train_secs,
                    t_start.elapsed().as_secs_f64()
                )
            });
        }
    }
    pb.finish();
    let wall = t_start.elapsed().as_secs_f64();
    let first =
        train_curve.iter().take(5).map(|p| p.1).sum::<f64>() / train_curve.len().min(5) as f64;
    let tail = &train_curve[train_curve.len().saturating_sub(20)..];
    let last = tail.iter().map(|p| p.1).sum::<f64>() / tail.len() as f64;
    println!(
        "done: {} steps in {wall:.1}s ({:.0} tokens/s training); train loss {first:.3} -> {last:.3} \
         (first 5 / last 20 steps), held-out {:.3} -> {:.3} nats/byte",
        args.steps,
        tokens_per_step * args.steps as f64 / train_secs,
        val_curve[0].1,
        val_curve[val_curve.len() - 1].1
    );

    let weights = common::save_checkpoint(&args.out, &varmap, &cfg)?;
    let title = format!(
        "GDP byte LM: D={} L={} H={} K={} n={}, batch {}x{}, lr {:e}",
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_heads,
        cfg.head_dim,
        cfg.num_householder,
        args.batch,
        args.seq_len,
        args.lr
    );
    plot::write_curves(&args.out, &title, &train_curve, &val_curve)?;
    println!(
        "wrote {}, config.json, loss.svg, loss.csv in {}",
        weights.file_name().and_then(|f| f.to_str()).unwrap_or(""),
        args.out.display()
    );

    if args.sample_len > 0 {
        print_sample(&model, &cfg, &args, &device)?;
    }
    Ok(())
}

/// Samples `--sample-len` bytes after `--prompt` (temperature 0.8, top-p 0.95).
fn print_sample(
    model: &GdpForCausalLM,
    cfg: &GdpConfig,
    args: &Args,
    device: &Device,
) -> Result<()> {
    let mut cache = Cache::new(cfg, 1, candle_core::DType::F32, device)?;
    let prompt: Vec<u32> = args.prompt.bytes().map(u32::from).collect();
    let mut sampler = Sampler::new(args.seed, 0.8, 0.95)?;
    let mut out = Utf8Stream::default();
    println!("--- sample (temperature 0.8, top-p 0.95) ---");
    print!("{}", args.prompt);
    let mut logits = common::prefill(model, &mut cache, &prompt, 64, device)?;
    for _ in 0..args.sample_len {
        let next = sampler.sample(&logits)?;
        out.push(next as u8)?;
        logits = common::decode_step(model, &mut cache, next, device)?;
    }
    out.finish()
}
