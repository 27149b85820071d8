//! The specification: a token-by-token float64 reference of Gated DeltaProduct and its
//! hand-written recurrent adjoint (`fla_gdp.md` §1.2 and §4.2). It honours every argument
//! (scale, initial state, packed sequences) and is what every fast path is tested against.
//! It is slow by design.

use super::{validate_fla, GdpOptions};
use crate::op::shape::{GdpShape, SeqSpan};
use candle_core::{DType, Device, Result, Tensor};

/// Gradients of `L = Σ do·o + Σ dht·S_T` returned by [`gated_delta_product_naive_backward`],
/// each with its input's shape, in f64.
#[derive(Debug, Clone)]
pub struct NaiveGrads {
    /// `[B, T, Hk, K]`
    pub dq: Tensor,
    /// `[B, T·n, Hk, K]`
    pub dk: Tensor,
    /// `[B, T·n, H, V]`
    pub dv: Tensor,
    /// `[B, T, H]`
    pub dg: Tensor,
    /// `[B, T·n, H]`
    pub dbeta: Tensor,
    /// `[N, H, K, V]`
    pub dh0: Tensor,
}

/// Host copies of all inputs in f64, FLA layout.
struct Host {
    /// The geometry; `sh.heads` counts the value heads `Hv`.
    sh: GdpShape,
    /// Key heads `Hk` of `q` and `k`; value head `h` reads key head `h / (Hv / Hk)`.
    key_heads: usize,
    scale: f64,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    g: Vec<f64>,
    beta: Vec<f64>,
    h0: Vec<f64>,
}

fn host(t: &Tensor) -> Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

impl Host {
    fn new(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        opts: &GdpOptions,
    ) -> Result<Self> {
        let sh = validate_fla(q, k, v, g, beta, opts)?;
        let key_heads = q.dim(2)?;
        let h0 = match opts.initial_state {
            Some(h0) => host(h0)?,
            None => vec![0.0; sh.state_len()],
        };
        Ok(Self {
            scale: opts.scale.unwrap_or((sh.dk as f64).powf(-0.5)),
            q: host(q)?,
            k: host(k)?,
            v: host(v)?,
            g: host(g)?,
            beta: host(beta)?,
            h0,
            sh,
            key_heads,
        })
    }

    /// Offset of token `t` of `seq` for head `h` in a `[B, T, H, ·]` tensor, in rows.
    fn tok(&self, seq: &SeqSpan, t: usize, h: usize) -> usize {
        (seq.batch * self.sh.tokens + seq.start + t) * self.sh.heads + h
    }

    /// Offset of sub-step row `p = t·n + j` of `seq` for head `h` in a `[B, T·n, H, ·]` tensor.
    fn sub(&self, seq: &SeqSpan, p: usize, h: usize) -> usize {
        ((seq.batch * self.sh.tokens + seq.start) * self.sh.n + p) * self.sh.heads + h
    }

    /// Offset of token `t`'s query in `q [B, T, Hk, K]`, in rows, as value head `h` reads it.
    fn q_row(&self, seq: &SeqSpan, t: usize, h: usize) -> usize {
        let r = self.sh.heads / self.key_heads;
        (seq.batch * self.sh.tokens + seq.start + t) * self.key_heads + h / r
    }

    /// Offset of sub-step `p`'s key in `k [B, T·n, Hk, K]`, in rows, as value head `h` reads it.
    fn k_row(&self, seq: &SeqSpan, p: usize, h: usize) -> usize {
        let r = self.sh.heads / self.key_heads;
        ((seq.batch * self.sh.tokens + seq.start) * self.sh.n + p) * self.key_heads + h / r
    }
}

/// `r = Sᵀ x` for `S [K, V]`.
fn st_x(s: &[f64], x: &[f64], dv: usize) -> Vec<f64> {
    let mut r = vec![0.0; dv];
    for (kk, &xk) in x.iter().enumerate() {
        for (rv, &sv) in r.iter_mut().zip(&s[kk * dv..(kk + 1) * dv]) {
            *rv += xk * sv;
        }
    }
    r
}

