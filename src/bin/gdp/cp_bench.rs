//! `gdp cp-bench`: one context-parallel rank timed alone on one device against the plain op on
//! the same shard ([`candle_gdp::cp::rank_alone`]); a table, then one JSON object as the last
//! line.

use crate::error::CliError;
use crate::kernels::KernelArgs;
use crate::run::{DTypeArg, DeviceArg};
use candle_gdp::cp::{rank_alone, RankBenchConfig, RankBenchReport};
use clap::Args;
use std::io::{IsTerminal, Write};

fn count(lo: u64, hi: u64) -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(lo..=hi)
}

/// Arguments of `gdp cp-bench`.
#[derive(Debug, Clone, Args)]
pub struct CpBenchArgs {
    /// Ranks R of the group.
    #[arg(long, default_value_t = 4, value_parser = count(1, 1 << 16))]
    pub ranks: usize,
    /// The rank timed (0-based, below R); the middle one when omitted.
    #[arg(long)]
    pub rank: Option<usize>,
    /// Tokens T of the whole sequence; the rank holds its shard (T / R, the first T mod R
    /// ranks one more).
    #[arg(long, default_value_t = 16384, value_parser = count(1, 1 << 26))]
    pub tokens: usize,
    /// Heads H.
    #[arg(long, default_value_t = 4, value_parser = count(1, 4096))]
    pub heads: usize,
    /// Key head dimension K.
    #[arg(long, default_value_t = 64, value_parser = count(1, 1024))]
    pub dk: usize,
    /// Value head dimension V.
    #[arg(long, default_value_t = 64, value_parser = count(1, 1024))]
    pub dv: usize,
    /// Householder keys per token n.
    #[arg(long, default_value_t = 2, value_parser = count(1, 64))]
    pub householder: usize,
    /// Dtype of q, k, v, beta.
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    pub dtype: DTypeArg,
    /// Device: cpu or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = DeviceArg::parse)]
    pub device: DeviceArg,
    /// Kernel choices (CUDA) and what the forward keeps.
    #[command(flatten)]
    pub kernels: KernelArgs,
    /// Timed iterations (medians reported).
    #[arg(long, default_value_t = 5, value_parser = count(1, 10_000))]
    pub iters: usize,
    /// Untimed iterations first.
    #[arg(long, default_value_t = 1, value_parser = count(0, 10_000))]
    pub warmup: usize,
}

/// Runs `gdp cp-bench`.
pub fn cp_bench(a: &CpBenchArgs) -> Result<(), CliError> {
    let rank = a.rank.unwrap_or(a.ranks / 2);
    if rank >= a.ranks {
        return Err(CliError::new(format!(
            "--rank {rank}: needs a rank below --ranks {}",
            a.ranks
        )));
    }
    if a.tokens < a.ranks {
        return Err(CliError::new(format!(
            "--tokens {}: needs at least one token per rank (--ranks {})",
            a.tokens, a.ranks
        )));
    }
    let device = a.device.open()?;
    a.kernels.prepare(&device)?;
    let cfg = RankBenchConfig {
        ranks: a.ranks,
        rank,
        tokens: a.tokens,
        heads: a.heads,
        dk: a.dk,
        dv: a.dv,
        householder: a.householder,
        dtype: a.dtype.dtype(),
        device,
        save_intermediates: a.kernels.save(),
        kernels: a.kernels.config(),
        warmup: a.warmup,
        iters: a.iters,
    };
    let mut err = std::io::stderr().lock();
    let progress = err.is_terminal();
    let _ = writeln!(
        err,
        "cp-bench: rank {rank} of {} on {}, {} tokens ({} on the rank), H{} K{} V{} n{} {}, \
         {} warm-up + {} timed iterations",
        a.ranks,
        a.device,
        a.tokens,
        a.tokens / a.ranks,
        a.heads,
        a.dk,
        a.dv,
        a.householder,
        a.dtype.name(),
        a.warmup,
        a.iters
    );
    let report = rank_alone(&cfg, |i| {
        if progress {
            let _ = write!(err, "\r  iteration {}/{}", i + 1, a.iters);
            let _ = err.flush();
        }
    })
    .map_err(|e| CliError::from_lib(&e))?;
    if progress {
        let _ = writeln!(err);
    }
    print_report(&report)
}

fn print_report(r: &RankBenchReport) -> Result<(), CliError> {
    let json = serde_json::to_string(r).map_err(|e| CliError::new(format!("json: {e}")))?;
    let mut out = std::io::stdout().lock();
    let lines = [
        "           | plain op ms | rank ms | efficiency | host ms plain / rank".to_string(),
        format!(
            "forward   | {:>11.3} | {:>7.3} | {:>10.3} | {:>8.3} / {:.3}",
            r.plain_fwd_ms,
            r.rank_fwd_ms,
            r.fwd_efficiency,
            r.plain_fwd_host_ms,
            r.rank_fwd_host_ms
        ),
        format!(
            "fwd + bwd | {:>11.3} | {:>7.3} | {:>10.3} | {:>8.3} / {:.3}",
            r.plain_ms, r.rank_ms, r.efficiency, r.plain_host_ms, r.rank_host_ms
        ),
        json,
    ];
    for l in lines {
        writeln!(out, "{l}").map_err(|e| CliError::new(format!("writing to stdout: {e}")))?;
    }
    Ok(())
}
