//! Chunked backward of one (sequence, head) (`fla_gdp.md` §3): recompute the WY factors, chunk
//! start states and `Δ`, then one reverse pass that carries `dS` and, per chunk, forms `dΔ`,
//! the q/k/gate gradients and the WY-representation adjoint, ending in the reverse chunk-local
//! cumsum of the gate gradient.

use super::chunk::{
    advance_state, chunk_delta, decayed_keys, query_rows, ChunkWy, Dims, HeadInputs,
};
use super::forward::{query_key_scores, select_queries};
use super::linalg::{dot, matmul, MatRef};
use crate::op::shape::{chunks, CHUNK};

/// Gradients of one (sequence, head), in the layout of [`HeadInputs`].
#[derive(Debug, Clone, Default)]
pub struct HeadGrads {
    /// `[len, K]`
    pub dq: Vec<f32>,
    /// `[len·n, K]`
    pub dk: Vec<f32>,
    /// `[len·n, V]`
    pub dv: Vec<f32>,
    /// `[len·n]`
    pub dbeta: Vec<f32>,
    /// `[len]` (natural-log gate)
    pub dg: Vec<f32>,
    /// `[K, V]`: gradient of the initial state.
    pub dh0: Vec<f32>,
}

/// The forward quantities of one chunk, rebuilt in the reverse pass from the saved start state.
struct ChunkRecord<'a> {
    wy: &'a ChunkWy,
    /// State at the chunk start `[K, V]`.
    h: &'a [f32],
    /// `Δ [c, V]`.
    delta: &'a [f32],
}

/// Per-chunk scratch of the reverse pass.
struct Scratch {
    kdec: Vec<f32>,
    qsel: Vec<f32>,
    dosel: Vec<f32>,
    p: Vec<f32>,
    ds: Vec<f32>,
    ddelta: Vec<f32>,
    dqsel: Vec<f32>,
    dk_inter: Vec<f32>,
    dk: Vec<f32>,
    dw: Vec<f32>,
    dg_cum: Vec<f32>,
    /// Exclusive prefix sums of k_i·dk_inter_i (their part of the gate gradient).
    inter_prefix: Vec<f32>,
    dainv: Vec<f32>,
    tmp: Vec<f32>,
    dm: Vec<f32>,
    dkbg: Vec<f32>,
    dvb: Vec<f32>,
    dkb: Vec<f32>,
    kb: Vec<f32>,
    qrows: Vec<(usize, usize)>,
}

impl Scratch {
    fn new(d: &Dims) -> Self {
        let (ck, cv, cc) = (CHUNK * d.dk, CHUNK * d.dv, CHUNK * CHUNK);
        Self {
            kdec: vec![0.0; ck],
            qsel: vec![0.0; ck],
            dosel: vec![0.0; cv],
            p: vec![0.0; cc],
            ds: vec![0.0; cc],
            ddelta: vec![0.0; cv],
            dqsel: vec![0.0; ck],
            dk_inter: vec![0.0; ck],
            dk: vec![0.0; ck],
            dw: vec![0.0; ck],
            dg_cum: vec![0.0; CHUNK],
            inter_prefix: vec![0.0; CHUNK],
            dainv: vec![0.0; cc],
            tmp: vec![0.0; cc],
            dm: vec![0.0; cc],
            dkbg: vec![0.0; ck],
            dvb: vec![0.0; cv],
            dkb: vec![0.0; ck],
            kb: vec![0.0; ck],
            qrows: Vec::with_capacity(CHUNK),
        }
    }
}

/// Runs the forward state scan of one (sequence, head) and returns the state at the start of
/// every chunk, `[chunks, K, V]`: the only thing kept between the two passes, so memory stays at
/// `K·V` floats per chunk (as FLA's backward, which recomputes `h`).
pub fn chunk_start_states(x: &HeadInputs, d: &Dims, h0: &[f32], wy: &mut ChunkWy) -> Vec<f32> {
    let kv = d.dk * d.dv;
    let mut state = h0.to_vec();
    let mut kdec = vec![0.0; CHUNK * d.dk];
    let mut delta = vec![0.0; CHUNK * d.dv];
    let mut hs = Vec::with_capacity(x.rows().div_ceil(CHUNK) * kv);
    for range in chunks(x.rows()) {
        wy.prepare(x, d, range);
        hs.extend_from_slice(&state);
        chunk_delta(wy, d, &state, &mut delta);
        decayed_keys(wy, x, d, &mut kdec);
        advance_state(wy, d, &kdec, &delta, &mut state);
    }
    hs
}

