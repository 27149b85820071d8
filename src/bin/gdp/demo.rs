//! `gdp demo`: a realistic random case (unit-norm q/k, `beta = 2·sigmoid(randn)`, strong
//! gates `g = -softplus(2·randn)`, an initial state), timed, plus two smaller cases (dense and
//! packed) checked against the f64 reference. No input file needed; deterministic.

use crate::error::CliError;
use crate::input::LoadedInput;
use crate::run::{bench, with_final_state, DTypeArg, DeviceArg, Prepared};
use candle_core::{DType, Device, Tensor};
use candle_gdp::op::naive::{gated_delta_product_naive, gated_delta_product_naive_backward};
use candle_gdp::GdpOptions;
use clap::Args;

/// Arguments of `gdp demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Compute dtype of q, k, v, beta, h0 (g stays f32).
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    pub dtype: DTypeArg,
    /// Device: cpu or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = DeviceArg::parse)]
    pub device: DeviceArg,
    /// Tokens T of the timed case (B=1, H=4, K=V=64, n=2); the checked cases use min(T, 512).
    #[arg(long, value_name = "T", default_value_t = 4096,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 24))]
    pub tokens: usize,
    /// Timed runs per measurement (after one warm-up); the median is shown.
    #[arg(long, value_name = "N", default_value_t = 3,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1000))]
    pub repeat: usize,
}

/// Largest accepted relative RMS error against the f64 reference, per compute dtype.
fn tolerance(dtype: DTypeArg) -> f64 {
    match dtype {
        DTypeArg::F32 => 1e-5,
        DTypeArg::Bf16 | DTypeArg::F16 => 1e-2,
    }
}

const HEADS: usize = 4;
const DIM: usize = 64;
const SUBSTEPS: usize = 2;
const CHECK_TOKENS: usize = 512;

/// SplitMix64 with Box–Muller normals: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    fn normals(&mut self, n: usize, f: impl Fn(f64) -> f64) -> Vec<f64> {
        (0..n).map(|_| f(self.normal())).collect()
    }

    /// Rows of length `d` with unit L2 norm.
    fn unit_rows(&mut self, rows: usize, d: usize) -> Vec<f64> {
        let mut x = self.normals(rows * d, |z| z);
        for row in x.chunks_mut(d) {
            let norm = row.iter().map(|a| a * a).sum::<f64>().sqrt();
            row.iter_mut().for_each(|a| *a /= norm);
        }
        x
    }
}

fn softplus(x: f64) -> f64 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// Random inputs with cotangents, in f64 on the CPU but already rounded through the dtypes the
/// op computes in, so that the reference sees exactly what the op sees.
fn random_case(
    t: usize,
    cu: Option<&[usize]>,
    dtype: DType,
    seed: u64,
) -> candle_core::Result<LoadedInput> {
    let mut rng = Rng(seed);
    let (h, d, n) = (HEADS, DIM, SUBSTEPS);
    let seqs = cu.map_or(1, |c| c.len() - 1);
    let dev = Device::Cpu;
    let mk = |data: Vec<f64>, shape: &[usize], dt: DType| -> candle_core::Result<Tensor> {
        Tensor::from_vec(data, shape, &dev)?
            .to_dtype(dt)?
            .to_dtype(DType::F64)
    };
    Ok(LoadedInput {
        q: mk(rng.unit_rows(t * h, d), &[1, t, h, d], dtype)?,
        k: mk(rng.unit_rows(t * n * h, d), &[1, t * n, h, d], dtype)?,
        v: mk(rng.normals(t * n * h * d, |z| z), &[1, t * n, h, d], dtype)?,
        g: mk(
            rng.normals(t * h, |z| -softplus(2.0 * z)),
            &[1, t, h],
            DType::F32,
        )?,
        beta: mk(
            rng.normals(t * n * h, |z| 2.0 / (1.0 + (-z).exp())),
            &[1, t * n, h],
            dtype,
        )?,
        h0: Some(mk(
            rng.normals(seqs * h * d * d, |z| 0.5 * z),
            &[seqs, h, d, d],
            dtype,
        )?),
        cu_seqlens: cu.map(<[usize]>::to_vec),
        dout: Some(mk(
            rng.normals(t * h * d, |z| z),
            &[1, t, h, d],
            DType::F32,
        )?),
        dht: Some(mk(
            rng.normals(seqs * h * d * d, |z| z),
            &[seqs, h, d, d],
            DType::F32,
        )?),
    })
}

/// `RMS(a − b) / RMS(b)`.
fn rel_rms(a: &Tensor, b: &Tensor) -> candle_core::Result<f64> {
    let a = a.to_dtype(DType::F64)?.flatten_all()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?;
    let num = (&a - &b)?.sqr()?.mean_all()?.to_scalar::<f64>()?.sqrt();
    let den = b.sqr()?.mean_all()?.to_scalar::<f64>()?.sqrt();
    Ok(if den == 0.0 { num } else { num / den })
}

