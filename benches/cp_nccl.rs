//! Weak scaling of context parallelism over NCCL (feature `nccl`, one process per GPU, started
//! by `gdp launch`): every rank holds `T` tokens of one dense sequence (R GPUs process R·T
//! tokens), bf16, H16, K = V = 128, n = 2, forward + backward.
//!
//! ```text
//! cargo bench --features nccl --bench cp_nccl --no-run        # prints the binary's path
//! gdp launch --nproc 2 -- <that binary> --tokens 32768 --iters 5
//! ```
//!
//! Each rank first times the plain single-GPU op on its own `T` tokens (the 1-GPU baseline,
//! all GPUs at once), then the context-parallel op on its shard. An iteration starts after a
//! barrier and ends when every rank is done (the slowest rank's time counts); reported: the
//! median over `--iters` timed iterations after `--warmup` ones, tokens/s, and the weak-scaling
//! efficiency `t(1 GPU, T) / t(R GPUs, R·T)`, plus each rank's forward and backward times and
//! its time in collectives (including waiting for slower ranks).

use candle_core::{DType, Device, Tensor, Var, D};
use candle_gdp::cp::{
    cp_gated_delta_product, dense_rank_meta, Communicator, Composition, CpRank, DistEnv, NcclComm,
    ShardPlan, DEFAULT_TIMEOUT,
};
use candle_gdp::{gated_delta_product, GdpOptions, SaveIntermediates};
use clap::Parser;
use std::sync::Arc;
use std::time::Instant;

/// Weak-scaling benchmark of CP over NCCL; run under `gdp launch`.
#[derive(Debug, Parser)]
struct Args {
    /// Tokens per rank.
    #[arg(long, default_value_t = 32768)]
    tokens: usize,
    /// Timed iterations (median reported).
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Warm-up iterations.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Heads.
    #[arg(long, default_value_t = 16)]
    heads: usize,
    /// Key = value head dimension.
    #[arg(long, default_value_t = 128)]
    dim: usize,
    /// Householder sub-steps per token.
    #[arg(long, default_value_t = 2)]
    n: usize,
    /// Skip the single-GPU baseline.
    #[arg(long)]
    no_baseline: bool,
    /// What the forward keeps for the backward (`save_intermediates`), in the baseline and on
    /// the ranks.
    #[arg(long, value_enum, default_value_t = Save::Wy)]
    save: Save,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// [`SaveIntermediates`] on the command line.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Save {
    Nothing,
    Wy,
    All,
}

impl From<Save> for SaveIntermediates {
    fn from(s: Save) -> Self {
        match s {
            Save::Nothing => Self::Nothing,
            Save::Wy => Self::WyFactors,
            Save::All => Self::All,
        }
    }
}

type Res<T> = candle_core::Result<T>;

/// One rank's inputs (`T` tokens), bf16 on its GPU, as leaves for autograd.
struct Inputs {
    q: Var,
    k: Var,
    v: Var,
    g: Var,
    beta: Var,
    dout: Tensor,
}

fn inputs(a: &Args, dev: &Device, seed: u64) -> Res<Inputs> {
    let (t, h, d, n) = (a.tokens, a.heads, a.dim, a.n);
    dev.set_seed(seed)?;
    let unit = |rows: usize| -> Res<Tensor> {
        let x = Tensor::randn(0f32, 1.0, (1, rows, h, d), dev)?;
        let norm = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
        x.broadcast_div(&norm)?.to_dtype(DType::BF16)
    };
    let q = unit(t)?;
    let k = unit(t * n)?;
    let v = Tensor::randn(0f32, 1.0, (1, t * n, h, d), dev)?.to_dtype(DType::BF16)?;
    let g = (Tensor::rand(0f32, 1.0, (1, t, h), dev)? * -0.1)?;
    let beta = candle_nn::ops::sigmoid(&Tensor::randn(0f32, 1.0, (1, t * n, h), dev)?)?
        .to_dtype(DType::BF16)?;
    let dout = Tensor::randn(0f32, 1.0, (1, t, h, d), dev)?;
    Ok(Inputs {
        q: Var::from_tensor(&q)?,
        k: Var::from_tensor(&k)?,
        v: Var::from_tensor(&v)?,
        g: Var::from_tensor(&g)?,
        beta: Var::from_tensor(&beta)?,
        dout,
    })
}

