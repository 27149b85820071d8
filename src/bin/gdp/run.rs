//! `gdp run`: the op (and, given cotangents, its gradients) on the tensors of a file.
//!
//! Dtypes: `q`, `k`, `v`, `beta` and `h0` are cast to `--dtype`; `g` is always kept in f32
//! (a log-space gate loses too much in 16 bits, and the op reads it in f32 anyway, as FLA
//! does); the cotangents `do`, `dht` are used in f32. Every output is written in f32.
//!
//! With `--cp-size R > 1` the op runs context-parallel ([`ContextParallel`]): the time axis is
//! cut into `R` shards, one rank (thread) per shard, on `R` CPU ranks or `R` separately opened
//! CUDA devices; the outputs and gradients are gathered and written as without CP.
//!
//! With `--distributed` (feature `nccl`) this process is one rank of a group started by
//! `gdp launch`: it reads the whole input, runs its own context-parallel shard on
//! `cuda:LOCAL_RANK` over NCCL ([`candle_gdp::cp::distributed_gated_delta_product`]), and rank 0
//! writes the gathered outputs, the same as a plain run.

use crate::error::CliError;
use crate::input::LoadedInput;
use crate::kernels::KernelArgs;
use candle_core::{DType, Device, Tensor, Var};
#[cfg(feature = "nccl")]
use candle_gdp::cp::{Communicator, Composition};
use candle_gdp::cp::{CpOutput, ShardPlan};
use candle_gdp::op::KernelConfig;
use candle_gdp::{gated_delta_product, ContextParallel, Cotangents, GdpOptions, SaveIntermediates};
use clap::{Args, ValueEnum};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

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

/// Timings in milliseconds: medians, or means with `--timing events`.
#[derive(Debug, Clone, Default)]
pub struct Timings {
    pub fwd_ms: f64,
    pub fwd_bwd_ms: Option<f64>,
}

/// What `run` computed: named f32 CPU tensors, in output order, and timings under `--repeat`.
#[derive(Debug, Clone)]
pub struct RunOutput {
    pub tensors: Vec<(String, Tensor)>,
    pub timings: Option<Timings>,
}

impl RunOutput {
    /// `fwd_ms=<median>` and `fwd_bwd_ms=<median>` lines (empty without `--repeat`).
    pub fn timing_lines(&self) -> Vec<String> {
        let Some(t) = &self.timings else {
            return vec![];
        };
        let mut lines = vec![format!("fwd_ms={:.3}", t.fwd_ms)];
        if let Some(fb) = t.fwd_bwd_ms {
            lines.push(format!("fwd_bwd_ms={fb:.3}"));
        }
        lines
    }
}

/// The inputs cast and placed on the device, ready for repeated calls.
pub struct Prepared<'a> {
    q: Var,
    k: Var,
    v: Var,
    g: Var,
    beta: Var,
    h0: Option<Var>,
    dout: Option<Tensor>,
    dht: Option<Tensor>,
    cu_seqlens: Option<&'a [usize]>,
    scale: Option<f64>,
    backward: BackwardArg,
    kernels: KernelConfig,
    save: SaveIntermediates,
}

impl<'a> Prepared<'a> {
    pub fn new(
        x: &'a LoadedInput,
        dtype: DType,
        device: &Device,
        scale: Option<f64>,
    ) -> Result<Self, CliError> {
        let put = |t: &Tensor, name: &str, dt: DType| -> Result<Tensor, CliError> {
            t.to_dtype(dt)
                .and_then(|t| t.to_device(device))
                .map_err(|e| CliError::tensor(name, &e))
        };
        let var = |t: &Tensor, name: &str, dt: DType| -> Result<Var, CliError> {
            Var::from_tensor(&put(t, name, dt)?).map_err(|e| CliError::tensor(name, &e))
        };
        Ok(Self {
            q: var(&x.q, "q", dtype)?,
            k: var(&x.k, "k", dtype)?,
            v: var(&x.v, "v", dtype)?,
            g: var(&x.g, "g", DType::F32)?,
            beta: var(&x.beta, "beta", dtype)?,
            h0: x.h0.as_ref().map(|t| var(t, "h0", dtype)).transpose()?,
            // In the dtypes of `o` and of the final state (f32).
            dout: x.dout.as_ref().map(|t| put(t, "do", dtype)).transpose()?,
            dht: x
                .dht
                .as_ref()
                .map(|t| put(t, "dht", DType::F32))
                .transpose()?,
            cu_seqlens: x.cu_seqlens.as_deref(),
            scale,
            backward: BackwardArg::Autograd,
            kernels: KernelConfig::default(),
            save: SaveIntermediates::default(),
        })
    }

