//! In-process transport: one thread per rank, sharing a `Mutex` + `Condvar` rendezvous.
//!
//! Collectives are numbered by a generation counter. Each rank deposits its buffer for the
//! current generation; the last to arrive combines the buffers (in rank order, so every rank gets
//! the same bits), publishes the result and advances the generation, which wakes the others. A
//! rank cannot enter generation `g + 1` before it has read the result of `g`, and generation
//! `g + 1` cannot complete without it, so one published result suffices.
//!
//! The group fails as a whole, and a failed group never blocks: a rank that calls
//! [`Communicator::abort`], a collective that waits longer than the timeout, ranks that disagree
//! on the collective or its length, a rank whose thread panics, and (under [`run_ranks`]) a rank
//! that errors or returns while its peers still need it all make every pending and later
//! collective return [`GdpError::Comm`]. Device tensors reach this transport as host copies
//! (see the [`Communicator`] tensor methods).

use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Collective, Communicator};
use crate::error::{GdpError, Result};

/// Default time a rank waits in a collective for its peers before the group fails.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// The collective being assembled, as announced by the first rank to arrive.
struct Pending {
    op: Collective,
    len: usize,
    rank: usize,
}

/// The first failure of the group (its root cause).
struct Failure {
    rank: usize,
    reason: String,
}

struct State {
    generation: u64,
    pending: Option<Pending>,
    contributions: Vec<Option<Vec<f32>>>,
    arrived: usize,
    completed: Option<(u64, Arc<Vec<f32>>)>,
    departed: Vec<bool>,
    failure: Option<Failure>,
}

struct Shared {
    world_size: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank's handle on an in-process group created by [`ThreadComm::group`]. Cloning gives
/// another handle on the same rank (for ops that keep the communicator until their backward).
#[derive(Clone)]
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadComm")
            .field("rank", &self.rank)
            .field("world_size", &self.shared.world_size)
            .field("timeout", &self.shared.timeout)
            .finish()
    }
}

fn comm_err(msg: String) -> candle_core::Error {
    GdpError::Comm(msg).into()
}

impl ThreadComm {
    /// Creates a group of `world_size` ranks; handle `r` is rank `r`. A collective fails if it
    /// waits longer than `timeout` for its peers.
    pub fn group(world_size: usize, timeout: Duration) -> Result<Vec<ThreadComm>> {
        if world_size == 0 {
            return Err(GdpError::Option {
                name: "world_size".into(),
                reason: "a communicator group needs at least one rank".into(),
            }
            .into());
        }
        let shared = Arc::new(Shared {
            world_size,
            timeout,
            state: Mutex::new(State {
                generation: 0,
                pending: None,
                contributions: vec![None; world_size],
                arrived: 0,
                completed: None,
                departed: vec![false; world_size],
                failure: None,
            }),
            cv: Condvar::new(),
        });
        Ok((0..world_size)
            .map(|rank| ThreadComm {
                rank,
                shared: shared.clone(),
            })
            .collect())
    }

    fn poisoned_err(&self) -> candle_core::Error {
        comm_err(format!(
            "rank {}: communicator state poisoned (a thread panicked while holding it)",
            self.rank
        ))
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.shared.state.lock().map_err(|_| self.poisoned_err())
    }

    /// Records `reason` as the group's failure (unless one is already recorded), wakes every
    /// waiter and returns the error this rank reports.
    fn fail(&self, st: &mut State, reason: String) -> candle_core::Error {
        if st.failure.is_none() {
            st.failure = Some(Failure {
                rank: self.rank,
                reason,
            });
        }
        self.shared.cv.notify_all();
        self.failed_err(st)
    }

    fn failed_err(&self, st: &State) -> candle_core::Error {
        match &st.failure {
            Some(f) if f.rank == self.rank => comm_err(format!("rank {}: {}", f.rank, f.reason)),
            Some(f) => comm_err(format!(
                "rank {}: group failed, rank {}: {}",
                self.rank, f.rank, f.reason
            )),
            None => comm_err(format!("rank {}: group failed", self.rank)),
        }
    }

    /// Marks this rank as finished; a collective still waiting for it can never complete.
    fn depart(&self) {
        let mut st = match self.shared.state.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        st.departed[self.rank] = true;
        if let Some(p) = &st.pending {
            let reason = format!(
                "finished while its peers wait in {} #{}",
                p.op, st.generation
            );
            let _ = self.fail(&mut st, reason);
        }
    }

