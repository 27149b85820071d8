//! One context-parallel rank timed alone on one device ([`rank_alone`]): the rank's real
//! forward and backward (summaries, exchange, fold, local op) against the plain op on the same
//! shard, in the same run. Peers are played by a [`ReplicaComm`], so one device suffices.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, D};
use serde::Serialize;

use super::comm::{Communicator, ReplicaComm};
use super::context::{cp_gated_delta_product, CpRank};
use super::protocol::Composition;
use super::shard::{dense_rank_meta, ShardPlan};
use crate::autograd::backward_with;
use crate::error::GdpError;
use crate::op::{gated_delta_product, GdpOptions, SaveIntermediates};

/// What [`rank_alone`] runs: rank `rank` of `ranks` on one dense sequence of `tokens` tokens
/// (the rank holds its shard of [`ShardPlan::new`]`(tokens, ranks)`), `heads` heads,
/// `q, k [.., K = dk]`, `v [.., V = dv]`, `householder` keys per token.
#[derive(Debug, Clone)]
pub struct RankBenchConfig {
    /// Ranks `R` of the group.
    pub ranks: usize,
    /// The rank timed, below `R`.
    pub rank: usize,
    /// Tokens `T` of the whole dense sequence (`B = 1`).
    pub tokens: usize,
    /// Heads `H`.
    pub heads: usize,
    /// Key head dimension `K`.
    pub dk: usize,
    /// Value head dimension `V`.
    pub dv: usize,
    /// Householder keys per token `n`.
    pub householder: usize,
    /// Dtype of `q, k, v, beta` (the gate is f32).
    pub dtype: DType,
    /// Where the plain op and the rank run.
    pub device: Device,
    /// What the forward keeps for the backward, in both the plain op and the rank.
    pub save_intermediates: SaveIntermediates,
    /// CUDA kernel choices of the plain op and the rank alike.
    pub kernels: crate::op::KernelConfig,
    /// Untimed iterations first.
    pub warmup: usize,
    /// Timed iterations (medians reported).
    pub iters: usize,
}

/// The medians of [`rank_alone`] in milliseconds; `efficiency = plain_ms / rank_ms` (1.0: a rank
/// costs what the plain op on its shard costs).
#[derive(Debug, Clone, Serialize)]
pub struct RankBenchReport {
    /// Ranks `R` of the group.
    pub ranks: usize,
    /// The rank timed.
    pub rank: usize,
    /// Tokens of the whole sequence.
    pub tokens: usize,
    /// Tokens of the rank's shard (what the plain op ran on).
    pub shard_tokens: usize,
    /// Heads `H`.
    pub heads: usize,
    /// Key head dimension `K`.
    pub dk: usize,
    /// Value head dimension `V`.
    pub dv: usize,
    /// Householder keys per token `n`.
    pub householder: usize,
    /// Dtype of `q, k, v, beta` (`f32`, `bf16`, `f16`).
    pub dtype: String,
    /// The device, as Candle names its location.
    pub device: String,
    /// Timed iterations behind each median.
    pub iters: usize,
    /// Plain op on the shard, forward + backward.
    pub plain_ms: f64,
    /// The rank, forward + backward.
    pub rank_ms: f64,
    /// `plain_ms / rank_ms`.
    pub efficiency: f64,
    /// Plain op on the shard, forward alone.
    pub plain_fwd_ms: f64,
    /// The rank, forward alone.
    pub rank_fwd_ms: f64,
    /// `plain_fwd_ms / rank_fwd_ms`.
    pub fwd_efficiency: f64,
    /// Plain op, forward alone: the host's time until the call returned, before the device
    /// was synchronised (launching the work; close to `plain_fwd_ms`, the host bounds it).
    pub plain_fwd_host_ms: f64,
    /// The rank, forward alone: the host's time until the call returned.
    pub rank_fwd_host_ms: f64,
    /// Plain op, forward + backward: the host's time until each call returned, summed.
    pub plain_host_ms: f64,
    /// The rank, forward + backward: the host's time until each call returned, summed.
    pub rank_host_ms: f64,
    /// Shard tokens per second of the rank, forward + backward.
    pub rank_tokens_per_s: f64,
    /// Shard tokens per second of the plain op, forward + backward.
    pub plain_tokens_per_s: f64,
}

/// One shard's inputs as tracked variables and the output cotangent.
struct Shard {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    dout: Tensor,
}

fn unit_rows(shape: (usize, usize, usize, usize), dtype: DType, dev: &Device) -> Result<Tensor> {
    let x = Tensor::randn(0f32, 1.0, shape, dev)?;
    let norm = x.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
    x.broadcast_div(&norm)?.to_dtype(dtype)
}

