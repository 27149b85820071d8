//! A long sequence (T = 65536, B = 1, H = 1, K = V = 16, n = 2) with realistic gates
//! (g ∈ [-5, 0], a fifth exactly 0), β ∈ (0, 2) and unit-norm keys: the forward and backward
//! stay finite and of sane magnitude, and prefixes / suffixes agree with the f64 reference.

mod common;

use anyhow::Result;
use candle_core::{DType, Tensor, Var};
use candle_gdp::op::naive::{gated_delta_product_naive, gated_delta_product_naive_backward};
use candle_gdp::{gated_delta_product, GdpOptions};
use common::{inputs, rel_rms, run_op, Case, Inputs, Results};
use std::sync::OnceLock;
use std::time::Instant;

const T: usize = 65536;
const N: usize = 2;
/// Tokens compared against the f64 reference at either end.
const W: usize = 512;

fn case() -> Case {
    let mut c = Case::new("long T65536 K16 V16 n2", 1, T, 1, 16, 16, N).seed(2024);
    c.gate_max = 5.0;
    c
}

/// The inputs, generated once and shared by the tests of this file.
fn long_inputs() -> (Case, &'static Inputs) {
    static X: OnceLock<Inputs> = OnceLock::new();
    let x = X.get_or_init(|| inputs(&case(), DType::F32).expect("inputs"));
    (case(), x)
}

/// The op's forward and backward (f32, loss `Σ do·o + Σ dht·S_T`), run once and shared.
fn long_op() -> &'static Results {
    static R: OnceLock<Results> = OnceLock::new();
    R.get_or_init(|| {
        let (c, x) = long_inputs();
        let t0 = Instant::now();
        let r = run_op(&c, x, DType::F32).expect("op");
        println!("T={T}: forward + backward {:.2?}", t0.elapsed());
        r
    })
}

fn all_finite(t: &Tensor) -> Result<bool> {
    let s = t
        .to_dtype(DType::F64)?
        .sqr()?
        .sum_all()?
        .to_scalar::<f64>()?;
    Ok(s.is_finite())
}

fn rms(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?
        .sqr()?
        .mean_all()?
        .to_scalar::<f64>()?
        .sqrt())
}

fn max_abs(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()?)
}

/// Tokens `[start, start + len)` of every per-token / per-sub-step input.
fn slice(x: &Inputs, start: usize, len: usize) -> Result<[Tensor; 5]> {
    Ok([
        x.q.narrow(1, start, len)?,
        x.k.narrow(1, start * N, len * N)?,
        x.v.narrow(1, start * N, len * N)?,
        x.g.narrow(1, start, len)?,
        x.beta.narrow(1, start * N, len * N)?,
    ])
}

#[test]
fn forward_and_backward_are_finite_and_sane() -> Result<()> {
    let (_, x) = long_inputs();
    let g_min = x.g.min_all()?.to_scalar::<f64>()?;
    let g_max = x.g.max_all()?.to_scalar::<f64>()?;
    assert!(
        (-5.0..-4.9).contains(&g_min) && g_max == 0.0,
        "gates in [{g_min}, {g_max}]"
    );
    let b_min = x.beta.min_all()?.to_scalar::<f64>()?;
    let b_max = x.beta.max_all()?.to_scalar::<f64>()?;
    assert!(b_min > 0.0 && b_max < 2.0, "beta in [{b_min}, {b_max}]");
    let r = long_op();
    assert_eq!(r.o.dims(), &[1, T, 1, 16]);
    assert!(
        all_finite(&r.o)? && all_finite(&r.ht)?,
        "forward not finite"
    );
    let (o_rms, o_max) = (rms(&r.o)?, max_abs(&r.o)?);
    // |o_t| <= scale·|S_t|·|q_t| with the state bounded by the values (the Householder factors
    // are non-expansive for β ∈ (0, 2)): O(1) values, not blown up, not collapsed.
    assert!((0.05..5.0).contains(&o_rms), "RMS(o) = {o_rms}");
    assert!(o_max < 50.0, "max |o| = {o_max}");
    assert!(max_abs(&r.ht)? < 50.0, "max |ht| = {}", max_abs(&r.ht)?);
    let mut report = vec![];
    for (name, gr) in &r.grads {
        assert!(all_finite(gr)?, "{name} not finite");
        let (m, s) = (max_abs(gr)?, rms(gr)?);
        assert!(m < 1e3 && s > 1e-4, "{name}: max |.| {m:e}, RMS {s:e}");
        report.push(format!("{name} rms {s:.2e}"));
    }
    println!(
        "T={T}: RMS(o) {o_rms:.3}, max |o| {o_max:.2}; {}",
        report.join(", ")
    );
    Ok(())
}

