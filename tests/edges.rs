//! Numerics at the edges of the inputs' range (issue 43): the CPU op (forward and every
//! gradient) and context parallelism on 2, 3 and 4 CPU ranks against the f64 reference, f32
//! within 1e-5 relative RMS, for
//!
//! * gates down to -1e4, where `exp(g)` is 0 in f32 and f64, and -inf (the same exact reset),
//!   mixed with ordinary gates, on whole chunks and right before a sequence start;
//! * `β` in `[0, 2]`, exactly 0 and exactly 2 included;
//! * zero-length packed sequences at the start, in the middle and at the end, on the ranks'
//!   shard boundaries;
//! * NaN and ±Inf inputs, as `gated_delta_product` documents them: no error, propagated like the
//!   reference, never beyond the (sequence, head) that holds them;
//!
//! and, with `--ignored`, one sequence of 2^20 tokens (`million_tokens_cpu`).

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gdp::cp::CpOutput;
use candle_gdp::op::shape::CHUNK;
use candle_gdp::{ContextParallel, Cotangents, GdpOptions};
use common::{
    assert_close, cp_pairs, deep_gate_cases, edge_beta_cases, empty_sequence_cases, inputs,
    rel_rms, run_op, run_reference, Case, Inputs, Results,
};

/// Context-parallel group sizes every case runs on.
const RANKS: [usize; 3] = [2, 3, 4];

/// Context parallelism on `ranks` CPU ranks, f32, with the cotangents of `x`.
fn run_cp(c: &Case, x: &Inputs, ranks: usize) -> Result<CpOutput> {
    let f = x.cast(DType::F32)?;
    let opts = GdpOptions {
        initial_state: f.h0.as_ref(),
        output_final_state: true,
        cu_seqlens: c.cu.as_deref(),
        ..Default::default()
    };
    let cot = Cotangents {
        dout: &f.dout,
        dht: Some(&f.dht),
    };
    Ok(ContextParallel::cpu(ranks)?.gated_delta_product(
        &f.q,
        &f.k,
        &f.v,
        &f.g,
        &f.beta,
        &opts,
        Some(cot),
    )?)
}

/// `o`, `ht` and the gradients as one named list.
fn named(r: Results) -> Vec<(&'static str, Tensor)> {
    let mut out = vec![("o", r.o), ("ht", r.ht)];
    out.extend(r.grads);
    out
}

/// [`named`], borrowed.
fn entries(r: &Results) -> Vec<(&'static str, &Tensor)> {
    let grads = r.grads.iter().map(|(name, t)| (*name, t));
    [("o", &r.o), ("ht", &r.ht)]
        .into_iter()
        .chain(grads)
        .collect()
}

/// The op and context parallelism on [`RANKS`] (forward, final state and every gradient)
/// against the f64 reference within 1e-5 relative RMS, all finite; returns the worst error.
fn check_against_reference(c: &Case, x: &Inputs) -> Result<f64> {
    let want = run_reference(c, x)?;
    for (name, t) in entries(&want) {
        assert!(
            finite(t)?,
            "{}: the f64 reference's {name} is not finite",
            c.name
        );
    }
    let mut worst = assert_close(c, &run_op(c, x, DType::F32)?, &want, 1e-5)?;
    for r in RANKS {
        let mut report = vec![];
        for (name, a, b) in cp_pairs(run_cp(c, x, r)?, &want)? {
            assert_eq!(a.dims(), b.dims(), "{} cp={r}: {name} shape", c.name);
            let e = rel_rms(&a, &b)?;
            assert!(e.is_finite(), "{} cp={r}: {name} is not finite", c.name);
            assert!(e <= 1e-5, "{} cp={r}: {name} relative RMS {e:.2e}", c.name);
            worst = worst.max(e);
            report.push(format!("{name} {e:.1e}"));
        }
        println!("{:<28} cp={r} {}", c.name, report.join("  "));
    }
    Ok(worst)
}

