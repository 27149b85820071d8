//! The chunkwise context-parallel algebra on one (fragment, head) (`megatron_cp.md` §2–5).
//!
//! A *fragment* is the part of one sequence that lies on one rank. Its chunks are affine maps
//! of the state, `S_next = M_c S + D_c` with `M_c = e^{G_last} I − kdecᵀ W`, so the whole
//! fragment is `S_out = M S_in + ΔS`. Its backward is the transposed map,
//! `dS_in = Mᵀ dS_out + γ`. Summaries are packed per head as `[K, V + K]` f32, row-major:
//! `[ΔS | M]` forward, `[γ | Mᵀ]` backward, typed by their direction ([`super::summary`]).

use super::summary::{
    identity, Backward, BackwardSummary, Direction, Forward, ForwardSummary, Summary, SummaryRef,
};
use crate::op::cpu::chunk::{decayed_keys, query_rows, ChunkWy, Dims, HeadInputs};
use crate::op::cpu::forward::{query_key_scores, select_queries};
use crate::op::cpu::linalg::{matmul, MatRef};
use crate::op::shape::{chunks, CHUNK};

/// Forward summary `[ΔS | M]` of a fragment: `ΔS` is its final state from `s0` (zeros for a
/// fragment that continues a sequence from an earlier rank; the sequence's own initial state
/// when it starts here), `M` the product of its chunk transitions (later chunks on the left).
pub fn forward_summary(x: &HeadInputs, d: &Dims, s0: &[f32]) -> ForwardSummary {
    let (dk, dv) = (d.dk, d.dv);
    let mut state = s0.to_vec();
    let mut m = identity(dk);
    let mut wy = ChunkWy::new(d);
    let mut kdec = vec![0.0; CHUNK * dk];
    let mut delta = vec![0.0; CHUNK * dv];
    let mut wm = vec![0.0; CHUNK * dk];
    for range in chunks(x.rows()) {
        wy.prepare(x, d, range);
        let c = wy.len();
        crate::op::cpu::chunk::chunk_delta(&wy, d, &state, &mut delta);
        decayed_keys(&wy, x, d, &mut kdec);
        crate::op::cpu::chunk::advance_state(&wy, d, &kdec, &delta, &mut state);
        // M ← (e^{G_last} I − kdecᵀ W) M
        matmul(
            &mut wm,
            MatRef::new(&wy.w, c, dk),
            MatRef::new(&m, dk, dk),
            false,
            0.0,
            1.0,
        );
        let kt = MatRef::new(&kdec, c, dk).t();
        matmul(
            &mut m,
            kt,
            MatRef::new(&wm, c, dk),
            true,
            wy.g_last().exp(),
            -1.0,
        );
    }
    Summary::from_parts(&state, &m, dk, dv)
}

/// Backward summary `[γ | Mᵀ]` of a fragment: `γ` is the gradient of its start state given the
/// output gradients `dout [len, V]` of its tokens and the end-state gradient `ds_end` (zeros
/// for a fragment whose sequence continues on a later rank), `Mᵀ` the transposed transition.
pub fn backward_summary(x: &HeadInputs, d: &Dims, dout: &[f32], ds_end: &[f32]) -> BackwardSummary {
    backward_summary_with(x, d, dout, ds_end, None)
}

