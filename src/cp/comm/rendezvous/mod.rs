//! Multi-process rendezvous, the torchrun way, and the group's health channel. No CUDA here.
//!
//! Every process of a group reads its place from the environment ([`DistEnv`]: `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, as set by `gdp launch` or
//! torchrun). [`Rendezvous::establish`] then connects the group over TCP:
//!
//! * rank 0 listens on `MASTER_ADDR:MASTER_PORT`; every other rank connects, retrying until the
//!   timeout (rank 0 may start later), and introduces itself (rank, world size);
//! * once all ranks are in, rank 0 sends each of them a byte blob (for NCCL: the 128-byte
//!   unique id that rank 0 created);
//! * the connections stay open as the group's **health channel**, one background thread per
//!   connection. An abort from any rank ([`Rendezvous::abort`]) goes to rank 0, which relays it
//!   to every other rank; a connection that drops without a clean goodbye means the process on
//!   the other end died, and is reported (and relayed) the same way. Every rank then sees the
//!   first failure, with its origin and reason, through [`Rendezvous::failure`], so that a rank
//!   waiting in a collective can give up at once instead of waiting for its timeout.
//!
//! The health channel is a star around rank 0: once rank 0 has left (cleanly, by dropping its
//! [`Rendezvous`]), later failures of other ranks are no longer relayed, and peers rely on their
//! collective timeouts.

use std::ffi::OsString;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{GdpError, Result};

const LAUNCH_HINT: &str = "start the processes with `gdp launch --nproc R -- ...` (or torchrun), \
                           which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT";

/// Where rank 0 listens: `MASTER_ADDR:MASTER_PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousAddr {
    /// Host name or IP address (in practice the loopback address).
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl RendezvousAddr {
    /// `host:port`.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        Self {
            host: host.into(),
            port,
        }
    }
}

impl fmt::Display for RendezvousAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// A process's place in a multi-process group, read from the torchrun environment variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// `RANK`: this process's rank in the group, `0..world_size`.
    pub rank: usize,
    /// `WORLD_SIZE`: number of processes in the group.
    pub world_size: usize,
    /// `LOCAL_RANK`: this process's index on its machine; the GPU it should use.
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE`, when set: number of processes on this machine.
    pub local_world_size: Option<usize>,
    /// `MASTER_ADDR:MASTER_PORT`: where rank 0 listens.
    pub master: RendezvousAddr,
}

fn env_err(var: &str, reason: impl Into<String>) -> candle_core::Error {
    GdpError::Env {
        var: var.to_string(),
        reason: reason.into(),
    }
    .into()
}

impl DistEnv {
    /// Reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` (optional), `MASTER_ADDR`
    /// and `MASTER_PORT` from `vars`, the environment that `gdp launch` (or torchrun) gave the
    /// process: pass `std::env::vars_os()`. The library itself reads no environment variable.
    /// A missing or malformed variable is a [`GdpError::Env`] naming it and the value it had.
    pub fn from_vars(vars: impl IntoIterator<Item = (OsString, OsString)>) -> Result<Self> {
        let vars: std::collections::HashMap<OsString, OsString> = vars.into_iter().collect();
        Self::from_lookup(|k| vars.get(std::ffi::OsStr::new(k)).cloned())
    }

    /// [`DistEnv::from_vars`] with each variable looked up through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Result<Self> {
        let text = |var: &str| -> Result<Option<String>> {
            match get(var) {
                None => Ok(None),
                Some(v) => v
                    .into_string()
                    .map(Some)
                    .map_err(|v| env_err(var, format!("expected UTF-8 text, got {v:?}"))),
            }
        };
        let required = |var: &str| -> Result<String> {
            text(var)?.ok_or_else(|| env_err(var, format!("not set; {LAUNCH_HINT}")))
        };
        let int = |var: &str, s: &str, what: &str| -> Result<usize> {
            s.trim()
                .parse::<usize>()
                .map_err(|_| env_err(var, format!("expected {what}, got `{s}`")))
        };
        let world_size = int("WORLD_SIZE", &required("WORLD_SIZE")?, "a positive integer")?;
        if world_size == 0 {
            return Err(env_err(
                "WORLD_SIZE",
                "expected a positive integer, got `0`",
            ));
        }
        let range = format!("an integer in 0..WORLD_SIZE = 0..{world_size}");
        let rank = int("RANK", &required("RANK")?, &range)?;
        if rank >= world_size {
            return Err(env_err("RANK", format!("expected {range}, got `{rank}`")));
        }
        let local_world_size = match text("LOCAL_WORLD_SIZE")? {
            None => None,
            Some(s) => {
                let n = int("LOCAL_WORLD_SIZE", &s, "a positive integer")?;
                if n == 0 {
                    return Err(env_err(
                        "LOCAL_WORLD_SIZE",
                        "expected a positive integer, got `0`",
                    ));
                }
                Some(n)
            }
        };
        let local_rank = int(
            "LOCAL_RANK",
            &required("LOCAL_RANK")?,
            "a non-negative integer (the GPU index)",
        )?;
        if let Some(n) = local_world_size {
            if local_rank >= n {
                return Err(env_err(
                    "LOCAL_RANK",
                    format!(
                        "expected an integer in 0..LOCAL_WORLD_SIZE = 0..{n}, got `{local_rank}`"
                    ),
                ));
            }
        }
        let host = required("MASTER_ADDR")?.trim().to_string();
        if host.is_empty() {
            return Err(env_err(
                "MASTER_ADDR",
                "expected a host name or IP address, got an empty value",
            ));
        }
        let port_text = required("MASTER_PORT")?;
        let port = port_text
            .trim()
            .parse::<u16>()
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| {
                env_err(
                    "MASTER_PORT",
                    format!("expected a TCP port in 1..=65535, got `{port_text}`"),
                )
            })?;
        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master: RendezvousAddr { host, port },
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Wire format: frames `[kind u8][len u32 LE][payload]`.