    /// The same, with the kernel choices and the save level of `k`.
    pub fn with_kernels(self, k: &KernelArgs) -> Self {
        Self {
            kernels: k.config(),
            save: k.save(),
            ..self
        }
    }

    /// The same, with the gradients computed by `backward`.
    pub fn with_backward(self, backward: BackwardArg) -> Self {
        Self { backward, ..self }
    }

    fn options(&self, final_state: bool) -> GdpOptions<'_> {
        GdpOptions {
            scale: self.scale,
            initial_state: self.h0.as_ref().map(|v| v.as_tensor()),
            output_final_state: final_state,
            cu_seqlens: self.cu_seqlens,
            kernels: self.kernels,
            save_intermediates: self.save,
            ..Default::default()
        }
    }

    /// `o` in the compute dtype and, with `final_state`, the final state (f32). Without it
    /// this is the call FLA's benchmark times (`output_final_state=False`).
    pub fn forward(&self, final_state: bool) -> Result<(Tensor, Option<Tensor>), CliError> {
        let opts = self.options(final_state);
        let (o, ht) = gated_delta_product(&self.q, &self.k, &self.v, &self.g, &self.beta, &opts)
            .map_err(|e| CliError::from_lib(&e))?;
        if final_state && ht.is_none() {
            return Err(CliError::new("the op returned no final state"));
        }
        Ok((o, ht))
    }

    /// `(o, final state)`, for the outputs.
    pub fn outputs(&self) -> Result<Vec<(String, Tensor)>, CliError> {
        let (o, ht) = self.forward(true)?;
        let ht = ht.ok_or_else(|| CliError::new("the op returned no final state"))?;
        Ok(vec![("o".to_string(), o), ("ht".to_string(), ht)])
    }

    /// Forward, then the gradients of `L = Σ do·o + Σ dht·ht` (a missing cotangent is zero;
    /// the final state is only computed when `dht` is given). Returns `o`, the final state
    /// when computed, then `dq dk dv dg dbeta` and `dh0` when there is an initial state.
    pub fn forward_backward(&self) -> Result<Vec<(String, Tensor)>, CliError> {
        if self.backward == BackwardArg::Explicit {
            return self.forward_backward_explicit();
        }
        let (o, ht) = self.forward(self.dht.is_some())?;
        let lib = |e: candle_core::Error| CliError::from_lib(&e);
        self.check_cotangents_of(&o, ht.as_ref())?;
        let mut pairs = vec![];
        if let Some(cot) = &self.dout {
            pairs.push((&o, cot));
        }
        if let (Some(cot), Some(ht)) = (&self.dht, &ht) {
            pairs.push((ht, cot));
        }
        let grads = candle_gdp::backward_with(&pairs).map_err(lib)?;
        let gradient = |var: &Var| match grads.get(var.as_tensor()) {
            Some(gr) => Ok(gr.clone()),
            None => var.zeros_like().map_err(lib),
        };
        let inputs = [&self.q, &self.k, &self.v, &self.g, &self.beta];
        let dh0 = self.h0.as_ref().map(gradient).transpose()?;
        let [dq, dk, dv, dg, dbeta] = inputs.map(gradient);
        Ok(named_outputs(o, ht, [dq?, dk?, dv?, dg?, dbeta?], dh0))
    }

    /// [`Prepared::forward_backward`] through the op's explicit backward.
    fn forward_backward_explicit(&self) -> Result<Vec<(String, Tensor)>, CliError> {
        let lib = |e: candle_core::Error| CliError::from_lib(&e);
        let opts = self.options(self.dht.is_some());
        let vjp = candle_gdp::gated_delta_product_vjp(
            &self.q, &self.k, &self.v, &self.g, &self.beta, &opts,
        )
        .map_err(lib)?;
        self.check_cotangents_of(&vjp.o, vjp.final_state.as_ref())?;
        let d_o = match &self.dout {
            Some(d) => d.clone(),
            None => vjp.o.zeros_like().map_err(lib)?,
        };
        let (o, ht) = (vjp.o.clone(), vjp.final_state.clone());
        let gr = vjp.backward(&d_o, self.dht.as_ref()).map_err(lib)?;
        let grads = [gr.dq, gr.dk, gr.dv, gr.dg, gr.dbeta];
        Ok(named_outputs(o, ht, grads, gr.dh0))
    }

    /// Checks the cotangents `do` and `dht` against the forward's `o` and final state `ht`
    /// (when computed): their shapes, and that at least one is given.
    fn check_cotangents_of(&self, o: &Tensor, ht: Option<&Tensor>) -> Result<(), CliError> {
        let ht_dims = ht.map_or(vec![], |t| t.dims().to_vec());
        check_cotangents(&self.dout, &self.dht, o.dims(), &ht_dims)?;
        if self.dout.is_none() && self.dht.is_none() {
            return Err(CliError::new("gradients need a `do` or `dht` tensor"));
        }
        Ok(())
    }
}

