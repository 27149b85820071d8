//! Context-parallel runs: `--cp-size R` on R ranks of this process, and `--distributed`, one
//! rank of a multi-process group over NCCL; the same outputs as the plain op.

use super::args::{BackwardArg, DeviceArg, RunArgs, TimingArg};
use super::output::{finish, RunOutput, Timings};
use super::plain::check_cotangents;
use super::timing::bench_on;
use crate::error::CliError;
use crate::input::LoadedInput;
use candle_core::{DType, Device, Tensor};
#[cfg(feature = "nccl")]
use candle_gdp::cp::{Communicator, Composition};
use candle_gdp::cp::{CpOutput, ShardPlan};
use candle_gdp::op::KernelConfig;
use candle_gdp::{ContextParallel, Cotangents, GdpOptions, SaveIntermediates};

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
        // `o` is [B, T, H, V], the final state [N, H, K, V] (H: the heads of v, which may be a
        // multiple of those of q); malformed q or v are left to the op.
        let shapes = q.dims4().and_then(|(b, t, _, k)| {
            let (h, vd) = (v.dim(2)?, v.dim(3)?);
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

/// `gdp run --cp-size R`: the same outputs through [`ContextParallel`] on `R` ranks.
pub(super) fn run_cp(args: &RunArgs, input: &LoadedInput) -> Result<RunOutput, CliError> {
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
