//! `gdp`: the Gated DeltaProduct command-line tool.
//!
//! ```text
//! gdp run  --input IN.safetensors --output OUT.safetensors [--dtype f32|bf16|f16]
//!          [--device cpu|cuda:N] [--scale S] [--repeat N] [--cp-size R] [--threads N]
//!          [--distributed]
//! gdp demo [--dtype f32|bf16|f16] [--tokens T] [--repeat N] [--threads N]
//! gdp cp-bench [--ranks R] [--rank r] [--tokens T] [--heads H] [--dk K] [--dv V]
//!          [--householder n] [--dtype D] [--device DEV] [--save nothing|wy|all] [--iters N]
//! gdp launch --nproc R [--master-addr A] [--master-port P] -- CMD ARGS...
//! ```
//!
//! Every failure prints exactly one line `error: ...` on stderr: exit code 2 for usage errors
//! (bad flags, reported by clap), 1 for everything else (bad input file, bad tensors, runtime
//! errors, and even an unexpected panic). `gdp launch` exits with the first failing rank's code
//! (after one `error:` line naming the rank).

// A crate root resolves `mod x;` next to itself, so the helpers under `gdp/` need `path`.
#[path = "gdp/cp_bench.rs"]
mod cp_bench;
#[path = "gdp/demo.rs"]
mod demo;
#[path = "gdp/error.rs"]
mod error;
#[path = "gdp/input.rs"]
mod input;
#[path = "gdp/kernels.rs"]
mod kernels;
#[path = "gdp/launch.rs"]
mod launch;
#[path = "gdp/launcher.rs"]
mod launcher;
#[path = "gdp/run.rs"]
mod run;

use clap::{Args, Parser, Subcommand};
use error::CliError;
use std::io::Write;
use std::process::ExitCode;

/// Gated DeltaProduct (flash-linear-attention's `chunk_gated_delta_product`) on Candle.
#[derive(Debug, Parser)]
#[command(name = "gdp", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    global: GlobalArgs,
}

/// Options shared by every subcommand.
#[derive(Debug, Args)]
struct GlobalArgs {
    /// Worker threads of the CPU kernels (rayon); all cores when omitted.
    #[arg(long, global = true, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=4096))]
    threads: Option<usize>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the op on tensors from a safetensors file and write `o`, `ht` (and gradients).
    Run(run::RunArgs),
    /// Run a built-in random case, check it against the f64 reference, and time it.
    Demo(demo::DemoArgs),
    /// Time one context-parallel rank alone on one device against the plain op on its shard.
    CpBench(cp_bench::CpBenchArgs),
    /// Start R copies of a command as one multi-process group (one per GPU; sets RANK,
    /// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); stops all if one fails.
    Launch(launch::LaunchArgs),
}

fn main() -> ExitCode {
    install_panic_hook();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return clap_exit(e),
    };
    if let Command::Launch(args) = &cli.command {
        return match launch::run(args) {
            Ok(out) => {
                if let Some(msg) = &out.message {
                    print_error(msg);
                }
                match out.code {
                    0 => ExitCode::SUCCESS,
                    c @ 1..=255 => ExitCode::from(c as u8),
                    _ => ExitCode::from(1),
                }
            }
            Err(e) => {
                print_error(&e.to_string());
                ExitCode::from(1)
            }
        };
    }
    match dispatch(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            print_error(&e.to_string());
            ExitCode::from(1)
        }
    }
}

fn dispatch(cli: &Cli) -> Result<(), CliError> {
    if let Some(n) = cli.global.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .map_err(|e| CliError::new(format!("--threads {n}: {e}")))?;
    }
    match &cli.command {
        Command::Run(args) => {
            let out = if args.distributed {
                run::check_distributed(args)?;
                let loaded = input::load(&args.input)?;
                run::run_distributed(args, &loaded)?
            } else {
                let loaded = input::load(&args.input)?;
                Some(run::run(args, &loaded)?)
            };
            // Under `--distributed` only rank 0 writes the gathered outputs and the timings.
            let Some(out) = out else {
                return Ok(());
            };
            run::write_output(&args.output, &out)?;
            let mut stdout = std::io::stdout().lock();
            for line in out.timing_lines() {
                writeln!(stdout, "{line}")
                    .map_err(|e| CliError::new(format!("writing to stdout: {e}")))?;
            }
            Ok(())
        }
        Command::Demo(args) => demo::demo(args),
        Command::CpBench(args) => cp_bench::cp_bench(args),
        Command::Launch(_) => unreachable!("handled in main"),
    }
}

/// Prints `error: <msg>` as one line on stderr.
fn print_error(msg: &str) {
    let line = error::one_line(msg);
    let line = line.strip_prefix("error: ").unwrap_or(&line);
    let _ = writeln!(std::io::stderr().lock(), "error: {line}");
}

/// Help and version go to stdout with exit code 0; every other clap error becomes one
/// `error: ...` line (the usage block and the `--help` hint are dropped) with exit code 2.
fn clap_exit(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        let _ = e.print();
        return ExitCode::SUCCESS;
    }
    if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        print_error("missing subcommand `run`, `demo`, `cp-bench` or `launch` (see `gdp --help`)");
        return ExitCode::from(2);
    }
    let rendered = e.render().to_string();
    let kept: Vec<&str> = rendered
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .collect();
    print_error(&kept.join(" "));
    ExitCode::from(2)
}

/// Even an unexpected panic (in any thread) prints one line and exits with code 1.
fn install_panic_hook() {
    use std::sync::atomic::{AtomicBool, Ordering};
    static PANICKING: AtomicBool = AtomicBool::new(false);
    std::panic::set_hook(Box::new(|info| {
        if PANICKING.swap(true, Ordering::SeqCst) {
            // Another thread is already reporting; the process exits shortly.
            loop {
                std::thread::park();
            }
        }
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown cause".to_string());
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        print_error(&format!("internal error: {msg}{at}"));
        std::process::exit(1);
    }));
}
