//! The rendezvous on threads of one process: the blob, aborts, dead peers, clean exits,
//! timeouts and mismatches.

use super::*;

fn local(port: u16) -> RendezvousAddr {
    RendezvousAddr::new("127.0.0.1", port)
}

/// A free port (bound once and released).
fn port() -> u16 {
    let l = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    l.local_addr().unwrap().port()
}

/// Establishes a group of `world` ranks on threads; rank 0's blob is `b"id-0123"`.
fn group(world: usize, timeout: Duration) -> Vec<Rendezvous> {
    let addr = local(port());
    let mut all: Vec<(usize, Rendezvous)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let addr = addr.clone();
                s.spawn(move || {
                    let rdv =
                        Rendezvous::establish(r, world, &addr, timeout, || Ok(b"id-0123".to_vec()));
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
