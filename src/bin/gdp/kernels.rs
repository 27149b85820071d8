//! The flags that build the library's typed tuning: [`candle_gdp::op::KernelConfig`] (which
//! CUDA kernels run and their value tiles), what the forward keeps for the backward
//! ([`candle_gdp::SaveIntermediates`]) and the CUDA memory-pool setting. Every default is the
//! library's automatic choice, which is what the benchmarks measure.

use crate::error::CliError;
use candle_core::Device;
use candle_gdp::op::{KernelConfig, KernelPath, Segments, TileConfig};
use candle_gdp::SaveIntermediates;
use clap::{Args, ValueEnum};

/// What the forward keeps for the backward (`GdpOptions::save_intermediates`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum SaveArg {
    /// Nothing: the backward recomputes the WY factors and the states.
    Nothing,
    /// The WY factors (the library's default).
    #[default]
    Wy,
    /// The WY factors and every chunk's state.
    All,
}

impl From<SaveArg> for SaveIntermediates {
    fn from(s: SaveArg) -> Self {
        match s {
            SaveArg::Nothing => Self::Nothing,
            SaveArg::Wy => Self::WyFactors,
            SaveArg::All => Self::All,
        }
    }
}

/// Which CUDA implementation runs one direction ([`KernelPath`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum PathArg {
    /// The chunked kernels where they fit, else the fused ones.
    #[default]
    Auto,
    /// The one-kernel fused path.
    Fused,
    /// The chunked bf16 kernels (an error where they do not fit).
    Chunked,
}

impl From<PathArg> for KernelPath {
    fn from(p: PathArg) -> Self {
        match p {
            PathArg::Auto => Self::Auto,
            PathArg::Fused => Self::Fused,
            PathArg::Chunked => Self::Chunked,
        }
    }
}

fn tile() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(["8", "16", "32", "64", "128"])
}

/// `--segments`: `auto`, `off` or a count of at least 1.
fn segments(s: &str) -> Result<Segments, String> {
    match s {
        "auto" => Ok(Segments::Auto),
        "off" => Ok(Segments::Off),
        _ => match s.parse::<usize>() {
            Ok(n) if n >= 1 => Ok(Segments::Count(n)),
            _ => Err(format!(
                "expected auto, off or a count of at least 1, got {s:?}"
            )),
        },
    }
}

/// Kernel choices and memory settings (CUDA; the CPU ignores them).
#[derive(Debug, Clone, Default, Args)]
pub struct KernelArgs {
    /// The forward's CUDA kernels.
    #[arg(long, value_enum, default_value_t = PathArg::Auto)]
    pub fwd_kernels: PathArg,
    /// The backward's CUDA kernels.
    #[arg(long, value_enum, default_value_t = PathArg::Auto)]
    pub bwd_kernels: PathArg,
    /// Context parallelism's summaries: the chunked widened pass or the fused kernels.
    #[arg(long, value_enum, default_value_t = PathArg::Auto)]
    pub summary_kernels: PathArg,
    /// Run the WY kernel before the state scan instead of beside it.
    #[arg(long)]
    pub no_overlap: bool,
    /// Queue every kernel on the device's stream (no side stream).
    #[arg(long)]
    pub one_stream: bool,
    /// Segments per sequence of the chunked bf16 op (the forward, and the backward where the
    /// WY factors are kept): `auto` (the library's default), `off`, or a count (1: none).
    #[arg(long, value_name = "auto|off|N", default_value = "auto", value_parser = segments)]
    pub segments: Segments,
    /// Value tile of the fused forward kernel.
    #[arg(long, value_name = "BV", value_parser = tile())]
    pub fused_fwd_tile: Option<String>,
    /// Value tile of the fused backward kernel.
    #[arg(long, value_name = "BV", value_parser = tile())]
    pub fused_bwd_tile: Option<String>,
    /// Value tile of the chunked forward scan.
    #[arg(long, value_name = "BV", value_parser = tile())]
    pub scan_tile: Option<String>,
    /// Value tile of the backward's rerun of the forward states.
    #[arg(long, value_name = "BV", value_parser = tile())]
    pub states_tile: Option<String>,
    /// Value tile of the backward's state-gradient scan.
    #[arg(long, value_name = "BV", value_parser = tile())]
    pub dh_tile: Option<String>,
    /// Cap the shared memory per block (KB) below the device's limit: narrower tiles or the
    /// fused kernels, as on a smaller GPU.
    #[arg(long, value_name = "KB", value_parser = clap::value_parser!(u32).range(1..))]
    pub smem_limit_kb: Option<u32>,
    /// What the forward keeps for the backward.
    #[arg(long, value_enum, default_value_t = SaveArg::Wy)]
    pub save: SaveArg,
    /// Leave CUDA's memory pool at the driver's default release threshold (the tool otherwise
    /// keeps freed memory mapped: `candle_gdp::op::cuda::retain_freed_memory`).
    #[arg(long)]
    pub no_retain_pool: bool,
}

impl KernelArgs {
    /// The library's [`KernelConfig`] from these flags.
    pub fn config(&self) -> KernelConfig {
        // The parsers admit only the listed integers.
        let bv = |s: &Option<String>| s.as_deref().and_then(|s| s.parse().ok());
        KernelConfig {
            forward: self.fwd_kernels.into(),
            backward: self.bwd_kernels.into(),
            summaries: self.summary_kernels.into(),
            overlap: !self.no_overlap,
            side_streams: !self.one_stream,
            segments: self.segments,
            tiles: TileConfig {
                fused_forward: bv(&self.fused_fwd_tile),
                fused_backward: bv(&self.fused_bwd_tile),
                forward_scan: bv(&self.scan_tile),
                states_scan: bv(&self.states_tile),
                dh_scan: bv(&self.dh_tile),
            },
            shared_memory_limit: self.smem_limit_kb.map(|kb| kb as usize * 1024),
        }
    }

    /// What the forward keeps.
    pub fn save(&self) -> SaveIntermediates {
        self.save.into()
    }

    /// Applies the memory-pool setting to `device` (a no-op on the CPU).
    pub fn prepare(&self, device: &Device) -> Result<(), CliError> {
        if self.no_retain_pool {
            return Ok(());
        }
        retain_pool(device)
    }
}

/// Keeps the memory Candle frees on a CUDA `device` in CUDA's pool, for throughput (the
/// library's explicit `retain_freed_memory`); a no-op elsewhere.
pub fn retain_pool(device: &Device) -> Result<(), CliError> {
    #[cfg(feature = "cuda")]
    candle_gdp::op::cuda::retain_freed_memory(device).map_err(|e| CliError::from_lib(&e))?;
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    Ok(())
}
