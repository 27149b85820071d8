//! Trains a small byte-level Gated DeltaProduct language model on the bundled public-domain
//! text (Ambrose Bierce, *The Devil's Dictionary*) with AdamW, then writes
//!
//! * `OUT/model.safetensors`: the weights under FLA's parameter names (`VarMap::save`);
//! * `OUT/config.json`: the `GdpConfig` (FLA's `GatedDeltaProductConfig` keys);
//! * `OUT/loss.svg`, `OUT/loss.csv`: the loss curve (training and held-out loss);
//!
//! and prints a short sample. With `--cp-size R > 1` every window is split along time over R
//! context-parallel ranks (one thread each, `candle_gdp::ContextParallel::cpu`), each rank
//! holding the same model and optimiser. See `README.md` beside this file for the command and
//! numbers.

#[path = "../common/mod.rs"]
mod common;
mod plot;

use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var, D};
use candle_gdp::cp::ShardPlan;
use candle_gdp::nn::{all_reduce_var_grads, Cache, CpContext, GdpConfig, GdpForCausalLM};
use candle_gdp::ContextParallel;
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
    /// Context-parallel ranks: every window is split along time over this many rank threads
    /// (1: no context parallelism). Each rank needs at least `conv_size - 1` = 3 bytes.
    #[arg(long, default_value_t = 1)]
    cp_size: usize,
    /// CPU threads (default: all cores), shared by all ranks.
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
/// AdamW update. [`train_step_cp`] is the context-parallel variant (same batch in, same
/// statistics out; only the forward and backward are split over the ranks).
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

/// `Σ -log p(target)` over `logits [B, T, V]` and `targets [B, T]` (a scalar).
fn nll_sum(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let lp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    Ok(lp
        .gather(&targets.contiguous()?.unsqueeze(2)?, 2)?
        .sum_all()?
        .neg()?)
}

/// This rank's contiguous time shard of `x [B, T]` (shards differ by at most one token).
fn time_shard(x: &Tensor, ctx: &CpContext) -> Result<Tensor> {
    let comm = ctx.comm();
    let range = ShardPlan::new(x.dim(1)?, comm.world_size())?.range(comm.rank())?;
    Ok(x.narrow(1, range.start, range.len())?)
}

/// This rank's share of the batch loss: the local cross-entropy sum over its shard (still in
/// the graph) and the global `[Σ loss, token count]`, all-reduced over the ranks.
fn cp_loss(
    model: &GdpForCausalLM,
    (inputs, targets): (&Tensor, &Tensor),
    ctx: &CpContext,
) -> Result<(Tensor, [f32; 2])> {
    let (xs, ys) = (time_shard(inputs, ctx)?, time_shard(targets, ctx)?);
    let local = nll_sum(&model.forward_cp(&xs, ctx)?, &ys)?;
    let mut total = [local.to_scalar::<f32>()?, ys.elem_count() as f32];
    ctx.comm().all_reduce_sum(&mut total)?;
    Ok((local, total))
}

/// [`train_step`] as one rank of a context-parallel group: the same full batch in (every rank
/// passes the same windows; this rank keeps its time shard), the same statistics out. The
/// local loss sum is divided by the global token count, so the gradients summed over the ranks
/// are those of the single-device mean loss; every rank then clips and steps its own AdamW
/// with identical gradients, so the ranks' weights stay identical. A collective: all ranks
/// call it in the same order.
fn train_step_cp(
    model: &GdpForCausalLM,
    opt: &mut AdamW,
    vars: &[Var],
    batch: (&Tensor, &Tensor),
    clip: f64,
    ctx: &CpContext,
) -> Result<StepStats> {
    let (local, [sum, count]) = cp_loss(model, batch, ctx)?;
    let mut grads = (local / count as f64)?.backward()?;
    all_reduce_var_grads(&mut grads, vars, ctx.comm().as_ref())?;
    let grad_norm = clip_grad_norm(&mut grads, vars, clip)?;
    opt.step(&grads)?;
    Ok(StepStats {
        loss: sum / count,
        grad_norm,
    })
}

