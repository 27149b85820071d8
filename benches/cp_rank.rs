//! One context-parallel rank alone on one device against the plain op on its shard
//! (`candle_gdp::cp::rank_alone`, the same measurement as `gdp cp-bench`), over the issue's
//! target shapes: the middle rank of 4.
//!
//! ```text
//! cargo bench --bench cp_rank                                   # CPU, f32, H4 K=V=64 n=2
//! cargo bench --features cuda --bench cp_rank -- --device cuda  # H200 set: bf16, H16 K=V=128
//! ```
//!
//! One line per shape, then one JSON object per shape.

use candle_core::{DType, Device};
use candle_gdp::cp::{rank_alone, RankBenchConfig};
use candle_gdp::SaveIntermediates;
use clap::Parser;

/// Rank-alone CP benchmark.
#[derive(Debug, Parser)]
struct Args {
    /// `cpu` or `cuda` (the first GPU).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Ranks of the group (the middle rank is timed).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Timed iterations per shape.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// `(tokens, heads, K = V, n)`.
type Shape = (usize, usize, usize, usize);

fn main() -> candle_core::Result<()> {
    let a = Args::parse();
    let (device, dtype, shapes): (Device, DType, Vec<Shape>) = match a.device.as_str() {
        "cpu" => (Device::Cpu, DType::F32, vec![(16384, 4, 64, 2)]),
        "cuda" => (
            Device::new_cuda(0)?,
            DType::BF16,
            vec![
                (65536, 16, 128, 1),
                (65536, 16, 128, 2),
                (16384, 16, 128, 1),
                (16384, 16, 128, 2),
            ],
        ),
        other => candle_core::bail!("--device: expected cpu or cuda, got {other}"),
    };
    // Freed memory stays in CUDA's pool, as in `gdp` (throughput; process-wide for the GPU).
    #[cfg(feature = "cuda")]
    candle_gdp::op::cuda::retain_freed_memory(&device)?;
    let mut json = vec![];
    println!(
        "tokens | H | K=V | n | plain fwd ms | rank fwd ms | fwd eff | plain ms | rank ms | eff"
    );
    for (tokens, heads, dim, n) in shapes {
        let cfg = RankBenchConfig {
            ranks: a.ranks,
            rank: a.ranks / 2,
            tokens,
            heads,
            dk: dim,
            dv: dim,
            householder: n,
            dtype,
            device: device.clone(),
            save_intermediates: SaveIntermediates::default(),
            kernels: Default::default(),
            warmup: 1,
            iters: a.iters,
        };
        let r = rank_alone(&cfg, |_| {})?;
        println!(
            "{tokens} | {heads} | {dim} | {n} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3}",
            r.plain_fwd_ms, r.rank_fwd_ms, r.fwd_efficiency, r.plain_ms, r.rank_ms, r.efficiency
        );
        json.push(serde_json::to_string(&r).map_err(candle_core::Error::wrap)?);
    }
    for j in json {
        println!("{j}");
    }
    Ok(())
}