/// [`backward_summary`], with the fragment's forward transition `M` (`[K, K]`, from its forward
/// summary) when known: then `Mᵀ` is its transpose and the reverse pass computes `γ` alone.
pub fn backward_summary_with(
    x: &HeadInputs,
    d: &Dims,
    dout: &[f32],
    ds_end: &[f32],
    transition: Option<&[f32]>,
) -> BackwardSummary {
    let (dk, dv) = (d.dk, d.dv);
    let mut ds = ds_end.to_vec();
    let mut mt = identity(dk);
    let mut wy = ChunkWy::new(d);
    let mut kdec = vec![0.0; CHUNK * dk];
    let mut qsel = vec![0.0; CHUNK * dk];
    let mut dosel = vec![0.0; CHUNK * dv];
    let mut p = vec![0.0; CHUNK * CHUNK];
    let mut ddelta = vec![0.0; CHUNK * dv];
    let mut tmp = vec![0.0; CHUNK * dk];
    let mut qrows = Vec::with_capacity(CHUNK);
    let ranges: Vec<_> = chunks(x.rows()).collect();
    for range in ranges.into_iter().rev() {
        wy.prepare(x, d, range.clone());
        let c = wy.len();
        let gl = wy.g_last().exp();
        decayed_keys(&wy, x, d, &mut kdec);
        qrows.clear();
        qrows.extend(query_rows(&range, d.n));
        let nq = qrows.len();
        select_queries(x, d, &qrows, &mut qsel);
        for (r, &(_, t)) in qrows.iter().enumerate() {
            dosel[r * dv..(r + 1) * dv].copy_from_slice(&dout[t * dv..(t + 1) * dv]);
        }
        // dΔ = kdec dS + Pᵀ dO
        matmul(
            &mut ddelta,
            MatRef::new(&kdec, c, dk),
            MatRef::new(&ds, dk, dv),
            false,
            0.0,
            1.0,
        );
        query_key_scores(&wy, x, d, &qrows, &qsel, &mut p);
        let dom = MatRef::new(&dosel, nq, dv);
        matmul(&mut ddelta, MatRef::new(&p, nq, c).t(), dom, true, 1.0, 1.0);
        // dS ← e^{G_last} dS + Σ_r scale e^{G_r} q_r do_rᵀ − Wᵀ dΔ
        for (r, &(i, _)) in qrows.iter().enumerate() {
            let f = d.scale * wy.eg[i];
            qsel[r * dk..(r + 1) * dk].iter_mut().for_each(|v| *v *= f);
        }
        matmul(&mut ds, MatRef::new(&qsel, nq, dk).t(), dom, true, gl, 1.0);
        let wt = MatRef::new(&wy.w, c, dk).t();
        matmul(&mut ds, wt, MatRef::new(&ddelta, c, dv), true, 1.0, -1.0);
        if transition.is_some() {
            continue;
        }
        // Mᵀ ← (e^{G_last} I − Wᵀ kdec) Mᵀ
        matmul(
            &mut tmp,
            MatRef::new(&kdec, c, dk),
            MatRef::new(&mt, dk, dk),
            false,
            0.0,
            1.0,
        );
        matmul(&mut mt, wt, MatRef::new(&tmp, c, dk), true, gl, -1.0);
    }
    if let Some(m) = transition {
        for r in 0..dk {
            for c in 0..dk {
                mt[r * dk + c] = m[c * dk + r];
            }
        }
    }
    Summary::from_parts(&ds, &mt, dk, dv)
}

/// How a rank composes the gathered summaries of its causal slice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Composition {
    /// Sequential fold, `R − 1` dependent `K×K` products at most (Megatron's choice).
    #[default]
    Fold,
    /// Hillis–Steele doubling ([`scan_forward`]): `log2(R)` rounds of independent compositions.
    Scan,
}

/// The state carried into a rank by `summaries` (rank order, nearest last), composed with
/// `method`; both give the same state `[K, V]` up to rounding.
pub fn compose_forward<'a>(
    summaries: impl Iterator<Item = SummaryRef<'a, Forward>>,
    dk: usize,
    dv: usize,
    method: Composition,
) -> Vec<f32> {
    compose(summaries, dk, dv, method)
}

/// The backward counterpart of [`compose_forward`]: `summaries` in rank order (nearest first),
/// applied farthest first; the final-state gradient `[K, V]` they carry.
pub fn compose_backward<'a>(
    summaries: impl DoubleEndedIterator<Item = SummaryRef<'a, Backward>>,
    dk: usize,
    dv: usize,
    method: Composition,
) -> Vec<f32> {
    compose(summaries.rev(), dk, dv, method)
}

/// Either direction, summaries in the order they apply.
fn compose<'a, D: Direction>(
    summaries: impl Iterator<Item = SummaryRef<'a, D>>,
    dk: usize,
    dv: usize,
    method: Composition,
) -> Vec<f32> {
    match method {
        Composition::Fold => fold(summaries, dk, dv),
        Composition::Scan => {
            let all: Vec<Summary<D>> = summaries.map(|s| s.to_owned()).collect();
            match scan(&all).last() {
                Some(p) => p.as_ref().split().0,
                None => vec![0.0; dk * dv],
            }
        }
    }
}

