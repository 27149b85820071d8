//! The decode step `gated_delta_product_step`, iterated token by token, against the chunked op:
//! outputs, final states and gradients; prefill-then-decode; bad shapes.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_gdp::op::naive::gated_delta_product_naive;
use candle_gdp::op::recurrent::{gated_delta_product_step, gated_delta_product_step_fused};
use candle_gdp::{gated_delta_product, GdpOptions};
use common::{inputs, rel_rms, run_op, step_inputs, Case, Inputs};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The per-token inputs of the FLA layout: `q [B, T, H, K]`, `k [B, T·n, H, K]`,
/// `v [B, T·n, H, V]`, `g [B, T, H]`, `beta [B, T·n, H]`.
struct Seq {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
}

impl Seq {
    /// The inputs of `x` cast to `dtype` (`g` to f32, as the layer computes it).
    fn of(x: &Inputs, dtype: DType) -> Result<Self> {
        Ok(Self {
            q: x.q.to_dtype(dtype)?,
            k: x.k.to_dtype(dtype)?,
            v: x.v.to_dtype(dtype)?,
            g: x.g.to_dtype(DType::F32)?,
            beta: x.beta.to_dtype(dtype)?,
        })
    }

    fn tokens(&self) -> usize {
        self.q.dim(1).unwrap()
    }

    /// Tokens `[start, start + len)`.
    fn slice(&self, n: usize, start: usize, len: usize) -> Result<Self> {
        Ok(Self {
            q: self.q.narrow(1, start, len)?,
            k: self.k.narrow(1, start * n, len * n)?,
            v: self.v.narrow(1, start * n, len * n)?,
            g: self.g.narrow(1, start, len)?,
            beta: self.beta.narrow(1, start * n, len * n)?,
        })
    }

    /// The chunked op from `h0`; returns `o` and the final state.
    fn op(&self, h0: Option<&Tensor>, scale: Option<f64>) -> Result<(Tensor, Tensor)> {
        let opts = GdpOptions {
            scale,
            initial_state: h0,
            output_final_state: true,
            ..Default::default()
        };
        let (o, ht) = gated_delta_product(&self.q, &self.k, &self.v, &self.g, &self.beta, &opts)?;
        Ok((o, ht.expect("final state requested")))
    }

    /// The decode step iterated over every token from `state`; returns `o [B, T, H, V]` and the
    /// final state.
    fn steps(&self, n: usize, state: &Tensor, scale: Option<f64>) -> Result<(Tensor, Tensor)> {
        let mut s = state.clone();
        let mut outs = vec![];
        for t in 0..self.tokens() {
            // Contiguous per-token tensors, as a decoder produces them (strided ones are
            // covered by `step_accepts_strided_inputs`).
            let (o, s_next) = gated_delta_product_step(
                &s,
                &self.q.narrow(1, t, 1)?.squeeze(1)?.contiguous()?,
                &self.k.narrow(1, t * n, n)?.contiguous()?,
                &self.v.narrow(1, t * n, n)?.contiguous()?,
                &self.g.narrow(1, t, 1)?.squeeze(1)?.contiguous()?,
                &self.beta.narrow(1, t * n, n)?.contiguous()?,
                scale,
            )?;
            assert_eq!(s_next.dtype(), DType::F32, "state dtype");
            assert_eq!(o.dtype(), self.q.dtype(), "o dtype");
            outs.push(o.unsqueeze(1)?);
            s = s_next;
        }
        Ok((Tensor::cat(&outs, 1)?, s))
    }
}

fn zero_state(c: &Case) -> Result<Tensor> {
    Ok(Tensor::zeros(
        (c.b, c.h, c.k, c.v),
        DType::F32,
        &Device::Cpu,
    )?)
}

fn initial_state(c: &Case, x: &Inputs) -> Result<Tensor> {
    match &x.h0 {
        Some(h0) => Ok(h0.to_dtype(DType::F32)?),
        None => zero_state(c),
    }
}