/// Reference forward in f64: returns `o [B, T, H, V]` and the final state `[N, H, K, V]`, both
/// f64 on the CPU. Same arguments and checks as [`crate::gated_delta_product`].
pub fn gated_delta_product_naive(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    opts: &GdpOptions,
) -> Result<(Tensor, Tensor)> {
    let x = Host::new(q, k, v, g, beta, opts)?;
    let sh = &x.sh;
    let (dk, dv, n) = (sh.dk, sh.dv, sh.n);
    let mut o = vec![0.0; sh.o_len()];
    let mut ht = x.h0.clone();
    for (si, seq) in sh.seqs.iter().enumerate() {
        for h in 0..sh.heads {
            let s = &mut ht[(si * sh.heads + h) * dk * dv..(si * sh.heads + h + 1) * dk * dv];
            for t in 0..seq.len {
                let gt = x.g[x.tok(seq, t, h)].exp();
                s.iter_mut().for_each(|e| *e *= gt);
                for j in 0..n {
                    let r = x.sub(seq, t * n + j, h);
                    let kr = x.k_row(seq, t * n + j, h);
                    let kp = &x.k[kr * dk..(kr + 1) * dk];
                    let vp = &x.v[r * dv..(r + 1) * dv];
                    let pred = st_x(s, kp, dv);
                    let b = x.beta[r];
                    for (kk, &kv) in kp.iter().enumerate() {
                        for ((e, &vv), &pv) in
                            s[kk * dv..(kk + 1) * dv].iter_mut().zip(vp).zip(&pred)
                        {
                            *e += kv * b * (vv - pv);
                        }
                    }
                }
                let row = x.tok(seq, t, h);
                let qr = x.q_row(seq, t, h);
                let read = st_x(s, &x.q[qr * dk..(qr + 1) * dk], dv);
                for (ov, rv) in o[row * dv..(row + 1) * dv].iter_mut().zip(read) {
                    *ov = x.scale * rv;
                }
            }
        }
    }
    Ok((
        Tensor::from_vec(o, (sh.batch, sh.tokens, sh.heads, dv), &Device::Cpu)?,
        Tensor::from_vec(ht, (sh.num_seqs(), sh.heads, dk, dv), &Device::Cpu)?,
    ))
}

