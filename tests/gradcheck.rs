//! Gradients against central finite differences of the f64 reference forward, on tiny sizes,
//! for every element of `q, k, v, g, beta, h0`:
//!
//! (a) the f64 hand-written adjoint `gated_delta_product_naive_backward` (max abs error relative
//!     to the gradient scale < 1e-7);
//! (b) the fast chunked op run in f32 under autograd (relative RMS <= 1e-5 per gradient).
//!
//! The loss is `L = Σ do·o + Σ dht·S_T`. Inputs are rounded through f32 so that the finite
//! differences and the f32 op see the same point.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_gdp::op::naive::{gated_delta_product_naive, gated_delta_product_naive_backward};
use candle_gdp::{gated_delta_product, GdpOptions};
use common::{inputs, rel_rms, Case, Inputs};

/// Finite-difference step.
const EPS: f64 = 1e-4;
const NAMES: [&str; 6] = ["q", "k", "v", "g", "beta", "h0"];

fn host(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// One gradient-check problem: the case, its (f32-rounded) inputs and an optional scale.
struct Problem {
    c: Case,
    x: Inputs,
    scale: Option<f64>,
    /// Host copies of q, k, v, g, beta, h0 (h0 empty when the case has none).
    vals: Vec<Vec<f64>>,
    shapes: Vec<Vec<usize>>,
    dout: Vec<f64>,
    dht: Vec<f64>,
}

impl Problem {
    fn new(c: Case, scale: Option<f64>) -> Result<Self> {
        let x = inputs(&c, DType::F32)?;
        let mut vals = vec![];
        let mut shapes = vec![];
        for t in [&x.q, &x.k, &x.v, &x.g, &x.beta] {
            vals.push(host(t)?);
            shapes.push(t.dims().to_vec());
        }
        match &x.h0 {
            Some(h0) => {
                vals.push(host(h0)?);
                shapes.push(h0.dims().to_vec());
            }
            None => {
                vals.push(vec![]);
                shapes.push(vec![]);
            }
        }
        let (dout, dht) = (host(&x.dout)?, host(&x.dht)?);
        Ok(Self {
            c,
            x,
            scale,
            vals,
            shapes,
            dout,
            dht,
        })
    }

    fn opts<'a>(&'a self, h0: Option<&'a Tensor>) -> GdpOptions<'a> {
        GdpOptions {
            num_householder: Some(self.c.n),
            scale: self.scale,
            initial_state: h0,
            output_final_state: true,
            cu_seqlens: self.c.cu.as_deref(),
            ..Default::default()
        }
    }

    /// `L` of the f64 reference forward at `vals`.
    fn loss(&self, vals: &[Vec<f64>]) -> Result<f64> {
        let t =
            |i: usize| Tensor::from_vec(vals[i].clone(), self.shapes[i].as_slice(), &Device::Cpu);
        let (q, k, v, g, beta) = (t(0)?, t(1)?, t(2)?, t(3)?, t(4)?);
        let h0 = if self.c.h0 { Some(t(5)?) } else { None };
        let (o, ht) = gated_delta_product_naive(&q, &k, &v, &g, &beta, &self.opts(h0.as_ref()))?;
        let dot = |a: &Tensor, b: &[f64]| -> Result<f64> {
            Ok(host(a)?.iter().zip(b).map(|(x, y)| x * y).sum())
        };
        Ok(dot(&o, &self.dout)? + dot(&ht, &self.dht)?)
    }

    /// Central finite differences of `L` for every element of every input: the fourth-order
    /// stencil `(8 (L(x+h) − L(x−h)) − (L(x+2h) − L(x−2h))) / 12h`, whose truncation error
    /// (`~h⁴`) is far below the round-off of `L / h`.
    fn finite_differences(&self) -> Result<Vec<Vec<f64>>> {
        let mut vals = self.vals.clone();
        let mut out = vec![];
        for i in 0..vals.len() {
            let mut d = vec![0.0; vals[i].len()];
            for (e, de) in d.iter_mut().enumerate() {
                let x0 = vals[i][e];
                let mut at = |dx: f64| -> Result<f64> {
                    vals[i][e] = x0 + dx;
                    self.loss(&vals)
                };
                let (p1, m1, p2, m2) = (at(EPS)?, at(-EPS)?, at(2.0 * EPS)?, at(-2.0 * EPS)?);
                vals[i][e] = x0;
                *de = (8.0 * (p1 - m1) - (p2 - m2)) / (12.0 * EPS);
            }
            out.push(d);
        }
        Ok(out)
    }

    /// The f64 reference adjoint, in the order of [`NAMES`].
    fn naive_adjoint(&self) -> Result<Vec<Vec<f64>>> {
        let x = &self.x;
        let gr = gated_delta_product_naive_backward(
            &x.q,
            &x.k,
            &x.v,
            &x.g,
            &x.beta,
            &self.opts(x.h0.as_ref()),
            &x.dout,
            Some(&x.dht),
        )?;
        let mut out = vec![];
        for t in [&gr.dq, &gr.dk, &gr.dv, &gr.dg, &gr.dbeta] {
            out.push(host(t)?);
        }
        out.push(if self.c.h0 { host(&gr.dh0)? } else { vec![] });
        Ok(out)
    }

    /// The fast op in f32 under autograd, in the order of [`NAMES`].
    fn op_grads(&self) -> Result<Vec<Vec<f64>>> {
        let x = &self.x;
        let var = |t: &Tensor| -> Result<Var> { Ok(Var::from_tensor(&t.to_dtype(DType::F32)?)?) };
        let vars = [
            var(&x.q)?,
            var(&x.k)?,
            var(&x.v)?,
            var(&x.g)?,
            var(&x.beta)?,
        ];
        let h0 = match &x.h0 {
            Some(h) => Some(var(h)?),
            None => None,
        };
        let opts = self.opts(h0.as_ref().map(|v| v.as_tensor()));
        let (o, ht) = gated_delta_product(&vars[0], &vars[1], &vars[2], &vars[3], &vars[4], &opts)?;
        let ht = ht.expect("final state requested");
        let loss = ((o.to_dtype(DType::F64)? * &x.dout)?.sum_all()?
            + (ht.to_dtype(DType::F64)? * &x.dht)?.sum_all()?)?;
        let gs = loss.backward()?;
        let mut out = vec![];
        for (name, v) in NAMES.iter().zip(&vars) {
            let g = gs
                .get(v.as_tensor())
                .unwrap_or_else(|| panic!("no gradient for {name}"));
            assert_eq!(g.dims(), v.dims(), "d{name} shape");
            out.push(host(g)?);
        }
        out.push(match &h0 {
            Some(h) => host(gs.get(h.as_tensor()).expect("no gradient for h0"))?,
            None => vec![],
        });
        Ok(out)
    }
}

fn max_abs(x: &[f64]) -> f64 {
    x.iter().fold(0.0f64, |m, v| m.max(v.abs()))
}

fn to_tensor(x: &[f64]) -> Result<Tensor> {
    Ok(Tensor::from_slice(x, x.len(), &Device::Cpu)?)
}

/// Runs (a) and (b) on one problem; returns the most negative gate.
fn gradcheck(c: Case, scale: Option<f64>) -> Result<f64> {
    let p = Problem::new(c, scale)?;
    let fd = p.finite_differences()?;
    let adj = p.naive_adjoint()?;
    let op = p.op_grads()?;
    let scale_all = fd.iter().map(|d| max_abs(d)).fold(0.0f64, f64::max);
    assert!(
        scale_all > 0.0 && scale_all.is_finite(),
        "{}: degenerate gradients",
        p.c.name
    );
    let mut report = vec![];
    for (i, name) in NAMES.iter().enumerate() {
        if fd[i].is_empty() {
            continue;
        }
        assert_eq!(adj[i].len(), fd[i].len(), "{}: d{name} length", p.c.name);
        assert_eq!(op[i].len(), fd[i].len(), "{}: d{name} length", p.c.name);
        // (a) f64 adjoint: worst element, relative to the gradient scale (the larger of this
        // gradient's and a thousandth of the overall scale, so that a near-zero gradient, e.g.
        // dg under g = -20, is not judged against finite-difference round-off alone).
        let gscale = max_abs(&fd[i]).max(1e-3 * scale_all);
        let (mut worst, mut at) = (0.0f64, 0);
        for (e, (a, f)) in adj[i].iter().zip(&fd[i]).enumerate() {
            let err = (a - f).abs();
            if err.is_nan() || err > worst {
                worst = err;
                at = e;
            }
        }
        let rel_a = worst / gscale;
        assert!(
            rel_a < 1e-7,
            "{}: (a) naive adjoint d{name}[{at}] = {:e} vs finite difference {:e}: \
             max abs error {worst:.2e} = {rel_a:.2e} of the gradient scale {gscale:.2e}",
            p.c.name,
            adj[i][at],
            fd[i][at],
        );
        // (b) f32 op: relative RMS per gradient, and no element off by more than f32 round-off
        // of the overall gradient scale (the bound that matters for gradients that are tiny
        // because of strong gates, where the chunked f32 `dg` is limited by cancellation).
        let worst_b = op[i]
            .iter()
            .zip(&fd[i])
            .fold(0.0f64, |m, (a, f)| m.max((a - f).abs()));
        assert!(
            worst_b <= 2e-6 * scale_all,
            "{}: (b) f32 op d{name} max abs error {worst_b:.2e} > 2e-6 of the gradient scale {scale_all:.2e}",
            p.c.name
        );
        let rel_b = rel_rms(&to_tensor(&op[i])?, &to_tensor(&fd[i])?)?;
        assert!(
            rel_b <= 1e-5,
            "{}: (b) f32 op d{name} relative RMS error vs finite differences {rel_b:.2e} > 1e-5",
            p.c.name
        );
        report.push(format!("d{name} {rel_a:.0e}/{rel_b:.0e}"));
    }
    let min_g = p.vals[3].iter().fold(0.0f64, |m, &g| m.min(g));
    println!(
        "{:<34} min g {min_g:6.2}  (a)/(b): {}",
        p.c.name,
        report.join("  ")
    );
    Ok(min_g)
}

#[test]
fn gradcheck_n1_b2_h0() -> Result<()> {
    gradcheck(
        Case::new("n1 B2 T5 H2 K3 V2 h0", 2, 5, 2, 3, 2, 1).h0(),
        None,
    )?;
    Ok(())
}

#[test]
fn gradcheck_n2_b1_h0() -> Result<()> {
    gradcheck(
        Case::new("n2 B1 T7 H1 K4 V3 h0", 1, 7, 1, 4, 3, 2)
            .h0()
            .seed(3),
        None,
    )?;
    Ok(())
}

#[test]
fn gradcheck_n3_b2_h2_h0() -> Result<()> {
    gradcheck(
        Case::new("n3 B2 T9 H2 K5 V4 h0", 2, 9, 2, 5, 4, 3)
            .h0()
            .seed(5),
        None,
    )?;
    Ok(())
}

#[test]
fn gradcheck_n2_no_h0_custom_scale() -> Result<()> {
    gradcheck(
        Case::new("n2 B2 T3 H2 K5 V2 scale 0.7", 2, 3, 2, 5, 2, 2).seed(9),
        Some(0.7),
    )?;
    Ok(())
}

#[test]
fn gradcheck_packed_with_empty_sequence() -> Result<()> {
    let c = Case::new("packed n2 [0,3,3,8,9] h0", 1, 9, 2, 4, 3, 2)
        .packed(&[0, 3, 3, 8, 9])
        .h0()
        .seed(13);
    gradcheck(c, None)?;
    Ok(())
}

#[test]
fn gradcheck_packed_n3_leading_empty() -> Result<()> {
    let c = Case::new("packed n3 [0,0,4,6] h0", 1, 6, 1, 3, 4, 3)
        .packed(&[0, 0, 4, 6])
        .h0()
        .seed(17);
    gradcheck(c, None)?;
    Ok(())
}

#[test]
fn gradcheck_strong_gates() -> Result<()> {
    let c = Case::new("strong n2 B2 T8 H2 K4 V3 h0", 2, 8, 2, 4, 3, 2)
        .strong_gates()
        .h0()
        .seed(21);
    let min_g = gradcheck(c, None)?;
    assert!(
        min_g < -15.0,
        "strong gates should reach below -15, got {min_g}"
    );
    Ok(())
}

#[test]
fn gradcheck_strong_gates_n3() -> Result<()> {
    let c = Case::new("strong n3 B1 T9 H2 K3 V2 h0", 1, 9, 2, 3, 2, 3)
        .strong_gates()
        .h0()
        .seed(23);
    let min_g = gradcheck(c, None)?;
    assert!(
        min_g < -15.0,
        "strong gates should reach below -15, got {min_g}"
    );
    Ok(())
}