/// A forward+backward run's outputs by name: `o`, the final state `ht` when computed, the
/// gradients `dq dk dv dg dbeta`, and `dh0` when there is an initial state.
fn named_outputs(
    o: Tensor,
    ht: Option<Tensor>,
    grads: [Tensor; 5],
    dh0: Option<Tensor>,
) -> Vec<(String, Tensor)> {
    let names = ["dq", "dk", "dv", "dg", "dbeta"];
    let mut out = vec![("o".to_string(), o)];
    out.extend(ht.map(|ht| ("ht".to_string(), ht)));
    out.extend(
        names
            .into_iter()
            .zip(grads)
            .map(|(n, t)| (n.to_string(), t)),
    );
    out.extend(dh0.map(|t| ("dh0".to_string(), t)));
    out
}

/// Checks the shapes of the cotangents `do` and `dht` against those of `o` and the final state.
fn check_cotangents(
    dout: &Option<Tensor>,
    dht: &Option<Tensor>,
    o_dims: &[usize],
    ht_dims: &[usize],
) -> Result<(), CliError> {
    for (name, cot, want, layout) in [
        ("do", dout, o_dims, "[B, T, H, V] (the shape of o)"),
        ("dht", dht, ht_dims, "[N, H, K, V] (the shape of ht)"),
    ] {
        let Some(cot) = cot else { continue };
        if cot.dims() != want {
            return Err(CliError::new(format!(
                "`{name}`: expected shape {want:?} {layout}, got {:?}",
                cot.dims()
            )));
        }
    }
    Ok(())
}

/// Who runs the ranks of a context-parallel call.
enum CpExec {
    /// All ranks in this process, one thread each.
    InProcess(ContextParallel),
    /// This process is one rank of a multi-process group.
    #[cfg(feature = "nccl")]
    Distributed {
        comm: std::sync::Arc<candle_gdp::cp::NcclComm>,
        device: Device,
    },
}

impl CpExec {
    /// The devices to synchronise around a timed call.
    fn devices(&self) -> Vec<Device> {
        match self {
            Self::InProcess(cp) => cp.devices().to_vec(),
            #[cfg(feature = "nccl")]
            Self::Distributed { device, .. } => vec![device.clone()],
        }
    }
}

/// The inputs of a context-parallel run: plain tensors on the CPU (each rank copies its shard
/// to its device), cast as for the plain op.
struct CpPrepared<'a> {
    exec: CpExec,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    h0: Option<Tensor>,
    /// `do`, or zeros when only `dht` was given (a missing cotangent is zero).
    dout: Option<Tensor>,
    dht: Option<Tensor>,
    cu_seqlens: Option<&'a [usize]>,
    scale: Option<f64>,
    kernels: KernelConfig,
    save: SaveIntermediates,
}