/// Reference backward in f64: the recurrent adjoint of `L = Σ do·o + Σ dht·S_T` on the
/// interleaved sequence (`fla_gdp.md` §4.2). `dout [B, T, H, V]`, `dht [N, H, K, V]` (optional).
#[expect(
    clippy::too_many_arguments,
    reason = "the op's own positional inputs (q, k, v, g, beta, opts), as in the forward and FLA"
)]
pub fn gated_delta_product_naive_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    opts: &GdpOptions,
    dout: &Tensor,
    dht: Option<&Tensor>,
) -> Result<NaiveGrads> {
    let x = Host::new(q, k, v, g, beta, opts)?;
    let sh = &x.sh;
    let (dk, dv, n, kv) = (sh.dk, sh.dv, sh.n, sh.dk * sh.dv);
    let dout = host(dout)?;
    let dht = match dht {
        Some(t) => host(t)?,
        None => vec![0.0; sh.state_len()],
    };
    let mut dq = vec![0.0; x.q.len()];
    let mut dkk = vec![0.0; x.k.len()];
    let mut dvv = vec![0.0; x.v.len()];
    let mut dg = vec![0.0; x.g.len()];
    let mut db = vec![0.0; x.beta.len()];
    let mut dh0 = vec![0.0; sh.state_len()];
    for (si, seq) in sh.seqs.iter().enumerate() {
        for h in 0..sh.heads {
            let slot = (si * sh.heads + h) * kv;
            // Forward, storing S̃_p (state after the gate of p) and δ_p.
            let rows = seq.len * n;
            let mut s = x.h0[slot..slot + kv].to_vec();
            let mut s_tilde = Vec::with_capacity(rows);
            let mut deltas = Vec::with_capacity(rows);
            for p in 0..rows {
                if p % n == 0 {
                    let gt = x.g[x.tok(seq, p / n, h)].exp();
                    s.iter_mut().for_each(|e| *e *= gt);
                }
                let r = x.sub(seq, p, h);
                let kr = x.k_row(seq, p, h);
                let kp = &x.k[kr * dk..(kr + 1) * dk];
                let pred = st_x(&s, kp, dv);
                let d: Vec<f64> = (0..dv)
                    .map(|c| x.beta[r] * (x.v[r * dv + c] - pred[c]))
                    .collect();
                s_tilde.push(s.clone());
                for (kk, &kval) in kp.iter().enumerate() {
                    for (e, &dd) in s[kk * dv..(kk + 1) * dv].iter_mut().zip(&d) {
                        *e += kval * dd;
                    }
                }
                deltas.push(d);
            }
            // Reverse.
            let mut ds = dht[slot..slot + kv].to_vec();
            for p in (0..rows).rev() {
                let r = x.sub(seq, p, h);
                let kr = x.k_row(seq, p, h);
                let kp = &x.k[kr * dk..(kr + 1) * dk];
                let st = &s_tilde[p];
                let d = &deltas[p];
                if p % n == n - 1 {
                    // o_t = scale · S_pᵀ q_t with S_p = S̃_p + k_p δ_pᵀ
                    let tr = x.tok(seq, p / n, h);
                    let qr = x.q_row(seq, p / n, h);
                    let qt = &x.q[qr * dk..(qr + 1) * dk];
                    let dot = &dout[tr * dv..(tr + 1) * dv];
                    for kk in 0..dk {
                        let mut acc = 0.0;
                        for c in 0..dv {
                            let sp = st[kk * dv + c] + kp[kk] * d[c];
                            acc += sp * dot[c];
                            ds[kk * dv + c] += x.scale * qt[kk] * dot[c];
                        }
                        // The value heads of a group share the query: their parts add up.
                        dq[qr * dk + kk] += x.scale * acc;
                    }
                }
                // S_p = S̃_p + k δᵀ
                let dd = st_x(&ds, kp, dv); // dSᵀ k
                for kk in 0..dk {
                    dkk[kr * dk + kk] += (0..dv).map(|c| ds[kk * dv + c] * d[c]).sum::<f64>();
                }
                let pred = st_x(st, kp, dv);
                let b = x.beta[r];
                for c in 0..dv {
                    dvv[r * dv + c] = b * dd[c];
                }
                db[r] = (0..dv).map(|c| (x.v[r * dv + c] - pred[c]) * dd[c]).sum();
                // δ = β (v − S̃ᵀ k): dS̃ += k drᵀ, dk += S̃ dr with dr = −β dδ
                for kk in 0..dk {
                    let mut acc = 0.0;
                    for c in 0..dv {
                        let dr = -b * dd[c];
                        ds[kk * dv + c] += kp[kk] * dr;
                        acc += st[kk * dv + c] * dr;
                    }
                    dkk[kr * dk + kk] += acc;
                }
                if p % n == 0 {
                    let tr = x.tok(seq, p / n, h);
                    let gt = x.g[tr].exp();
                    // S̃ = e^g S_prev: dg = ⟨S̃, dS̃⟩, dS_prev = e^g dS̃
                    dg[tr] = st.iter().zip(&ds).map(|(a, b)| a * b).sum();
                    ds.iter_mut().for_each(|e| *e *= gt);
                }
            }
            dh0[slot..slot + kv].copy_from_slice(&ds);
        }
    }
    let dev = Device::Cpu;
    let (b, t, hh, hk) = (sh.batch, sh.tokens, sh.heads, x.key_heads);
    Ok(NaiveGrads {
        dq: Tensor::from_vec(dq, (b, t, hk, dk), &dev)?,
        dk: Tensor::from_vec(dkk, (b, t * n, hk, dk), &dev)?,
        dv: Tensor::from_vec(dvv, (b, t * n, hh, dv), &dev)?,
        dg: Tensor::from_vec(dg, (b, t, hh), &dev)?,
        dbeta: Tensor::from_vec(db, (b, t * n, hh), &dev)?,
        dh0: Tensor::from_vec(dh0, (sh.num_seqs(), hh, dk, dv), &dev)?,
    })
}