fn shard_inputs(c: &RankBenchConfig, t: usize) -> Result<Shard> {
    let (h, n, dev) = (c.heads, c.householder, &c.device);
    let var = |x: Tensor| -> Result<Tensor> {
        Ok(candle_core::Var::from_tensor(&x)?.as_tensor().clone())
    };
    let beta = candle_nn::ops::sigmoid(&Tensor::randn(0f32, 1.0, (1, t * n, h), dev)?)?;
    Ok(Shard {
        q: var(unit_rows((1, t, h, c.dk), c.dtype, dev)?)?,
        k: var(unit_rows((1, t * n, h, c.dk), c.dtype, dev)?)?,
        v: var(Tensor::randn(0f32, 1.0, (1, t * n, h, c.dv), dev)?.to_dtype(c.dtype)?)?,
        g: var((Tensor::rand(0f32, 1.0, (1, t, h), dev)? * -0.1)?)?,
        beta: var(beta.to_dtype(c.dtype)?)?,
        dout: Tensor::randn(0f32, 1.0, (1, t, h, c.dv), dev)?.to_dtype(c.dtype)?,
    })
}

/// The times of one [`step`] (ms): forward and forward + backward, each until the device was
/// synchronised, and the host's time until the calls returned (forward, both summed).
#[derive(Debug, Clone, Copy)]
struct StepTimes {
    fwd: f64,
    total: f64,
    fwd_host: f64,
    total_host: f64,
}

/// Forward, then forward + backward of one call, the device synchronised after each.
fn step(x: &Shard, c: &RankBenchConfig, rank: Option<&CpRank>) -> Result<StepTimes> {
    let opts = GdpOptions {
        save_intermediates: c.save_intermediates,
        kernels: c.kernels,
        ..Default::default()
    };
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
    let t0 = Instant::now();
    let (o, _) = match rank {
        Some(r) => cp_gated_delta_product(&x.q, &x.k, &x.v, &x.g, &x.beta, &opts, r)?,
        None => gated_delta_product(&x.q, &x.k, &x.v, &x.g, &x.beta, &opts)?,
    };
    let fwd_host = ms(t0);
    c.device.synchronize()?;
    let fwd = ms(t0);
    let t1 = Instant::now();
    let grads = backward_with(&[(&o, &x.dout)])?;
    let bwd_host = ms(t1);
    c.device.synchronize()?;
    let total = ms(t0);
    drop(grads);
    Ok(StepTimes {
        fwd,
        total,
        fwd_host,
        total_host: fwd_host + bwd_host,
    })
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let m = xs.len() / 2;
    match xs.len() {
        0 => f64::NAN,
        l if l % 2 == 1 => xs[m],
        _ => 0.5 * (xs[m - 1] + xs[m]),
    }
}

/// Times rank `c.rank` of `c.ranks` (forward, and forward + backward through
/// [`backward_with`]) and the plain op on the same shard, alternating the two in every
/// iteration; `progress` is called after each timed iteration with its index.
pub fn rank_alone(c: &RankBenchConfig, mut progress: impl FnMut(usize)) -> Result<RankBenchReport> {
    if c.iters == 0 {
        return Err(GdpError::Option {
            name: "iters".into(),
            reason: "needs at least one timed iteration, got 0".into(),
        }
        .into());
    }
    let plan = ShardPlan::new(c.tokens, c.ranks)?;
    let comm: Arc<dyn Communicator> = Arc::new(ReplicaComm::new(c.rank, c.ranks)?);
    let cp = CpRank {
        comm,
        meta: dense_rank_meta(&plan, c.rank)?,
        composition: Composition::Fold,
    };
    let t = plan.len(c.rank)?;
    let x = shard_inputs(c, t)?;
    for _ in 0..c.warmup {
        step(&x, c, None)?;
        step(&x, c, Some(&cp))?;
    }
    let (mut plain, mut ranked) = (vec![], vec![]);
    for i in 0..c.iters {
        plain.push(step(&x, c, None)?);
        ranked.push(step(&x, c, Some(&cp))?);
        progress(i);
    }
    let med = |xs: &[StepTimes], f: fn(&StepTimes) -> f64| median(xs.iter().map(f).collect());
    let (plain_ms, rank_ms) = (med(&plain, |s| s.total), med(&ranked, |s| s.total));
    let (plain_fwd_ms, rank_fwd_ms) = (med(&plain, |s| s.fwd), med(&ranked, |s| s.fwd));
    Ok(RankBenchReport {
        ranks: c.ranks,
        rank: c.rank,
        tokens: c.tokens,
        shard_tokens: t,
        heads: c.heads,
        dk: c.dk,
        dv: c.dv,
        householder: c.householder,
        dtype: format!("{:?}", c.dtype).to_lowercase(),
        device: format!("{:?}", c.device.location()),
        iters: c.iters,
        plain_ms,
        rank_ms,
        efficiency: plain_ms / rank_ms,
        plain_fwd_ms,
        rank_fwd_ms,
        fwd_efficiency: plain_fwd_ms / rank_fwd_ms,
        plain_fwd_host_ms: med(&plain, |s| s.fwd_host),
        rank_fwd_host_ms: med(&ranked, |s| s.fwd_host),
        plain_host_ms: med(&plain, |s| s.total_host),
        rank_host_ms: med(&ranked, |s| s.total_host),
        rank_tokens_per_s: t as f64 / (rank_ms * 1e-3),
        plain_tokens_per_s: t as f64 / (plain_ms * 1e-3),
    })
}