/// Steps vs op vs the f64 reference, in `dtype`, within `tol` relative RMS.
fn steps_match_op(c: &Case, dtype: DType, scale: Option<f64>, tol: f64) -> Result<()> {
    let x = inputs(c, dtype)?;
    let s = Seq::of(&x, dtype)?;
    let h0 = initial_state(c, &x)?;
    let (o_step, s_step) = s.steps(c.n, &h0, scale)?;
    let (o_op, s_op) = s.op(x.h0.is_some().then_some(&h0), scale)?;
    let opts = GdpOptions {
        scale,
        initial_state: x.h0.as_ref(),
        ..Default::default()
    };
    let (o_ref, s_ref) = gated_delta_product_naive(&x.q, &x.k, &x.v, &x.g, &x.beta, &opts)?;
    assert_eq!(o_step.dims(), o_op.dims());
    assert_eq!(o_step.dtype(), dtype);
    let errs = [
        ("o step vs op", rel_rms(&o_step, &o_op)?),
        ("state step vs op", rel_rms(&s_step, &s_op)?),
        ("o step vs f64", rel_rms(&o_step, &o_ref)?),
        ("state step vs f64", rel_rms(&s_step, &s_ref)?),
    ];
    println!(
        "{:<30} {dtype:?}: {}",
        c.name,
        errs.iter()
            .map(|(n, e)| format!("{n} {e:.1e}"))
            .collect::<Vec<_>>()
            .join("  ")
    );
    for (name, e) in errs {
        assert!(
            e <= tol,
            "{} {dtype:?}: {name} rel RMS {e:.2e} > {tol:e}",
            c.name
        );
    }
    Ok(())
}

/// B = 2 cases (plus one B = 1, H = 2). With n >= 2 and B = 2 they use one head; B >= 2,
/// H >= 2 and n >= 2 together are covered by `multi_head_multi_substep`.
fn cases() -> Vec<Case> {
    vec![
        Case::new("n1 B2 T70 H2 K8 V6 h0", 2, 70, 2, 8, 6, 1).h0(),
        Case::new("n2 B2 T45 H1 K8 V12", 2, 45, 1, 8, 12, 2).seed(3),
        Case::new("n3 B2 T40 H1 K12 V8 h0", 2, 40, 1, 12, 8, 3)
            .h0()
            .seed(5),
        Case::new("n2 B2 T30 H1 K6 V6 strong h0", 2, 30, 1, 6, 6, 2)
            .strong_gates()
            .h0()
            .seed(8),
        Case::new("n3 B1 T50 H2 K6 V6 h0", 1, 50, 2, 6, 6, 3)
            .h0()
            .seed(9),
    ]
}

/// The same checks with B = 2, H = 2 and n = 2, 3.
fn multi_head_cases() -> Vec<Case> {
    vec![
        Case::new("n2 B2 T45 H2 K8 V12", 2, 45, 2, 8, 12, 2).seed(3),
        Case::new("n3 B2 T40 H2 K12 V8 h0", 2, 40, 2, 12, 8, 3)
            .h0()
            .seed(5),
    ]
}

#[test]
fn steps_equal_chunked_op_f32() -> Result<()> {
    for c in cases() {
        steps_match_op(&c, DType::F32, None, 1e-5)?;
    }
    Ok(())
}

#[test]
fn steps_equal_chunked_op_with_custom_scale() -> Result<()> {
    let c = Case::new("n2 B2 T20 H1 K8 V4 h0 scale 1.3", 2, 20, 1, 8, 4, 2)
        .h0()
        .seed(4);
    steps_match_op(&c, DType::F32, Some(1.3), 1e-5)
}

#[test]
fn steps_equal_chunked_op_bf16() -> Result<()> {
    for c in cases() {
        steps_match_op(&c, DType::BF16, None, 1e-2)?;
    }
    Ok(())
}

#[test]
fn steps_equal_chunked_op_f16() -> Result<()> {
    for c in cases().into_iter().step_by(2) {
        steps_match_op(&c, DType::F16, None, 1e-2)?;
    }
    Ok(())
}

