//! The multi-process machinery without a GPU: `gdp launch` (environment, inherited output,
//! a failing rank stops its siblings, one-line usage errors) and the rendezvous health channel
//! across real processes (an abort, or a process that dies, reaches every other rank promptly).
//! The workers are this test binary itself, started by `gdp launch` with a worker variable
//! set: `rendezvous_worker` is an ignored test that only `failures_reach_every_process`
//! starts (`--ignored --exact rendezvous_worker`); run on its own it fails. Each rank's standard
//! output goes to a file that the parent reads, so a filter that stops matching (libtest's
//! "running 0 tests") fails the parent instead of passing.

use anyhow::{ensure, Result};
use candle_gdp::cp::comm::{DistEnv, Rendezvous};
use std::process::{Command, Output};
#[path = "common/workers.rs"]
mod workers;
use std::time::{Duration, Instant};
use workers::{launch_workers, ONE_PASSED};

const WORKER: &str = "GDP_RDV_TEST_WORKER";
const GDP: &str = env!("CARGO_BIN_EXE_gdp");

/// Runs as a worker only: `failures_reach_every_process` starts it with `WORKER` set; run
/// without it (e.g. by `--ignored`), it fails.
#[test]
#[ignore = "worker: started by failures_reach_every_process"]
fn rendezvous_worker() {
    let Ok(scenario) = std::env::var(WORKER) else {
        panic!("{WORKER} is unset: rendezvous_worker is run only by failures_reach_every_process");
    };
    let env = DistEnv::from_vars(std::env::vars_os()).expect("launcher environment");
    let r = env.rank;
    let rdv = Rendezvous::establish(
        r,
        env.world_size,
        &env.master,
        Duration::from_secs(20),
        || Ok(b"unique-id".to_vec()),
    )
    .expect("rendezvous");
    assert_eq!(rdv.blob(), b"unique-id");
    let (culprit, what) = match scenario.as_str() {
        "abort" => (1, "gives up"),
        "die" => (2, "lost"),
        other => panic!("unknown scenario {other}"),
    };
    if r == culprit {
        std::thread::sleep(Duration::from_millis(200));
        if scenario == "abort" {
            rdv.abort("rank 1 gives up");
            std::thread::sleep(Duration::from_millis(100));
        }
        // Exit without dropping anything: for "die" the kernel closes the sockets, as when a
        // process crashes.
        std::process::exit(0);
    }
    let t0 = Instant::now();
    let f = rdv
        .wait_failure(Duration::from_secs(15))
        .expect("the failure reaches this rank");
    let waited = t0.elapsed();
    println!("[rank {r}] {scenario}: after {waited:?}: {f}");
    assert!(f.starts_with(&format!("rank {culprit}: ")), "{f}");
    assert!(f.contains(what), "{f}");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
}

/// libtest's header for a worker whose filter matched exactly one test.
const ONE_RUNNING: &str = "running 1 test\n";

#[test]
fn failures_reach_every_process() -> Result<()> {
    for (scenario, culprit) in [("abort", 1), ("die", 2)] {
        let dir =
            std::env::temp_dir().join(format!("gdp-launch-test-{}-{scenario}", std::process::id()));
        let t0 = Instant::now();
        let (launched, outs) = launch_workers(3, "rendezvous_worker", (WORKER, scenario), &dir)?;
        ensure!(
            launched.status.success(),
            "{scenario}: {launched:?}; outputs: {outs:#?}"
        );
        ensure!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
        for (r, out) in outs.iter().enumerate() {
            // The culprit exits in the middle of its test, before libtest's summary.
            let want = if r == culprit {
                ONE_RUNNING
            } else {
                ONE_PASSED
            };
            ensure!(
                out.contains(want),
                "{scenario}: rank {r} did not print `{}`: {out}",
                want.trim_end()
            );
        }
    }
    Ok(())
}

mod cli {
    use super::*;

    fn gdp(args: &[&str]) -> Result<Output> {
        Ok(Command::new(GDP).args(args).output()?)
    }