    /// Deposits `data`, waits for every rank and returns the combined buffer.
    fn collective(&self, op: Collective, data: &[f32]) -> Result<Arc<Vec<f32>>> {
        let world = self.shared.world_size;
        let mut st = self.lock()?;
        if st.failure.is_some() {
            return Err(self.failed_err(&st));
        }
        let generation = st.generation;
        if let Some(gone) = st.departed.iter().position(|&d| d) {
            let reason = format!("called {op} #{generation}, but rank {gone} has already finished");
            return Err(self.fail(&mut st, reason));
        }
        match &st.pending {
            Some(p) if p.op != op || p.len != data.len() => {
                let reason = format!(
                    "collective mismatch at #{generation}: rank {} called {op} with {} values, \
                     rank {} called {} with {} values",
                    self.rank,
                    data.len(),
                    p.rank,
                    p.op,
                    p.len
                );
                return Err(self.fail(&mut st, reason));
            }
            Some(_) => {}
            None => {
                st.pending = Some(Pending {
                    op,
                    len: data.len(),
                    rank: self.rank,
                })
            }
        }
        st.contributions[self.rank] = Some(data.to_vec());
        st.arrived += 1;
        if st.arrived == world {
            let parts: Vec<Vec<f32>> = st
                .contributions
                .iter_mut()
                .map(|c| c.take().unwrap_or_default())
                .collect();
            let result = Arc::new(combine(op, parts));
            st.completed = Some((generation, result.clone()));
            st.pending = None;
            st.arrived = 0;
            st.generation += 1;
            self.shared.cv.notify_all();
            return Ok(result);
        }
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            if st.generation > generation {
                if let Some((g, result)) = &st.completed {
                    if *g == generation {
                        return Ok(result.clone());
                    }
                }
                let reason = format!("lost the result of {op} #{generation}");
                return Err(self.fail(&mut st, reason));
            }
            if st.failure.is_some() {
                return Err(self.failed_err(&st));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..world)
                    .filter(|&r| st.contributions[r].is_none())
                    .collect();
                let reason = format!(
                    "timed out after {:?} in {op} #{generation}; ranks {missing:?} never arrived",
                    self.shared.timeout
                );
                return Err(self.fail(&mut st, reason));
            }
            st = match self.shared.cv.wait_timeout(st, deadline - now) {
                Ok((guard, _)) => guard,
                Err(_) => return Err(self.poisoned_err()),
            };
        }
    }
}

/// Combines the rank-ordered buffers of one collective.
fn combine(op: Collective, parts: Vec<Vec<f32>>) -> Vec<f32> {
    match op {
        Collective::AllGather => parts.concat(),
        Collective::AllReduceSum => {
            let mut parts = parts.into_iter();
            let mut sum = parts.next().unwrap_or_default();
            for part in parts {
                sum.iter_mut().zip(&part).for_each(|(s, x)| *s += x);
            }
            sum
        }
        Collective::Barrier => Vec::new(),
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        Ok(self
            .collective(Collective::AllGather, local)?
            .as_ref()
            .clone())
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let sum = self.collective(Collective::AllReduceSum, buf)?;
        buf.copy_from_slice(&sum);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.collective(Collective::Barrier, &[]).map(|_| ())
    }

    fn abort(&self, reason: &str) {
        let mut st = match self.shared.state.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        let _ = self.fail(&mut st, format!("aborted: {reason}"));
    }
}

