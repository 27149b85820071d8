//! The multi-process launcher behind `gdp launch`: starts `nproc` copies of a command as one
//! group, torchrun style, and stops the whole group when one of them fails.
//!
//! Every process gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (= its GPU), `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR` and `MASTER_PORT` (see [`candle_gdp::cp::comm::rendezvous`]), and NVLink multicast
//! is forced off ([`FORCED_ENV`]: on shared multi-GPU hosts a program that uses it can take the
//! GPUs out of service for everyone). Standard input, output and error are inherited, with no
//! prefix. If a process exits with a failure, the launcher terminates the others (`SIGTERM` to each
//! process group, `SIGKILL` after a grace period) and reports the first failure.

use std::ffi::OsString;
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use candle_core::Result;
use candle_gdp::GdpError;

/// Environment forced on every launched process: NVLink multicast off in NCCL, PyTorch and
/// NVSHMEM.
pub const FORCED_ENV: [(&str, &str); 3] = [
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
];

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Number of processes (ranks), at least 1.
    pub nproc: usize,
    /// `MASTER_ADDR` (default `127.0.0.1`).
    pub master_addr: String,
    /// `MASTER_PORT`; `None` picks a free port.
    pub master_port: Option<u16>,
    /// The program every rank runs.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// How long the other ranks get between `SIGTERM` and `SIGKILL` once one has failed.
    pub grace: Duration,
}

impl LaunchConfig {
    /// `nproc` copies of `program args..` on `127.0.0.1`, a free port, a 5 s grace period.
    pub fn new(
        nproc: usize,
        program: impl Into<OsString>,
        args: impl IntoIterator<Item = impl Into<OsString>>,
    ) -> Self {
        Self {
            nproc,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            program: program.into(),
            args: args.into_iter().map(Into::into).collect(),
            grace: Duration::from_secs(5),
        }
    }
}

/// Why a rank counts as failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// The rank.
    pub rank: usize,
    /// Its exit code (`128 + signal` when a signal killed it).
    pub code: i32,
    /// `"rank 1 (pid 4242) exited with code 3"`.
    pub description: String,
}

/// How a launch ended.
#[derive(Debug, Clone)]
pub struct LaunchReport {
    /// The first rank that failed, if any (later ones were usually terminated by the launcher).
    pub first_failure: Option<RankFailure>,
    /// The signal that interrupted the launcher (see [`forward_signals`]), if any.
    pub interrupted: Option<i32>,
}

impl LaunchReport {
    /// The launcher's exit code: 0, the first failure's code, or `128 + signal` when
    /// interrupted.
    pub fn exit_code(&self) -> i32 {
        match (&self.first_failure, self.interrupted) {
            (Some(f), _) => f.code,
            (None, Some(sig)) => 128 + sig,
            (None, None) => 0,
        }
    }
}

/// A free TCP port on `host` (bound once and released; another program could take it in
/// between, which the rendezvous then reports).
pub fn free_port(host: &str) -> Result<u16> {
    let l = TcpListener::bind((host, 0)).map_err(|e| GdpError::Option {
        name: "master_addr".into(),
        reason: format!("cannot bind a free port on `{host}`: {e}"),
    })?;
    Ok(l.local_addr()?.port())
}

/// The exit code of a status: the code, or `128 + signal`.
pub fn exit_code(status: &ExitStatus) -> i32 {
    if let Some(c) = status.code() {
        return c;
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return 128 + sig;
        }
    }
    1
}

fn describe(rank: usize, pid: u32, status: &ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("rank {rank} (pid {pid}) was killed by signal {sig}");
        }
    }
    format!(
        "rank {rank} (pid {pid}) exited with code {}",
        exit_code(status)
    )
}

/// The signal that [`forward_signals`] caught, 0 if none.
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

/// Makes `SIGINT`, `SIGTERM` and `SIGHUP` stop a running [`launch`] (which forwards the signal
/// to every rank's process group and returns with [`LaunchReport::interrupted`]) instead of
/// killing only the launcher. The ranks run in their own process groups, so a terminal's Ctrl-C
/// reaches them only through this. For command-line launchers; a no-op off Unix.
pub fn forward_signals() {
    #[cfg(unix)]
    {
        extern "C" fn on_signal(sig: libc::c_int) {
            STOP_SIGNAL.store(sig, Ordering::SeqCst);
        }
        let handler: extern "C" fn(libc::c_int) = on_signal;
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
            unsafe {
                libc::signal(sig, handler as libc::sighandler_t);
            }
        }
    }
}

/// Sends `sig` to the process group of `child` (Unix), or kills it (elsewhere).
fn signal_group(child: &mut Child, sig: i32) {
    #[cfg(unix)]
    {
        // Each rank leads its own process group (pgid = pid): signal the whole group, so that
        // processes the rank started go too.
        // SAFETY: plain syscall on a pid we spawned.
        unsafe {
            libc::kill(-(child.id() as libc::pid_t), sig);
        }
    }
    #[cfg(not(unix))]
    {
        let _ = sig;
        let _ = child.kill();
    }
}

#[cfg(unix)]
const SIGTERM: i32 = libc::SIGTERM;
#[cfg(unix)]
const SIGKILL: i32 = libc::SIGKILL;
#[cfg(not(unix))]
const SIGTERM: i32 = 15;
#[cfg(not(unix))]
const SIGKILL: i32 = 9;

