//! CPU kernels of the chunked (WY) algorithm: f32 accumulation for f32/bf16/f16/f64 inputs,
//! parallel over (sequence, head) with rayon, matrix products through the `gemm` crate.
//!
//! Buffers follow the packed layout of `op::custom`: `qk [B, T, n+1, H, K]`,
//! `v [B, T·n, H, V]`, and the f32 gate buffer `[g | beta | h0?]`.

pub mod backward;
pub mod chunk;
pub mod forward;
pub mod linalg;
pub mod subnormal;

use crate::error::{GdpError, Result};
use crate::op::shape::{GdpShape, SeqSpan};
use candle_core::WithDType;
use chunk::{Dims, HeadInputs};
use rayon::prelude::*;

/// Borrowed inputs of one call, in the packed layout.
pub struct PackedInputs<'a, T> {
    /// `[B, T, n+1, H, K]`
    pub qk: &'a [T],
    /// `[B, T·n, H, V]`
    pub v: &'a [T],
    /// `[g (B·T·H) | beta (B·T·n·H) | h0 (N·H·K·V)?]`, f32.
    pub aux: &'a [f32],
    /// Whether `aux` carries an initial state.
    pub has_h0: bool,
}

impl<T: WithDType> PackedInputs<'_, T> {
    /// Copies one (sequence, head) slice into contiguous f32 buffers.
    pub fn gather(&self, sh: &GdpShape, seq: &SeqSpan, head: usize) -> HeadInputs {
        let (h, k, v, n, tt) = (sh.heads, sh.dk, sh.dv, sh.n, sh.tokens);
        let rows = seq.len * n;
        let mut x = HeadInputs {
            q: Vec::with_capacity(seq.len * k),
            k: Vec::with_capacity(rows * k),
            v: Vec::with_capacity(rows * v),
            beta: Vec::with_capacity(rows),
            gate: vec![0.0; rows],
        };
        let beta_off = sh.token_heads();
        for t in 0..seq.len {
            let tok = seq.batch * tt + seq.start + t;
            let base = tok * (n + 1) * h * k + head * k;
            x.q.extend(to_f32(&self.qk[base..base + k]));
            for j in 0..n {
                let b = base + (1 + j) * h * k;
                x.k.extend(to_f32(&self.qk[b..b + k]));
                let row = tok * n + j;
                let vb = (row * h + head) * v;
                x.v.extend(to_f32(&self.v[vb..vb + v]));
                x.beta.push(self.aux[beta_off + row * h + head]);
            }
            x.gate[t * n] = self.aux[tok * h + head];
        }
        x
    }

    /// The initial state of (sequence `s`, head) as `[K, V]` f32: from `states [N, H, K, V]`
    /// when given, else from the gate buffer's `h0`, else zeros.
    pub fn initial_state(
        &self,
        sh: &GdpShape,
        states: Option<&[f32]>,
        s: usize,
        head: usize,
    ) -> Vec<f32> {
        let kv = sh.dk * sh.dv;
        if let Some(st) = states {
            let off = (s * sh.heads + head) * kv;
            return st[off..off + kv].to_vec();
        }
        if !self.has_h0 {
            return vec![0.0; kv];
        }
        let off = sh.token_heads() * (1 + sh.n) + (s * sh.heads + head) * kv;
        self.aux[off..off + kv].to_vec()
    }
}

/// Converts a slice of any float dtype to f32 values.
fn to_f32<T: WithDType>(s: &[T]) -> impl Iterator<Item = f32> + '_ {
    s.iter().map(|x| x.to_f64() as f32)
}

/// A raw output pointer shared by the rayon tasks of one call.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes a disjoint set of elements (its own sequence and head), and the
// buffer outlives the parallel loop that uses the pointer.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Writes `src` at element offset `off`.
    ///
    /// # Safety
    /// `off + src.len()` must lie inside the buffer and no other task may write these elements.
    unsafe fn write(self, off: usize, src: &[f32]) {
        std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.add(off), src.len());
    }
}