const MAGIC: &[u8; 8] = b"GDP-RDV1";
const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const REJECT: u8 = 3;
const ABORT: u8 = 4;
const BYE: u8 = 5;
/// Largest payload accepted (the blob and abort reasons are small; anything bigger is not us).
const MAX_PAYLOAD: usize = 1 << 20;
/// How long rank 0 waits for a fresh connection to introduce itself (short in unit tests, which
/// check that it does not outlive the handshake).
const HELLO_TIMEOUT: Duration = if cfg!(test) {
    Duration::from_millis(200)
} else {
    Duration::from_secs(5)
};
/// How long a write on the health channel may block.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);

fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(5 + payload.len());
    buf.push(kind);
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)?;
    w.flush()
}

fn read_frame(r: &mut impl Read) -> io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    r.read_exact(&mut head)?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes (not a gdp rendezvous peer?)"),
        ));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok((head[0], payload))
}

fn u32_at(p: &[u8], at: usize) -> Option<u32> {
    p.get(at..at + 4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

// ---------------------------------------------------------------------------------------------

/// The first failure seen by this rank.
#[derive(Debug, Clone)]
struct Failure {
    origin: usize,
    reason: String,
}

struct Health {
    rank: usize,
    failed: AtomicBool,
    closing: AtomicBool,
    failure: Mutex<Option<Failure>>,
    cv: Condvar,
    /// Write halves: rank 0 holds one per peer, the others one to rank 0. `None` once gone.
    links: Vec<Link>,
}

struct Link {
    peer: usize,
    writer: Mutex<Option<TcpStream>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Health {
    /// Records the failure unless one is recorded already; returns whether it was the first.
    fn record(&self, origin: usize, reason: &str) -> bool {
        self.record_and_relay(origin, reason, None::<fn()>)
    }

    /// [`Self::record`], running `relay` (the abort frames to the peers) before anyone on this
    /// rank can see the failure: a rank that wakes up on it and exits at once must not say a
    /// clean goodbye to a peer before that peer has been told.
    fn record_and_relay(&self, origin: usize, reason: &str, relay: Option<impl FnOnce()>) -> bool {
        let mut f = lock(&self.failure);
        if f.is_some() {
            return false;
        }
        if let Some(relay) = relay {
            relay();
        }
        *f = Some(Failure {
            origin,
            reason: reason.to_string(),
        });
        self.failed.store(true, Ordering::SeqCst);
        self.cv.notify_all();
        true
    }

    /// Sends an abort frame to every link except `skip`; failed writes are ignored (that peer is
    /// gone or going).
    fn send_abort(&self, origin: usize, reason: &str, skip: Option<usize>) {
        let mut payload = (origin as u32).to_le_bytes().to_vec();
        payload.extend_from_slice(reason.as_bytes());
        for link in &self.links {
            if Some(link.peer) == skip {
                continue;
            }
            let mut w = lock(&link.writer);
            if let Some(s) = w.as_mut() {
                if write_frame(s, ABORT, &payload).is_err() {
                    *w = None;
                }
            }
        }
    }

    /// A frame or a lost connection on the link to `peer`; returns whether to keep reading.
    fn on_event(&self, peer: usize, event: io::Result<(u8, Vec<u8>)>) -> bool {
        let (origin, reason) = match event {
            Ok((ABORT, p)) => {
                let origin = u32_at(&p, 0).map_or(peer, |o| o as usize);
                let reason = String::from_utf8_lossy(p.get(4..).unwrap_or_default()).into_owned();
                (origin, reason)
            }
            Ok((BYE, _)) => {
                *lock(&self.links_to(peer).writer) = None;
                return false;
            }
            Ok((kind, _)) => (
                peer,
                format!("sent an unexpected frame (kind {kind}) on the health channel"),
            ),
            Err(_) if self.closing.load(Ordering::SeqCst) => return false,
            // Not a lost connection (the channel has no read timeout; this is defensive).
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return true
            }
            Err(e) => {
                let why = match e.kind() {
                    io::ErrorKind::UnexpectedEof => "closed".to_string(),
                    _ => e.to_string(),
                };
                (
                    peer,
                    format!(
                        "its connection to rank {} was lost ({why}): the process died or exited \
                         without closing its communicator",
                        self.rank
                    ),
                )
            }
        };
        // Only the group's first failure is relayed (by rank 0, to everyone but its source).
        let relay = (self.rank == 0).then_some(|| self.send_abort(origin, &reason, Some(peer)));
        self.record_and_relay(origin, &reason, relay);
        false
    }

    fn links_to(&self, peer: usize) -> &Link {
        self.links
            .iter()
            .find(|l| l.peer == peer)
            .expect("a link per peer")
    }
}

/// One rank's membership in an established multi-process group: the broadcast blob and the
/// health channel (see the [module docs](self)). Dropping it says goodbye to the peers (a clean
/// exit, not a failure) and stops its background threads.
pub struct Rendezvous {
    rank: usize,
    world_size: usize,
    blob: Vec<u8>,
    health: Arc<Health>,
    readers: Vec<TcpStream>,
    threads: Vec<JoinHandle<()>>,
}

impl fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rendezvous")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("blob_len", &self.blob.len())
            .field("failure", &self.failure())
            .finish()
    }
}

