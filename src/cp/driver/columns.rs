//! The CPU rank's value columns: a sequence that continues from an earlier rank runs on
//! `[v | 0_K]` from `[0 | I_K]` (one widened task, or its `V` and `K` columns as two tasks side
//! by side), and its rows are corrected once the incoming state is known.

use crate::cp::summary::{identity, ForwardSummary};
use crate::op::cpu::chunk::Dims;
use crate::op::cpu::linalg::{matmul, MatRef};
use crate::op::cpu::{self, PackedInputs};
use crate::op::shape::GdpShape;
use candle_core::WithDType;

/// Which value columns a CPU forward task runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Columns {
    /// The sequence as in the plain op, from its own initial state.
    Plain,
    /// `[v | 0_K]` from `[0 | I_K]`: `[o⁰ | Q̃]` and `[ΔS | M]` in one task.
    Widened,
    /// The `V` columns of [`Columns::Widened`] alone: `o⁰` and `ΔS`.
    Values,
    /// Its `K` columns alone: `Q̃` and `M`.
    Transition,
}

/// Runs the forward of (sequence `s`, head `hd`) over the value columns `cols`: the token rows
/// and the final state.
pub(super) fn run_columns<T: WithDType>(
    x: &PackedInputs<T>,
    sh: &GdpShape,
    d: &Dims,
    s: usize,
    hd: usize,
    cols: Columns,
) -> (Vec<f32>, Vec<f32>) {
    let (k, v) = (sh.dk, sh.dv);
    let seq = &sh.seqs[s];
    let mut inp = x.gather(sh, seq, hd);
    let rows = inp.rows();
    let (dv, state) = match cols {
        Columns::Plain => (v, x.initial_state(sh, None, s, hd)),
        Columns::Values => (v, vec![0.0f32; k * v]),
        Columns::Widened => {
            inp.v = widen(&inp.v, v, k);
            // `[0 | I_K]`: the state the widened run starts from is the empty summary's rows.
            (v + k, ForwardSummary::identity(k, v).into_rows())
        }
        Columns::Transition => {
            inp.v = vec![0.0f32; rows * k];
            (k, identity(k))
        }
    };
    let dc = Dims { dv, ..*d };
    let mut ws = cpu::forward::ForwardWorkspace::new(&dc);
    let mut state = state;
    let mut o = vec![0.0f32; seq.len * dv];
    cpu::forward::forward_head(&inp, &dc, &mut state, &mut o, &mut ws);
    (o, state)
}

/// `rows` rows `[a | b]` from `a [rows, V]` and `b [rows, K]`.
pub(super) fn join_columns(a: &[f32], b: &[f32], rows: usize, v: usize, k: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * (v + k));
    for r in 0..rows {
        out.extend_from_slice(&a[r * v..(r + 1) * v]);
        out.extend_from_slice(&b[r * k..(r + 1) * k]);
    }
    out
}

/// `rows` rows of width `v` widened by `k` zero columns.
fn widen(x: &[f32], v: usize, k: usize) -> Vec<f32> {
    let rows = x.len() / v.max(1);
    let mut out = vec![0.0f32; rows * (v + k)];
    for (dst, src) in out.chunks_exact_mut(v + k).zip(x.chunks_exact(v.max(1))) {
        dst[..v].copy_from_slice(src);
    }
    out
}

/// `y = y⁰ + ỹ S` for `rows` widened rows `[y⁰ | ỹ]` (width `V + K`) and `S [K, V]`.
pub(super) fn correct_rows(wide: &[f32], rows: usize, s: &[f32], k: usize, v: usize) -> Vec<f32> {
    let w = v + k;
    let mut out = vec![0.0f32; rows * v];
    for (dst, src) in out.chunks_exact_mut(v.max(1)).zip(wide.chunks_exact(w)) {
        dst.copy_from_slice(&src[..v]);
    }
    if rows > 0 && v > 0 {
        let tilde = MatRef::strided(&wide[v.min(wide.len())..], rows, k, w);
        matmul(&mut out, tilde, MatRef::new(s, k, v), true, 1.0, 1.0);
    }
    out
}