/// The worst relative RMS error of the op's outputs and gradients against the f64 reference,
/// with the name of the worst tensor.
fn reference_error(
    x: &LoadedInput,
    got: &[(String, Tensor)],
) -> candle_core::Result<(f64, String)> {
    let opts = GdpOptions {
        initial_state: x.h0.as_ref(),
        output_final_state: true,
        cu_seqlens: x.cu_seqlens.as_deref(),
        ..Default::default()
    };
    let (o, ht) = gated_delta_product_naive(&x.q, &x.k, &x.v, &x.g, &x.beta, &opts)?;
    let dout = x
        .dout
        .as_ref()
        .ok_or_else(|| candle_core::Error::Msg("no `do`".into()))?;
    let gr = gated_delta_product_naive_backward(
        &x.q,
        &x.k,
        &x.v,
        &x.g,
        &x.beta,
        &opts,
        dout,
        x.dht.as_ref(),
    )?;
    let want = [
        ("o", o),
        ("ht", ht),
        ("dq", gr.dq),
        ("dk", gr.dk),
        ("dv", gr.dv),
        ("dg", gr.dg),
        ("dbeta", gr.dbeta),
        ("dh0", gr.dh0),
    ];
    let mut worst = (0.0f64, String::new());
    for (name, w) in want {
        let g = got
            .iter()
            .find(|(n, _)| n == name)
            .ok_or_else(|| candle_core::Error::Msg(format!("no `{name}` computed")))?;
        let e = rel_rms(&g.1, &w)?;
        if e.is_nan() || e > worst.0 {
            worst = (e, name.to_string());
        }
    }
    Ok(worst)
}

struct Row {
    case: &'static str,
    shape: String,
    fwd_ms: f64,
    fwd_bwd_ms: f64,
    tokens: usize,
    err: Option<(f64, String)>,
}

fn lib(e: candle_core::Error) -> CliError {
    CliError::from_lib(&e)
}

/// One case: time forward and forward+backward, and optionally check against the reference.
fn measure(
    case: &'static str,
    t: usize,
    cu: Option<&[usize]>,
    args: &DemoArgs,
    device: &Device,
    check: bool,
) -> Result<Row, CliError> {
    let x = random_case(t, cu, args.dtype.dtype(), 0x5EED ^ t as u64).map_err(lib)?;
    let p = Prepared::new(&x, args.dtype.dtype(), device, None)?;
    let (_, fwd_ms) = bench(device, args.repeat, || p.forward(false))?;
    let (got, fwd_bwd_ms) = bench(device, args.repeat, || p.forward_backward())?;
    let got = with_final_state(&p, got)?;
    let err = if check {
        let got = got
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_device(&Device::Cpu)?)))
            .collect::<candle_core::Result<Vec<_>>>()
            .map_err(lib)?;
        Some(reference_error(&x, &got).map_err(lib)?)
    } else {
        None
    };
    let seqs = cu.map_or(String::new(), |c| format!(" N{}", c.len() - 1));
    Ok(Row {
        case,
        shape: format!("B1 T{t} H{HEADS} K{DIM} V{DIM} n{SUBSTEPS}{seqs}"),
        fwd_ms,
        fwd_bwd_ms,
        tokens: t,
        err,
    })
}

fn rate(tokens: usize, ms: f64) -> String {
    let r = tokens as f64 / (ms * 1e-3);
    if r >= 1e6 {
        format!("{:.2}M", r / 1e6)
    } else {
        format!("{:.1}k", r / 1e3)
    }
}

/// Runs `gdp demo`: prints the table, fails if an error exceeds the dtype's tolerance.
pub fn demo(args: &DemoArgs) -> Result<(), CliError> {
    let device = args.device.open()?;
    crate::kernels::retain_pool(&device)?;
    let tc = args.tokens.min(CHECK_TOKENS);
    let cut = |f: f64| ((tc as f64 * f) as usize).clamp(0, tc);
    let cu = [0, cut(0.2), cut(0.2), cut(0.65), tc];
    let rows = [
        measure("check", tc, None, args, &device, true)?,
        measure("packed", tc, Some(&cu), args, &device, true)?,
        measure("bench", args.tokens, None, args, &device, false)?,
    ];
    let tol = tolerance(args.dtype);
    println!(
        "gdp demo: dtype {}, device {}, {} threads, median of {} runs, reference tolerance {tol:.0e}",
        args.dtype.name(),
        args.device,
        rayon::current_num_threads(),
        args.repeat,
    );
    let header = [
        "case",
        "shape",
        "fwd ms",
        "fwd+bwd ms",
        "fwd tok/s",
        "fwd+bwd tok/s",
        "max rel RMS",
    ];
    let body: Vec<[String; 7]> = rows
        .iter()
        .map(|r| {
            [
                r.case.to_string(),
                r.shape.clone(),
                format!("{:.2}", r.fwd_ms),
                format!("{:.2}", r.fwd_bwd_ms),
                rate(r.tokens, r.fwd_ms),
                rate(r.tokens, r.fwd_bwd_ms),
                r.err
                    .as_ref()
                    .map_or("-".to_string(), |(e, n)| format!("{e:.1e} ({n})")),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..7)
        .map(|c| {
            body.iter()
                .map(|r| r[c].len())
                .chain([header[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: &[&str]| -> String {
        let mut s = String::new();
        for (c, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if c < 2 {
                s.push_str(&format!("{cell:<w$}  "));
            } else {
                s.push_str(&format!("{cell:>w$}  "));
            }
        }
        s.trim_end().to_string()
    };
    println!("{}", line(&header));
    for r in &body {
        println!(
            "{}",
            line(&r.iter().map(String::as_str).collect::<Vec<_>>())
        );
    }
    for r in &rows {
        if let Some((e, name)) = &r.err {
            if e.is_nan() || *e > tol {
                return Err(CliError::new(format!(
                    "demo: `{name}` of case {} is off the f64 reference by {e:.2e} (relative RMS) > {tol:.0e}",
                    r.case
                )));
            }
        }
    }
    Ok(())
}