/// Starts the group and waits for it; see the [module docs](self). Returns an error only when
/// the launch itself fails (no ranks, a program that cannot be started); a rank that fails is
/// reported in the [`LaunchReport`].
pub fn launch(cfg: &LaunchConfig) -> Result<LaunchReport> {
    if cfg.nproc == 0 {
        return Err(GdpError::Option {
            name: "nproc".into(),
            reason: "needs at least one process".into(),
        }
        .into());
    }
    let port = match cfg.master_port {
        Some(p) => p,
        None => free_port(&cfg.master_addr)?,
    };
    let world = cfg.nproc.to_string();
    let mut children: Vec<Child> = Vec::with_capacity(cfg.nproc);
    for rank in 0..cfg.nproc {
        let mut cmd = Command::new(&cfg.program);
        cmd.args(&cfg.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", &world)
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", &world)
            .env("MASTER_ADDR", &cfg.master_addr)
            .env("MASTER_PORT", port.to_string())
            .envs(FORCED_ENV);
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            cmd.process_group(0);
        }
        match cmd.spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in &mut children {
                    signal_group(c, SIGKILL);
                    let _ = c.wait();
                }
                return Err(GdpError::Option {
                    name: "command".into(),
                    reason: format!(
                        "cannot start `{}` (rank {rank}): {e}",
                        cfg.program.to_string_lossy()
                    ),
                }
                .into());
            }
        }
    }
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; cfg.nproc];
    let mut first_failure: Option<RankFailure> = None;
    let mut interrupted = None;
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;
    loop {
        for (rank, child) in children.iter_mut().enumerate() {
            if statuses[rank].is_some() {
                continue;
            }
            let status = match child.try_wait() {
                Ok(Some(s)) => s,
                Ok(None) => continue,
                // Cannot query it any more: treat as failed, and stop it.
                Err(_) => {
                    signal_group(child, SIGKILL);
                    child.wait().unwrap_or_else(|_| failed_status())
                }
            };
            statuses[rank] = Some(status);
            if !status.success() && first_failure.is_none() && kill_at.is_none() {
                first_failure = Some(RankFailure {
                    rank,
                    code: exit_code(&status),
                    description: describe(rank, child.id(), &status),
                });
            }
        }
        if statuses.iter().all(Option::is_some) {
            break;
        }
        let sig = STOP_SIGNAL.swap(0, Ordering::SeqCst);
        if sig != 0 && interrupted.is_none() {
            interrupted = Some(sig);
        }
        if kill_at.is_none() && (first_failure.is_some() || interrupted.is_some()) {
            let sig = interrupted.unwrap_or(SIGTERM);
            for (rank, child) in children.iter_mut().enumerate() {
                if statuses[rank].is_none() {
                    signal_group(child, sig);
                }
            }
            kill_at = Some(Instant::now() + cfg.grace);
        }
        if let Some(at) = kill_at {
            if !killed && Instant::now() >= at {
                for (rank, child) in children.iter_mut().enumerate() {
                    if statuses[rank].is_none() {
                        signal_group(child, SIGKILL);
                    }
                }
                killed = true;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(LaunchReport {
        first_failure,
        interrupted,
    })
}

fn failed_status() -> ExitStatus {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        ExitStatus::from_raw(1 << 8)
    }
    #[cfg(not(unix))]
    {
        use std::os::windows::process::ExitStatusExt;
        ExitStatus::from_raw(1)
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    fn sh(nproc: usize, script: &str) -> LaunchConfig {
        LaunchConfig::new(nproc, "sh", ["-c", script])
    }

    #[test]
    fn every_rank_gets_its_environment() {
        let dir = std::env::temp_dir().join(format!("gdp-launch-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = format!(
            "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT \
             $NCCL_NVLS_ENABLE $TORCH_SYMM_MEM_DISABLE_MULTICAST $NVSHMEM_DISABLE_NVLS\" \
             > {}/$RANK",
            dir.display()
        );
        let mut cfg = sh(3, &script);
        cfg.master_port = Some(29577);
        let rep = launch(&cfg).unwrap();
        assert_eq!(rep.exit_code(), 0, "{rep:?}");
        for r in 0..3 {
            let line = std::fs::read_to_string(dir.join(r.to_string())).unwrap();
            assert_eq!(line.trim(), format!("{r} 3 {r} 3 127.0.0.1 29577 0 1 1"));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failure_stops_the_others_quickly() {
        let t0 = Instant::now();
        let rep = launch(&sh(
            3,
            "if [ \"$RANK\" = 1 ]; then sleep 0.2; exit 7; fi; sleep 30 & wait",
        ))
        .unwrap();
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        let f = rep.first_failure.clone().expect("a failure");
        assert_eq!((f.rank, f.code, rep.exit_code()), (1, 7, 7));
        assert!(f.description.contains("rank 1") && f.description.contains("code 7"));
        // A rank that ignores SIGTERM is killed after the grace period.
        let mut cfg = sh(
            2,
            "if [ \"$RANK\" = 0 ]; then exit 3; fi; trap '' TERM; sleep 30",
        );
        cfg.grace = Duration::from_millis(300);
        let t0 = Instant::now();
        let rep = launch(&cfg).unwrap();
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        assert_eq!(rep.exit_code(), 3);
    }

    #[test]
    fn bad_launches_are_errors() {
        let e = launch(&sh(0, "true")).unwrap_err().to_string();
        assert!(e.contains("nproc"), "{e}");
        let e = launch(&LaunchConfig::new(2, "/nonexistent/gdp-x", ["a"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot start `/nonexistent/gdp-x`"), "{e}");
        let p = free_port("127.0.0.1").unwrap();
        assert!(p > 0);
    }
}
