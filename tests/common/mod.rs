//! Shared test helpers: seeded random GDP inputs, the relative-RMS metric, and running the op
//! under autograd.
#![allow(dead_code)]

use anyhow::{Context as _, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_gdp::cp::CpOutput;
use candle_gdp::op::naive::{gated_delta_product_naive, gated_delta_product_naive_backward};
use candle_gdp::op::KernelConfig;
use candle_gdp::{gated_delta_product, ContextParallel, Cotangents, GdpOptions, SaveIntermediates};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One test configuration.
#[derive(Debug, Clone)]
pub struct Case {
    pub name: &'static str,
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub k: usize,
    pub v: usize,
    pub n: usize,
    pub h0: bool,
    /// Heads of `q` and `k` where they are fewer than `h` (grouped value heads).
    pub key_heads: Option<usize>,
    pub cu: Option<Vec<usize>>,
    /// Gates are `-U(0, gate_max)`, a fifth of them exactly 0.
    pub gate_max: f64,
    pub seed: u64,
}

impl Case {
    pub fn new(
        name: &'static str,
        b: usize,
        t: usize,
        h: usize,
        k: usize,
        v: usize,
        n: usize,
    ) -> Self {
        Self {
            name,
            b,
            t,
            h,
            k,
            v,
            n,
            h0: false,
            key_heads: None,
            cu: None,
            gate_max: 1.0,
            seed: 7,
        }
    }
    pub fn h0(mut self) -> Self {
        self.h0 = true;
        self
    }
    /// `q` and `k` with `hk` heads, `h / hk` value heads reading each.
    pub fn key_heads(mut self, hk: usize) -> Self {
        self.key_heads = Some(hk);
        self
    }
    /// Heads of `q` and `k`.
    pub fn hk(&self) -> usize {
        self.key_heads.unwrap_or(self.h)
    }
    pub fn packed(mut self, cu: &[usize]) -> Self {
        self.cu = Some(cu.to_vec());
        self
    }
    pub fn strong_gates(mut self) -> Self {
        self.gate_max = 20.0;
        self
    }
    pub fn seed(mut self, s: u64) -> Self {
        self.seed = s;
        self
    }
    pub fn num_seqs(&self) -> usize {
        self.cu.as_ref().map_or(self.b, |c| c.len() - 1)
    }
}

/// Inputs of a case, in f64, with the cotangents of `o` and the final state.
#[derive(Clone)]
pub struct Inputs {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub g: Tensor,
    pub beta: Tensor,
    pub h0: Option<Tensor>,
    pub dout: Tensor,
    pub dht: Tensor,
}

impl Inputs {
    /// The same inputs with a zero final-state cotangent.
    pub fn without_dht(&self) -> candle_core::Result<Inputs> {
        Ok(Inputs {
            dht: self.dht.zeros_like()?,
            ..self.clone()
        })
    }

    /// The inputs as the op takes them in `dtype`: q, k, v, beta in `dtype`; the gates, the
    /// initial state and the cotangents in f32.
    pub fn cast(&self, dtype: DType) -> candle_core::Result<Inputs> {
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        Ok(Inputs {
            q: self.q.to_dtype(dtype)?,
            k: self.k.to_dtype(dtype)?,
            v: self.v.to_dtype(dtype)?,
            g: f32(&self.g)?,
            beta: self.beta.to_dtype(dtype)?,
            h0: self.h0.as_ref().map(f32).transpose()?,
            dout: f32(&self.dout)?,
            dht: f32(&self.dht)?,
        })
    }
}

fn normal(rng: &mut StdRng) -> f64 {
    // Box–Muller
    let u1: f64 = rng.random::<f64>().max(1e-300);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

fn randn(rng: &mut StdRng, shape: &[usize], scale: f64) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let data: Vec<f64> = (0..n).map(|_| normal(rng) * scale).collect();
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

/// Rows along the last axis scaled to unit L2 norm.
fn unit_rows(rng: &mut StdRng, shape: &[usize]) -> Result<Tensor> {
    let x = randn(rng, shape, 1.0)?;
    let norm = x.sqr()?.sum_keepdim(candle_core::D::Minus1)?.sqrt()?;
    Ok(x.broadcast_div(&norm)?)
}

/// Fresh random inputs, rounded through `dtype` (so that the f64 reference sees exactly what
/// the op sees).
pub fn inputs(c: &Case, dtype: DType) -> Result<Inputs> {
    let mut rng = StdRng::seed_from_u64(c.seed);
    let tn = c.t * c.n;
    let round = |x: Tensor| -> Result<Tensor> { Ok(x.to_dtype(dtype)?.to_dtype(DType::F64)?) };
    let q = round(unit_rows(&mut rng, &[c.b, c.t, c.hk(), c.k])?)?;
    let k = round(unit_rows(&mut rng, &[c.b, tn, c.hk(), c.k])?)?;
    let v = round(randn(&mut rng, &[c.b, tn, c.h, c.v], 1.0)?)?;
    let beta: Vec<f64> = (0..c.b * tn * c.h)
        .map(|_| 2.0 / (1.0 + (-normal(&mut rng)).exp()))
        .collect();
    let beta = round(Tensor::from_vec(beta, (c.b, tn, c.h), &Device::Cpu)?)?;
    let g: Vec<f64> = (0..c.b * c.t * c.h)
        .map(|_| {
            if rng.random::<f64>() < 0.2 {
                0.0
            } else {
                -rng.random::<f64>() * c.gate_max
            }
        })
        .collect();
    let g = Tensor::from_vec(g, (c.b, c.t, c.h), &Device::Cpu)?
        .to_dtype(DType::F32)?
        .to_dtype(DType::F64)?;
    let ns = c.num_seqs();
    let h0 = if c.h0 {
        Some(round(randn(&mut rng, &[ns, c.h, c.k, c.v], 0.5)?)?)
    } else {
        None
    };
    let dout = randn(&mut rng, &[c.b, c.t, c.h, c.v], 1.0)?;
    let dht = randn(&mut rng, &[ns, c.h, c.k, c.v], 1.0)?;
    Ok(Inputs {
        q,
        k,
        v,
        g,
        beta,
        h0,
        dout,
        dht,
    })
}

/// `RMS(a − b) / RMS(b)` over all elements, in f64.
pub fn rel_rms(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_dtype(DType::F64)?.flatten_all()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?;
    let num = (&a - &b)?.sqr()?.mean_all()?.to_scalar::<f64>()?.sqrt();
    let den = b.sqr()?.mean_all()?.to_scalar::<f64>()?.sqrt();
    Ok(if den == 0.0 { num } else { num / den })
}

/// Outputs and gradients, named as in FLA.
pub struct Results {
    pub o: Tensor,
    pub ht: Tensor,
    pub grads: Vec<(&'static str, Tensor)>,
}

/// Runs the op in `dtype` under autograd on the CPU; loss `Σ do·o + Σ dht·S_T`.
pub fn run_op(c: &Case, x: &Inputs, dtype: DType) -> Result<Results> {
    run_op_on(c, x, dtype, &Device::Cpu)
}

/// The inputs as variables on `dev`: q, k, v, beta in `dtype`, g and h0 in f32.
struct OpVars {
    q: Var,
    k: Var,
    v: Var,
    g: Var,
    beta: Var,
    h0: Option<Var>,
    save_intermediates: SaveIntermediates,
    kernels: KernelConfig,
    /// Through [`candle_gdp::gated_delta_product_packed`] on `q`, `k` concatenated by Candle.
    packed: bool,
}

impl OpVars {
    fn new(x: &Inputs, dtype: DType, dev: &Device) -> Result<Self> {
        let var = |t: &Tensor, dt: DType| -> Result<Var> {
            Ok(Var::from_tensor(&t.to_dtype(dt)?.to_device(dev)?)?)
        };
        Ok(Self {
            q: var(&x.q, dtype)?,
            k: var(&x.k, dtype)?,
            v: var(&x.v, dtype)?,
            g: var(&x.g, DType::F32)?,
            beta: var(&x.beta, dtype)?,
            h0: x.h0.as_ref().map(|h| var(h, DType::F32)).transpose()?,
            save_intermediates: SaveIntermediates::Nothing,
            kernels: KernelConfig::default(),
            packed: false,
        })
    }

    fn forward(&self, c: &Case, final_state: bool) -> Result<(Tensor, Option<Tensor>)> {
        let opts = GdpOptions {
            initial_state: self.h0.as_ref().map(|v| v.as_tensor()),
            output_final_state: final_state,
            cu_seqlens: c.cu.as_deref(),
            save_intermediates: self.save_intermediates,
            kernels: self.kernels,
            ..Default::default()
        };
        if self.packed {
            let (b, t, h, dk) = self.q.dims4()?;
            let k = self.k.reshape((b, t, (self.k.dim(1)? / t), h, dk))?;
            let qk = Tensor::cat(&[&self.q.unsqueeze(2)?, &k], 2)?;
            return Ok(candle_gdp::gated_delta_product_packed(
                &qk, &self.v, &self.g, &self.beta, &opts,
            )?);
        }
        Ok(gated_delta_product(
            &self.q, &self.k, &self.v, &self.g, &self.beta, &opts,
        )?)
    }

    /// Every gradient (`dh0` when there is an initial state), checked for its input's shape,
    /// dtype and device, moved to the CPU.
    fn grads(
        &self,
        c: &Case,
        gs: &candle_core::backprop::GradStore,
        dev: &Device,
    ) -> Result<Vec<(&'static str, Tensor)>> {
        let mut vars = vec![
            ("dq", &self.q),
            ("dk", &self.k),
            ("dv", &self.v),
            ("dg", &self.g),
            ("dbeta", &self.beta),
        ];
        if let Some(h) = &self.h0 {
            vars.push(("dh0", h));
        }
        let mut grads = vec![];
        for (name, var) in vars {
            let gr = gs
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{}: no gradient for {name}", c.name));
            assert_eq!(gr.dims(), var.dims(), "{}: {name} shape", c.name);
            assert_eq!(gr.dtype(), var.dtype(), "{}: {name} dtype", c.name);
            assert!(gr.device().same_device(dev), "{}: {name} device", c.name);
            grads.push((name, gr.to_device(&Device::Cpu)?));
        }
        Ok(grads)
    }
}

/// Runs the op on `dev` with q, k, v, beta in `dtype` (g and h0 in f32) under autograd, with
/// the loss `Σ do·o + Σ dht·S_T` in f64. Checks that every gradient has its input's shape,
/// dtype and device, and returns outputs and gradients (`dh0` when the case has an initial
/// state) moved to the CPU.
pub fn run_op_on(c: &Case, x: &Inputs, dtype: DType, dev: &Device) -> Result<Results> {
    run_vars(c, x, OpVars::new(x, dtype, dev)?, dev)
}

/// [`run_op_on`] (or with `plain`, [`run_op_plain_on`]) with
/// [`GdpOptions::save_intermediates`] set to `what`.
pub fn run_op_saving_on(
    c: &Case,
    x: &Inputs,
    dtype: DType,
    dev: &Device,
    plain: bool,
    what: SaveIntermediates,
) -> Result<Results> {
    run_op_configured_on(c, x, dtype, dev, plain, what, KernelConfig::default())
}

/// [`run_op_saving_on`] with the CUDA kernel choices `kernels`.
pub fn run_op_configured_on(
    c: &Case,
    x: &Inputs,
    dtype: DType,
    dev: &Device,
    plain: bool,
    what: SaveIntermediates,
    kernels: KernelConfig,
) -> Result<Results> {
    let mut vars = OpVars::new(x, dtype, dev)?;
    vars.save_intermediates = what;
    vars.kernels = kernels;
    if plain {
        run_vars_plain(c, x, vars, dtype, dev)
    } else {
        run_vars(c, x, vars, dev)
    }
}

/// [`run_op_on`] through the packed-layout entry point, `qk` concatenated from `q` and `k` by
/// Candle (so their gradients come through Candle's own `cat` backward).
pub fn run_op_packed_on(c: &Case, x: &Inputs, dtype: DType, dev: &Device) -> Result<Results> {
    let mut vars = OpVars::new(x, dtype, dev)?;
    vars.packed = true;
    run_vars(c, x, vars, dev)
}

fn run_vars(c: &Case, x: &Inputs, vars: OpVars, dev: &Device) -> Result<Results> {
    let (o, ht) = vars.forward(c, true)?;
    let ht = ht.expect("final state requested");
    let (dout, dht) = (x.dout.to_device(dev)?, x.dht.to_device(dev)?);
    let loss = ((o.to_dtype(DType::F64)? * dout)?.sum_all()?
        + (ht.to_dtype(DType::F64)? * dht)?.sum_all()?)?;
    let grads = vars.grads(c, &loss.backward()?, dev)?;
    let cpu = Device::Cpu;
    Ok(Results {
        o: o.to_device(&cpu)?,
        ht: ht.to_device(&cpu)?,
        grads,
    })
}

/// As [`run_op_on`] without the final state (`output_final_state: false`: the op's output is
/// `o` alone, in `dtype`), backpropagating `do` with [`candle_gdp::backward_with`]; `ht` comes
/// from a second forward with the final state. Compare with the reference of
/// [`Inputs::without_dht`].
pub fn run_op_plain_on(c: &Case, x: &Inputs, dtype: DType, dev: &Device) -> Result<Results> {
    run_vars_plain(c, x, OpVars::new(x, dtype, dev)?, dtype, dev)
}

fn run_vars_plain(
    c: &Case,
    x: &Inputs,
    vars: OpVars,
    dtype: DType,
    dev: &Device,
) -> Result<Results> {
    let (o, none) = vars.forward(c, false)?;
    assert!(none.is_none(), "{}: a final state nobody asked for", c.name);
    assert_eq!(o.dtype(), dtype, "{}: o dtype", c.name);
    let dout = x.dout.to_device(dev)?;
    let grads = vars.grads(c, &candle_gdp::backward_with(&[(&o, &dout)])?, dev)?;
    let ht = vars.forward(c, true)?.1.expect("final state requested");
    let cpu = Device::Cpu;
    Ok(Results {
        o: o.to_device(&cpu)?,
        ht: ht.to_device(&cpu)?,
        grads,
    })
}

/// The op through [`candle_gdp::gated_delta_product_vjp`] on `dev` (q, k, v, beta in `dtype`,
/// g and h0 in f32), with `final_state` the cotangent `dht` too; otherwise `ht` comes from a
/// second call and the reference is that of [`Inputs::without_dht`]. Checks every gradient's
/// shape, dtype and device, and returns outputs and gradients on the CPU.
pub fn run_op_vjp_on(
    c: &Case,
    x: &Inputs,
    dtype: DType,
    dev: &Device,
    final_state: bool,
    save_intermediates: SaveIntermediates,
) -> Result<Results> {
    let put = |t: &Tensor, dt: DType| -> Result<Tensor> { Ok(t.to_dtype(dt)?.to_device(dev)?) };
    let (q, k, v) = (put(&x.q, dtype)?, put(&x.k, dtype)?, put(&x.v, dtype)?);
    let (g, beta) = (put(&x.g, DType::F32)?, put(&x.beta, dtype)?);
    let h0 = x.h0.as_ref().map(|h| put(h, DType::F32)).transpose()?;
    let opts = |final_state: bool| GdpOptions {
        initial_state: h0.as_ref(),
        output_final_state: final_state,
        cu_seqlens: c.cu.as_deref(),
        save_intermediates,
        ..Default::default()
    };
    let vjp = candle_gdp::gated_delta_product_vjp(&q, &k, &v, &g, &beta, &opts(final_state))?;
    assert_eq!(vjp.o.dtype(), dtype, "{}: o dtype", c.name);
    let (o, ht) = match &vjp.final_state {
        Some(ht) => (vjp.o.clone(), ht.clone()),
        None => {
            let again = candle_gdp::gated_delta_product_vjp(&q, &k, &v, &g, &beta, &opts(true))?;
            (
                vjp.o.clone(),
                again.final_state.expect("final state requested"),
            )
        }
    };
    let dht = x.dht.to_device(dev)?;
    let dht = final_state.then_some(&dht);
    let gr = vjp.backward(&x.dout.to_device(dev)?, dht)?;
    let mut grads = vec![
        ("dq", gr.dq, &q),
        ("dk", gr.dk, &k),
        ("dv", gr.dv, &v),
        ("dg", gr.dg, &g),
        ("dbeta", gr.dbeta, &beta),
    ];
    match (gr.dh0, &h0) {
        (Some(d), Some(h)) => grads.push(("dh0", d, h)),
        (None, None) => {}
        _ => panic!("{}: dh0 without an initial state or the reverse", c.name),
    }
    let mut out = vec![];
    for (name, gr, input) in grads {
        assert_eq!(gr.dims(), input.dims(), "{}: {name} shape", c.name);
        assert_eq!(gr.dtype(), input.dtype(), "{}: {name} dtype", c.name);
        assert!(gr.device().same_device(dev), "{}: {name} device", c.name);
        out.push((name, gr.to_device(&Device::Cpu)?));
    }
    let cpu = Device::Cpu;
    Ok(Results {
        o: o.to_device(&cpu)?,
        ht: ht.to_device(&cpu)?,
        grads: out,
    })
}

/// The f64 reference for the same case.
pub fn run_reference(c: &Case, x: &Inputs) -> Result<Results> {
    let opts = GdpOptions {
        initial_state: x.h0.as_ref(),
        output_final_state: true,
        cu_seqlens: c.cu.as_deref(),
        ..Default::default()
    };
    let (o, ht) = gated_delta_product_naive(&x.q, &x.k, &x.v, &x.g, &x.beta, &opts)?;
    let gr = gated_delta_product_naive_backward(
        &x.q,
        &x.k,
        &x.v,
        &x.g,
        &x.beta,
        &opts,
        &x.dout,
        Some(&x.dht),
    )?;
    let mut grads = vec![
        ("dq", gr.dq),
        ("dk", gr.dk),
        ("dv", gr.dv),
        ("dg", gr.dg),
        ("dbeta", gr.dbeta),
    ];
    if x.h0.is_some() {
        grads.push(("dh0", gr.dh0));
    }
    Ok(Results { o, ht, grads })
}

/// Asserts every output and gradient of `got` within `tol` relative RMS of `want`; returns the
/// worst error.
pub fn assert_close(c: &Case, got: &Results, want: &Results, tol: f64) -> Result<f64> {
    let mut worst = 0.0f64;
    let mut report = vec![];
    let mut check = |name: &str, a: &Tensor, b: &Tensor| -> Result<()> {
        let e = rel_rms(a, b)?;
        assert!(e.is_finite(), "{}: {name} is not finite", c.name);
        report.push(format!("{name} {e:.1e}"));
        assert!(
            e <= tol,
            "{}: {name} relative RMS error {e:.2e} > {tol:.0e}",
            c.name
        );
        worst = worst.max(e);
        Ok(())
    };
    check("o", &got.o, &want.o)?;
    check("ht", &got.ht, &want.ht)?;
    assert_same_grads(&got.grads, &want.grads);
    for ((name, a), (_, b)) in got.grads.iter().zip(&want.grads) {
        check(name, a, b)?;
    }
    println!("{:<28} {}", c.name, report.join("  "));
    Ok(worst)
}

/// Asserts that two gradient lists hold the same names in the same order, so that a `zip` over
/// them compares like with like and cannot silently drop a missing or extra gradient.
pub fn assert_same_grads<A: AsRef<str>, B: AsRef<str>>(a: &[(A, Tensor)], b: &[(B, Tensor)]) {
    let names_a: Vec<&str> = a.iter().map(|(n, _)| n.as_ref()).collect();
    let names_b: Vec<&str> = b.iter().map(|(n, _)| n.as_ref()).collect();
    assert_eq!(names_a, names_b, "gradient lists differ in length or names");
}

/// Decode-step arguments `[state, q, k, v, g, beta]` on `dev`: a normal f32 state
/// `[B, H, K, V]`, unit queries and keys, normal values, gates in (-2, 0), betas in (0, 2).
pub fn step_inputs(
    b: usize,
    h: usize,
    k: usize,
    v: usize,
    n: usize,
    dev: &Device,
) -> Result<[Tensor; 6]> {
    let unit = |t: Tensor| -> Result<Tensor> {
        let norm = t.sqr()?.sum_keepdim(candle_core::D::Minus1)?.sqrt()?;
        Ok(t.broadcast_div(&norm)?)
    };
    let r = |s: &[usize]| Tensor::randn(0f32, 1f32, s, dev);
    let u = |s: &[usize]| Tensor::rand(0f32, 1f32, s, dev);
    Ok([
        r(&[b, h, k, v])?,
        unit(r(&[b, h, k])?)?,
        unit(r(&[b, n, h, k])?)?,
        r(&[b, n, h, v])?,
        (u(&[b, h])? * -2.0)?,
        (u(&[b, n, h])? * 2.0)?,
    ])
}

/// Median wall time of `f` in ms over `iters` calls, each followed by a device synchronisation,
/// after `warm` calls.
pub fn median_ms(
    dev: &Device,
    warm: usize,
    iters: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..warm {
        f()?;
    }
    dev.synchronize()?;
    let mut ts = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t0 = std::time::Instant::now();
        f()?;
        dev.synchronize()?;
        ts.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    ts.sort_by(|a, b| a.total_cmp(b));
    Ok(ts[ts.len() / 2])
}

/// A context-parallel run's outputs and gradients paired by name with the single-device
/// `want`'s: `o`, `ht`, then `dq dk dv dg dbeta` and `dh0` exactly where `want` has it. An error
/// where the run lacks a final state or gradients, or where the two disagree on `dh0`.
#[allow(dead_code)]
pub fn cp_pairs(got: CpOutput, want: &Results) -> Result<Vec<(&'static str, Tensor, Tensor)>> {
    let grads = got.grads.context("the CP run returned no gradients")?;
    let ht = got
        .final_state
        .context("the CP run returned no final state")?;
    let mut got_grads = vec![
        ("dq", grads.dq),
        ("dk", grads.dk),
        ("dv", grads.dv),
        ("dg", grads.dg),
        ("dbeta", grads.dbeta),
    ];
    if let Some(dh0) = grads.dh0 {
        got_grads.push(("dh0", dh0));
    }
    assert_same_grads(&got_grads, &want.grads);
    let mut pairs = vec![("o", got.o, want.o.clone()), ("ht", ht, want.ht.clone())];
    for ((name, a), (_, b)) in got_grads.into_iter().zip(&want.grads) {
        pairs.push((name, a, b.clone()));
    }
    Ok(pairs)
}

/// Context parallelism on CPU ranks (`ranks` group sizes) against the single-device op: the
/// outputs, final states and every gradient within 1e-5 (f32).
#[allow(dead_code)]
pub fn cp_check_cpu(c: &Case, ranks: &[usize]) -> Result<()> {
    let x = inputs(c, DType::F32)?;
    let want = run_op(c, &x, DType::F32)?;
    let Inputs {
        q,
        k,
        v,
        g,
        beta,
        h0,
        dout,
        dht,
    } = x.cast(DType::F32)?;
    for &r in ranks {
        let opts = GdpOptions {
            initial_state: h0.as_ref(),
            output_final_state: true,
            cu_seqlens: c.cu.as_deref(),
            ..Default::default()
        };
        let cp = ContextParallel::cpu(r)?;
        let got = cp.gated_delta_product(
            &q,
            &k,
            &v,
            &g,
            &beta,
            &opts,
            Some(Cotangents {
                dout: &dout,
                dht: Some(&dht),
            }),
        )?;
        let mut report = vec![];
        for (name, a, b) in cp_pairs(got, &want)? {
            assert_eq!(a.dims(), b.dims(), "{} cp={r}: {name} shape", c.name);
            let e = rel_rms(&a, &b)?;
            report.push(format!("{name} {e:.0e}"));
            assert!(e <= 1e-5, "{} cp={r}: {name} relative RMS {e:.2e}", c.name);
        }
        println!("{:<26} cp={r} {}", c.name, report.join(" "));
    }
    Ok(())
}

/// `t [A, B, C]` with every element `x` at `(a, b, c)` replaced by `f(a, b, c, x)`, rounded
/// through `dtype`, in f64 on the CPU.
fn map3(t: &Tensor, dtype: DType, f: impl Fn(usize, usize, usize, f64) -> f64) -> Result<Tensor> {
    let (na, nb, nc) = t.dims3()?;
    let data = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
    let out: Vec<f64> = data
        .iter()
        .enumerate()
        .map(|(i, &x)| f(i / (nb * nc), (i / nc) % nb, i % nc, x))
        .collect();
    let out = Tensor::from_vec(out, (na, nb, nc), &Device::Cpu)?;
    Ok(out.to_dtype(dtype)?.to_dtype(DType::F64)?)
}

/// `x` with the gate `g[b, t, h]` replaced by `f(b, t, h, g)` (rounded through f32, as the op
/// takes the gates).
pub fn map_gates(x: &Inputs, f: impl Fn(usize, usize, usize, f64) -> f64) -> Result<Inputs> {
    Ok(Inputs {
        g: map3(&x.g, DType::F32, f)?,
        ..x.clone()
    })
}

/// `x` with `beta[b, row, h]` (row `t·n + j`) replaced by `f(b, row, h, beta)`, rounded through
/// `dtype`.
pub fn map_betas(
    x: &Inputs,
    dtype: DType,
    f: impl Fn(usize, usize, usize, f64) -> f64,
) -> Result<Inputs> {
    Ok(Inputs {
        beta: map3(&x.beta, dtype, f)?,
        ..x.clone()
    })
}

/// Log gates far below f32's exponent range: `exp(g)` is subnormal in f32 (flushed to zero by
/// the CPU kernels) from about -87.3, zero in f32 from about -103.3 and zero in f64 too from
/// about -745.
pub const DEEP_GATES: [f64; 6] = [-20.0, -87.0, -88.0, -104.0, -1e3, -1e4];

/// Cases whose gates reach down to `floor` (-1e4, or -inf: the same exact reset), mixed with
/// ordinary ones (issue 43): `floor` on whole chunks of rows, on the first token of a sequence
/// with an initial state, right before a sequence start and on the last token, and
/// [`DEEP_GATES`] scattered among the rest. Inputs rounded through `dtype`.
pub fn deep_gate_cases(dtype: DType, floor: f64) -> Result<Vec<(Case, Inputs)>> {
    let deep = |i: usize| DEEP_GATES[i % DEEP_GATES.len()];
    let mut out = vec![];
    // Dense: tokens 30..=110 are rows 60..=221 (n = 2), whole chunks 64..128 and 128..192.
    let c = Case::new("deep gates dense n2 T203", 2, 203, 2, 16, 24, 2)
        .h0()
        .seed(43);
    let x = map_gates(&inputs(&c, dtype)?, |b, t, h, g| match (b, t, h) {
        (0, 0, _) | (_, 30..=110, _) | (1, 202, _) => floor,
        // Head 1 of row 1 forgets at almost every token.
        (1, _, 1) if t % 5 != 0 => floor,
        _ if t % 7 == 3 => deep(t / 7 + h + b),
        _ => g,
    })?;
    out.push((c, x));
    // Packed, n = 3: sequence 0 ends on 44 tokens at the floor (rows 60..192: two whole chunks),
    // sequence 1 (one token) starts right after them, sequence 2 starts at the floor, has a
    // whole chunk of it (tokens 100..=140) and ends on it, sequence 3 starts right after.
    let c = Case::new("deep gates packed n3 T250", 1, 250, 2, 20, 12, 3)
        .packed(&[0, 64, 65, 150, 250])
        .h0()
        .seed(44);
    let x = map_gates(&inputs(&c, dtype)?, |_, t, h, g| match t {
        20..=63 | 65 | 100..=149 => floor,
        150.. if t % 5 == 0 => floor,
        _ if (t + h) % 4 == 1 => deep(t + h),
        _ => g,
    })?;
    out.push((c, x));
    // n = 1, K ≠ V: the state holds almost nothing but the current token's update.
    let c = Case::new("deep gates n1 T150 mostly floor", 1, 150, 1, 24, 16, 1)
        .h0()
        .seed(45);
    let x = map_gates(&inputs(&c, dtype)?, |_, t, _, g| match t % 9 {
        0 => g,
        4 => deep(t),
        _ => floor,
    })?;
    out.push((c, x));
    Ok(out)
}

/// Cases with `β` at the ends of `[0, 2]` (issue 43): exactly 0 (no update) and exactly 2
/// (`I − 2 k kᵀ`, a reflection: eigenvalue −1 for unit keys) on whole chunks, on every sub-step
/// of some tokens and interleaved with ordinary values; one case with `β = 2` everywhere, one
/// with reflections alone (`g = 0`). Inputs rounded through `dtype`.
///
/// Reflections that nothing forgets are the hardest case for the chunked f32 kernels: their
/// error grows with the length (3e-6 at T = 100 in the case below) and passes 1e-5 on longer
/// sequences, first in the gate gradient; the case is kept at the length where it holds.
pub fn edge_beta_cases(dtype: DType) -> Result<Vec<(Case, Inputs)>> {
    let mut out = vec![];
    let c = Case::new("beta edges dense n2 T190", 2, 190, 2, 16, 12, 2)
        .h0()
        .seed(46);
    let x = map_betas(&inputs(&c, dtype)?, dtype, |b, row, _, beta| {
        match (b, row) {
            (0, 64..=127) => 2.0,
            (0, 128..=191) | (1, 20..=39) => 0.0,
            _ if row % 3 == 0 => 0.0,
            _ if row % 3 == 1 => 2.0,
            _ => beta,
        }
    })?;
    out.push((c, x));
    let c = Case::new("beta 0 or 2 packed n3 T170", 1, 170, 1, 12, 20, 3)
        .packed(&[0, 50, 50, 170])
        .h0()
        .seed(47);
    let x = map_betas(&inputs(&c, dtype)?, dtype, |_, row, _, _| {
        // Rows 214..278 are local rows 64..128 of sequence 2: one whole chunk.
        if (214..278).contains(&row) || (row * 7919) % 5 < 2 {
            2.0
        } else {
            0.0
        }
    })?;
    out.push((c, x));
    let c = Case::new("beta 2 everywhere n1 T130", 1, 130, 2, 24, 16, 1).seed(48);
    let x = map_betas(&inputs(&c, dtype)?, dtype, |_, _, _, _| 2.0)?;
    out.push((c, x));
    let c = Case::new("reflections only n2 T100", 1, 100, 1, 16, 16, 2)
        .h0()
        .seed(49);
    let x = map_betas(&inputs(&c, dtype)?, dtype, |_, _, _, _| 2.0)?;
    let x = map_gates(&x, |_, _, _, _| 0.0)?;
    out.push((c, x));
    Ok(out)
}

/// Packed cases with zero-length sequences (repeated offsets) at the start, in the middle and at
/// the end, placed on the shard boundaries of 2, 3 and 4 context-parallel ranks (shards of
/// `T / ranks` tokens, the first `T % ranks` one longer).
pub fn empty_sequence_cases() -> Vec<Case> {
    vec![
        // T = 240: boundaries 120 (2 ranks), 80 and 160 (3), 60, 120 and 180 (4).
        Case::new("empty seqs n2 T240", 1, 240, 2, 12, 20, 2)
            .packed(&[
                0, 0, 0, 37, 60, 60, 80, 120, 120, 160, 160, 179, 180, 180, 240, 240, 240,
            ])
            .h0()
            .seed(50),
        // T = 131: boundaries 66 (2 ranks), 44 and 88 (3), 33, 66 and 99 (4).
        Case::new("empty seqs n3 T131", 1, 131, 1, 16, 8, 3)
            .packed(&[0, 0, 33, 33, 44, 44, 44, 66, 88, 88, 99, 99, 131, 131])
            .h0()
            .seed(51),
        // One real sequence among empty ones, no initial state.
        Case::new("empty seqs n1 T100 no h0", 1, 100, 2, 8, 12, 1)
            .packed(&[0, 0, 0, 100, 100])
            .seed(52),
    ]
}