fn rdv_err(msg: String) -> candle_core::Error {
    GdpError::Comm(msg).into()
}

impl Rendezvous {
    /// Connects rank `rank` of a `world_size`-process group through `master` (see the
    /// [module docs](self)). Rank 0 calls `root_blob` once and sends its bytes to every other
    /// rank; every rank gets them back from [`Rendezvous::blob`]. Fails with
    /// [`GdpError::Comm`] if the group is not complete within `timeout` (naming the missing
    /// ranks or the unreachable address), or if the ranks disagree on the world size.
    pub fn establish(
        rank: usize,
        world_size: usize,
        master: &RendezvousAddr,
        timeout: Duration,
        root_blob: impl FnOnce() -> Result<Vec<u8>>,
    ) -> Result<Self> {
        if world_size == 0 || rank >= world_size {
            return Err(GdpError::Option {
                name: "rank".into(),
                reason: format!("need rank < world_size, got rank {rank}, world_size {world_size}"),
            }
            .into());
        }
        let deadline = Instant::now() + timeout;
        if rank == 0 {
            let blob = root_blob()?;
            Self::establish_root(world_size, master, timeout, deadline, blob)
        } else {
            Self::establish_peer(rank, world_size, master, timeout, deadline)
        }
    }

    fn establish_root(
        world_size: usize,
        master: &RendezvousAddr,
        timeout: Duration,
        deadline: Instant,
        blob: Vec<u8>,
    ) -> Result<Self> {
        let mut peers: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
        if world_size > 1 {
            let listener = TcpListener::bind((master.host.as_str(), master.port)).map_err(|e| {
                rdv_err(format!(
                    "rank 0: cannot listen on MASTER_ADDR:MASTER_PORT = {master}: {e}"
                ))
            })?;
            listener
                .set_nonblocking(true)
                .map_err(|e| rdv_err(format!("rank 0: listener on {master}: {e}")))?;
            let mut joined = 1;
            while joined < world_size {
                let now = Instant::now();
                if now >= deadline {
                    let missing: Vec<usize> =
                        (1..world_size).filter(|&r| peers[r].is_none()).collect();
                    return Err(rdv_err(format!(
                        "rank 0: rendezvous at {master} timed out after {timeout:?}: ranks \
                         {missing:?} of {world_size} never connected"
                    )));
                }
                let mut stream = match listener.accept() {
                    Ok((s, _)) => s,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                    Err(e) => return Err(rdv_err(format!("rank 0: accept on {master}: {e}"))),
                };
                // A connection that does not introduce itself properly is not ours: drop it.
                let hello = stream
                    .set_nonblocking(false)
                    .and_then(|_| stream.set_read_timeout(Some(HELLO_TIMEOUT)))
                    .and_then(|_| read_frame(&mut stream));
                let Ok((HELLO, p)) = hello else { continue };
                if p.len() != 16 || &p[..8] != MAGIC {
                    continue;
                }
                let r = u32_at(&p, 8).unwrap_or(0) as usize;
                let w = u32_at(&p, 12).unwrap_or(0) as usize;
                let problem = if w != world_size {
                    Some(format!(
                        "rank {r} says WORLD_SIZE = {w}, rank 0 says {world_size}"
                    ))
                } else if r == 0 || r >= world_size {
                    Some(format!("a peer claims rank {r} (expected 1..{world_size})"))
                } else if peers[r].is_some() {
                    Some(format!("two processes claim rank {r}"))
                } else {
                    None
                };
                if let Some(problem) = problem {
                    let _ = write_frame(&mut stream, REJECT, problem.as_bytes());
                    for s in peers.iter_mut().flatten() {
                        let _ = write_frame(s, REJECT, problem.as_bytes());
                    }
                    return Err(rdv_err(format!(
                        "rank 0: rendezvous at {master}: {problem}"
                    )));
                }
                // The health channel blocks in reads for as long as the group lives.
                stream
                    .set_read_timeout(None)
                    .map_err(|e| rdv_err(format!("rank 0: connection to rank {r}: {e}")))?;
                peers[r] = Some(stream);
                joined += 1;
            }
        }
        let mut payload = (world_size as u32).to_le_bytes().to_vec();
        payload.extend_from_slice(&blob);
        let mut links = vec![];
        let mut readers = vec![];
        for (peer, s) in peers.into_iter().enumerate() {
            let Some(mut s) = s else { continue };
            write_frame(&mut s, WELCOME, &payload)
                .map_err(|e| rdv_err(format!("rank 0: sending the blob to rank {peer}: {e}")))?;
            let (reader, writer) =
                split(s).map_err(|e| rdv_err(format!("rank 0: connection to rank {peer}: {e}")))?;
            links.push(Link {
                peer,
                writer: Mutex::new(Some(writer)),
            });
            readers.push((peer, reader));
        }
        Ok(Self::start(0, world_size, blob, links, readers))
    }

