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
//!
//! This module holds the run itself and its plain (single-device) path; `args` the command-line
//! arguments, `plain` the plain op on prepared inputs, `cp` the context-parallel runs
//! (in-process and `--distributed`), `timing` how `--repeat` times a call, `output` what a run
//! returns and how it is written.
//!
//! [`ContextParallel`]: candle_gdp::ContextParallel

// Reached through `#[path]`, this file resolves `mod x;` next to itself (like a `mod.rs`), so
// the submodules under `run/` need `path` too.
#[path = "run/args.rs"]
mod args;
#[path = "run/cp.rs"]
mod cp;
#[path = "run/output.rs"]
mod output;
#[path = "run/plain.rs"]
mod plain;
#[path = "run/timing.rs"]
mod timing;

pub use args::{DTypeArg, DeviceArg, RunArgs};
pub use cp::{check_distributed, run_distributed};
pub use output::write_output;
pub use plain::{with_final_state, Prepared};
pub use timing::bench;

use crate::error::CliError;
use crate::input::LoadedInput;
use cp::run_cp;
use output::{finish, RunOutput, Timings};
use timing::bench_with;

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
