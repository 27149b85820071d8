//! The command-line arguments of `gdp run`: [`RunArgs`] and its value types.

use crate::error::CliError;
use crate::kernels::KernelArgs;
use candle_core::{DType, Device};
use clap::{Args, ValueEnum};
use std::path::PathBuf;

/// Compute dtype of `q`, `k`, `v`, `beta`, `h0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DTypeArg {
    F32,
    Bf16,
    F16,
}

impl DTypeArg {
    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        }
    }
}

/// `--device`: `cpu` or `cuda:N` (`cuda` alone is `cuda:0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceArg {
    Cpu,
    Cuda(usize),
}

impl std::fmt::Display for DeviceArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceArg {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| "expected `cpu` or `cuda:N`".to_string()),
        }
    }

    /// Opens the device; a build without CUDA fails here, naming `--device`.
    pub fn open(self) -> Result<Device, CliError> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(n) => {
                let dev = Device::new_cuda(n).map_err(|e| {
                    CliError::new(format!(
                        "--device {self}: cannot open the device: {}",
                        CliError::from_lib(&e)
                    ))
                })?;
                Ok(dev)
            }
        }
    }
}

/// How `--repeat` times a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum TimingArg {
    /// Host clock from the call until the device has finished it, one call at a time.
    #[default]
    Host,
    /// CUDA events on the device's stream around each call, the calls queued back to back
    /// with 256 MiB of device memory cleared before each, the mean of the calls: how
    /// `triton.testing.do_bench` times FLA (GPU time; the host's work overlaps the previous
    /// call). One CUDA device only.
    Events,
}

/// How `gdp run` computes gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum BackwardArg {
    /// Candle's autograd (`backward_with`): what a training loop on `loss.backward()` pays,
    /// Candle's gradient accumulation included.
    #[default]
    Autograd,
    /// The op's explicit backward (`gated_delta_product_vjp`): the op alone, as FLA's
    /// `autograd.Function` runs under PyTorch.
    Explicit,
}

/// Arguments of `gdp run`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Input: tensors `q k v g beta` (required), `h0 cu_seqlens do dht` (optional), FLA layout.
    #[arg(long, value_name = "IN.safetensors")]
    pub input: PathBuf,
    /// Output: `o`, `ht` and, given `do` or `dht`, `dq dk dv dg dbeta` (+ `dh0`), all f32.
    #[arg(long, value_name = "OUT.safetensors")]
    pub output: PathBuf,
    /// Compute dtype of q, k, v, beta, h0 (g stays f32).
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    pub dtype: DTypeArg,
    /// Device: cpu or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = DeviceArg::parse)]
    pub device: DeviceArg,
    /// Output scale (default K^-0.5).
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    pub scale: Option<f64>,
    /// Time the op: one warm-up then N runs; prints `fwd_ms=` (and `fwd_bwd_ms=`): medians, or
    /// means with `--timing events`.
    #[arg(long, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub repeat: Option<usize>,
    /// How `--repeat` times a call.
    #[arg(long, value_enum, default_value_t = TimingArg::Host)]
    pub timing: TimingArg,
    /// How the gradients are computed (plain op only).
    #[arg(long, value_enum, default_value_t = BackwardArg::Autograd)]
    pub backward: BackwardArg,
    /// Context-parallel ranks: the time axis is sharded over R ranks (R devices); 1 runs the
    /// plain op.
    #[arg(
        long,
        value_name = "R",
        default_value_t = 1,
        allow_negative_numbers = true
    )]
    pub cp_size: usize,
    /// Run as one rank of a multi-process group started by `gdp launch` (build with
    /// `--features nccl`): this rank's shard on cuda:LOCAL_RANK over NCCL; rank 0 writes the
    /// gathered outputs. Needs a CUDA `--device` (its index is replaced by LOCAL_RANK).
    #[arg(long)]
    pub distributed: bool,
    /// Kernel choices (CUDA) and what the forward keeps.
    #[command(flatten)]
    pub kernels: KernelArgs,
}