    fn establish_peer(
        rank: usize,
        world_size: usize,
        master: &RendezvousAddr,
        timeout: Duration,
        deadline: Instant,
    ) -> Result<Self> {
        let mut last_err;
        let mut stream = loop {
            let attempt = (master.host.as_str(), master.port)
                .to_socket_addrs()
                .and_then(|mut addrs| {
                    addrs.next().ok_or_else(|| {
                        io::Error::new(io::ErrorKind::NotFound, "the host resolves to nothing")
                    })
                })
                .and_then(|addr| {
                    let left = deadline.saturating_duration_since(Instant::now());
                    TcpStream::connect_timeout(
                        &addr,
                        left.clamp(Duration::from_millis(10), Duration::from_secs(2)),
                    )
                });
            match attempt {
                Ok(s) => break s,
                Err(e) => last_err = e.to_string(),
            }
            if Instant::now() >= deadline {
                return Err(rdv_err(format!(
                    "rank {rank}: could not reach rank 0 at MASTER_ADDR:MASTER_PORT = {master} \
                     within {timeout:?} (last error: {last_err})"
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let io_err = |e: io::Error| {
            rdv_err(format!(
                "rank {rank}: rendezvous with rank 0 at {master}: {e}"
            ))
        };
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&(rank as u32).to_le_bytes());
        hello.extend_from_slice(&(world_size as u32).to_le_bytes());
        write_frame(&mut stream, HELLO, &hello).map_err(io_err)?;
        stream
            .set_read_timeout(Some(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(100)),
            ))
            .map_err(io_err)?;
        let (kind, p) = read_frame(&mut stream).map_err(|e| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => rdv_err(format!(
                "rank {rank}: rendezvous at {master} timed out after {timeout:?} waiting for \
                 the other ranks to connect"
            )),
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => rdv_err(format!(
                "rank {rank}: rank 0 at {master} closed the connection before the group was \
                 complete (it failed or timed out)"
            )),
            _ => io_err(e),
        })?;
        match kind {
            WELCOME => {}
            REJECT => {
                return Err(rdv_err(format!(
                    "rank {rank}: rendezvous at {master} rejected by rank 0: {}",
                    String::from_utf8_lossy(&p)
                )))
            }
            k => {
                return Err(rdv_err(format!(
                    "rank {rank}: unexpected answer (kind {k}) from {master}: not a gdp rendezvous?"
                )))
            }
        }
        let w = u32_at(&p, 0).unwrap_or(0) as usize;
        if w != world_size {
            return Err(rdv_err(format!(
                "rank {rank}: rank 0 says WORLD_SIZE = {w}, this rank says {world_size}"
            )));
        }
        let blob = p[4..].to_vec();
        stream.set_read_timeout(None).map_err(io_err)?;
        let (reader, writer) = split(stream).map_err(io_err)?;
        let links = vec![Link {
            peer: 0,
            writer: Mutex::new(Some(writer)),
        }];
        Ok(Self::start(
            rank,
            world_size,
            blob,
            links,
            vec![(0, reader)],
        ))
    }

    fn start(
        rank: usize,
        world_size: usize,
        blob: Vec<u8>,
        links: Vec<Link>,
        readers: Vec<(usize, TcpStream)>,
    ) -> Self {
        let health = Arc::new(Health {
            rank,
            failed: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            failure: Mutex::new(None),
            cv: Condvar::new(),
            links,
        });
        let mut handles = vec![];
        let mut threads = vec![];
        for (peer, mut reader) in readers {
            if let Ok(h) = reader.try_clone() {
                handles.push(h);
            }
            let h = health.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("gdp-rdv-{rank}-{peer}"))
                .spawn(move || loop {
                    let event = read_frame(&mut reader);
                    if !h.on_event(peer, event) {
                        break;
                    }
                });
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    health.record(
                        rank,
                        &format!("cannot start the health-channel thread: {e}"),
                    );
                }
            }
        }
        Self {
            rank,
            world_size,
            blob,
            health,
            readers: handles,
            threads,
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of processes in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The bytes rank 0 broadcast (rank 0's own on rank 0).
    pub fn blob(&self) -> &[u8] {
        &self.blob
    }

    /// Whether any rank has failed (cheap: one atomic load).
    pub fn is_failed(&self) -> bool {
        self.health.failed.load(Ordering::SeqCst)
    }

    /// The group's first failure as this rank saw it: `"rank R: reason"`, or `None` while the
    /// group is healthy.
    pub fn failure(&self) -> Option<String> {
        if !self.is_failed() {
            return None;
        }
        lock(&self.health.failure)
            .as_ref()
            .map(|f| format!("rank {}: {}", f.origin, f.reason))
    }

    /// Waits up to `timeout` for a failure of the group; returns it, or `None` if the group
    /// stayed healthy.
    pub fn wait_failure(&self, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        let mut f = lock(&self.health.failure);
        while f.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            f = match self.health.cv.wait_timeout(f, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        f.as_ref()
            .map(|f| format!("rank {}: {}", f.origin, f.reason))
    }

    /// Marks the group failed with `reason` (from this rank) and tells every other rank, through
    /// rank 0. Idempotent: only the group's first failure is recorded and relayed.
    pub fn abort(&self, reason: &str) {
        let relay = || self.health.send_abort(self.rank, reason, None);
        self.health.record_and_relay(self.rank, reason, Some(relay));
    }
}

impl Drop for Rendezvous {
    fn drop(&mut self) {
        self.health.closing.store(true, Ordering::SeqCst);
        for link in &self.health.links {
            if let Some(mut w) = lock(&link.writer).take() {
                let _ = write_frame(&mut w, BYE, &[]);
                let _ = w.shutdown(Shutdown::Both);
            }
        }
        for r in &self.readers {
            let _ = r.shutdown(Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
impl Rendezvous {
    /// Closes the connections without a goodbye, as the death of the process would.
    fn sever(mut self) {
        self.health.closing.store(true, Ordering::SeqCst);
        for link in &self.health.links {
            if let Some(w) = lock(&link.writer).take() {
                let _ = w.shutdown(Shutdown::Both);
            }
        }
        for r in &self.readers {
            let _ = r.shutdown(Shutdown::Both);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A blocking read half and a write half (with a write timeout) of one connection.
fn split(s: TcpStream) -> io::Result<(TcpStream, TcpStream)> {
    s.set_nodelay(true)?;
    let writer = s.try_clone()?;
    writer.set_write_timeout(Some(WRITE_TIMEOUT))?;
    Ok((s, writer))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).map(OsString::from)
    }

    const GOOD: [(&str, &str); 6] = [
        ("RANK", "1"),
        ("WORLD_SIZE", "3"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "3"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    fn with(change: (&str, Option<&str>)) -> Vec<(&'static str, String)> {
        GOOD.iter()
            .filter(|(k, _)| *k != change.0)
            .map(|(k, v)| (*k, v.to_string()))
            .chain(change.1.map(|v| {
                let k: &'static str = GOOD.iter().find(|(k, _)| *k == change.0).unwrap().0;
                (k, v.to_string())
            }))
            .collect()
    }

    fn env_error(change: (&str, Option<&str>)) -> String {
        let vars = with(change);
        let pairs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        DistEnv::from_lookup(lookup(&pairs))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn dist_env_parses_and_names_bad_variables() {
        let env = DistEnv::from_lookup(lookup(&GOOD)).unwrap();
        assert_eq!(
            env,
            DistEnv {
                rank: 1,
                world_size: 3,
                local_rank: 1,
                local_world_size: Some(3),
                master: RendezvousAddr::new("127.0.0.1", 29500),
            }
        );
        for (change, needles) in [
            (("RANK", None), vec!["`RANK`", "not set", "gdp launch"]),
            (("RANK", Some("x1")), vec!["`RANK`", "0..3", "`x1`"]),
            (("RANK", Some("3")), vec!["`RANK`", "0..3", "`3`"]),
            (
                ("WORLD_SIZE", Some("0")),
                vec!["`WORLD_SIZE`", "positive", "`0`"],
            ),
            (("WORLD_SIZE", Some("-2")), vec!["`WORLD_SIZE`", "`-2`"]),
            (("LOCAL_RANK", None), vec!["`LOCAL_RANK`", "not set"]),
            (
                ("LOCAL_RANK", Some("5")),
                vec!["`LOCAL_RANK`", "0..3", "`5`"],
            ),
            (("MASTER_ADDR", Some(" ")), vec!["`MASTER_ADDR`", "empty"]),
            (
                ("MASTER_PORT", Some("0")),
                vec!["`MASTER_PORT`", "1..=65535", "`0`"],
            ),
            (
                ("MASTER_PORT", Some("70000")),
                vec!["`MASTER_PORT`", "`70000`"],
            ),
            (("MASTER_PORT", None), vec!["`MASTER_PORT`", "not set"]),
        ] {
            let e = env_error(change);
            assert!(e.starts_with("environment variable"), "{e}");
            for n in needles {
                assert!(e.contains(n), "{change:?}: `{n}` not in: {e}");
            }
        }
        // LOCAL_WORLD_SIZE is optional.
        let vars = with(("LOCAL_WORLD_SIZE", None));
        let pairs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(
            DistEnv::from_lookup(lookup(&pairs))
                .unwrap()
                .local_world_size,
            None
        );
    }

    fn local(port: u16) -> RendezvousAddr {
        RendezvousAddr::new("127.0.0.1", port)
    }

    fn port() -> u16 {
        crate::cp::launch::free_port("127.0.0.1").unwrap()
    }

    /// Establishes a group of `world` ranks on threads; rank 0's blob is `b"id-0123"`.
    fn group(world: usize, timeout: Duration) -> Vec<Rendezvous> {
        let addr = local(port());
        let mut all: Vec<(usize, Rendezvous)> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|r| {
                    let addr = addr.clone();
                    s.spawn(move || {
                        let rdv = Rendezvous::establish(r, world, &addr, timeout, || {
                            Ok(b"id-0123".to_vec())
                        });
                        (r, rdv.unwrap())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        all.sort_by_key(|(r, _)| *r);
        all.into_iter().map(|(_, g)| g).collect()
    }

    const LONG: Duration = Duration::from_secs(20);
    const PROMPT: Duration = Duration::from_secs(5);

    #[test]
    fn blob_reaches_every_rank_and_an_abort_every_other() {
        let g = group(4, LONG);
        for (r, rdv) in g.iter().enumerate() {
            assert_eq!((rdv.rank(), rdv.world_size()), (r, 4));
            assert_eq!(rdv.blob(), b"id-0123");
            assert_eq!(rdv.failure(), None);
        }
        let t0 = Instant::now();
        g[2].abort("on purpose");
        g[2].abort("second reason is ignored");
        for rdv in &g {
            let f = rdv.wait_failure(PROMPT).expect("failure seen");
            assert_eq!(f, "rank 2: on purpose");
            assert!(rdv.is_failed());
        }
        assert!(t0.elapsed() < PROMPT, "{:?}", t0.elapsed());
        // Rank 0's own abort reaches everyone too.
        let g = group(3, LONG);
        g[0].abort("root stops");
        for rdv in &g {
            assert_eq!(rdv.wait_failure(PROMPT).unwrap(), "rank 0: root stops");
        }
    }

    #[test]
    fn a_dead_peer_is_reported_to_every_rank() {
        let mut g = group(3, LONG);
        let dead = g.remove(1);
        dead.sever();
        for rdv in &g {
            let f = rdv.wait_failure(PROMPT).expect("failure seen");
            assert!(f.starts_with("rank 1: ") && f.contains("lost"), "{f}");
        }
        // Rank 0 dying is seen by every peer directly.
        let mut g = group(3, LONG);
        g.remove(0).sever();
        for rdv in &g {
            let f = rdv.wait_failure(PROMPT).expect("failure seen");
            assert!(f.starts_with("rank 0: ") && f.contains("lost"), "{f}");
        }
    }

    #[test]
    fn an_idle_group_stays_healthy() {
        // Idle for longer than any handshake timeout: the channel must not read that as a loss.
        let g = group(3, LONG);
        std::thread::sleep(HELLO_TIMEOUT * 3);
        for rdv in &g {
            assert_eq!(rdv.wait_failure(Duration::from_millis(10)), None);
        }
    }

    #[test]
    fn a_clean_exit_is_not_a_failure() {
        let mut g = group(3, LONG);
        drop(g.remove(2));
        drop(g.remove(1));
        assert_eq!(g[0].wait_failure(Duration::from_millis(300)), None);
        let g = group(1, LONG);
        assert_eq!(g[0].blob(), b"id-0123");
        assert_eq!(g[0].wait_failure(Duration::from_millis(10)), None);
    }

    #[test]
    fn timeouts_and_mismatches_are_errors() {
        let short = Duration::from_millis(500);
        // Nobody listens.
        let t0 = Instant::now();
        let e = Rendezvous::establish(1, 2, &local(port()), short, || unreachable!())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 1: could not reach rank 0") && e.contains("127.0.0.1"),
            "{e}"
        );
        assert!(t0.elapsed() < LONG);
        // Rank 2 of 3 never comes.
        let addr = local(port());
        let (e0, e1) = std::thread::scope(|s| {
            let a = addr.clone();
            let h0 = s.spawn(move || Rendezvous::establish(0, 3, &a, short, || Ok(vec![1])));
            let a = addr.clone();
            let h1 = s.spawn(move || Rendezvous::establish(1, 3, &a, LONG, || unreachable!()));
            (h0.join().unwrap(), h1.join().unwrap())
        });
        let e0 = e0.unwrap_err().to_string();
        assert!(e0.contains("ranks [2] of 3 never connected"), "{e0}");
        let e1 = e1.unwrap_err().to_string();
        assert!(
            e1.contains("rank 1: rank 0") && e1.contains("closed"),
            "{e1}"
        );
        // The ranks disagree on the world size.
        let addr = local(port());
        let (e0, e1) = std::thread::scope(|s| {
            let a = addr.clone();
            let h0 = s.spawn(move || Rendezvous::establish(0, 2, &a, LONG, || Ok(vec![1])));
            let a = addr.clone();
            let h1 = s.spawn(move || Rendezvous::establish(1, 3, &a, LONG, || unreachable!()));
            (h0.join().unwrap(), h1.join().unwrap())
        });
        for e in [e0.unwrap_err().to_string(), e1.unwrap_err().to_string()] {
            assert!(e.contains("WORLD_SIZE = 3") && e.contains("says 2"), "{e}");
        }
        assert!(Rendezvous::establish(2, 2, &local(1), short, || Ok(vec![])).is_err());
    }

    #[test]
    fn display_addr() {
        assert_eq!(
            RendezvousAddr::new("127.0.0.1", 5).to_string(),
            "127.0.0.1:5"
        );
        assert_eq!(RendezvousAddr::new("::1", 5).to_string(), "[::1]:5");
    }
}