/// Checks that `r` ranks can shard `x` before any device is opened (the library checks it
/// again); a malformed `q` is left to the op's own validation, which names it.
fn check_plan(x: &LoadedInput, r: usize) -> Result<(), CliError> {
    match x.q.dims4() {
        Ok((_, t, _, _)) if t > 0 => {
            ShardPlan::new(t, r).map_err(|e| CliError::from_lib(&e))?;
        }
        _ if r == 0 => {
            ShardPlan::new(1, r).map_err(|e| CliError::from_lib(&e))?;
        }
        _ => {}
    }
    Ok(())
}

impl<'a> CpPrepared<'a> {
    /// `--cp-size R` in this process: R ranks on R separately opened devices.
    fn in_process(x: &'a LoadedInput, args: &RunArgs) -> Result<Self, CliError> {
        let r = args.cp_size;
        check_plan(x, r)?;
        // Every `Device::new_cuda` call is a distinct Candle device: one per rank.
        let devices = (0..r)
            .map(|_| {
                let d = args.device.open()?;
                args.kernels.prepare(&d)?;
                Ok(d)
            })
            .collect::<Result<Vec<_>, CliError>>()?;
        let cp = ContextParallel::new(devices).map_err(|e| CliError::from_lib(&e))?;
        Self::new(x, args, CpExec::InProcess(cp))
    }

    fn new(x: &'a LoadedInput, args: &RunArgs, exec: CpExec) -> Result<Self, CliError> {
        let dtype = args.dtype.dtype();
        let put = |t: &Tensor, name: &str, dt: DType| -> Result<Tensor, CliError> {
            t.to_dtype(dt).map_err(|e| CliError::tensor(name, &e))
        };
        let q = put(&x.q, "q", dtype)?;
        let v = put(&x.v, "v", dtype)?;
        let dout = x
            .dout
            .as_ref()
            .map(|t| put(t, "do", DType::F32))
            .transpose()?;
        let dht = x
            .dht
            .as_ref()
            .map(|t| put(t, "dht", DType::F32))
            .transpose()?;
        // `o` is [B, T, H, V], the final state [N, H, K, V]; malformed q or v are left to the op.
        let shapes = q.dims4().and_then(|(b, t, h, k)| {
            let vd = v.dim(3)?;
            let n = x
                .cu_seqlens
                .as_ref()
                .map_or(b, |cu| cu.len().saturating_sub(1));
            Ok((vec![b, t, h, vd], vec![n, h, k, vd]))
        });
        if let (Ok((o_dims, ht_dims)), 4) = (&shapes, v.rank()) {
            check_cotangents(&dout, &dht, o_dims, ht_dims)?;
        }
        let dout = match (dout, &dht, &shapes) {
            (None, Some(_), Ok((o_dims, _))) => Some(
                Tensor::zeros(o_dims.as_slice(), DType::F32, &Device::Cpu)
                    .map_err(|e| CliError::tensor("do", &e))?,
            ),
            (dout, _, _) => dout,
        };
        Ok(Self {
            exec,
            k: put(&x.k, "k", dtype)?,
            g: put(&x.g, "g", DType::F32)?,
            beta: put(&x.beta, "beta", dtype)?,
            h0: x.h0.as_ref().map(|t| put(t, "h0", dtype)).transpose()?,
            q,
            v,
            dout,
            dht,
            cu_seqlens: x.cu_seqlens.as_deref(),
            scale: args.scale,
            kernels: args.kernels.config(),
            save: args.kernels.save(),
        })
    }

    /// The context-parallel call; with `grads`, the gradients of `L = Σ do·o + Σ dht·ht`.
    fn call(&self, grads: bool) -> Result<CpOutput, CliError> {
        let opts = GdpOptions {
            scale: self.scale,
            initial_state: self.h0.as_ref(),
            output_final_state: true,
            cu_seqlens: self.cu_seqlens,
            kernels: self.kernels,
            save_intermediates: self.save,
            ..Default::default()
        };
        let cotangents = match (grads, &self.dout) {
            (false, _) => None,
            (true, Some(dout)) => Some(Cotangents {
                dout,
                dht: self.dht.as_ref(),
            }),
            // No zero `do` could be shaped: the inputs are malformed, let the op name them.
            (true, None) => None,
        };
        let (q, k, v, g, beta) = (&self.q, &self.k, &self.v, &self.g, &self.beta);
        let out = match &self.exec {
            CpExec::InProcess(cp) => cp.gated_delta_product(q, k, v, g, beta, &opts, cotangents),
            #[cfg(feature = "nccl")]
            CpExec::Distributed { comm, device } => {
                let comm: std::sync::Arc<dyn Communicator> = comm.clone();
                candle_gdp::cp::distributed_gated_delta_product(
                    comm,
                    device,
                    q,
                    k,
                    v,
                    g,
                    beta,
                    &opts,
                    cotangents,
                    Composition::Fold,
                )
            }
        }
        .map_err(|e| CliError::from_lib(&e))?;
        if grads && out.grads.is_none() {
            return Err(CliError::new("gradients need a `do` or `dht` tensor"));
        }
        Ok(out)
    }

