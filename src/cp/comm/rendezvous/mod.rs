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
//!
//! Submodules: `env` (the launcher's environment: [`DistEnv`], [`RendezvousAddr`]), `wire` (the
//! frame format of the connections), `health` (the health channel's shared state and its
//! reader threads' handling of frames); this module connects the group and owns the
//! [`Rendezvous`].

mod env;
mod health;
#[cfg(test)]
mod tests;
mod wire;

pub use env::{DistEnv, RendezvousAddr};

use std::fmt;
use std::io;
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{GdpError, Result};
use health::{lock, Health, Link};
use wire::{
    read_frame, split, u32_at, write_frame, BYE, HELLO, HELLO_TIMEOUT, MAGIC, REJECT, WELCOME,
};

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