/// All (sequence, head) pairs of a call.
fn tasks(sh: &GdpShape) -> Vec<(usize, usize)> {
    (0..sh.num_seqs())
        .flat_map(|s| (0..sh.heads).map(move |h| (s, h)))
        .collect()
}

/// Checks `sh` ([`GdpShape::check`]) and every buffer's length against it, before any raw
/// write: the kernels below write through [`OutPtr`] at offsets derived from `sh` alone.
fn check_call<T>(
    x: &PackedInputs<T>,
    sh: &GdpShape,
    h0: Option<&[f32]>,
    grad: Option<&[f32]>,
    states: Option<&[Vec<f32>]>,
) -> Result<()> {
    sh.check()?;
    let want = |name: &str, got: usize, want: usize| -> Result<()> {
        if got != want {
            return Err(GdpError::Option {
                name: name.into(),
                reason: format!("has {got} elements, the shape needs {want}"),
            }
            .into());
        }
        Ok(())
    };
    want("qk", x.qk.len(), sh.qk_len())?;
    want("v", x.v.len(), sh.v_len())?;
    want("aux", x.aux.len(), sh.aux_len(x.has_h0))?;
    if let Some(h0) = h0 {
        want("h0", h0.len(), sh.state_len())?;
    }
    if let Some(grad) = grad {
        want("grad", grad.len(), sh.o_len() + sh.state_len())?;
    }
    if let Some(st) = states {
        want("states", st.len(), sh.num_seqs() * sh.heads)?;
    }
    Ok(())
}

fn dims(sh: &GdpShape, scale: f32) -> Dims {
    Dims {
        dk: sh.dk,
        dv: sh.dv,
        n: sh.n,
        scale,
    }
}

/// Forward: returns `[o (B·T·H·V) | final state (N·H·K·V)]` in f32. `h0 [N, H, K, V]`, when
/// given, replaces the initial states of the gate buffer (context parallelism folds states in).
///
/// Errors when `sh` is inconsistent ([`GdpShape::check`]) or a buffer's length does not match it.
pub fn forward<T: WithDType>(
    x: &PackedInputs<T>,
    sh: &GdpShape,
    scale: f32,
    h0: Option<&[f32]>,
) -> Result<Vec<f32>> {
    check_call(x, sh, h0, None, None)?;
    let d = dims(sh, scale);
    let o_len = sh.o_len();
    let mut out = vec![0.0f32; o_len + sh.state_len()];
    let ptr = OutPtr(out.as_mut_ptr());
    tasks(sh).into_par_iter().for_each_init(
        || forward::ForwardWorkspace::new(&d),
        |ws, (s, h)| {
            let _flush = subnormal::FlushSubnormals::new();
            let seq = &sh.seqs[s];
            let inp = x.gather(sh, seq, h);
            let mut state = x.initial_state(sh, h0, s, h);
            let mut o = vec![0.0f32; seq.len * sh.dv];
            forward::forward_head(&inp, &d, &mut state, &mut o, ws);
            for t in 0..seq.len {
                let tok = seq.batch * sh.tokens + seq.start + t;
                // SAFETY: (tok, h) rows belong to this task only; offsets are inside `out`.
                unsafe { ptr.write((tok * sh.heads + h) * sh.dv, &o[t * sh.dv..(t + 1) * sh.dv]) };
            }
            // SAFETY: state slot (s, h) belongs to this task only.
            unsafe { ptr.write(o_len + (s * sh.heads + h) * sh.dk * sh.dv, &state) };
        },
    );
    Ok(out)
}

/// Backward. `grad` is `[do (B·T·H·V) | dht (N·H·K·V)]` f32. Returns
/// `[dqk (B·T·(n+1)·H·K) | dv (B·T·n·H·V) | dg (B·T·H) | dbeta (B·T·n·H) | dh0 (N·H·K·V)?]`.
/// `h0` as in [`forward()`]. Errors as [`forward()`] does, or when `grad`'s length is wrong.
pub fn backward<T: WithDType>(
    x: &PackedInputs<T>,
    sh: &GdpShape,
    scale: f32,
    grad: &[f32],
    h0: Option<&[f32]>,
) -> Result<Vec<f32>> {
    backward_from(x, sh, scale, grad, h0, None)
}