/// How a step and the evaluation are computed: on the whole batch, or as one rank of a
/// context-parallel group.
#[derive(Clone, Copy)]
enum Parallel<'a> {
    Single,
    Context(&'a CpContext),
}

impl Parallel<'_> {
    fn is_main(&self) -> bool {
        match self {
            Parallel::Single => true,
            Parallel::Context(ctx) => ctx.comm().rank() == 0,
        }
    }

    fn train_step(
        &self,
        model: &GdpForCausalLM,
        opt: &mut AdamW,
        vars: &[Var],
        batch: (&Tensor, &Tensor),
        clip: f64,
    ) -> Result<StepStats> {
        match self {
            Parallel::Single => train_step(model, opt, vars, batch, clip),
            Parallel::Context(ctx) => train_step_cp(model, opt, vars, batch, clip, ctx),
        }
    }

    /// Mean loss over fixed held-out batches (forward only; with CP a collective).
    fn evaluate(&self, model: &GdpForCausalLM, batches: &[(Tensor, Tensor)]) -> Result<f32> {
        let mut total = 0f32;
        for (x, y) in batches {
            total += match self {
                Parallel::Single => lm_loss(model, x, y)?.to_scalar::<f32>()?,
                Parallel::Context(ctx) => {
                    let (_, [sum, count]) = cp_loss(model, (x, y), ctx)?;
                    sum / count
                }
            };
        }
        Ok(total / batches.len().max(1) as f32)
    }
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

/// What the training leaves behind (on rank 0).
struct Trained {
    varmap: VarMap,
    model: GdpForCausalLM,
    train_curve: Vec<(f64, f64)>,
    val_curve: Vec<(f64, f64)>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.steps == 0 || args.batch == 0 || args.seq_len == 0 || args.eval_every == 0 {
        bail!("--steps, --batch, --seq-len and --eval-every must be at least 1");
    }
    let cfg = byte_config(&args);
    // forward_cp needs W - 1 tokens per shard (the short-convolution halo), at least one.
    let per_rank = if cfg.use_short_conv {
        cfg.conv_size.saturating_sub(1).max(1)
    } else {
        1
    };
    let max_ranks = args.seq_len / per_rank;
    if args.cp_size == 0 || args.cp_size > max_ranks {
        bail!(
            "--cp-size must be between 1 and {max_ranks} (--seq-len {} / {per_rank} bytes per \
             rank for the width-{} short convolution), got {}",
            args.seq_len,
            cfg.conv_size,
            args.cp_size
        );
    }
    common::set_threads(args.threads)?;
    let data_path = args
        .data
        .clone()
        .unwrap_or_else(|| PathBuf::from(common::DEFAULT_DATA));
    let corpus = ByteCorpus::load(&data_path, 0.05)?;
    println!(
        "data: {} ({} bytes train, {} held out)",
        data_path.display(),
        corpus.train.len(),
        corpus.valid.len()
    );

    let trained = if args.cp_size == 1 {
        train(&args, &cfg, &corpus, Parallel::Single)?
    } else {
        // One thread per rank; every rank trains its own identical copy of the model.
        let ranks = ContextParallel::cpu(args.cp_size)?.run(|comm, _| {
            let ctx = CpContext::new(comm);
            train(&args, &cfg, &corpus, Parallel::Context(&ctx))
                .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
        })?;
        ranks.into_iter().flatten().next()
    }
    .ok_or_else(|| anyhow::anyhow!("rank 0 returned no model"))?;

