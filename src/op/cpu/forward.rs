//! Chunked forward of one (sequence, head): WY factors, state scan and output per interleaved
//! chunk (`fla_gdp.md` §2, in the per-interleaved-chunk output form of §2.7 restricted to the
//! query rows, which does `n`× less intra-chunk work than the token-chunk form on a CPU).

use super::chunk::{
    advance_state, chunk_delta, decayed_keys, query_rows, ChunkWy, Dims, HeadInputs,
};
use super::linalg::{matmul, MatRef};
use crate::op::shape::{chunks, CHUNK};

/// Reusable buffers of the forward.
pub struct ForwardWorkspace {
    wy: ChunkWy,
    delta: Vec<f32>,
    kdec: Vec<f32>,
    qsel: Vec<f32>,
    p: Vec<f32>,
    osel: Vec<f32>,
    qrows: Vec<(usize, usize)>,
}

impl ForwardWorkspace {
    /// Buffers for chunks of up to [`CHUNK`] rows.
    pub fn new(d: &Dims) -> Self {
        Self {
            wy: ChunkWy::new(d),
            delta: vec![0.0; CHUNK * d.dv],
            kdec: vec![0.0; CHUNK * d.dk],
            qsel: vec![0.0; CHUNK * d.dk],
            p: vec![0.0; CHUNK * CHUNK],
            osel: vec![0.0; CHUNK * d.dv],
            qrows: Vec::with_capacity(CHUNK),
        }
    }
}

/// The intra-chunk attention of the query rows: `P[r, j] = scale · e^{G_{i_r} − G_j} (q_r·k_j)`
/// for `j ≤ i_r`, else 0. `qsel [nq, K]` holds the selected queries. Written to `p [nq, c]`.
pub fn query_key_scores(
    wy: &ChunkWy,
    x: &HeadInputs,
    d: &Dims,
    qrows: &[(usize, usize)],
    qsel: &[f32],
    p: &mut [f32],
) {
    let c = wy.len();
    let nq = qrows.len();
    let kc = &x.k[wy.range.start * d.dk..wy.range.end * d.dk];
    matmul(
        p,
        MatRef::new(qsel, nq, d.dk),
        MatRef::new(kc, c, d.dk).t(),
        false,
        0.0,
        1.0,
    );
    for (r, &(i, _)) in qrows.iter().enumerate() {
        let decay = &wy.decay[i * c..(i + 1) * c];
        for (pj, &dj) in p[r * c..(r + 1) * c].iter_mut().zip(decay) {
            *pj *= d.scale * dj;
        }
    }
}

/// Gathers the queries of `qrows` into `qsel [nq, K]`.
pub fn select_queries(x: &HeadInputs, d: &Dims, qrows: &[(usize, usize)], qsel: &mut [f32]) {
    for (r, &(_, t)) in qrows.iter().enumerate() {
        qsel[r * d.dk..(r + 1) * d.dk].copy_from_slice(&x.q[t * d.dk..(t + 1) * d.dk]);
    }
}

/// Runs one (sequence, head): `state` holds the initial state `[K, V]` on entry and the final
/// state on exit; `o [len, V]` receives the outputs.
pub fn forward_head(
    x: &HeadInputs,
    d: &Dims,
    state: &mut [f32],
    o: &mut [f32],
    ws: &mut ForwardWorkspace,
) {
    let (dk, dv) = (d.dk, d.dv);
    for range in chunks(x.rows()) {
        ws.wy.prepare(x, d, range.clone());
        let c = range.len();
        chunk_delta(&ws.wy, d, state, &mut ws.delta);

        ws.qrows.clear();
        ws.qrows.extend(query_rows(&range, d.n));
        let nq = ws.qrows.len();
        if nq > 0 {
            select_queries(x, d, &ws.qrows, &mut ws.qsel);
            // o = scale · e^{G_i} q_i S  +  P Δ
            matmul(
                &mut ws.osel,
                MatRef::new(&ws.qsel, nq, dk),
                MatRef::new(state, dk, dv),
                false,
                0.0,
                1.0,
            );
            for (r, &(i, _)) in ws.qrows.iter().enumerate() {
                let f = d.scale * ws.wy.eg[i];
                ws.osel[r * dv..(r + 1) * dv]
                    .iter_mut()
                    .for_each(|x| *x *= f);
            }
            query_key_scores(&ws.wy, x, d, &ws.qrows, &ws.qsel, &mut ws.p);
            matmul(
                &mut ws.osel,
                MatRef::new(&ws.p, nq, c),
                MatRef::new(&ws.delta, c, dv),
                true,
                1.0,
                1.0,
            );
            for (r, &(_, t)) in ws.qrows.iter().enumerate() {
                o[t * dv..(t + 1) * dv].copy_from_slice(&ws.osel[r * dv..(r + 1) * dv]);
            }
        }
        decayed_keys(&ws.wy, x, d, &mut ws.kdec);
        advance_state(&ws.wy, d, &ws.kdec, &ws.delta, state);
    }
}