fn values(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

fn finite(t: &Tensor) -> Result<bool> {
    Ok(values(t)?.iter().all(|x| x.is_finite()))
}

#[test]
fn gates_down_to_minus_1e4_match_reference() -> Result<()> {
    // The floor underflows in both precisions: those tokens erase the state completely.
    assert_eq!((-1e4f32).exp(), 0.0);
    assert_eq!((-1e4f64).exp(), 0.0);
    let mut worst = 0.0f64;
    for (c, x) in deep_gate_cases(DType::F32, -1e4)? {
        assert_eq!(x.g.min_all()?.to_scalar::<f64>()?, -1e4, "{}", c.name);
        worst = worst.max(check_against_reference(&c, &x)?);
    }
    println!("gates down to -1e4: worst relative RMS error {worst:.2e}");
    Ok(())
}

#[test]
fn beta_from_zero_to_two_matches_reference() -> Result<()> {
    let mut worst = 0.0f64;
    for (c, x) in edge_beta_cases(DType::F32)? {
        let b = values(&x.beta)?;
        assert!(b.iter().all(|b| (0.0..=2.0).contains(b)), "{}", c.name);
        assert!(b.contains(&2.0), "{}: no β = 2", c.name);
        worst = worst.max(check_against_reference(&c, &x)?);
    }
    println!("β in [0, 2]: worst relative RMS error {worst:.2e}");
    Ok(())
}

#[test]
fn empty_sequences_match_reference() -> Result<()> {
    let mut worst = 0.0f64;
    for c in empty_sequence_cases() {
        let x = inputs(&c, DType::F32)?;
        worst = worst.max(check_against_reference(&c, &x)?);
        // An empty sequence passes its initial state through, and its final-state cotangent
        // back, exactly.
        let cu = c.cu.as_deref().expect("packed");
        let f = x.cast(DType::F32)?;
        let op = run_op(&c, &x, DType::F32)?;
        let dh0_op = op
            .grads
            .iter()
            .find(|(n, _)| *n == "dh0")
            .map(|g| g.1.clone());
        let mut runs = vec![("op".to_string(), op.ht, dh0_op)];
        for r in RANKS {
            let out = run_cp(&c, &x, r)?;
            let dh0 = out.grads.and_then(|g| g.dh0);
            runs.push((format!("cp={r}"), out.final_state.expect("ht"), dh0));
        }
        let empty: Vec<usize> = (0..cu.len() - 1).filter(|&i| cu[i] == cu[i + 1]).collect();
        assert!(empty.len() >= 3, "{}", c.name);
        for (path, ht, dh0) in runs {
            for &i in &empty {
                let ht_i = values(&ht.narrow(0, i, 1)?)?;
                let want = match &f.h0 {
                    Some(h0) => values(&h0.narrow(0, i, 1)?)?,
                    None => vec![0.0; ht_i.len()],
                };
                assert_eq!(
                    ht_i, want,
                    "{} {path}: final state of empty sequence {i}",
                    c.name
                );
                if let Some(dh0) = &dh0 {
                    let got = values(&dh0.narrow(0, i, 1)?)?;
                    let want = values(&f.dht.narrow(0, i, 1)?)?;
                    assert_eq!(got, want, "{} {path}: dh0 of empty sequence {i}", c.name);
                }
            }
        }
    }
    println!("empty sequences: worst relative RMS error {worst:.2e}");
    Ok(())
}

#[test]
fn minus_infinity_gates_reset_the_state_exactly() -> Result<()> {
    // exp(-inf) = 0: the one non-finite input value that leaves everything finite, as in the
    // reference (its gate gradient is exactly 0 there).
    let mut worst = 0.0f64;
    let floors = deep_gate_cases(DType::F32, -1e4)?;
    for ((c, x), (_, x_floor)) in deep_gate_cases(DType::F32, f64::NEG_INFINITY)?
        .into_iter()
        .zip(floors)
    {
        let g = values(&x.g)?;
        assert!(g.contains(&f64::NEG_INFINITY), "{}", c.name);
        worst = worst.max(check_against_reference(&c, &x)?);
        // Bit for bit what a gate of -1e4 gives (the op takes -inf as -1e4: both underflow to
        // a factor of exactly 0), except the gradient of the -inf gates themselves: exactly 0,
        // as in the reference, where -1e4 leaves rounding residues of the chunk's other terms.
        let (a, b) = (
            run_op(&c, &x, DType::F32)?,
            run_op(&c, &x_floor, DType::F32)?,
        );
        for ((name, a), (_, b)) in named(a).iter().zip(&named(b)) {
            let (a, mut b) = (values(a)?, values(b)?);
            if *name == "dg" {
                for (bi, gi) in b.iter_mut().zip(&g) {
                    if *gi == f64::NEG_INFINITY {
                        *bi = 0.0;
                    }
                }
            }
            assert_eq!(a, b, "{}: {name}, -inf against -1e4", c.name);
        }
    }
    println!("gates down to -inf: worst relative RMS error {worst:.2e}");
    Ok(())
}

/// Where a non-finite value goes: one element of `arg`, in (sequence `seq`, head `head`), at
/// token `token` and sub-step row `row` of that sequence (both 0 for the initial state).
#[derive(Debug, Clone)]
struct Site {
    arg: &'static str,
    index: Vec<usize>,
    seq: usize,
    head: usize,
    token: usize,
    row: usize,
}

impl Site {
    /// The element of `arg` at global token `t` of batch row `b`, sub-step `j` (k, v, beta),
    /// head `h`; for `h0`, of the sequence holding that token.
    fn new(c: &Case, arg: &'static str, b: usize, t: usize, j: usize, h: usize) -> Self {
        let (seq, start) = match &c.cu {
            None => (b, 0),
            Some(cu) => {
                let s = (0..cu.len() - 1)
                    .find(|&s| cu[s] <= t && t < cu[s + 1])
                    .expect("token inside a sequence");
                (s, cu[s])
            }
        };
        let (n, tl) = (c.n, t - start);
        let (e, ev) = (1 % c.k, 3 % c.v);
        let (index, row) = match arg {
            "q" => (vec![b, t, h, e], tl * n + n - 1),
            "k" => (vec![b, t * n + j, h, e], tl * n + j),
            "v" => (vec![b, t * n + j, h, ev], tl * n + j),
            "beta" => (vec![b, t * n + j, h], tl * n + j),
            "g" => (vec![b, t, h], tl * n),
            "h0" => return Self::initial_state(seq, h),
            _ => unreachable!("{arg}"),
        };
        Self {
            arg,
            index,
            seq,
            head: h,
            token: tl,
            row,
        }
    }

    /// One element of the initial state of sequence `seq`, head `h`.
    fn initial_state(seq: usize, h: usize) -> Self {
        Self {
            arg: "h0",
            index: vec![seq, h, 1, 3],
            seq,
            head: h,
            token: 0,
            row: 0,
        }
    }

    /// `x` with the element set to `value`.
    fn apply(&self, x: &Inputs, value: f64) -> Result<Inputs> {
        let set = |t: &Tensor| -> Result<Tensor> {
            let dims = t.dims().to_vec();
            let mut data = values(t)?;
            let off = self
                .index
                .iter()
                .zip(&dims)
                .fold(0, |off, (i, d)| off * d + i);
            data[off] = value;
            Ok(Tensor::from_vec(data, dims, &Device::Cpu)?)
        };
        let mut x = x.clone();
        match self.arg {
            "q" => x.q = set(&x.q)?,
            "k" => x.k = set(&x.k)?,
            "v" => x.v = set(&x.v)?,
            "beta" => x.beta = set(&x.beta)?,
            "g" => x.g = set(&x.g)?,
            _ => x.h0 = Some(set(x.h0.as_ref().expect("an initial state"))?),
        }
        Ok(x)
    }
}

/// (sequence, head, token within the sequence) of element `i` of output or gradient `name`
/// (`dims` its shape); no token for the states `[N, H, K, V]`.
fn locate(c: &Case, name: &str, dims: &[usize], i: usize) -> (usize, usize, Option<usize>) {
    if matches!(name, "ht" | "dh0") {
        let per_head = dims[2] * dims[3];
        return (i / (dims[1] * per_head), (i / per_head) % dims[1], None);
    }
    let inner: usize = dims[3..].iter().product();
    let (rows, heads) = (dims[1], dims[2]);
    let b = i / (rows * heads * inner);
    let h = (i / inner) % heads;
    let t = (i / (heads * inner)) % rows / (rows / c.t);
    match &c.cu {
        None => (b, h, Some(t)),
        Some(cu) => {
            let s = (0..cu.len() - 1)
                .find(|&s| cu[s] <= t && t < cu[s + 1])
                .expect("token inside a sequence");
            (s, h, Some(t - cu[s]))
        }
    }
}

/// Outputs and gradients of a context-parallel run, named as [`named`] names them.
fn cp_named(out: CpOutput) -> Vec<(&'static str, Tensor)> {
    let g = out.grads.expect("gradients");
    let mut v = vec![
        ("o", out.o),
        ("ht", out.final_state.expect("final state")),
        ("dq", g.dq),
        ("dk", g.dk),
        ("dv", g.dv),
        ("dg", g.dg),
        ("dbeta", g.dbeta),
    ];
    v.extend(g.dh0.map(|d| ("dh0", d)));
    v
}

/// Checks one run with a non-finite value at `site` against the run `clean` of the same path
/// without it and the f64 reference `refr` with it: what `gated_delta_product` documents.
fn check_non_finite(
    c: &Case,
    path: &str,
    site: &Site,
    got: &[(&str, Tensor)],
    clean: &[(&str, Tensor)],
    refr: &[(&str, Tensor)],
) -> Result<()> {
    let ctx = format!("{} {path}: {} at {:?}", c.name, site.arg, site.index);
    let names = |l: &[(&str, Tensor)]| l.iter().map(|p| p.0.to_string()).collect::<Vec<_>>();
    assert_eq!(names(got), names(clean), "{ctx}");
    assert_eq!(names(got), names(refr), "{ctx}");
    // Non-finite outputs of the affected (sequence, head), by token; whether its state is.
    let mut bad_tokens = vec![false; c.t];
    let mut bad_state = false;
    for (((name, a), (_, b)), (_, r)) in got.iter().zip(clean).zip(refr) {
        let dims = a.dims().to_vec();
        let (a, b, r) = (values(a)?, values(b)?, values(r)?);
        for (i, ((&x, &y), &z)) in a.iter().zip(&b).zip(&r).enumerate() {
            let (seq, head, token) = locate(c, name, &dims, i);
            if (seq, head) != (site.seq, site.head) {
                assert_eq!(
                    x.to_bits(),
                    y.to_bits(),
                    "{ctx}: {name}[{i}] changed elsewhere"
                );
                continue;
            }
            // Whatever the reference makes non-finite is non-finite here too.
            assert!(
                z.is_finite() || !x.is_finite(),
                "{ctx}: {name}[{i}] = {x}, f64 {z}"
            );
            let unaffected = match (*name, token) {
                ("o", Some(t)) if site.arg == "q" => t != site.token,
                // Tokens whose last sub-step lies a whole chunk before the value's.
                ("o", Some(t)) => (t + 1) * c.n + CHUNK - 1 <= site.row,
                ("ht", _) => site.arg == "q",
                _ => false,
            };
            if unaffected {
                assert_eq!(x.to_bits(), y.to_bits(), "{ctx}: {name}[{i}] changed");
            }
            match (*name, token) {
                ("o", Some(t)) => bad_tokens[t] |= !x.is_finite(),
                ("ht", _) => bad_state |= !x.is_finite(),
                _ => {}
            }
        }
    }
    // The affected outputs: the value's token (q) or every token from it on, and the state.
    let len = match &c.cu {
        Some(cu) => cu[site.seq + 1] - cu[site.seq],
        None => c.t,
    };
    for (t, &bad) in bad_tokens.iter().enumerate().take(len) {
        let affected = if site.arg == "q" {
            t == site.token
        } else {
            t >= site.token
        };
        assert!(bad || !affected, "{ctx}: o at token {t} is finite");
    }
    assert_eq!(bad_state, site.arg != "q", "{ctx}: non-finite final state");
    Ok(())
}

/// Where a non-finite value goes: (batch row, token, sub-step, head).
type Place = (usize, usize, usize, usize);

#[test]
fn non_finite_inputs_stay_in_their_sequence_and_head() -> Result<()> {
    let packed = Case::new("non-finite packed n2 T240", 1, 240, 2, 16, 12, 2)
        .packed(&[0, 40, 150, 150, 240])
        .h0()
        .seed(53);
    let dense = Case::new("non-finite dense n3 T100", 2, 100, 2, 8, 12, 3)
        .h0()
        .seed(54);
    // Inside a sequence that spans shard boundaries, at the start of the first sequence, at
    // the end of one followed by an empty one, at the end.
    let places: [(&Case, &[Place]); 2] = [
        (
            &packed,
            &[(0, 100, 1, 1), (0, 0, 0, 0), (0, 149, 1, 0), (0, 239, 0, 1)],
        ),
        (&dense, &[(1, 50, 1, 0), (0, 99, 2, 1), (0, 0, 0, 1)]),
    ];
    let mut runs = 0;
    for (c, at) in places {
        let x = inputs(c, DType::F32)?;
        let mut clean = vec![("op".to_string(), named(run_op(c, &x, DType::F32)?))];
        for r in RANKS {
            clean.push((format!("cp={r}"), cp_named(run_cp(c, &x, r)?)));
        }
        let mut sites = vec![];
        for &(b, t, j, h) in at {
            for arg in ["q", "k", "v", "g", "beta", "h0"] {
                sites.push(Site::new(c, arg, b, t, j, h));
            }
        }
        if c.cu.is_some() {
            sites.push(Site::initial_state(2, 1)); // the empty sequence's
        }
        for site in &sites {
            // A gate of -inf is an exact reset (`minus_infinity_gates_reset_the_state_exactly`).
            let vals: &[f64] = if site.arg == "g" {
                &[f64::NAN, f64::INFINITY]
            } else {
                &[f64::NAN, f64::INFINITY, f64::NEG_INFINITY]
            };
            for &val in vals {
                let xp = site.apply(&x, val)?;
                let refr = named(run_reference(c, &xp)?);
                for (path, clean) in &clean {
                    let got = match path.strip_prefix("cp=") {
                        None => named(run_op(c, &xp, DType::F32)?),
                        Some(r) => cp_named(run_cp(c, &xp, r.parse()?)?),
                    };
                    check_non_finite(c, &format!("{path} {val}"), site, &got, clean, &refr)?;
                    runs += 1;
                }
            }
        }
    }
    println!("non-finite inputs: {runs} runs, each confined to its (sequence, head)");
    Ok(())
}

/// Tokens `[start, start + len)` of every per-token and per-sub-step input and of `dout`.
fn window(x: &Inputs, n: usize, start: usize, len: usize) -> Result<[Tensor; 6]> {
    Ok([
        x.q.narrow(1, start, len)?,
        x.k.narrow(1, start * n, len * n)?,
        x.v.narrow(1, start * n, len * n)?,
        x.g.narrow(1, start, len)?,
        x.beta.narrow(1, start * n, len * n)?,
        x.dout.narrow(1, start, len)?,
    ])
}

/// One sequence of 2^20 tokens (B = H = 1, K = V = 16, n = 2, gates in [-5, 0] with a fifth
/// exactly 0, β in (0, 2), an initial state), forward and backward on the CPU: everything
/// finite, and against the f64 reference the first and last `W` outputs, the whole output, the
/// final state and every gradient. The reference runs in segments of 2^16 tokens: forward, each
/// from the state the previous one ended in; then the adjoint backwards, each segment from its
/// f64 start state and the state gradient the following one handed back, so its memory stays
/// that of one segment.
#[test]
#[ignore = "2^20 tokens: about 30 s and 5 GB in release on 2 cores"]
fn million_tokens_cpu() -> Result<()> {
    use candle_gdp::op::naive::{gated_delta_product_naive, gated_delta_product_naive_backward};
    use std::time::Instant;
    const T: usize = 1 << 20;
    const SEG: usize = 1 << 16;
    const W: usize = 512;
    let n = 2;
    let mut c = Case::new("1M tokens K16 V16 n2 h0", 1, T, 1, 16, 16, n)
        .h0()
        .seed(2026);
    c.gate_max = 5.0;
    let t0 = Instant::now();
    let x = inputs(&c, DType::F32)?;
    println!("inputs: {:.1?}", t0.elapsed());

    let t0 = Instant::now();
    let f = x.cast(DType::F32)?;
    let opts = GdpOptions {
        initial_state: f.h0.as_ref(),
        ..Default::default()
    };
    let (o, _) = candle_gdp::gated_delta_product(&f.q, &f.k, &f.v, &f.g, &f.beta, &opts)?;
    let fwd_time = t0.elapsed();
    let t0 = Instant::now();
    let got = run_op(&c, &x, DType::F32)?;
    let op_time = t0.elapsed();
    assert_eq!(
        values(&o)?,
        values(&got.o)?,
        "forward alone and under autograd"
    );
    for (name, t) in entries(&got) {
        assert!(finite(t)?, "{name} is not finite");
    }
    println!(
        "op over {T} tokens: forward {fwd_time:.1?}; forward + backward {op_time:.1?}; finite"
    );

    let t0 = Instant::now();
    let h0 = x.h0.clone().expect("initial state");
    let mut starts = vec![h0];
    let mut o_parts = vec![];
    for s in 0..T / SEG {
        let [q, k, v, g, beta, _] = window(&x, n, s * SEG, SEG)?;
        let opts = GdpOptions {
            initial_state: starts.last(),
            output_final_state: true,
            ..Default::default()
        };
        let (o, ht) = gated_delta_product_naive(&q, &k, &v, &g, &beta, &opts)?;
        o_parts.push(o);
        starts.push(ht);
    }
    let ht_ref = starts.pop().expect("final state");
    let mut ds = x.dht.clone();
    let mut parts = vec![];
    for s in (0..T / SEG).rev() {
        let [q, k, v, g, beta, dout] = window(&x, n, s * SEG, SEG)?;
        let opts = GdpOptions {
            initial_state: Some(&starts[s]),
            ..Default::default()
        };
        let gr =
            gated_delta_product_naive_backward(&q, &k, &v, &g, &beta, &opts, &dout, Some(&ds))?;
        ds = gr.dh0.clone();
        parts.push(gr);
    }
    parts.reverse();
    let cat = |f: &dyn Fn(&candle_gdp::op::naive::NaiveGrads) -> Tensor| -> Result<Tensor> {
        let ts: Vec<Tensor> = parts.iter().map(f).collect();
        Ok(Tensor::cat(&ts, 1)?)
    };
    let want = Results {
        o: Tensor::cat(&o_parts, 1)?,
        ht: ht_ref,
        grads: vec![
            ("dq", cat(&|g| g.dq.clone())?),
            ("dk", cat(&|g| g.dk.clone())?),
            ("dv", cat(&|g| g.dv.clone())?),
            ("dg", cat(&|g| g.dg.clone())?),
            ("dbeta", cat(&|g| g.dbeta.clone())?),
            ("dh0", ds),
        ],
    };
    println!("f64 reference in segments: {:.1?}", t0.elapsed());

    let first = rel_rms(&got.o.narrow(1, 0, W)?, &want.o.narrow(1, 0, W)?)?;
    let last = rel_rms(&got.o.narrow(1, T - W, W)?, &want.o.narrow(1, T - W, W)?)?;
    println!("o, first {W} tokens: {first:.2e}; last {W} tokens: {last:.2e}");
    assert!(
        first <= 1e-5 && last <= 1e-5,
        "windows: {first:.2e}, {last:.2e}"
    );
    let worst = assert_close(&c, &got, &want, 1e-5)?;
    println!("{T} tokens: worst relative RMS error {worst:.2e}");
    Ok(())
}
