//! Typed state summaries. A fragment's forward summary `[ΔS | M]` maps the state before it to
//! the state after it, `S_out = M S_in + ΔS`; its backward summary `[γ | Mᵀ]` maps the gradient
//! of its final state to that of its initial state, `dS_in = Mᵀ dS_out + γ`. Both are packed per
//! head as `[K, V + K]` f32, row-major (the wire format of the all-gather); the direction is a
//! type parameter, so that a backward summary cannot be folded into an initial state.

use crate::error::{GdpError, Result};
use crate::op::cpu::linalg::{matmul, MatRef};
use std::fmt;
use std::marker::PhantomData;

/// Which way a summary maps ([`Forward`] or [`Backward`]).
pub trait Direction: Copy + Default + fmt::Debug + Send + Sync + 'static {
    /// `"forward"` or `"backward"`, for messages.
    const NAME: &'static str;
}

/// The forward direction: `[ΔS | M]`, `S_out = M S_in + ΔS`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Forward;

/// The backward direction: `[γ | Mᵀ]`, `dS_in = Mᵀ dS_out + γ`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Backward;

impl Direction for Forward {
    const NAME: &'static str = "forward";
}

impl Direction for Backward {
    const NAME: &'static str = "backward";
}

/// Elements of one packed summary `[K, V + K]`.
pub fn summary_len(dk: usize, dv: usize) -> usize {
    dk * (dv + dk)
}

fn bad_len(what: &str, expected: usize, got: usize) -> candle_core::Error {
    GdpError::Comm(format!("{what}: expected {expected} values, got {got}")).into()
}

/// One packed summary `[K, V + K]` of direction `D`, owned.
#[derive(Clone, PartialEq)]
pub struct Summary<D: Direction> {
    dk: usize,
    dv: usize,
    rows: Vec<f32>,
    direction: PhantomData<D>,
}

/// A forward summary `[ΔS | M]`.
pub type ForwardSummary = Summary<Forward>;
/// A backward summary `[γ | Mᵀ]`.
pub type BackwardSummary = Summary<Backward>;

impl<D: Direction> fmt::Debug for Summary<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}Summary(K {}, V {})", D::NAME, self.dk, self.dv)
    }
}

impl<D: Direction> Summary<D> {
    /// A summary from its packed rows `[K, V + K]`; fails on another length.
    pub fn from_rows(dk: usize, dv: usize, rows: Vec<f32>) -> Result<Self> {
        if rows.len() != summary_len(dk, dv) {
            return Err(bad_len(
                &format!("a {} summary [K {dk}, V + K {}]", D::NAME, dv + dk),
                summary_len(dk, dv),
                rows.len(),
            ));
        }
        Ok(Self::from_rows_unchecked(dk, dv, rows))
    }

    fn from_rows_unchecked(dk: usize, dv: usize, rows: Vec<f32>) -> Self {
        Self {
            dk,
            dv,
            rows,
            direction: PhantomData,
        }
    }

    /// The summary of an empty fragment, `[0 | I]`.
    pub fn identity(dk: usize, dv: usize) -> Self {
        Self::from_parts(&vec![0.0; dk * dv], &identity(dk), dk, dv)
    }

    /// Packs the state part `a [K, V]` and the transition part `m [K, K]`.
    pub(crate) fn from_parts(a: &[f32], m: &[f32], dk: usize, dv: usize) -> Self {
        let mut rows = Vec::with_capacity(summary_len(dk, dv));
        for r in 0..dk {
            rows.extend_from_slice(&a[r * dv..(r + 1) * dv]);
            rows.extend_from_slice(&m[r * dk..(r + 1) * dk]);
        }
        Self::from_rows_unchecked(dk, dv, rows)
    }

    /// A borrowed view.
    pub fn as_ref(&self) -> SummaryRef<'_, D> {
        SummaryRef {
            dk: self.dk,
            dv: self.dv,
            rows: &self.rows,
            direction: PhantomData,
        }
    }

    /// The packed rows `[K, V + K]`.
    pub fn rows(&self) -> &[f32] {
        &self.rows
    }

    /// The packed rows `[K, V + K]`, owned (to send).
    pub fn into_rows(self) -> Vec<f32> {
        self.rows
    }
}

/// One packed summary `[K, V + K]` of direction `D`, borrowed (e.g. one rank's in a gathered
/// buffer).
#[derive(Clone, Copy)]
pub struct SummaryRef<'a, D: Direction> {
    dk: usize,
    dv: usize,
    rows: &'a [f32],
    direction: PhantomData<D>,
}

impl<'a, D: Direction> SummaryRef<'a, D> {
    /// A view of packed rows `[K, V + K]`; fails on another length.
    pub fn new(dk: usize, dv: usize, rows: &'a [f32]) -> Result<Self> {
        if rows.len() != summary_len(dk, dv) {
            return Err(bad_len(
                &format!("a {} summary [K {dk}, V + K {}]", D::NAME, dv + dk),
                summary_len(dk, dv),
                rows.len(),
            ));
        }
        Ok(Self {
            dk,
            dv,
            rows,
            direction: PhantomData,
        })
    }