/// A rank whose thread panics fails its group as the unwinding drops its handles (the op keeps
/// one until its backward), so that the peers stop waiting for it, with or without
/// [`run_ranks`].
impl Drop for ThreadComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut st = match self.shared.state.lock() {
                Ok(g) => g,
                Err(poisoned) => poisoned.into_inner(),
            };
            let _ = self.fail(&mut st, "panicked".into());
        }
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Runs `f` on `world_size` scoped threads, one per rank of a fresh [`ThreadComm`] group, and
/// returns the per-rank results in rank order.
///
/// A rank that returns `Err` or panics aborts the group, so its peers fail fast instead of
/// waiting for the timeout; a rank that returns `Ok` while its peers still wait for it fails the
/// group too. On failure the root-cause error is returned: that of the rank whose failure came
/// first (its own error, not the peers' [`GdpError::Comm`] echoes).
pub fn run_ranks<T, F>(world_size: usize, timeout: Duration, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(&ThreadComm) -> Result<T> + Sync,
{
    let comms = ThreadComm::group(world_size, timeout)?;
    let shared = comms[0].shared.clone();
    let f = &f;
    let outcomes: Vec<Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let out = catch_unwind(AssertUnwindSafe(|| f(&comm))).unwrap_or_else(|p| {
                        let msg = format!("rank {} panicked: {}", comm.rank, panic_message(&*p));
                        Err(comm_err(msg))
                    });
                    match &out {
                        Ok(_) => comm.depart(),
                        Err(e) => comm.abort(&e.to_string()),
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|p| {
                    Err(comm_err(format!(
                        "rank {rank} died: {}",
                        panic_message(&*p)
                    )))
                })
            })
            .collect()
    });
    let root = match shared.state.lock() {
        Ok(st) => st.failure.as_ref().map(|f| f.rank),
        Err(poisoned) => poisoned.into_inner().failure.as_ref().map(|f| f.rank),
    };
    if outcomes.iter().all(|o| o.is_ok()) {
        return outcomes.into_iter().collect();
    }
    let mut first_err = None;
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        if let Err(e) = outcome {
            if Some(rank) == root {
                return Err(e);
            }
            first_err.get_or_insert(e);
        }
    }
    Err(first_err.unwrap_or_else(|| comm_err("a rank failed".into())))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LONG: Duration = Duration::from_secs(20);

    #[test]
    fn collectives_under_races() {
        for world in 1..=8usize {
            let checks = run_ranks(world, LONG, |comm| {
                let r = comm.rank();
                for i in 0..300usize {
                    let len = i % 5;
                    let local: Vec<f32> =
                        (0..len).map(|j| (1000 * r + 10 * i + j) as f32).collect();
                    let gathered = comm.all_gather(&local)?;
                    let want: Vec<f32> = (0..world)
                        .flat_map(|q| (0..len).map(move |j| (1000 * q + 10 * i + j) as f32))
                        .collect();
                    assert_eq!(gathered, want, "world {world} rank {r} iter {i}");
                    let mut buf = local.clone();
                    comm.all_reduce_sum(&mut buf)?;
                    let want: Vec<f32> = (0..len)
                        .map(|j| (0..world).map(|q| (1000 * q + 10 * i + j) as f32).sum())
                        .collect();
                    assert_eq!(buf, want, "world {world} rank {r} iter {i}");
                    if i % 7 == 0 {
                        comm.barrier()?;
                    }
                }
                Ok(comm.world_size())
            })
            .unwrap();
            assert_eq!(checks, vec![world; world]);
        }
    }

    /// Runs one closure per rank on a raw group and returns every rank's result.
    fn each_rank<T: Send>(
        world: usize,
        timeout: Duration,
        f: impl Fn(&ThreadComm) -> Result<T> + Sync,
    ) -> Vec<Result<T>> {
        let comms = ThreadComm::group(world, timeout).unwrap();
        std::thread::scope(|s| {
            let hs: Vec<_> = comms.iter().map(|c| s.spawn(|| f(c))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn mismatches_fail_every_rank() {
        let res = each_rank(3, LONG, |c| {
            c.all_gather(&vec![1.0; 1 + (c.rank() == 1) as usize])
        });
        for r in res {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("communicator") && e.contains("mismatch"), "{e}");
        }
        let res = each_rank(2, LONG, |c| {
            let mut buf = [1.0f32];
            if c.rank() == 0 {
                c.all_gather(&buf).map(|_| ())
            } else {
                c.all_reduce_sum(&mut buf)
            }
        });
        for r in res {
            let e = r.unwrap_err().to_string();
            assert!(
                e.contains("all_gather") && e.contains("all_reduce_sum"),
                "{e}"
            );
        }
    }

    #[test]
    fn panic_fails_peers_fast() {
        let t0 = Instant::now();
        let e = run_ranks(4, LONG, |c| {
            if c.rank() == 2 {
                std::thread::sleep(Duration::from_millis(50));
                panic!("boom on purpose");
            }
            c.all_gather(&[1.0])
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("rank 2 panicked: boom on purpose"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }

    #[test]
    fn silent_rank_times_out() {
        let comms = ThreadComm::group(2, Duration::from_millis(200)).unwrap();
        let t0 = Instant::now();
        let e = comms[0].all_gather(&[1.0]).unwrap_err().to_string();
        let waited = t0.elapsed();
        assert!(e.contains("timed out") && e.contains("[1]"), "{e}");
        assert!(
            waited >= Duration::from_millis(200) && waited < LONG,
            "{waited:?}"
        );
        // The group stays failed, for everyone, without waiting.
        let e = comms[1].barrier().unwrap_err().to_string();
        assert!(e.contains("group failed, rank 0"), "{e}");
    }

    #[test]
    fn run_ranks_returns_root_cause() {
        let t0 = Instant::now();
        let e = run_ranks(3, LONG, |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(50));
                return Err(GdpError::CuSeqlens("root cause".into()).into());
            }
            c.barrier()
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("root cause") && !e.contains("communicator"),
            "{e}"
        );
        // A rank that returns Ok while its peers still need it fails the group, too.
        let e = run_ranks(
            2,
            LONG,
            |c| if c.rank() == 0 { c.barrier() } else { Ok(()) },
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("finished"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }

    #[test]
    fn poisoned_state_is_an_error() {
        let comms = ThreadComm::group(1, LONG).unwrap();
        let shared = comms[0].shared.clone();
        let _ = std::thread::spawn(move || {
            let _guard = shared.state.lock();
            panic!("poison the communicator on purpose");
        })
        .join();
        let e = comms[0].all_gather(&[1.0]).unwrap_err().to_string();
        assert!(e.contains("poisoned"), "{e}");
        comms[0].abort("still no panic");
    }

    #[test]
    fn bad_world_size() {
        assert!(ThreadComm::group(0, LONG).is_err());
        assert!(run_ranks(0, LONG, |_| Ok(())).is_err());
    }
}