/// The chunk start states `[chunks, K, V]` of (sequence `s`, head `hd`) from its initial state
/// (`h0` as in [`forward()`]): what [`backward_from`] reruns, to run beside other work.
pub fn head_start_states<T: WithDType>(
    x: &PackedInputs<T>,
    sh: &GdpShape,
    scale: f32,
    h0: Option<&[f32]>,
    (s, hd): (usize, usize),
) -> Vec<f32> {
    let _flush = subnormal::FlushSubnormals::new();
    let d = dims(sh, scale);
    let inp = x.gather(sh, &sh.seqs[s], hd);
    let h0s = x.initial_state(sh, h0, s, hd);
    backward::chunk_start_states(&inp, &d, &h0s, &mut chunk::ChunkWy::new(&d))
}

/// [`backward()`], with each (sequence, head)'s chunk start states from `states` (in (sequence,
/// head) order, [`head_start_states`]) instead of a rerun of the forward scan when given.
/// Errors as [`backward()`] does, or when `states` does not hold one entry per (sequence, head).
pub fn backward_from<T: WithDType>(
    x: &PackedInputs<T>,
    sh: &GdpShape,
    scale: f32,
    grad: &[f32],
    h0: Option<&[f32]>,
    states: Option<&[Vec<f32>]>,
) -> Result<Vec<f32>> {
    check_call(x, sh, h0, Some(grad), states)?;
    let d = dims(sh, scale);
    let (h, k, v, n, tt) = (sh.heads, sh.dk, sh.dv, sh.n, sh.tokens);
    let (qk_len, v_len, th) = (sh.qk_len(), sh.v_len(), sh.token_heads());
    let (dg_off, dbeta_off, dh0_off) = (
        qk_len + v_len,
        qk_len + v_len + th,
        qk_len + v_len + th * (1 + n),
    );
    let total = dh0_off + if x.has_h0 { sh.state_len() } else { 0 };
    let mut out = vec![0.0f32; total];
    let ptr = OutPtr(out.as_mut_ptr());
    let o_len = sh.o_len();
    tasks(sh).into_par_iter().for_each(|(s, hd)| {
        let _flush = subnormal::FlushSubnormals::new();
        let seq = &sh.seqs[s];
        let inp = x.gather(sh, seq, hd);
        let mut dout = Vec::with_capacity(seq.len * v);
        for t in 0..seq.len {
            let off = ((seq.batch * tt + seq.start + t) * h + hd) * v;
            dout.extend_from_slice(&grad[off..off + v]);
        }
        let st = o_len + (s * h + hd) * k * v;
        let dht = &grad[st..st + k * v];
        let gr = match states {
            Some(hs) => backward::backward_head_from(&inp, &d, &hs[s * h + hd], &dout, dht),
            None => {
                let h0s = x.initial_state(sh, h0, s, hd);
                backward::backward_head(&inp, &d, &h0s, &dout, dht)
            }
        };
        // SAFETY (all writes below): the rows of token/sub-token (tok, hd) and the state slot
        // (s, hd) belong to this task only, and every offset is inside `out`.
        unsafe {
            for t in 0..seq.len {
                let tok = seq.batch * tt + seq.start + t;
                let base = tok * (n + 1) * h * k + hd * k;
                ptr.write(base, &gr.dq[t * k..(t + 1) * k]);
                for j in 0..n {
                    let p = t * n + j;
                    ptr.write(base + (1 + j) * h * k, &gr.dk[p * k..(p + 1) * k]);
                    let row = tok * n + j;
                    ptr.write(qk_len + (row * h + hd) * v, &gr.dv[p * v..(p + 1) * v]);
                    ptr.write(dbeta_off + row * h + hd, &gr.dbeta[p..p + 1]);
                }
                ptr.write(dg_off + tok * h + hd, &gr.dg[t..t + 1]);
            }
            if x.has_h0 {
                ptr.write(dh0_off + (s * h + hd) * k * v, &gr.dh0);
            }
        }
    });
    Ok(out)
}