/// Forward fold over the preceding ranks' summaries, nearest rank last:
/// `S = 0; for P in summaries: S ← M_P S + ΔS_P`.
pub fn fold_forward<'a>(
    summaries: impl Iterator<Item = SummaryRef<'a, Forward>>,
    dk: usize,
    dv: usize,
) -> Vec<f32> {
    fold(summaries, dk, dv)
}

/// Backward fold over the following ranks' summaries, given nearest first; applied farthest
/// first: `dS = 0; for P in reversed: dS ← Mᵀ_P dS + γ_P`.
pub fn fold_backward<'a>(
    summaries: impl DoubleEndedIterator<Item = SummaryRef<'a, Backward>>,
    dk: usize,
    dv: usize,
) -> Vec<f32> {
    fold(summaries.rev(), dk, dv)
}

fn fold<'a, D: Direction>(
    summaries: impl Iterator<Item = SummaryRef<'a, D>>,
    dk: usize,
    dv: usize,
) -> Vec<f32> {
    let mut s = vec![0.0; dk * dv];
    for p in summaries {
        p.apply(&mut s);
    }
    s
}

/// Inclusive prefix composition of forward `summaries` (rank order) by Hillis–Steele doubling:
/// `log2(R)` rounds of independent [`SummaryRef::then`] calls instead of `R − 1` dependent ones.
/// Entry `r` maps the state before rank 0 to the state after rank `r`. It costs `O(R log R)`
/// `K×K` products in total against the fold's `O(R)` per rank, so it wins only when the ranks'
/// compositions run in parallel (one per rank, on a large group); the plain fold is cheaper on
/// a single host.
pub fn scan_forward(summaries: &[ForwardSummary]) -> Vec<ForwardSummary> {
    scan(summaries)
}