    /// `(K, V)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.dk, self.dv)
    }

    /// The state part `[K, V]` (`ΔS` or `γ`) and the transition part `[K, K]` (`M` or `Mᵀ`).
    pub fn split(&self) -> (Vec<f32>, Vec<f32>) {
        let (dk, dv) = (self.dk, self.dv);
        let (mut a, mut m) = (Vec::with_capacity(dk * dv), Vec::with_capacity(dk * dk));
        for row in self.rows.chunks_exact(dv + dk).take(dk) {
            a.extend_from_slice(&row[..dv]);
            m.extend_from_slice(&row[dv..]);
        }
        (a, m)
    }

    /// Applies the map to a state `s [K, V]`: `s ← M s + ΔS` (backward: `Mᵀ s + γ`).
    pub fn apply(&self, s: &mut [f32]) {
        let (dk, dv) = (self.dk, self.dv);
        let (a, m) = self.split();
        let prev = s.to_vec();
        s[..dk * dv].copy_from_slice(&a);
        matmul(
            s,
            MatRef::new(&m, dk, dk),
            MatRef::new(&prev, dk, dv),
            true,
            1.0,
            1.0,
        );
    }

    /// `self` then `next` as one map: `[ΔS₂ + M₂ΔS₁ | M₂M₁]`. Associative, so that a
    /// log-depth scan over ranks can replace the sequential fold.
    pub fn then(&self, next: SummaryRef<'_, D>) -> Summary<D> {
        let (dk, dv) = (self.dk, self.dv);
        let (a1, m1) = self.split();
        let (mut a, m2) = next.split();
        matmul(
            &mut a,
            MatRef::new(&m2, dk, dk),
            MatRef::new(&a1, dk, dv),
            true,
            1.0,
            1.0,
        );
        let mut m = vec![0.0; dk * dk];
        matmul(
            &mut m,
            MatRef::new(&m2, dk, dk),
            MatRef::new(&m1, dk, dk),
            false,
            0.0,
            1.0,
        );
        Summary::from_parts(&a, &m, dk, dv)
    }

    /// An owned copy.
    pub fn to_owned(&self) -> Summary<D> {
        Summary::from_rows_unchecked(self.dk, self.dv, self.rows.to_vec())
    }
}

/// The summaries of one direction all-gathered over a group: `[ranks, frags, H, K, V + K]`,
/// rank `r`'s `frags · H` summaries (fragment-major) at block `r`.
#[derive(Clone, Copy)]
pub struct Gathered<'a, D: Direction> {
    rows: &'a [f32],
    frags: usize,
    heads: usize,
    dk: usize,
    dv: usize,
    direction: PhantomData<D>,
}

impl<'a, D: Direction> Gathered<'a, D> {
    /// A view of an all-gather's result; fails unless it holds `ranks · frags · H` summaries.
    pub fn new(
        rows: &'a [f32],
        ranks: usize,
        frags: usize,
        heads: usize,
        (dk, dv): (usize, usize),
    ) -> Result<Self> {
        let want = ranks * frags * heads * summary_len(dk, dv);
        if rows.len() != want {
            return Err(bad_len(
                &format!(
                    "{} summaries gathered from {ranks} ranks ({frags} fragments x {heads} heads, \
                     K {dk}, V {dv})",
                    D::NAME
                ),
                want,
                rows.len(),
            ));
        }
        Ok(Self {
            rows,
            frags,
            heads,
            dk,
            dv,
            direction: PhantomData,
        })
    }

    /// Rank `rank`'s summary of fragment `frag`, head `head`.
    pub fn get(&self, rank: usize, frag: usize, head: usize) -> SummaryRef<'a, D> {
        let sl = summary_len(self.dk, self.dv);
        let at = ((rank * self.frags + frag) * self.heads + head) * sl;
        SummaryRef {
            dk: self.dk,
            dv: self.dv,
            rows: &self.rows[at..at + sl],
            direction: PhantomData,
        }
    }
}

/// The `n × n` identity, row-major.
pub(crate) fn identity(n: usize) -> Vec<f32> {
    let mut m = vec![0.0; n * n];
    for i in 0..n {
        m[i * n + i] = 1.0;
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_are_checked() {
        assert!(ForwardSummary::from_rows(2, 3, vec![0.0; 10]).is_ok());
        let e = ForwardSummary::from_rows(2, 3, vec![0.0; 9]).unwrap_err();
        assert!(e.to_string().contains("expected 10 values, got 9"), "{e}");
        let e = Gathered::<Backward>::new(&[0.0; 30], 2, 1, 2, (2, 3))
            .err()
            .expect("40 values wanted");
        assert!(e.to_string().contains("backward"), "{e}");
    }

    #[test]
    fn identity_maps_a_state_to_itself() {
        let s0: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let mut s = s0.clone();
        BackwardSummary::identity(2, 3).as_ref().apply(&mut s);
        assert_eq!(s, s0);
    }
}
