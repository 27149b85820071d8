//! Per-(sequence, head) inputs in f32 and the WY factors of one chunk, shared by the forward,
//! the backward and the context-parallel summaries.
//!
//! Everything here works on the *interleaved* sequence of `L = len·n` sub-tokens (see
//! `fla_gdp.md` §1.2): the gate sits on sub-step 0 of every token and the query on sub-step
//! `n − 1`.

use super::linalg::{matmul, unit_lower_inverse, MatRef};
use crate::op::shape::CHUNK;
use std::ops::Range;

/// Sizes that every per-head kernel needs.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    /// Key dimension `K`.
    pub dk: usize,
    /// Value dimension `V`.
    pub dv: usize,
    /// Householder sub-steps per token.
    pub n: usize,
    /// Output scale.
    pub scale: f32,
}

/// One (sequence, head) slice, converted to f32 and laid out contiguously.
#[derive(Debug, Clone, Default)]
pub struct HeadInputs {
    /// Queries `[len, K]`.
    pub q: Vec<f32>,
    /// Keys `[len·n, K]`.
    pub k: Vec<f32>,
    /// Values `[len·n, V]`.
    pub v: Vec<f32>,
    /// Per-sub-token `β` `[len·n]`.
    pub beta: Vec<f32>,
    /// Interleaved natural-log gate `[len·n]`: `g_t` at row `t·n`, 0 elsewhere.
    pub gate: Vec<f32>,
}

impl HeadInputs {
    /// Interleaved rows `L = len·n`.
    pub fn rows(&self) -> usize {
        self.beta.len()
    }
}

/// Query rows of a chunk: `(row within the chunk, token index within the sequence)`.
pub fn query_rows(range: &Range<usize>, n: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
    range
        .clone()
        .filter(move |i| i % n == n - 1)
        .map(move |i| (i - range.start, i / n))
}

/// The WY representation of one chunk (`fla_gdp.md` §2.2–2.4), with the chunk-local gate
/// cumsum `G`. Buffers are sized for a full chunk and reused across chunks.
pub struct ChunkWy {
    /// Interleaved rows `[start, end)` of the chunk within its sequence.
    pub range: Range<usize>,
    /// Chunk-local inclusive cumsum of the interleaved gate, `[c]`.
    pub g: Vec<f32>,
    /// `e^{G_i}`, `[c]`.
    pub eg: Vec<f32>,
    /// `e^{G_i − G_j}` for `j ≤ i`, 0 above the diagonal, `[c, c]`. Built as running products
    /// of the per-row gate factors: no exponential of a positive difference is ever taken
    /// (pitfall P4) and only `c` exponentials are evaluated per chunk.
    pub decay: Vec<f32>,
    /// `β_i (k_i·k_j)` for all `i, j` (un-masked, un-decayed), `[c, c]`.
    pub kk_beta: Vec<f32>,
    /// `A = strict_lower(β_i (k_i·k_j) e^{G_i − G_j})`, `[c, c]` (upper part unspecified).
    pub a: Vec<f32>,
    /// `(I + A)⁻¹`, `[c, c]`.
    pub ainv: Vec<f32>,
    /// `W = (I + A)⁻¹ diag(β e^G) K`, `[c, K]`.
    pub w: Vec<f32>,
    /// `U = (I + A)⁻¹ diag(β) V`, `[c, V]`.
    pub u: Vec<f32>,
    /// Scratch: `diag(β e^G) K` then reused, `[c, K]`.
    pub kbg: Vec<f32>,
    /// Scratch: `diag(β) V`, `[c, V]`.
    pub vb: Vec<f32>,
}

impl ChunkWy {
    /// Empty buffers for chunks of up to [`CHUNK`] rows.
    pub fn new(d: &Dims) -> Self {
        Self {
            range: 0..0,
            g: vec![0.0; CHUNK],
            eg: vec![0.0; CHUNK],
            decay: vec![0.0; CHUNK * CHUNK],
            kk_beta: vec![0.0; CHUNK * CHUNK],
            a: vec![0.0; CHUNK * CHUNK],
            ainv: vec![0.0; CHUNK * CHUNK],
            w: vec![0.0; CHUNK * d.dk],
            u: vec![0.0; CHUNK * d.dv],
            kbg: vec![0.0; CHUNK * d.dk],
            vb: vec![0.0; CHUNK * d.dv],
        }
    }

    /// Rows in the chunk.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether the chunk has no rows (never, once prepared).
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Gate cumsum at the last row, `G_last`.
    pub fn g_last(&self) -> f32 {
        self.g[self.len() - 1]
    }