    /// `o`, `ht` and, with `grads`, `dq dk dv dg dbeta` (+ `dh0`), named as without CP.
    fn outputs(&self, grads: bool) -> Result<Vec<(String, Tensor)>, CliError> {
        let out = self.call(grads)?;
        let ht = out
            .final_state
            .ok_or_else(|| CliError::new("the op returned no final state"))?;
        let mut named = vec![("o".to_string(), out.o), ("ht".to_string(), ht)];
        if grads {
            let gr = out
                .grads
                .ok_or_else(|| CliError::new("the op returned no gradients"))?;
            let mut all = vec![
                ("dq", gr.dq),
                ("dk", gr.dk),
                ("dv", gr.dv),
                ("dg", gr.dg),
                ("dbeta", gr.dbeta),
            ];
            if self.h0.is_some() {
                let dh0 = gr
                    .dh0
                    .ok_or_else(|| CliError::new("the op returned no `dh0`"))?;
                all.push(("dh0", dh0));
            }
            named.extend(all.into_iter().map(|(n, t)| (n.to_string(), t)));
        }
        Ok(named)
    }
}

/// [`bench()`] or, with [`TimingArg::Events`], [`bench_events`].
fn bench_with<T>(
    timing: TimingArg,
    device: &Device,
    repeat: usize,
    f: impl Fn() -> Result<T, CliError>,
) -> Result<(T, f64), CliError> {
    match timing {
        TimingArg::Host => bench(device, repeat, f),
        TimingArg::Events => bench_events(device, repeat, f),
    }
}

/// Mean GPU time of `repeat` calls after one warm-up, measured as `triton.testing.do_bench`
/// measures (and averages, its default): an event pair on the device's stream around each
/// call, the calls queued back to back (one synchronisation at the end), 256 MiB of device
/// memory cleared before each call so that no input stays in L2. Returns the warm-up's result
/// too.
#[cfg(feature = "cuda")]
fn bench_events<T>(
    device: &Device,
    repeat: usize,
    f: impl Fn() -> Result<T, CliError>,
) -> Result<(T, f64), CliError> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    let lib = |e: candle_core::Error| CliError::from_lib(&e);
    let drv = |e: candle_core::cuda_backend::cudarc::driver::DriverError| {
        CliError::new(format!("--timing events: {e}"))
    };
    let cuda = device.as_cuda_device().map_err(|_| {
        CliError::new("--timing events needs a CUDA device (use --timing host on the CPU)")
    })?;
    let stream = cuda.cuda_stream();
    let mut flush = stream.alloc_zeros::<u8>(256 << 20).map_err(drv)?;
    let (first, _) = timed(std::slice::from_ref(device), &f)?;
    let mut marks = Vec::with_capacity(repeat);
    for _ in 0..repeat {
        stream.memset_zeros(&mut flush).map_err(drv)?;
        let start = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)?;
        drop(f()?);
        let end = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)?;
        marks.push((start, end));
    }
    device.synchronize().map_err(lib)?;
    let ms = marks
        .iter()
        .map(|(a, b)| a.elapsed_ms(b).map(f64::from).map_err(drv))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((first, ms.iter().sum::<f64>() / ms.len() as f64))
}

/// Without CUDA there is no event timing.
#[cfg(not(feature = "cuda"))]
fn bench_events<T>(
    _: &Device,
    _: usize,
    _: impl Fn() -> Result<T, CliError>,
) -> Result<(T, f64), CliError> {
    Err(CliError::new(
        "--timing events needs a CUDA build and device (use --timing host)",
    ))
}

