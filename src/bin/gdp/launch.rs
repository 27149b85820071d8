//! `gdp launch`: start R copies of a command as one multi-process group (one process per GPU),
//! torchrun style, through [`crate::launcher`].

use crate::error::CliError;
use crate::launcher::{forward_signals, launch, LaunchConfig};
use clap::Args;
use std::ffi::OsString;
use std::time::Duration;

/// Arguments of `gdp launch`.
#[derive(Debug, Clone, Args)]
pub struct LaunchArgs {
    /// Number of processes (ranks); rank r gets LOCAL_RANK = r, its GPU.
    #[arg(long, value_name = "R",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    pub nproc: usize,
    /// MASTER_ADDR: where rank 0 listens for the rendezvous.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    pub master_addr: String,
    /// MASTER_PORT (default: a free port).
    #[arg(long, value_name = "PORT",
          value_parser = clap::builder::RangedU64ValueParser::<u16>::new().range(1..=65535))]
    pub master_port: Option<u16>,
    /// Seconds the other ranks get between SIGTERM and SIGKILL once one rank has failed.
    #[arg(long, value_name = "S", default_value_t = 5.0,
          value_parser = parse_grace)]
    pub grace: f64,
    /// The command every rank runs (after `--`), e.g. `gdp run ... --distributed`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

fn parse_grace(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && (0.0..=3600.0).contains(&x) => Ok(x),
        _ => Err("expected a number of seconds in 0..=3600".to_string()),
    }
}

/// How a launch ended: the exit code, and the line to print on stderr when it failed.
pub struct Outcome {
    pub code: i32,
    pub message: Option<String>,
}

/// Runs the group; the ranks inherit stdin, stdout and stderr.
pub fn run(args: &LaunchArgs) -> Result<Outcome, CliError> {
    let (program, rest) = args
        .command
        .split_first()
        .ok_or_else(|| CliError::new("missing the command to launch after `--`"))?;
    let mut cfg = LaunchConfig::new(args.nproc, program.clone(), rest.iter().cloned());
    cfg.master_addr = args.master_addr.clone();
    cfg.master_port = args.master_port;
    cfg.grace = Duration::from_secs_f64(args.grace);
    forward_signals();
    let rep = launch(&cfg).map_err(|e| CliError::from_lib(&e))?;
    let message = match (&rep.first_failure, rep.interrupted) {
        (Some(f), _) if args.nproc > 1 => {
            Some(format!("{}; stopped the other ranks", f.description))
        }
        (Some(f), _) => Some(f.description.clone()),
        (None, Some(sig)) => Some(format!("interrupted by signal {sig}; stopped every rank")),
        (None, None) => None,
    };
    Ok(Outcome {
        code: rep.exit_code(),
        message,
    })
}
