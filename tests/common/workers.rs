//! Multi-process tests whose workers are the test binary itself, started as one group by the
//! `gdp` binary's `launch` command (included by tests/launch.rs and tests/nccl.rs, which both
//! need the `cli` feature for it).

use anyhow::Result;
use std::path::Path;
use std::process::{Command, Output};

/// libtest's summary for a worker that ran exactly one test, which passed.
pub const ONE_PASSED: &str = "test result: ok. 1 passed; 0 failed;";

/// Starts `nproc` copies of this test binary running exactly the ignored test `name` through
/// `gdp launch`, with `env` set, each rank's standard output redirected to `<dir>/rank<R>.out`
/// (through `sh`, so that libtest's own summary is captured too). Returns the launcher's output
/// and every rank's output; `dir` is removed afterwards.
pub fn launch_workers(
    nproc: usize,
    name: &str,
    env: (&str, &str),
    dir: &Path,
) -> Result<(Output, Vec<String>)> {
    std::fs::create_dir_all(dir)?;
    let launched = Command::new(env!("CARGO_BIN_EXE_gdp"))
        .args(["launch", "--nproc", &nproc.to_string(), "--", "sh", "-c"])
        .arg(r#"exec "$0" "$@" > "$GDP_WORKER_OUT/rank$RANK.out""#)
        .arg(std::env::current_exe()?)
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(env.0, env.1)
        .env("GDP_WORKER_OUT", dir)
        .output()?;
    let outs = (0..nproc)
        .map(|r| std::fs::read_to_string(dir.join(format!("rank{r}.out"))).unwrap_or_default())
        .collect();
    let _ = std::fs::remove_dir_all(dir);
    Ok((launched, outs))
}