/// One call, timed to completion on every device, in milliseconds.
fn timed<T>(devices: &[Device], f: impl Fn() -> Result<T, CliError>) -> Result<(T, f64), CliError> {
    let t0 = Instant::now();
    let r = f()?;
    for device in devices {
        device.synchronize().map_err(|e| CliError::from_lib(&e))?;
    }
    Ok((r, t0.elapsed().as_secs_f64() * 1e3))
}

/// Median of the runs of `f` after one warm-up; returns the warm-up's result too.
pub fn bench<T>(
    device: &Device,
    repeat: usize,
    f: impl Fn() -> Result<T, CliError>,
) -> Result<(T, f64), CliError> {
    bench_on(std::slice::from_ref(device), repeat, f)
}

/// [`bench()`], synchronising every device of `devices` after each call.
fn bench_on<T>(
    devices: &[Device],
    repeat: usize,
    f: impl Fn() -> Result<T, CliError>,
) -> Result<(T, f64), CliError> {
    let (first, _) = timed(devices, &f)?;
    let mut ms = Vec::with_capacity(repeat);
    for _ in 0..repeat {
        ms.push(timed(devices, &f)?.1);
    }
    Ok((first, median(&mut ms)))
}

pub fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let m = xs.len() / 2;
    if xs.len() % 2 == 1 {
        xs[m]
    } else {
        0.5 * (xs[m - 1] + xs[m])
    }
}

/// Runs `gdp run` on loaded inputs (context-parallel when `--cp-size` is not 1). No file I/O
/// here, so that other drivers can share the loading and writing around it.
pub fn run(args: &RunArgs, input: &LoadedInput) -> Result<RunOutput, CliError> {
    if args.cp_size != 1 {
        return run_cp(args, input);
    }
    let device = args.device.open()?;
    args.kernels.prepare(&device)?;
    let p = Prepared::new(input, args.dtype.dtype(), &device, args.scale)?
        .with_backward(args.backward)
        .with_kernels(&args.kernels);
    let with_grads = input.wants_grads();
    let (tensors, timings) = match args.repeat {
        None if with_grads => (with_final_state(&p, p.forward_backward()?)?, None),
        None => (p.outputs()?, None),
        Some(n) => {
            // Timed as FLA's benchmark calls it: no final state unless a gradient needs it.
            let (_, fwd_ms) = bench_with(args.timing, &device, n, || p.forward(false))?;
            if with_grads {
                let (all, fb) = bench_with(args.timing, &device, n, || p.forward_backward())?;
                let t = Timings {
                    fwd_ms,
                    fwd_bwd_ms: Some(fb),
                };
                (with_final_state(&p, all)?, Some(t))
            } else {
                let t = Timings {
                    fwd_ms,
                    fwd_bwd_ms: None,
                };
                (p.outputs()?, Some(t))
            }
        }
    };
    finish(tensors, timings)
}