/// A chunked prefill of the first tokens returning its state, then decode steps, equals one
/// chunked run over the whole sequence.
#[test]
fn prefill_then_steps_equals_full_op() -> Result<()> {
    for (c, prefill) in [
        (
            Case::new("prefill n2 T100", 2, 100, 1, 8, 6, 2)
                .h0()
                .seed(31),
            67,
        ),
        (Case::new("prefill n3 T50", 2, 50, 1, 6, 10, 3).seed(32), 22),
        (
            Case::new("prefill n1 T80", 2, 80, 2, 8, 8, 1).h0().seed(33),
            64,
        ),
    ] {
        let x = inputs(&c, DType::F32)?;
        let s = Seq::of(&x, DType::F32)?;
        let h0 = initial_state(&c, &x)?;
        let h0_opt = x.h0.is_some().then_some(&h0);
        let (o_full, s_full) = s.op(h0_opt, None)?;
        let (o_pre, s_pre) = s.slice(c.n, 0, prefill)?.op(h0_opt, None)?;
        let (o_dec, s_dec) = s
            .slice(c.n, prefill, c.t - prefill)?
            .steps(c.n, &s_pre, None)?;
        let eo = rel_rms(&Tensor::cat(&[&o_pre, &o_dec], 1)?, &o_full)?;
        let ed = rel_rms(&o_dec, &o_full.narrow(1, prefill, c.t - prefill)?)?;
        let es = rel_rms(&s_dec, &s_full)?;
        println!(
            "{:<18} prefill {prefill}: o {eo:.1e}, decoded o {ed:.1e}, state {es:.1e}",
            c.name
        );
        assert!(
            eo <= 1e-5 && ed <= 1e-5 && es <= 1e-5,
            "{}: o {eo:.2e} decoded {ed:.2e} state {es:.2e}",
            c.name
        );
    }
    Ok(())
}

/// Gradients of `L = Σ do·o + Σ dht·S` through the iterated steps, w.r.t. the same variables as
/// the op's (the step inputs are views of them), against the op's gradients.
fn step_grads_match_op(c: &Case) -> Result<()> {
    assert!(c.h0, "the state gradient needs an initial state");
    let x = inputs(c, DType::F32)?;
    let want = run_op(c, &x, DType::F32)?;
    let var = |t: &Tensor| -> Result<Var> { Ok(Var::from_tensor(&t.to_dtype(DType::F32)?)?) };
    let vars = [
        var(&x.q)?,
        var(&x.k)?,
        var(&x.v)?,
        var(&x.g)?,
        var(&x.beta)?,
    ];
    let h0 = var(x.h0.as_ref().expect("h0"))?;
    let s = Seq {
        q: vars[0].as_tensor().clone(),
        k: vars[1].as_tensor().clone(),
        v: vars[2].as_tensor().clone(),
        g: vars[3].as_tensor().clone(),
        beta: vars[4].as_tensor().clone(),
    };
    let (o, st) = s.steps(c.n, h0.as_tensor(), None)?;
    let e_o = rel_rms(&o, &want.o)?;
    assert!(e_o <= 1e-5, "{}: o {e_o:.2e}", c.name);
    let loss = ((o.to_dtype(DType::F64)? * &x.dout)?.sum_all()?
        + (st.to_dtype(DType::F64)? * &x.dht)?.sum_all()?)?;
    let gs = loss.backward()?;
    let mut report = vec![];
    let names: Vec<&str> = want.grads.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names,
        ["dq", "dk", "dv", "dg", "dbeta", "dh0"],
        "{}",
        c.name
    );
    assert_eq!(vars.len() + 1, want.grads.len(), "q, k, v, g, beta, h0");
    let all = vars.iter().chain(std::iter::once(&h0));
    for (v, (name, g_op)) in all.zip(&want.grads) {
        let g = gs
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("{}: no gradient for {name}", c.name));
        assert_eq!(g.dims(), g_op.dims(), "{name} shape");
        let e = rel_rms(g, g_op)?;
        report.push(format!("{name} {e:.1e}"));
        assert!(e <= 1e-5, "{}: step {name} vs op rel RMS {e:.2e}", c.name);
    }
    assert_eq!(report.len(), 6, "dq, dk, dv, dg, dbeta, dh0");
    println!("{:<24} step grads vs op: {}", c.name, report.join("  "));
    Ok(())
}