    let weights = common::save_checkpoint(&args.out, &trained.varmap, &cfg)?;
    let title = format!(
        "GDP byte LM: D={} L={} H={} K={} n={}, batch {}x{}, lr {:e}{}",
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_heads,
        cfg.head_dim,
        cfg.num_householder,
        args.batch,
        args.seq_len,
        args.lr,
        if args.cp_size > 1 {
            format!(", CP {}", args.cp_size)
        } else {
            String::new()
        }
    );
    plot::write_curves(&args.out, &title, &trained.train_curve, &trained.val_curve)?;
    println!(
        "wrote {}, config.json, loss.svg, loss.csv in {}",
        weights.file_name().and_then(|f| f.to_str()).unwrap_or(""),
        args.out.display()
    );

    if args.sample_len > 0 {
        print_sample(&trained.model, &cfg, &args, &Device::Cpu)?;
    }
    Ok(())
}

/// The training run of one rank (or of the single device): builds the seeded model, draws the
/// same windows on every rank, trains and evaluates. Rank 0 prints, shows the progress bar and
/// returns the model and the loss curves; the other ranks return `None`.
fn train(
    args: &Args,
    cfg: &GdpConfig,
    corpus: &ByteCorpus,
    par: Parallel,
) -> Result<Option<Trained>> {
    let main = par.is_main();
    let device = Device::Cpu;
    let varmap = VarMap::new();
    let model = GdpForCausalLM::new(
        cfg,
        VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &device),
    )?;
    common::seed_vars(&varmap, cfg, args.seed)?;
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
    if main {
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
        let cp = match par {
            Parallel::Single => String::new(),
            Parallel::Context(ctx) => {
                let plan = ShardPlan::new(args.seq_len, ctx.comm().world_size())?;
                format!(
                    ", context parallel over {} ranks (bytes {:?} of each window)",
                    plan.cp_size(),
                    plan.ranges()
                )
            }
        };
        println!(
            "training: {} steps x {} windows x {} bytes, AdamW lr {:e}{cp}",
            args.steps, args.batch, args.seq_len, args.lr
        );
    }

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
    let mut val_curve = vec![(0.0, par.evaluate(&model, &eval_batches)? as f64)];
    if main {
        println!(
            "step 0: held-out loss {:.3} (ln 256 = 5.545)",
            val_curve[0].1
        );
    }

    let pb = if main {
        ProgressBar::new(args.steps as u64).with_style(ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/{len} {msg}",
        )?)
    } else {
        ProgressBar::hidden()
    };
    let tokens_per_step = (args.batch * args.seq_len) as f64;
    let (mut train_secs, mut ema_tok_s) = (0f64, 0f64);
    let t_start = Instant::now();
    for step in 1..=args.steps {
        opt.set_learning_rate(learning_rate(step, args.steps, args.lr));
        let (x, y) =
            common::sample_windows(&corpus.train, args.batch, args.seq_len, &mut rng, &device)?;
        let t0 = Instant::now();
        let stats = par.train_step(&model, &mut opt, &vars, (&x, &y), args.clip)?;
        let dt = t0.elapsed().as_secs_f64();
        train_secs += dt;
        let tok_s = tokens_per_step / dt;
        ema_tok_s = if step == 1 {
            tok_s
        } else {
            0.9 * ema_tok_s + 0.1 * tok_s
        };
        train_curve.push((step as f64, stats.loss as f64));
        if main {
            pb.set_message(format!(
                "loss {:.3} | {:.0} tok/s | lr {:.1e} | |g| {:.2}",
                stats.loss,
                ema_tok_s,
                opt.learning_rate(),
                stats.grad_norm
            ));
            pb.inc(1);
        }
        if step % args.eval_every == 0 || step == args.steps {
            let val = par.evaluate(&model, &eval_batches)?;
            val_curve.push((step as f64, val as f64));
            let recent = &train_curve[train_curve.len().saturating_sub(args.eval_every)..];
            let train_avg = recent.iter().map(|p| p.1).sum::<f64>() / recent.len() as f64;
            if main {
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
    }
    if !main {
        return Ok(None);
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
    Ok(Some(Trained {
        varmap,
        model,
        train_curve,
        val_curve,
    }))
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