/// Forward and backward; returns (forward ms, forward + backward ms), the device synchronised.
fn step(x: &Inputs, dev: &Device, rank: Option<&CpRank>, save: Save) -> Res<(f64, f64)> {
    let opts = GdpOptions {
        save_intermediates: save.into(),
        ..Default::default()
    };
    let t0 = Instant::now();
    let (o, _) = match rank {
        Some(rank) => cp_gated_delta_product(&x.q, &x.k, &x.v, &x.g, &x.beta, &opts, rank)?,
        None => gated_delta_product(&x.q, &x.k, &x.v, &x.g, &x.beta, &opts)?,
    };
    dev.synchronize()?;
    let fwd = t0.elapsed().as_secs_f64() * 1e3;
    // PyTorch's `o.backward(dout)`: no loss ops around the op.
    let grads = candle_gdp::backward_with(&[(&o, &x.dout)])?;
    dev.synchronize()?;
    let total = t0.elapsed().as_secs_f64() * 1e3;
    drop(grads);
    Ok((fwd, total))
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let m = xs.len() / 2;
    if xs.len() % 2 == 1 {
        xs[m]
    } else {
        0.5 * (xs[m - 1] + xs[m])
    }
}

fn main() -> Res<()> {
    let a = Args::parse();
    let env = DistEnv::from_vars(std::env::vars_os())?;
    let dev = NcclComm::local_device(&env)?;
    candle_gdp::op::cuda::retain_freed_memory(&dev)?;
    let comm = Arc::new(NcclComm::from_dist_env(&dev, &env, DEFAULT_TIMEOUT)?);
    let (r, w) = (comm.rank(), comm.world_size());
    let x = inputs(&a, &dev, 1000 + r as u64)?;
    let iters = a.iters.max(1);
    if r == 0 {
        println!(
            "cp_nccl: {w} rank(s), {} tokens/rank ({} in all), bf16 H{} K=V={} n={}, fwd+bwd, \
             median of {iters} after {} warm-up, save_intermediates {:?}",
            a.tokens,
            a.tokens * w,
            a.heads,
            a.dim,
            a.n,
            a.warmup,
            SaveIntermediates::from(a.save)
        );
    }
    // Baseline: the plain op on this GPU's T tokens (all GPUs at once, no communication).
    let baseline = if a.no_baseline {
        None
    } else {
        for _ in 0..a.warmup {
            step(&x, &dev, None, a.save)?;
        }
        let ms: Vec<f64> = (0..iters)
            .map(|_| step(&x, &dev, None, a.save).map(|s| s.1))
            .collect::<Res<_>>()?;
        let mine = median(ms);
        let all = comm.all_gather(&[mine as f32])?;
        Some((all[0] as f64, all))
    };
    // Context parallel: this rank's shard of the R·T-token sequence.
    let plan = ShardPlan::new(a.tokens * w, w)?;
    let rank = CpRank {
        comm: comm.clone() as Arc<dyn Communicator>,
        meta: dense_rank_meta(&plan, r)?,
        composition: Composition::Fold,
    };
    for _ in 0..a.warmup {
        comm.barrier()?;
        step(&x, &dev, Some(&rank), a.save)?;
    }
    let mut per_iter = vec![];
    let (mut fwd, mut tot) = (vec![], vec![]);
    let mut comm_ms = 0.0;
    for _ in 0..iters {
        comm.barrier()?;
        let before = comm.stats();
        let (f, t) = step(&x, &dev, Some(&rank), a.save)?;
        let after = comm.stats();
        comm_ms += (after.wait - before.wait).as_secs_f64() * 1e3;
        fwd.push(f);
        tot.push(t);
        let all = comm.all_gather(&[t as f32])?;
        per_iter.push(all.iter().copied().fold(0.0f32, f32::max) as f64);
    }
    let (fwd_med, tot_med) = (median(fwd), median(tot));
    let mine = [
        fwd_med as f32,
        (tot_med - fwd_med) as f32,
        tot_med as f32,
        (comm_ms / iters as f64) as f32,
    ];
    let table = comm.all_gather(&mine)?;
    if r == 0 {
        let t_r = median(per_iter);
        let toks = (a.tokens * w) as f64 / (t_r * 1e-3);
        println!("rank | fwd ms | bwd ms | fwd+bwd ms | in collectives ms | 1-GPU baseline ms");
        for q in 0..w {
            let row = &table[q * 4..q * 4 + 4];
            let base = baseline
                .as_ref()
                .map_or("-".to_string(), |(_, all)| format!("{:.1}", all[q]));
            println!(
                "{q:>4} | {:>6.1} | {:>6.1} | {:>10.1} | {:>17.1} | {base:>17}",
                row[0], row[1], row[2], row[3]
            );
        }
        let (base_ms, eff) = match &baseline {
            Some((b, _)) => (format!("{b:.1}"), format!("{:.3}", b / t_r)),
            None => ("-".into(), "-".into()),
        };
        println!(
            "RESULT world={w} tokens_per_rank={} total_tokens={} ms={t_r:.1} tokens_per_s={toks:.0} \
             baseline_1gpu_ms={base_ms} efficiency={eff}",
            a.tokens,
            a.tokens * w
        );
    }
    comm.barrier()?;
    Ok(())
}