/// Causality: the outputs of the first `W` tokens of the full run equal the f64 reference run on
/// the `W`-token prefix alone.
#[test]
fn prefix_outputs_match_reference_on_prefix() -> Result<()> {
    let (_, x) = long_inputs();
    let (o, _) = gated_delta_product(&x.q, &x.k, &x.v, &x.g, &x.beta, &GdpOptions::default())?;
    let [q, k, v, g, beta] = slice(x, 0, W)?;
    let (o_ref, _) = gated_delta_product_naive(&q, &k, &v, &g, &beta, &GdpOptions::default())?;
    let e = rel_rms(&o.narrow(1, 0, W)?, &o_ref)?;
    println!("first {W} tokens vs f64 reference on the prefix: rel RMS {e:.2e}");
    assert!(e <= 1e-5, "prefix outputs: rel RMS {e:.2e}");
    Ok(())
}

/// The whole output and the final state against the f64 token loop over all 65536 tokens.
#[test]
fn full_sequence_matches_reference() -> Result<()> {
    let (_, x) = long_inputs();
    let opts = GdpOptions {
        output_final_state: true,
        ..Default::default()
    };
    let (o, ht) = gated_delta_product(&x.q, &x.k, &x.v, &x.g, &x.beta, &opts)?;
    let (o_ref, ht_ref) = gated_delta_product_naive(&x.q, &x.k, &x.v, &x.g, &x.beta, &opts)?;
    let eo = rel_rms(&o, &o_ref)?;
    let eh = rel_rms(&ht.expect("final state"), &ht_ref)?;
    let el = rel_rms(&o.narrow(1, T - W, W)?, &o_ref.narrow(1, T - W, W)?)?;
    println!("full sequence: o {eo:.2e}, ht {eh:.2e}, last {W} tokens {el:.2e}");
    assert!(eo <= 1e-5 && eh <= 1e-5 && el <= 1e-5);
    Ok(())
}

/// Gradients of the last `W` tokens: the f64 adjoint of the suffix, started from the f64 state
/// after the first `T - W` tokens, against the op's gradients from the full backward.
#[test]
fn suffix_gradients_match_reference() -> Result<()> {
    let (_, x) = long_inputs();
    let r = long_op();
    let [q, k, v, g, beta] = slice(x, 0, T - W)?;
    let (_, s_mid) = gated_delta_product_naive(&q, &k, &v, &g, &beta, &GdpOptions::default())?;
    let [q, k, v, g, beta] = slice(x, T - W, W)?;
    let opts = GdpOptions {
        initial_state: Some(&s_mid),
        output_final_state: true,
        ..Default::default()
    };
    let dout = x.dout.narrow(1, T - W, W)?;
    let gr = gated_delta_product_naive_backward(&q, &k, &v, &g, &beta, &opts, &dout, Some(&x.dht))?;
    let (_, ht_ref) = gated_delta_product_naive(&q, &k, &v, &g, &beta, &opts)?;
    let mut report = vec![format!("ht {:.1e}", rel_rms(&r.ht, &ht_ref)?)];
    assert!(rel_rms(&r.ht, &ht_ref)? <= 1e-5);
    let names: Vec<&str> = r.grads.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["dq", "dk", "dv", "dg", "dbeta"]);
    for ((name, got), want) in r.grads.iter().zip([gr.dq, gr.dk, gr.dv, gr.dg, gr.dbeta]) {
        let rows = if matches!(*name, "dq" | "dg") {
            W
        } else {
            W * N
        };
        let got = got.narrow(1, got.dim(1)? - rows, rows)?;
        let e = rel_rms(&got, &want)?;
        report.push(format!("{name} {e:.1e}"));
        assert!(e <= 1e-5, "suffix {name}: rel RMS {e:.2e}");
    }
    println!(
        "last {W} tokens' gradients vs f64 adjoint: {}",
        report.join("  ")
    );
    Ok(())
}