#[test]
fn step_gradients_match_op_one_token() -> Result<()> {
    for n in 1..=3 {
        // Two heads for n = 1, one for n >= 2 (see `multi_head_multi_substep`).
        let h = if n == 1 { 2 } else { 1 };
        let c = Case::new("grad 1 token", 2, 1, h, 6, 5, n)
            .h0()
            .seed(40 + n as u64);
        step_grads_match_op(&c)?;
    }
    Ok(())
}

#[test]
fn step_gradients_match_op_several_tokens() -> Result<()> {
    step_grads_match_op(&Case::new("grad T9 n1", 2, 9, 2, 6, 5, 1).h0().seed(50))?;
    step_grads_match_op(&Case::new("grad T9 n2", 2, 9, 1, 6, 5, 2).h0().seed(50))?;
    step_grads_match_op(
        &Case::new("grad T5 n3 strong", 1, 5, 2, 4, 7, 3)
            .h0()
            .strong_gates()
            .seed(51),
    )
}

/// A state passed in another float dtype is cast; the result equals the f32 state's.
#[test]
fn step_accepts_other_state_dtypes() -> Result<()> {
    let c = Case::new("state dtype", 2, 1, 1, 4, 4, 2).h0();
    let x = inputs(&c, DType::BF16)?;
    let s = Seq::of(&x, DType::F32)?;
    let h0 = x.h0.as_ref().unwrap().to_dtype(DType::BF16)?;
    let (o32, s32) = s.steps(c.n, &h0.to_dtype(DType::F32)?, None)?;
    let (o16, s16) = s.steps(c.n, &h0, None)?;
    assert_eq!(rel_rms(&o16, &o32)?, 0.0);
    assert_eq!(rel_rms(&s16, &s32)?, 0.0);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Bad input

const B: usize = 2;
const H: usize = 2;
const K: usize = 3;
const V: usize = 4;
const N: usize = 2;

fn randn(shape: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1f32, shape, &Device::Cpu).unwrap()
}

/// Valid step arguments `[state, q, k, v, g, beta]`.
fn step_args() -> [Tensor; 6] {
    [
        randn(&[B, H, K, V]),
        randn(&[B, H, K]),
        randn(&[B, N, H, K]),
        randn(&[B, N, H, V]),
        randn(&[B, H]).neg().unwrap(),
        randn(&[B, N, H]).abs().unwrap(),
    ]
}

fn step_with(i: usize, t: Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let mut a = step_args();
    a[i] = t;
    gated_delta_product_step(&a[0], &a[1], &a[2], &a[3], &a[4], &a[5], None)
}

/// `None` when `f` returned an error naming `name` in backticks; a description otherwise.
fn check(
    label: &str,
    name: &str,
    f: impl FnOnce() -> candle_core::Result<(Tensor, Tensor)>,
) -> Option<String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Err(_) => Some(format!("{label}: PANICKED")),
        Ok(Ok(_)) => Some(format!(
            "{label}: returned Ok, expected an error naming `{name}`"
        )),
        Ok(Err(e)) => {
            let s = e.to_string();
            (!s.contains(&format!("`{name}`")))
                .then(|| format!("{label}: error does not name `{name}`: {s}"))
        }
    }
}