/// `forward_backward`'s outputs with the final state after `o` (computed apart when no `dht`
/// asked for it).
pub fn with_final_state(
    p: &Prepared,
    mut all: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>, CliError> {
    if !all.iter().any(|(name, _)| name == "ht") {
        let mut outs = p.outputs()?;
        all.insert(1, outs.remove(1));
    }
    Ok(all)
}

/// `gdp run --cp-size R`: the same outputs through [`ContextParallel`] on `R` ranks.
fn run_cp(args: &RunArgs, input: &LoadedInput) -> Result<RunOutput, CliError> {
    let p = CpPrepared::in_process(input, args)?;
    run_prepared_cp(args, input, &p)
}

/// Runs (and under `--repeat` times) a prepared context-parallel call.
fn run_prepared_cp(
    args: &RunArgs,
    input: &LoadedInput,
    p: &CpPrepared,
) -> Result<RunOutput, CliError> {
    if args.backward == BackwardArg::Explicit {
        return Err(CliError::new(
            "--backward explicit runs the plain op; context-parallel runs use Candle's autograd",
        ));
    }
    if args.timing == TimingArg::Events && args.repeat.is_some() {
        return Err(CliError::new(
            "--timing events times the plain op on one device; context-parallel runs are timed \
             with --timing host",
        ));
    }
    let with_grads = input.wants_grads();
    let (tensors, timings) = match args.repeat {
        None => (p.outputs(with_grads)?, None),
        Some(n) => {
            let devices = p.exec.devices();
            let (fwd, fwd_ms) = bench_on(&devices, n, || p.outputs(false))?;
            if with_grads {
                let (all, fb) = bench_on(&devices, n, || p.outputs(true))?;
                let t = Timings {
                    fwd_ms,
                    fwd_bwd_ms: Some(fb),
                };
                (all, Some(t))
            } else {
                let t = Timings {
                    fwd_ms,
                    fwd_bwd_ms: None,
                };
                (fwd, Some(t))
            }
        }
    };
    finish(tensors, timings)
}

/// The checks of `--distributed` that need no input: the build, the flags and the
/// environment of `gdp launch`.
pub fn check_distributed(args: &RunArgs) -> Result<(), CliError> {
    if !cfg!(feature = "nccl") {
        return Err(CliError::new(
            "--distributed needs a build with `--features nccl` (multi-GPU context parallelism \
             over NCCL); this `gdp` was built without it",
        ));
    }
    if args.device == DeviceArg::Cpu {
        return Err(CliError::new(
            "--distributed runs one rank per GPU over NCCL: use `--device cuda` (rank r runs on \
             cuda:LOCAL_RANK)",
        ));
    }
    if args.cp_size != 1 {
        return Err(CliError::new(format!(
            "--cp-size {} cannot be combined with --distributed (the context-parallel size is \
             WORLD_SIZE, the number of ranks `gdp launch --nproc` started)",
            args.cp_size
        )));
    }
    candle_gdp::cp::DistEnv::from_vars(std::env::vars_os())
        .map(|_| ())
        .map_err(|e| CliError::new(format!("--distributed: {}", CliError::from_lib(&e))))
}

/// `gdp run --distributed` (see the module docs): every rank computes, rank 0 gets `Some`.
pub fn run_distributed(args: &RunArgs, input: &LoadedInput) -> Result<Option<RunOutput>, CliError> {
    #[cfg(not(feature = "nccl"))]
    {
        let _ = input;
        check_distributed(args).map(|_| None)
    }
    #[cfg(feature = "nccl")]
    {
        let lib = |e: candle_core::Error| CliError::from_lib(&e);
        let env = candle_gdp::cp::DistEnv::from_vars(std::env::vars_os()).map_err(lib)?;
        check_plan(input, env.world_size)?;
        let device = DeviceArg::Cuda(env.local_rank).open()?;
        args.kernels.prepare(&device)?;
        let timeout = candle_gdp::cp::DEFAULT_TIMEOUT;
        let comm = candle_gdp::cp::NcclComm::from_dist_env(&device, &env, timeout).map_err(lib)?;
        let exec = CpExec::Distributed {
            comm: std::sync::Arc::new(comm),
            device,
        };
        let p = CpPrepared::new(input, args, exec)?;
        let out = run_prepared_cp(args, input, &p)?;
        Ok((env.rank == 0).then_some(out))
    }
}

/// The outputs as f32 CPU tensors.
fn finish(tensors: Vec<(String, Tensor)>, timings: Option<Timings>) -> Result<RunOutput, CliError> {
    let tensors = tensors
        .into_iter()
        .map(|(name, t)| {
            let t = t
                .to_dtype(DType::F32)
                .and_then(|t| t.to_device(&Device::Cpu))
                .map_err(|e| CliError::tensor(&name, &e))?;
            Ok((name, t))
        })
        .collect::<Result<Vec<_>, CliError>>()?;
    Ok(RunOutput { tensors, timings })
}

/// Writes the outputs with `candle_core::safetensors::save`.
pub fn write_output(path: &Path, out: &RunOutput) -> Result<(), CliError> {
    let map: HashMap<String, Tensor> = out.tensors.iter().cloned().collect();
    candle_core::safetensors::save(&map, path).map_err(|e| {
        CliError::new(format!(
            "--output {}: cannot write: {}",
            path.display(),
            CliError::from_lib(&e)
        ))
    })
}