    /// Fills every factor for the chunk `range` of `x`.
    pub fn prepare(&mut self, x: &HeadInputs, d: &Dims, range: Range<usize>) {
        let c = range.len();
        let (dk, dv) = (d.dk, d.dv);
        let kc = &x.k[range.start * dk..range.end * dk];
        let vc = &x.v[range.start * dv..range.end * dv];
        let bc = &x.beta[range.clone()];
        let mut acc = 0.0f32;
        for (gi, &raw) in self.g[..c].iter_mut().zip(&x.gate[range.clone()]) {
            acc += raw;
            *gi = acc;
        }
        let g = &self.g[..c];
        for (e, &gi) in self.eg[..c].iter_mut().zip(g) {
            *e = gi.exp();
        }
        let step: Vec<f32> = x.gate[range.clone()].iter().map(|r| r.exp()).collect();
        for i in 0..c {
            let row = &mut self.decay[i * c..(i + 1) * c];
            row[i] = 1.0;
            for j in (0..i).rev() {
                row[j] = row[j + 1] * step[j + 1];
            }
            row[i + 1..].fill(0.0);
        }
        // kk_beta = diag(β) K Kᵀ (kept for the backward);
        // A = strict_lower(kk_beta ⊙ e^{G_i − G_j}).
        let kmat = MatRef::new(kc, c, dk);
        matmul(&mut self.kk_beta, kmat, kmat.t(), false, 0.0, 1.0);
        for (i, &b) in bc.iter().enumerate() {
            let row = &mut self.kk_beta[i * c..(i + 1) * c];
            row.iter_mut().for_each(|x| *x *= b);
            let decay = &self.decay[i * c..i * c + i];
            for ((a, &m), &e) in self.a[i * c..i * c + i]
                .iter_mut()
                .zip(&row[..i])
                .zip(decay)
            {
                *a = m * e;
            }
        }
        unit_lower_inverse(&self.a, &mut self.ainv, c);
        for i in 0..c {
            let f = bc[i] * self.eg[i];
            for (o, &kv) in self.kbg[i * dk..(i + 1) * dk]
                .iter_mut()
                .zip(&kc[i * dk..(i + 1) * dk])
            {
                *o = f * kv;
            }
            for (o, &vv) in self.vb[i * dv..(i + 1) * dv]
                .iter_mut()
                .zip(&vc[i * dv..(i + 1) * dv])
            {
                *o = bc[i] * vv;
            }
        }
        let ainv = MatRef::new(&self.ainv, c, c);
        matmul(
            &mut self.w,
            ainv,
            MatRef::new(&self.kbg, c, dk),
            false,
            0.0,
            1.0,
        );
        matmul(
            &mut self.u,
            ainv,
            MatRef::new(&self.vb, c, dv),
            false,
            0.0,
            1.0,
        );
        self.range = range;
    }
}

/// `Δ = U − W S` for a chunk (the per-sub-step `δ_p`, "v_new"), written to `delta [c, V]`.
pub fn chunk_delta(wy: &ChunkWy, d: &Dims, state: &[f32], delta: &mut [f32]) {
    let c = wy.len();
    delta[..c * d.dv].copy_from_slice(&wy.u[..c * d.dv]);
    matmul(
        delta,
        MatRef::new(&wy.w, c, d.dk),
        MatRef::new(state, d.dk, d.dv),
        true,
        1.0,
        -1.0,
    );
}

/// `kdec_i = e^{G_last − G_i} k_i`, `[c, K]`: keys decayed to the chunk end.
pub fn decayed_keys(wy: &ChunkWy, x: &HeadInputs, d: &Dims, kdec: &mut [f32]) {
    let c = wy.len();
    let kc = &x.k[wy.range.start * d.dk..wy.range.end * d.dk];
    for i in 0..c {
        let f = wy.decay[(c - 1) * c + i];
        for (o, &kv) in kdec[i * d.dk..(i + 1) * d.dk]
            .iter_mut()
            .zip(&kc[i * d.dk..(i + 1) * d.dk])
        {
            *o = f * kv;
        }
    }
}

/// `S ← e^{G_last} S + kdecᵀ Δ`: carries the state across the chunk.
pub fn advance_state(wy: &ChunkWy, d: &Dims, kdec: &[f32], delta: &[f32], state: &mut [f32]) {
    let c = wy.len();
    matmul(
        state,
        MatRef::new(kdec, c, d.dk).t(),
        MatRef::new(delta, c, d.dv),
        true,
        wy.g_last().exp(),
        1.0,
    );
}