fn assert_all(failures: Vec<Option<String>>) {
    let bad: Vec<String> = failures.into_iter().flatten().collect();
    assert!(
        bad.is_empty(),
        "{} case(s) failed:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

fn run_step(b: usize, h: usize, n: usize) -> candle_core::Result<(Tensor, Tensor)> {
    gated_delta_product_step(
        &randn(&[b, h, K, V]),
        &randn(&[b, h, K]),
        &randn(&[b, n, h, K]),
        &randn(&[b, n, h, V]),
        &randn(&[b, h]).neg()?,
        &randn(&[b, n, h]).abs()?,
        None,
    )
}

#[test]
fn valid_step_runs() -> Result<()> {
    for (b, h, n) in [(2, 2, 1), (2, 1, 2), (1, 2, 3), (2, 1, 3)] {
        let (o, s) = run_step(b, h, n)?;
        assert_eq!(o.dims(), &[b, h, V]);
        assert_eq!(s.dims(), &[b, h, K, V]);
    }
    Ok(())
}

/// Contiguous inputs with B = 2, H = 2, n = 2 run. Sub-step `j` of `k` and `v` is a strided
/// `[B, H, K]` view (batch stride n·H·K, head stride K) that src/op/recurrent.rs makes
/// contiguous before its batched `matmul`, which cannot flatten strided (B, H) batch
/// dimensions (`MatMulUnexpectedStriding`, as an earlier version failed).
#[test]
fn valid_step_runs_with_two_batches_two_heads_two_substeps() -> Result<()> {
    let (o, s) = run_step(B, H, N)?;
    assert_eq!(o.dims(), &[B, H, V]);
    assert_eq!(s.dims(), &[B, H, K, V]);
    Ok(())
}

/// Everything checked above, for B = 2, H = 2 and n = 2, 3.
#[test]
fn multi_head_multi_substep() -> Result<()> {
    for c in multi_head_cases() {
        steps_match_op(&c, DType::F32, None, 1e-5)?;
        steps_match_op(&c, DType::BF16, None, 1e-2)?;
    }
    for n in 2..=3 {
        step_grads_match_op(&Case::new("grad 1 token H2", 2, 1, 2, 6, 5, n).h0().seed(60))?;
    }
    step_grads_match_op(&Case::new("grad T7 n2 H2", 2, 7, 2, 6, 5, 2).h0().seed(61))
}

/// Strided (non-contiguous) step inputs, e.g. `q[:, t]` of a `[B, T, H, K]` tensor, are valid
/// Candle tensors, and the step gives exactly what it gives on contiguous copies (it makes its
/// `matmul` operands contiguous; an earlier version failed with `MatMulUnexpectedStriding`).
#[test]
fn step_accepts_strided_inputs() -> Result<()> {
    let c = Case::new("strided q n1", 2, 6, 2, 4, 3, 1).h0();
    let x = inputs(&c, DType::F32)?;
    let s = Seq::of(&x, DType::F32)?;
    let h0 = initial_state(&c, &x)?;
    let (o_ref, s_ref) = s.steps(c.n, &h0, None)?;
    let mut st = h0.clone();
    let mut outs = vec![];
    for t in 0..c.t {
        let (o, s_next) = gated_delta_product_step(
            &st,
            &s.q.narrow(1, t, 1)?.squeeze(1)?,
            &s.k.narrow(1, t, 1)?,
            &s.v.narrow(1, t, 1)?,
            &s.g.narrow(1, t, 1)?.squeeze(1)?,
            &s.beta.narrow(1, t, 1)?,
            None,
        )?;
        outs.push(o.unsqueeze(1)?);
        st = s_next;
    }
    assert_eq!(rel_rms(&Tensor::cat(&outs, 1)?, &o_ref)?, 0.0);
    assert_eq!(rel_rms(&st, &s_ref)?, 0.0);
    Ok(())
}

#[test]
fn step_bad_shapes_name_the_tensor() {
    assert_all(vec![
        check("state rank 3", "state", || {
            step_with(0, randn(&[B * H, K, V]))
        }),
        check("state rank 5", "state", || {
            step_with(0, randn(&[B, 1, H, K, V]))
        }),
        check("state K differs from q", "q", || {
            step_with(0, randn(&[B, H, K + 1, V]))
        }),
        check("state V differs from v", "v", || {
            step_with(0, randn(&[B, H, K, V + 1]))
        }),
        check("state batch differs", "q", || {
            step_with(0, randn(&[B + 1, H, K, V]))
        }),
        check("q rank 2", "q", || step_with(1, randn(&[B, H * K]))),
        check("q in op layout [B, 1, H, K]", "q", || {
            step_with(1, randn(&[B, 1, H, K]))
        }),
        check("q dim", "q", || step_with(1, randn(&[B, H, K + 1]))),
        check("q heads", "q", || step_with(1, randn(&[B, H + 1, K]))),
        check("k rank 3 (no n axis)", "k", || {
            step_with(2, randn(&[B, H, K]))
        }),
        check("k rank 5", "k", || step_with(2, randn(&[B, 1, N, H, K]))),
        check("k n = 0", "k", || step_with(2, randn(&[B, 0, H, K]))),
        check("k heads", "k", || step_with(2, randn(&[B, N, H + 1, K]))),
        check("k dim", "k", || step_with(2, randn(&[B, N, H, K + 1]))),
        check("k batch", "k", || step_with(2, randn(&[B + 1, N, H, K]))),
        check("v rank 3", "v", || step_with(3, randn(&[B, H, V]))),
        check("v n + 1 sub-steps", "v", || {
            step_with(3, randn(&[B, N + 1, H, V]))
        }),
        check("v dim", "v", || step_with(3, randn(&[B, N, H, V + 1]))),
        check("g [B, 1, H]", "g", || step_with(4, randn(&[B, 1, H]))),
        check("g [B]", "g", || step_with(4, randn(&[B]))),
        check("g heads", "g", || step_with(4, randn(&[B, H + 1]))),
        check("beta [B, H]", "beta", || step_with(5, randn(&[B, H]))),
        check("beta n + 1", "beta", || step_with(5, randn(&[B, N + 1, H]))),
        check("beta rank 4", "beta", || step_with(5, randn(&[B, N, H, 1]))),
    ]);
}

/// Zero-sized dimensions must not panic (an error or an empty result are both acceptable).
#[test]
fn step_zero_sized_dimensions_do_not_panic() {
    for (b, h, k, v) in [(B, H, 0, V), (B, H, K, 0), (0, H, K, V), (B, 0, K, V)] {
        let r = catch_unwind(AssertUnwindSafe(|| {
            gated_delta_product_step(
                &randn(&[b, h, k, v]),
                &randn(&[b, h, k]),
                &randn(&[b, N, h, k]),
                &randn(&[b, N, h, v]),
                &randn(&[b, h]),
                &randn(&[b, N, h]),
                None,
            )
            .map(|_| ())
        }));
        assert!(r.is_ok(), "state [{b}, {h}, {k}, {v}]: panicked");
    }
}

/// The fused step with K = 0 or V = 0 (an empty state) gives zeros of `[B, H, V]` and an empty
/// new state, as the unfused step's algebra does; with B = 0 or H = 0, empty outputs. Never a
/// panic (it used to split the state into chunks of K·V = 0 elements). An explicit scale is
/// given, since the default `K^-0.5` is infinite at K = 0 (an error naming `scale`).
#[test]
fn fused_step_zero_sized_dimensions_give_empty_results() {
    for (b, h, k, v) in [(B, H, 0, V), (B, H, K, 0), (0, H, K, V), (B, 0, K, V)] {
        let args = [
            randn(&[b, h, k, v]),
            randn(&[b, h, k]),
            randn(&[b, N, h, k]),
            randn(&[b, N, h, v]),
            randn(&[b, h]),
            randn(&[b, N, h]),
        ];
        let [s, q, kk, vv, g, beta] = &args;
        let r = catch_unwind(AssertUnwindSafe(|| {
            gated_delta_product_step_fused(s, q, kk, vv, g, beta, Some(0.5))
        }));
        let (o, st) = r
            .unwrap_or_else(|_| panic!("state [{b}, {h}, {k}, {v}]: panicked"))
            .unwrap_or_else(|e| panic!("state [{b}, {h}, {k}, {v}]: {e}"));
        assert_eq!(o.dims(), [b, h, v], "o");
        assert_eq!(st.dims(), [b, h, k, v], "new state");
        let max = o
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(
            max.iter().all(|&x| x == 0.0),
            "state [{b}, {h}, {k}, {v}]: o {max:?}"
        );
        let msg = gated_delta_product_step_fused(s, q, kk, vv, g, beta, None);
        if k == 0 {
            let msg = msg.expect_err("K^-0.5 at K = 0").to_string();
            assert!(msg.contains("`scale`"), "{msg}");
        }
    }
}

/// The step validates as `gated_delta_product` does: integer inputs and a non-finite scale are
/// errors naming the argument (`q`, `g`, `scale`), not casts to f32 or NaN/inf outputs.
#[test]
fn step_rejects_integer_queries_and_non_finite_scale() {
    // n = 1: one sub-step (B = 2, H = 2, n >= 2 is covered above).
    let a = [
        randn(&[B, H, K, V]),
        randn(&[B, H, K]),
        randn(&[B, 1, H, K]),
        randn(&[B, 1, H, V]),
        randn(&[B, H]).neg().unwrap(),
        randn(&[B, 1, H]).abs().unwrap(),
    ];
    let step = |i: usize, t: Option<Tensor>, scale: Option<f64>| {
        let mut a = a.clone();
        if let Some(t) = t {
            a[i] = t;
        }
        gated_delta_product_step(&a[0], &a[1], &a[2], &a[3], &a[4], &a[5], scale)
    };
    assert!(step(0, None, None).is_ok(), "the valid baseline must run");
    let q_u32 = a[1].abs().unwrap().to_dtype(DType::U32).unwrap();
    let g_i64 = a[4].to_dtype(DType::I64).unwrap();
    assert_all(vec![
        check("q u32", "q", || step(1, Some(q_u32), None)),
        check("g i64", "g", || step(4, Some(g_i64), None)),
        check("scale NaN", "scale", || step(0, None, Some(f64::NAN))),
        check("scale inf", "scale", || step(0, None, Some(f64::INFINITY))),
    ]);
}

#[test]
fn fused_step_equals_the_step() -> Result<()> {
    use candle_gdp::op::recurrent::gated_delta_product_step_fused;
    for (b, h, k, v, n) in [
        (2, 3, 16, 24, 1),
        (1, 2, 32, 20, 2),
        (3, 1, 8, 8, 3),
        (2, 2, 48, 40, 2),
        // 2·4·64·130 state elements: past the CPU step's threshold for rayon's threads.
        (2, 4, 64, 130, 2),
    ] {
        for dtype in [DType::F32, DType::BF16] {
            let [s0, q, kk, vv, g, beta] = step_inputs(b, h, k, v, n, &Device::Cpu)?;
            let cast = |t: &Tensor| t.to_dtype(dtype);
            let (q, kk, vv, beta) = (cast(&q)?, cast(&kk)?, cast(&vv)?, cast(&beta)?);
            // Five chained steps each way.
            let (mut sa, mut sb) = (s0.clone(), s0);
            for _ in 0..5 {
                let (oa, na) = gated_delta_product_step(&sa, &q, &kk, &vv, &g, &beta, None)?;
                let (ob, nb) = gated_delta_product_step_fused(&sb, &q, &kk, &vv, &g, &beta, None)?;
                assert_eq!(ob.dtype(), dtype);
                assert_eq!(nb.dims(), na.dims());
                let (eo, es) = (rel_rms(&ob, &oa)?, rel_rms(&nb, &na)?);
                // Both in f32 from the same (rounded) inputs; o in bf16 is rounded at the end.
                let tol_o = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                assert!(
                    eo <= tol_o && es <= 1e-5,
                    "B{b} H{h} K{k} V{v} n{n} {dtype:?}: o {eo:.1e} S {es:.1e}"
                );
                (sa, sb) = (na, nb);
            }
        }
    }
    Ok(())
}