/// Causality of the backward: with a loss on the first `W` outputs only, the gradients of every
/// later token are exactly zero and the prefix gradients equal the f64 adjoint of the prefix.
#[test]
fn backward_is_causal() -> Result<()> {
    let (_, x) = long_inputs();
    let vars: Vec<Var> = [&x.q, &x.k, &x.v, &x.g, &x.beta]
        .iter()
        .map(|t| Var::from_tensor(&t.to_dtype(DType::F32)?))
        .collect::<candle_core::Result<_>>()?;
    let (o, _) = gated_delta_product(
        &vars[0],
        &vars[1],
        &vars[2],
        &vars[3],
        &vars[4],
        &GdpOptions::default(),
    )?;
    let dout = x.dout.narrow(1, 0, W)?;
    let loss = (o.narrow(1, 0, W)?.to_dtype(DType::F64)? * &dout)?.sum_all()?;
    let gs = loss.backward()?;
    let [q, k, v, g, beta] = slice(x, 0, W)?;
    let gr = gated_delta_product_naive_backward(
        &q,
        &k,
        &v,
        &g,
        &beta,
        &GdpOptions::default(),
        &dout,
        None,
    )?;
    let names = ["dq", "dk", "dv", "dg", "dbeta"];
    assert_eq!(vars.len(), names.len(), "q, k, v, g, beta");
    for ((name, var), want) in names
        .iter()
        .zip(&vars)
        .zip([gr.dq, gr.dk, gr.dv, gr.dg, gr.dbeta])
    {
        let got = gs.get(var.as_tensor()).expect("gradient present");
        let rows = want.dim(1)?;
        let e = rel_rms(&got.narrow(1, 0, rows)?, &want)?;
        assert!(e <= 1e-5, "prefix {name}: rel RMS {e:.2e}");
        let rest = max_abs(&got.narrow(1, rows, got.dim(1)? - rows)?)?;
        assert_eq!(
            rest, 0.0,
            "{name} of tokens after the loss window must be exactly 0"
        );
    }
    Ok(())
}

/// A run over the first half returning its state, continued over the second half from that
/// state, equals the single run (outputs and final state).
#[test]
fn split_run_matches_full_run() -> Result<()> {
    let (_, x) = long_inputs();
    let opts = GdpOptions {
        output_final_state: true,
        ..Default::default()
    };
    let (o, ht) = gated_delta_product(&x.q, &x.k, &x.v, &x.g, &x.beta, &opts)?;
    let half = T / 2 + 37; // not a multiple of the 64-row chunk
    let [q, k, v, g, beta] = slice(x, 0, half)?;
    let (o1, s1) = gated_delta_product(&q, &k, &v, &g, &beta, &opts)?;
    let s1 = s1.expect("final state");
    let [q, k, v, g, beta] = slice(x, half, T - half)?;
    let opts2 = GdpOptions {
        initial_state: Some(&s1),
        output_final_state: true,
        ..Default::default()
    };
    let (o2, s2) = gated_delta_product(&q, &k, &v, &g, &beta, &opts2)?;
    let eo = rel_rms(&Tensor::cat(&[&o1, &o2], 1)?, &o)?;
    let eh = rel_rms(&s2.expect("final state"), &ht.expect("final state"))?;
    println!("split at {half}: o {eo:.2e}, ht {eh:.2e}");
    assert!(
        eo <= 1e-5 && eh <= 1e-5,
        "split run: o {eo:.2e}, ht {eh:.2e}"
    );
    Ok(())
}