    /// Exit `code`, exactly one `error:` line on stderr, naming `needle`.
    fn expect_error(what: &str, r: &Output, code: i32, needle: &str) -> Result<()> {
        let stderr = String::from_utf8_lossy(&r.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        ensure!(
            r.status.code() == Some(code),
            "{what}: exit {:?}, want {code}; stderr: {stderr}",
            r.status.code()
        );
        ensure!(lines.len() == 1, "{what}: stderr: {stderr}");
        ensure!(lines[0].starts_with("error: "), "{what}: {stderr}");
        ensure!(
            lines[0].contains(needle),
            "{what}: `{needle}` not in: {stderr}"
        );
        println!("{what:<22} exit {code}  {}", lines[0]);
        Ok(())
    }

    #[test]
    fn launch_sets_the_environment_and_inherits_output() -> Result<()> {
        let r = gdp(&[
            "launch",
            "--nproc",
            "3",
            "--",
            "sh",
            "-c",
            "echo $RANK/$WORLD_SIZE $LOCAL_RANK $MASTER_ADDR $NCCL_NVLS_ENABLE",
        ])?;
        ensure!(r.status.success(), "{r:?}");
        ensure!(r.stderr.is_empty(), "{r:?}");
        let out = String::from_utf8(r.stdout)?;
        let mut lines: Vec<&str> = out.lines().collect();
        lines.sort();
        ensure!(
            lines
                == [
                    "0/3 0 127.0.0.1 0",
                    "1/3 1 127.0.0.1 0",
                    "2/3 2 127.0.0.1 0"
                ],
            "{out}"
        );
        let r = gdp(&[
            "launch",
            "--nproc",
            "1",
            "--master-port",
            "29611",
            "--",
            "sh",
            "-c",
            "echo $MASTER_PORT",
        ])?;
        ensure!(String::from_utf8(r.stdout)?.trim() == "29611");
        // The ranks inherit the launcher's environment; its forced variables win.
        let r = Command::new(GDP)
            .args(["launch", "--nproc", "2", "--", "sh", "-c"])
            .arg("echo $EXTRA $NCCL_NVLS_ENABLE")
            .env("EXTRA", "x")
            .env("NCCL_NVLS_ENABLE", "1")
            .output()?;
        ensure!(r.status.success(), "{r:?}");
        ensure!(String::from_utf8(r.stdout)?.lines().all(|l| l == "x 0"));
        Ok(())
    }

    #[test]
    fn a_failing_rank_stops_its_siblings_quickly() -> Result<()> {
        let t0 = Instant::now();
        let r = gdp(&[
            "launch",
            "--nproc",
            "3",
            "--",
            "sh",
            "-c",
            "if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 5; fi; sleep 60 & wait",
        ])?;
        let took = t0.elapsed();
        expect_error("failing rank", &r, 5, "rank 1")?;
        ensure!(
            String::from_utf8_lossy(&r.stderr).contains("exited with code 5; stopped the other"),
            "{r:?}"
        );
        ensure!(took < Duration::from_secs(10), "took {took:?}");
        Ok(())
    }

    #[test]
    fn bad_launches_give_one_line() -> Result<()> {
        let sh = ["--", "sh", "-c", "true"];
        let with = |pre: &[&'static str]| -> Vec<&'static str> {
            let mut a = vec!["launch"];
            a.extend_from_slice(pre);
            a.extend_from_slice(&sh);
            a
        };
        expect_error("--nproc 0", &gdp(&with(&["--nproc", "0"]))?, 2, "--nproc")?;
        expect_error("--nproc x", &gdp(&with(&["--nproc", "x"]))?, 2, "--nproc")?;
        expect_error("no --nproc", &gdp(&with(&[]))?, 2, "--nproc")?;
        expect_error(
            "--master-port 0",
            &gdp(&with(&["--nproc", "2", "--master-port", "0"]))?,
            2,
            "--master-port",
        )?;
        expect_error("no command", &gdp(&["launch", "--nproc", "2"])?, 2, "CMD")?;
        let help = gdp(&["launch", "--help"])?;
        ensure!(help.status.success() && !help.stdout.is_empty(), "{help:?}");
        expect_error(
            "missing program",
            &gdp(&["launch", "--nproc", "2", "--", "/nonexistent/gdp-prog"])?,
            1,
            "cannot start `/nonexistent/gdp-prog`",
        )?;
        Ok(())
    }

    #[cfg(not(feature = "nccl"))]
    #[test]
    fn distributed_run_needs_the_nccl_feature() -> Result<()> {
        let r = gdp(&[
            "run",
            "--input",
            "in.safetensors",
            "--output",
            "out.safetensors",
            "--device",
            "cuda",
            "--distributed",
        ])?;
        expect_error("--distributed", &r, 1, "--features nccl")
    }
}