fn scan<D: Direction>(summaries: &[Summary<D>]) -> Vec<Summary<D>> {
    let mut cur = summaries.to_vec();
    let mut step = 1;
    while step < cur.len() {
        let prev = cur.clone();
        for r in step..cur.len() {
            cur[r] = prev[r - step].as_ref().then(prev[r].as_ref());
        }
        step *= 2;
    }
    cur
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cp::summary::summary_len;
    use crate::op::cpu::backward::backward_head;
    use crate::op::cpu::forward::{forward_head, ForwardWorkspace};

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
    }

    fn head(len: usize, d: &Dims, seed: &mut u64) -> HeadInputs {
        let rows = len * d.n;
        let unit = |v: Vec<f32>, w: usize| -> Vec<f32> {
            v.chunks(w)
                .flat_map(|r| {
                    let nrm = r.iter().map(|x| x * x).sum::<f32>().sqrt();
                    r.iter().map(move |x| x / nrm).collect::<Vec<_>>()
                })
                .collect()
        };
        let mut gate = vec![0.0; rows];
        for t in 0..len {
            gate[t * d.n] = -(lcg(seed) + 0.5) * 0.7;
        }
        HeadInputs {
            q: unit((0..len * d.dk).map(|_| lcg(seed)).collect(), d.dk),
            k: unit((0..rows * d.dk).map(|_| lcg(seed)).collect(), d.dk),
            v: (0..rows * d.dv).map(|_| lcg(seed)).collect(),
            beta: (0..rows).map(|_| 1.0 + 1.8 * lcg(seed)).collect(),
            gate,
        }
    }

    fn rel(a: &[f32], b: &[f32]) -> f32 {
        let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let den: f32 = b.iter().map(|y| y * y).sum();
        (num / den.max(1e-30)).sqrt()
    }

    #[test]
    fn forward_summary_is_the_affine_map_of_the_fragment() {
        let mut seed = 1;
        for (len, n) in [(1, 1), (50, 2), (97, 3), (200, 1)] {
            let d = Dims {
                dk: 12,
                dv: 7,
                n,
                scale: 0.3,
            };
            let x = head(len, &d, &mut seed);
            let s_in: Vec<f32> = (0..d.dk * d.dv).map(|_| lcg(&mut seed)).collect();
            let mut s = s_in.clone();
            let mut o = vec![0.0; len * d.dv];
            forward_head(&x, &d, &mut s, &mut o, &mut ForwardWorkspace::new(&d));
            let p = forward_summary(&x, &d, &vec![0.0; d.dk * d.dv]);
            let mut via = s_in.clone();
            p.as_ref().apply(&mut via);
            assert!(rel(&via, &s) < 1e-5, "len {len} n {n}: {}", rel(&via, &s));
        }
    }

    #[test]
    fn backward_summary_is_the_transposed_map() {
        let mut seed = 5;
        for (len, n) in [(1, 2), (70, 2), (130, 3)] {
            let d = Dims {
                dk: 9,
                dv: 11,
                n,
                scale: 0.5,
            };
            let x = head(len, &d, &mut seed);
            let h0: Vec<f32> = (0..d.dk * d.dv).map(|_| lcg(&mut seed)).collect();
            let dout: Vec<f32> = (0..len * d.dv).map(|_| lcg(&mut seed)).collect();
            let ds_out: Vec<f32> = (0..d.dk * d.dv).map(|_| lcg(&mut seed)).collect();
            let want = backward_head(&x, &d, &h0, &dout, &ds_out).dh0;
            let p = backward_summary(&x, &d, &dout, &vec![0.0; d.dk * d.dv]);
            let mut got = ds_out.clone();
            p.as_ref().apply(&mut got);
            assert!(rel(&got, &want) < 1e-5, "len {len}: {}", rel(&got, &want));
            // Mᵀ of the backward is the transpose of the forward M of the same fragment.
            let (_, mf) = forward_summary(&x, &d, &h0).as_ref().split();
            let (_, mb) = p.as_ref().split();
            let mft: Vec<f32> = (0..d.dk * d.dk)
                .map(|i| mf[(i % d.dk) * d.dk + i / d.dk])
                .collect();
            assert!(rel(&mb, &mft) < 1e-5);
        }
    }

    #[test]
    fn compositions_agree() {
        let mut seed = 3;
        let (dk, dv) = (4, 6);
        let mut rows =
            || -> Vec<f32> { (0..summary_len(dk, dv)).map(|_| lcg(&mut seed)).collect() };
        let fwd: Vec<ForwardSummary> = (0..6)
            .map(|_| ForwardSummary::from_rows(dk, dv, rows()).unwrap())
            .collect();
        let bwd: Vec<BackwardSummary> = (0..6)
            .map(|_| BackwardSummary::from_rows(dk, dv, rows()).unwrap())
            .collect();
        let f = || fwd.iter().map(|s| s.as_ref());
        let b = || bwd.iter().map(|s| s.as_ref());
        for (x, y) in [
            (
                compose_forward(f(), dk, dv, Composition::Fold),
                compose_forward(f(), dk, dv, Composition::Scan),
            ),
            (
                compose_backward(b(), dk, dv, Composition::Fold),
                compose_backward(b(), dk, dv, Composition::Scan),
            ),
        ] {
            assert!(rel(&x, &y) < 1e-5);
        }
        assert_eq!(
            compose_forward(std::iter::empty(), dk, dv, Composition::Scan),
            vec![0.0; dk * dv]
        );
    }

    #[test]
    fn scan_equals_fold() {
        let mut seed = 9;
        let (dk, dv) = (5, 4);
        let sums: Vec<ForwardSummary> = (0..7)
            .map(|_| {
                let rows = (0..summary_len(dk, dv)).map(|_| lcg(&mut seed)).collect();
                ForwardSummary::from_rows(dk, dv, rows).unwrap()
            })
            .collect();
        let scan = scan_forward(&sums);
        for r in 0..sums.len() {
            let fold = fold_forward(sums[..=r].iter().map(|s| s.as_ref()), dk, dv);
            let (a, _) = scan[r].as_ref().split();
            assert!(rel(&a, &fold) < 1e-5);
        }
    }
}