/// Backward of one (sequence, head). `dout [len, V]` is `∂L/∂o`, `dht [K, V]` is `∂L/∂S_T`.
pub fn backward_head(x: &HeadInputs, d: &Dims, h0: &[f32], dout: &[f32], dht: &[f32]) -> HeadGrads {
    let hs = chunk_start_states(x, d, h0, &mut ChunkWy::new(d));
    backward_head_from(x, d, &hs, dout, dht)
}

/// [`backward_head`] from the chunk start states `hs [chunks, K, V]` of
/// [`chunk_start_states`] (computed beforehand, e.g. beside other work).
pub fn backward_head_from(
    x: &HeadInputs,
    d: &Dims,
    hs: &[f32],
    dout: &[f32],
    dht: &[f32],
) -> HeadGrads {
    let (dk, dv, n) = (d.dk, d.dv, d.n);
    let rows = x.rows();
    let len = x.q.len() / dk;
    let mut gr = HeadGrads {
        dq: vec![0.0; len * dk],
        dk: vec![0.0; rows * dk],
        dv: vec![0.0; rows * dv],
        dbeta: vec![0.0; rows],
        dg: vec![0.0; len],
        dh0: Vec::new(),
    };
    let mut wy = ChunkWy::new(d);
    let kv = dk * dv;
    let mut delta = vec![0.0; CHUNK * dv];
    let mut ds_state = dht.to_vec();
    let mut s = Scratch::new(d);
    let ranges: Vec<_> = chunks(rows).collect();
    for (ci, range) in ranges.into_iter().enumerate().rev() {
        wy.prepare(x, d, range);
        let h = &hs[ci * kv..(ci + 1) * kv];
        chunk_delta(&wy, d, h, &mut delta);
        let rec = ChunkRecord {
            wy: &wy,
            h,
            delta: &delta[..wy.len() * dv],
        };
        reverse_chunk(x, d, &rec, dout, &mut ds_state, &mut s, &mut gr);
    }
    debug_assert!(n >= 1);
    gr.dh0 = ds_state;
    gr
}

