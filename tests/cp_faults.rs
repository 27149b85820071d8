//! Faults injected into one rank of a context-parallel group at every phase of a forward and
//! backward (bad input before any collective, disagreeing problems, a transport error or a
//! short result in the forward and the backward exchange, a panic inside the op and in the
//! rank's own code between forward and backward): every rank must return an error naming the
//! failing rank (or the mismatch) within 2 s, although the group's timeout is 30 s, and no rank
//! may return a wrong result as success (a rank may only finish when the fault came after the
//! group's last collective and its own result is the healthy one).
//!
//! The ranks run on plain threads over a [`ThreadComm`] group, not under `run_ranks` (which
//! aborts the group itself when a rank errors): what fails the group here is the library.

mod common;

use anyhow::Result;
use candle_core::{DType, Tensor, Var};
use candle_gdp::cp::{
    cp_gated_delta_product, dense_rank_meta, Communicator, CpRank, ShardPlan, ThreadComm,
};
use candle_gdp::{GdpError, GdpOptions};
use common::{inputs, Case, Inputs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const RANKS: usize = 3;
const FAILING: usize = 1;
/// Far above the 2 s bound: a rank that waits for its timeout fails the test.
const TIMEOUT: Duration = Duration::from_secs(30);
const BOUND: Duration = Duration::from_secs(2);

/// What the failing rank does wrong.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// Its `beta` has the wrong shape (the op fails before any collective).
    BadInput,
    /// It calls the op with another scale (the ranks' problem agreement fails).
    OtherScale,
    /// Its transport returns an error from collective `#i` (0: agreement, 1: the forward
    /// summaries, 2: the backward summaries) without taking part.
    TransportError(usize),
    /// Its transport returns collective `#i` one value short.
    ShortResult(usize),
    /// Its transport panics in collective `#i` (a panic inside the op).
    PanicIn(usize),
    /// Its own code panics between the forward and the backward.
    PanicAfterForward,
}

/// A rank's communicator with an injected fault.
struct Faulty {
    inner: ThreadComm,
    fault: Option<Fault>,
    calls: AtomicUsize,
}

impl Faulty {
    fn at(&self, i: usize) -> Option<Fault> {
        self.fault.filter(|f| match *f {
            Fault::TransportError(j) | Fault::ShortResult(j) | Fault::PanicIn(j) => i == j,
            _ => false,
        })
    }
}

impl Communicator for Faulty {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn all_gather(&self, local: &[f32]) -> candle_core::Result<Vec<f32>> {
        let i = self.calls.fetch_add(1, Ordering::SeqCst);
        match self.at(i) {
            Some(Fault::TransportError(_)) => {
                Err(GdpError::Comm("injected transport error".into()).into())
            }
            Some(Fault::ShortResult(_)) => {
                let mut all = self.inner.all_gather(local)?;
                all.pop();
                Ok(all)
            }
            Some(Fault::PanicIn(_)) => panic!("injected panic in all_gather #{i}"),
            _ => self.inner.all_gather(local),
        }
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> candle_core::Result<()> {
        self.inner.all_reduce_sum(buf)
    }

    fn barrier(&self) -> candle_core::Result<()> {
        self.inner.barrier()
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}

fn case() -> Case {
    Case::new("faults B2 T90 H2 K8 V6 n2", 2, 90, 2, 8, 6, 2).seed(77)
}

/// Rank `r`'s forward and backward on its shard of `x` (f32), with `fault` if it is the
/// failing rank; returns the gradient of `q` as the rank's result.
fn rank_step(comm: Arc<dyn Communicator>, x: &Inputs, fault: Option<Fault>) -> Result<Tensor> {
    let c = case();
    let plan = ShardPlan::new(c.t, RANKS)?;
    let r = comm.rank();
    let span = plan.range(r)?;
    let (t0, len) = (span.start, span.len());
    let x = x.cast(DType::F32)?;
    let var = |t: &Tensor, at: usize, l: usize| Var::from_tensor(&t.narrow(1, at, l)?);
    let q = var(&x.q, t0, len)?;
    let k = var(&x.k, t0 * c.n, len * c.n)?;
    let v = var(&x.v, t0 * c.n, len * c.n)?;
    let g = var(&x.g, t0, len)?;
    let beta = match fault {
        Some(Fault::BadInput) => var(&x.beta, t0 * c.n, len)?,
        _ => var(&x.beta, t0 * c.n, len * c.n)?,
    };
    let dout = x.dout.narrow(1, t0, len)?;
    let opts = GdpOptions {
        scale: (fault == Some(Fault::OtherScale)).then_some(0.5),
        ..Default::default()
    };
    let rank = CpRank {
        comm,
        meta: dense_rank_meta(&plan, r)?,
        composition: Default::default(),
    };
    let (o, _) = cp_gated_delta_product(&q, &k, &v, &g, &beta, &opts, &rank)?;
    if fault == Some(Fault::PanicAfterForward) {
        panic!("injected panic between the forward and the backward");
    }
    let grads = (o * dout)?.sum_all()?.backward()?;
    Ok(grads.get(&q).expect("dq").clone())
}

/// Runs every rank on its own thread with `fault` on rank [`FAILING`]; returns each rank's
/// outcome (`Err` with the panic message for a panicking rank) and the slowest rank's time.
fn run_group(fault: Option<Fault>) -> (Vec<std::result::Result<Tensor, String>>, Duration) {
    let x = inputs(&case(), DType::F32).expect("inputs");
    let comms = ThreadComm::group(RANKS, TIMEOUT).expect("group");
    let start = Instant::now();
    let outcomes = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|inner| {
                let x = &x;
                s.spawn(move || {
                    let mine = (inner.rank() == FAILING).then_some(fault).flatten();
                    let comm: Arc<dyn Communicator> = Arc::new(Faulty {
                        inner,
                        fault: mine,
                        calls: AtomicUsize::new(0),
                    });
                    let out = rank_step(comm, x, mine).map_err(|e| e.to_string());
                    (out, start.elapsed())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|p| {
                    let msg = p
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    (Err(format!("panicked: {msg}")), start.elapsed())
                })
            })
            .collect::<Vec<_>>()
    });
    let slowest = outcomes.iter().map(|o| o.1).max().unwrap_or_default();
    (outcomes.into_iter().map(|o| o.0).collect(), slowest)
}

