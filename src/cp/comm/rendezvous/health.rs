//! The health channel's shared state: the group's first failure as this rank saw it, the write
//! halves of the connections, and how a reader thread handles what arrives on its connection
//! (an abort to record and, on rank 0, relay; a goodbye; a lost connection).

use std::io;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

use super::wire::{u32_at, write_frame, ABORT, BYE};

/// The first failure seen by this rank.
#[derive(Debug, Clone)]
pub(super) struct Failure {
    pub(super) origin: usize,
    pub(super) reason: String,
}

pub(super) struct Health {
    pub(super) rank: usize,
    pub(super) failed: AtomicBool,
    pub(super) closing: AtomicBool,
    pub(super) failure: Mutex<Option<Failure>>,
    pub(super) cv: Condvar,
    /// Write halves: rank 0 holds one per peer, the others one to rank 0. `None` once gone.
    pub(super) links: Vec<Link>,
}

pub(super) struct Link {
    pub(super) peer: usize,
    pub(super) writer: Mutex<Option<TcpStream>>,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Health {
    /// Records the failure unless one is recorded already; returns whether it was the first.
    pub(super) fn record(&self, origin: usize, reason: &str) -> bool {
        self.record_and_relay(origin, reason, None::<fn()>)
    }

    /// [`Self::record`], running `relay` (the abort frames to the peers) before anyone on this
    /// rank can see the failure: a rank that wakes up on it and exits at once must not say a
    /// clean goodbye to a peer before that peer has been told.
    pub(super) fn record_and_relay(
        &self,
        origin: usize,
        reason: &str,
        relay: Option<impl FnOnce()>,
    ) -> bool {
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
    pub(super) fn send_abort(&self, origin: usize, reason: &str, skip: Option<usize>) {
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
    pub(super) fn on_event(&self, peer: usize, event: io::Result<(u8, Vec<u8>)>) -> bool {
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