/// One chunk of the reverse pass; `ds_state` enters as `∂L/∂S` at the chunk end and leaves as
/// `∂L/∂S` at its start.
fn reverse_chunk(
    x: &HeadInputs,
    d: &Dims,
    rec: &ChunkRecord,
    dout: &[f32],
    ds_state: &mut [f32],
    s: &mut Scratch,
    gr: &mut HeadGrads,
) {
    let (dk, dv, n) = (d.dk, d.dv, d.n);
    let wy = rec.wy;
    let range = wy.range.clone();
    let c = range.len();
    let gl = wy.g_last();
    let kc = &x.k[range.start * dk..range.end * dk];
    let vc = &x.v[range.start * dv..range.end * dv];
    let bc = &x.beta[range.clone()];
    let kmat = MatRef::new(kc, c, dk);
    let dsm = MatRef::new(ds_state, dk, dv);
    let hm = MatRef::new(rec.h, dk, dv);
    let delta = MatRef::new(rec.delta, c, dv);

    s.qrows.clear();
    s.qrows.extend(query_rows(&range, n));
    let nq = s.qrows.len();
    select_queries(x, d, &s.qrows, &mut s.qsel);
    for (r, &(_, t)) in s.qrows.iter().enumerate() {
        s.dosel[r * dv..(r + 1) * dv].copy_from_slice(&dout[t * dv..(t + 1) * dv]);
    }
    let qm = MatRef::new(&s.qsel, nq, dk);
    let dom = MatRef::new(&s.dosel, nq, dv);

    // dΔ = diag(e^{G_last − G}) K dS + Pᵀ dO
    decayed_keys(wy, x, d, &mut s.kdec);
    matmul(
        &mut s.ddelta,
        MatRef::new(&s.kdec, c, dk),
        dsm,
        false,
        0.0,
        1.0,
    );
    query_key_scores(wy, x, d, &s.qrows, &s.qsel, &mut s.p);
    matmul(
        &mut s.ddelta,
        MatRef::new(&s.p, nq, c).t(),
        dom,
        true,
        1.0,
        1.0,
    );

    // ds = (dO Δᵀ) ⊙ scale e^{G_i − G_j} (j ≤ i)
    matmul(&mut s.ds, dom, delta.t(), false, 0.0, 1.0);
    for (r, &(i, _)) in s.qrows.iter().enumerate() {
        let decay = &wy.decay[i * c..(i + 1) * c];
        for (x, &dj) in s.ds[r * c..(r + 1) * c].iter_mut().zip(decay) {
            *x *= d.scale * dj;
        }
    }
    let dsmat = MatRef::new(&s.ds, nq, c);

    // dq = scale e^{G_i} dO hᵀ + ds K
    matmul(&mut s.dqsel, dom, hm.t(), false, 0.0, 1.0);
    for (r, &(i, _)) in s.qrows.iter().enumerate() {
        let f = d.scale * wy.eg[i];
        s.dqsel[r * dk..(r + 1) * dk]
            .iter_mut()
            .for_each(|x| *x *= f);
    }
    matmul(&mut s.dqsel, dsmat, kmat, true, 1.0, 1.0);

    // dk = diag(e^{G_last − G}) Δ dSᵀ + dsᵀ Q. The gate gradient takes k·dk of the two parts
    // apart (see the reverse cumsum below), so dsᵀ Q is formed first and read alone.
    matmul(&mut s.dk_inter, delta, dsm.t(), false, 0.0, 1.0);
    for i in 0..c {
        let f = wy.decay[(c - 1) * c + i];
        s.dk_inter[i * dk..(i + 1) * dk]
            .iter_mut()
            .for_each(|x| *x *= f);
    }
    matmul(&mut s.dk, dsmat.t(), qm, false, 0.0, 1.0);
    let dg = &mut s.dg_cum[..c];
    for (i, dgi) in dg.iter_mut().enumerate() {
        *dgi = -dot(&kc[i * dk..(i + 1) * dk], &s.dk[i * dk..(i + 1) * dk]);
    }
    for (o, &a) in s.dk[..c * dk].iter_mut().zip(&s.dk_inter[..c * dk]) {
        *o += a;
    }

    // dW = −dΔ hᵀ
    matmul(
        &mut s.dw,
        MatRef::new(&s.ddelta, c, dv),
        hm.t(),
        false,
        0.0,
        -1.0,
    );

    // Gradient w.r.t. the cumulated gate, from the output and state paths. The terms of the
    // inter-chunk key gradient, a_i = k_i·dk_inter_i, would enter as −a_i on every row and
    // +Σ a on the last, whose reverse cumsum is the exclusive prefix Σ_{m<i} a_m: they are
    // added as that prefix at the end, so that these large (dS-driven) terms do not cancel in
    // f32 (wide keys under strong gates lost the 1e-5 bound that way).
    let dg = &mut s.dg_cum[..c];
    for (r, &(i, t)) in s.qrows.iter().enumerate() {
        let dq_row = &s.dqsel[r * dk..(r + 1) * dk];
        dg[i] += dot(&s.qsel[r * dk..(r + 1) * dk], dq_row);
        gr.dq[t * dk..(t + 1) * dk].copy_from_slice(dq_row);
    }
    dg[c - 1] += gl.exp() * dot(rec.h, ds_state);
    let inter_prefix = &mut s.inter_prefix[..c];
    let mut pre = 0.0f32;
    for (i, p) in inter_prefix.iter_mut().enumerate() {
        *p = pre;
        pre += dot(&kc[i * dk..(i + 1) * dk], &s.dk_inter[i * dk..(i + 1) * dk]);
    }

    // Carry dS to the chunk start: e^{G_last} dS + Σ_r scale e^{G_r} q_r do_rᵀ − Wᵀ dΔ
    for (r, &(i, _)) in s.qrows.iter().enumerate() {
        let f = d.scale * wy.eg[i];
        s.qsel[r * dk..(r + 1) * dk]
            .iter_mut()
            .for_each(|x| *x *= f);
    }
    matmul(
        ds_state,
        MatRef::new(&s.qsel, nq, dk).t(),
        dom,
        true,
        gl.exp(),
        1.0,
    );
    matmul(
        ds_state,
        MatRef::new(&wy.w, c, dk).t(),
        MatRef::new(&s.ddelta, c, dv),
        true,
        1.0,
        -1.0,
    );

    // WY adjoint (`prepare_wy_repr_bwd`). dU = dΔ.
    let ainv = MatRef::new(&wy.ainv, c, c);
    let kbg = MatRef::new(&wy.kbg, c, dk);
    let vb = MatRef::new(&wy.vb, c, dv);
    let dwm = MatRef::new(&s.dw, c, dk);
    let dum = MatRef::new(&s.ddelta, c, dv);
    matmul(&mut s.dainv, dwm, kbg.t(), false, 0.0, 1.0);
    matmul(&mut s.dainv, dum, vb.t(), true, 1.0, 1.0);
    for i in 0..c {
        s.dainv[i * c + i..(i + 1) * c].fill(0.0);
    }
    matmul(&mut s.dkbg, ainv.t(), dwm, false, 0.0, 1.0);
    matmul(&mut s.dvb, ainv.t(), dum, false, 0.0, 1.0);
    // dA = −Ainvᵀ dAinv Ainvᵀ; dM = strict_lower(dA ⊙ e^{G_i − G_j})
    matmul(
        &mut s.tmp,
        MatRef::new(&s.dainv, c, c),
        ainv.t(),
        false,
        0.0,
        1.0,
    );
    matmul(
        &mut s.dm,
        ainv.t(),
        MatRef::new(&s.tmp, c, c),
        false,
        0.0,
        -1.0,
    );
    for i in 0..c {
        let row = &mut s.dm[i * c..(i + 1) * c];
        for (x, &dj) in row[..i].iter_mut().zip(&wy.decay[i * c..i * c + i]) {
            *x *= dj;
        }
        row[i..].fill(0.0);
    }
    let dmm = MatRef::new(&s.dm, c, c);
    matmul(&mut s.dkb, dmm, kmat, false, 0.0, 1.0);
    for i in 0..c {
        for (o, &kv) in s.kb[i * dk..(i + 1) * dk]
            .iter_mut()
            .zip(&kc[i * dk..(i + 1) * dk])
        {
            *o = bc[i] * kv;
        }
    }
    // dk += dMᵀ (β ⊙ K)
    matmul(
        &mut s.dk,
        dmm.t(),
        MatRef::new(&s.kb, c, dk),
        true,
        1.0,
        1.0,
    );
    for i in 0..c {
        let p = range.start + i;
        let eg = wy.eg[i];
        let krow = &kc[i * dk..(i + 1) * dk];
        let dkbg = &s.dkbg[i * dk..(i + 1) * dk];
        let dvb = &s.dvb[i * dv..(i + 1) * dv];
        let dkb = &s.dkb[i * dk..(i + 1) * dk];
        gr.dbeta[p] = eg * dot(krow, dkbg) + dot(&vc[i * dv..(i + 1) * dv], dvb) + dot(dkb, krow);
        dg[i] += dot(&wy.kbg[i * dk..(i + 1) * dk], dkbg);
        let f = bc[i] * eg;
        let out = &mut gr.dk[p * dk..(p + 1) * dk];
        for (((o, &a), &b), &kd) in out
            .iter_mut()
            .zip(&s.dk[i * dk..(i + 1) * dk])
            .zip(dkbg)
            .zip(dkb)
        {
            *o = a + f * b + bc[i] * kd;
        }
        for (o, &x) in gr.dv[p * dv..(p + 1) * dv].iter_mut().zip(dvb) {
            *o = bc[i] * x;
        }
    }
    // dG_i += Σ_j dM_ij M_ij − Σ_m dM_mi M_mi, with M_ij = β_i k_i·k_j
    for i in 0..c {
        for j in 0..i {
            let a = s.dm[i * c + j] * wy.kk_beta[i * c + j];
            dg[i] += a;
            dg[j] -= a;
        }
    }
    // Reverse chunk-local cumsum: gradient of the raw gate; keep slot 0 of every token.
    let mut acc = 0.0f32;
    for i in (0..c).rev() {
        acc += dg[i];
        let p = range.start + i;
        if p.is_multiple_of(n) {
            gr.dg[p / n] = acc + s.inter_prefix[i];
        }
    }
}