/// Every rank fails within [`BOUND`]; the peers' errors contain `peer_says`.
fn assert_fails_fast(fault: Fault, peer_says: &str) {
    assert_fails_fast_or_finishes(fault, peer_says, &[]);
}

/// As [`assert_fails_fast`], except that the ranks in `may_finish` may instead return their
/// healthy result: a fault that the failing rank meets only after the group's last collective
/// (a short result of the backward exchange, seen when it folds) cannot reach peers that
/// already hold everything they need; their results must then be right.
fn assert_fails_fast_or_finishes(fault: Fault, peer_says: &str, may_finish: &[usize]) {
    let (outcomes, slowest) = run_group(Some(fault));
    assert!(
        slowest < BOUND,
        "{fault:?}: the slowest rank took {slowest:?}"
    );
    let healthy = (!may_finish.is_empty()).then(|| run_group(None).0);
    for (r, out) in outcomes.iter().enumerate() {
        match out {
            Err(e) if r != FAILING => {
                assert!(e.contains(peer_says), "{fault:?}: rank {r} says: {e}")
            }
            Err(_) => {}
            Ok(dq) => {
                assert!(
                    may_finish.contains(&r),
                    "{fault:?}: rank {r} returned a result as success"
                );
                let want = healthy.as_ref().expect("healthy run")[r]
                    .as_ref()
                    .expect("healthy rank");
                let diff: f32 = (dq - want)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar()
                    .unwrap();
                assert_eq!(
                    diff, 0.0,
                    "{fault:?}: rank {r} finished with another result"
                );
            }
        }
    }
}

#[test]
fn healthy_group_succeeds() {
    let (outcomes, _) = run_group(None);
    for (r, out) in outcomes.into_iter().enumerate() {
        let dq = out.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        let sum: f32 = dq.abs().unwrap().sum_all().unwrap().to_scalar().unwrap();
        assert!(sum.is_finite() && sum > 0.0, "rank {r}: |dq| = {sum}");
    }
}

#[test]
fn bad_input_before_any_collective() {
    assert_fails_fast(Fault::BadInput, "rank 1");
}

#[test]
fn disagreeing_problems_name_the_mismatch() {
    let (outcomes, slowest) = run_group(Some(Fault::OtherScale));
    assert!(slowest < BOUND, "the slowest rank took {slowest:?}");
    for (r, out) in outcomes.iter().enumerate() {
        let e = out.as_ref().expect_err("every rank fails");
        assert!(
            e.contains("scale") && e.contains("rank 1"),
            "rank {r} says: {e}"
        );
    }
}

#[test]
fn transport_error_in_the_forward_exchange() {
    assert_fails_fast(Fault::TransportError(1), "rank 1");
}

#[test]
fn short_result_in_the_forward_fold() {
    assert_fails_fast(Fault::ShortResult(1), "rank 1");
}

#[test]
fn panic_inside_the_forward() {
    assert_fails_fast(Fault::PanicIn(1), "rank 1");
}

#[test]
fn panic_between_forward_and_backward() {
    assert_fails_fast(Fault::PanicAfterForward, "rank 1");
}

#[test]
fn transport_error_in_the_backward_exchange() {
    assert_fails_fast(Fault::TransportError(2), "rank 1");
}

#[test]
fn short_result_in_the_backward_fold() {
    // Rank 1 sees the short buffer after the last collective: ranks 0 and 2 hold their whole
    // exchange by then and finish with the healthy gradients.
    assert_fails_fast_or_finishes(Fault::ShortResult(2), "rank 1", &[0, 2]);
}

#[test]
fn panic_inside_the_backward() {
    assert_fails_fast(Fault::PanicIn(2), "rank 1");
}
