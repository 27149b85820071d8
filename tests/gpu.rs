//! The CUDA forward (feature `cuda`, needs a GPU): outputs and final states against the CPU op
//! (f32) and the f64 reference (bf16/f16) on odd shapes, plus the device and dtype errors.
//! A CUDA-linked binary cannot even start without `libcuda.so.1`, so CI (no GPU) never builds
//! this with the feature on. Run on a GPU machine: `cargo test --release --features cuda --test gpu`.
//! `--ignored` adds the timing of the bf16 B4 T4096 H16 K=V=128 n=2 forward.
#![cfg(feature = "cuda")]

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_gdp::op::naive::gated_delta_product_naive;
use candle_gdp::{gated_delta_product, gated_delta_product_packed, GdpOptions};
use common::{inputs, rel_rms, Case, Inputs};

fn cuda() -> Result<Device> {
    Ok(Device::new_cuda(0)?)
}

fn cases() -> Vec<Case> {
    vec![
        Case::new("n1 T100 K32 V48 h0", 2, 100, 2, 32, 48, 1).h0(),
        Case::new("n2 T77 K100 V60 h0", 1, 77, 3, 100, 60, 2)
            .h0()
            .seed(3),
        Case::new("n3 T70 K64 V64", 2, 70, 2, 64, 64, 3).seed(5),
        Case::new("n2 T1 K8 V8 h0", 2, 1, 2, 8, 8, 2).h0(),
        Case::new("n2 T300 K128 V128 h0", 1, 300, 2, 128, 128, 2)
            .h0()
            .seed(9),
        Case::new("packed n2 empty seq h0", 1, 150, 2, 48, 40, 2)
            .packed(&[0, 37, 37, 150])
            .h0()
            .seed(13),
        Case::new("packed n3 strong", 1, 129, 2, 24, 20, 3)
            .packed(&[0, 1, 64, 64, 129])
            .strong_gates()
            .seed(17),
        Case::new("packed n1 no h0", 1, 97, 3, 16, 16, 1).packed(&[0, 33, 96, 97]),
        Case::new("strong n2 T130 K64 V64 h0", 2, 130, 2, 64, 64, 2)
            .strong_gates()
            .h0()
            .seed(19),
        Case::new("K256 V256 n2 h0", 1, 80, 1, 256, 256, 2)
            .h0()
            .seed(23),
        Case::new("K256 V200 n1 strong", 1, 70, 2, 256, 200, 1)
            .strong_gates()
            .seed(29),
    ]
}

/// Runs the op on `dev` with the inputs in `dtype` (gates and h0 in f32); returns `(o, ht)` on
/// the CPU.
fn run_on(c: &Case, x: &Inputs, dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
    let put = |t: &Tensor, dt: DType| -> Result<Tensor> { Ok(t.to_dtype(dt)?.to_device(dev)?) };
    let (q, k, v) = (put(&x.q, dtype)?, put(&x.k, dtype)?, put(&x.v, dtype)?);
    let (g, beta) = (put(&x.g, DType::F32)?, put(&x.beta, dtype)?);
    let h0 = match &x.h0 {
        Some(h) => Some(put(h, DType::F32)?),
        None => None,
    };
    let opts = GdpOptions {
        initial_state: h0.as_ref(),
        output_final_state: true,
        cu_seqlens: c.cu.as_deref(),
        ..Default::default()
    };
    let (o, ht) = gated_delta_product(&q, &k, &v, &g, &beta, &opts)?;
    let ht = ht.expect("final state requested");
    assert_eq!(o.dtype(), dtype, "{}: o dtype", c.name);
    assert_eq!(ht.dtype(), DType::F32, "{}: ht dtype", c.name);
    assert!(o.device().same_device(dev), "{}: o device", c.name);
    Ok((o.to_device(&Device::Cpu)?, ht.to_device(&Device::Cpu)?))
}

fn reference(c: &Case, x: &Inputs) -> Result<(Tensor, Tensor)> {
    let opts = GdpOptions {
        initial_state: x.h0.as_ref(),
        output_final_state: true,
        cu_seqlens: c.cu.as_deref(),
        ..Default::default()
    };
    let (o, ht) = gated_delta_product_naive(&x.q, &x.k, &x.v, &x.g, &x.beta, &opts)?;
    Ok((o, ht))
}

fn check(c: &Case, what: &str, got: &Tensor, want: &Tensor, tol: f64) -> Result<f64> {
    assert_eq!(got.dims(), want.dims(), "{}: {what} shape", c.name);
    let e = rel_rms(got, want)?;
    println!("{:<28} {what:<14} rel RMS {e:.2e}", c.name);
    assert!(e.is_finite(), "{}: {what} is not finite", c.name);
    assert!(e <= tol, "{}: {what} rel RMS {e:.2e} > {tol:.0e}", c.name);
    Ok(e)
}

#[test]
fn f32_matches_cpu_op() -> Result<()> {
    let dev = cuda()?;
    for c in cases() {
        let x = inputs(&c, DType::F32)?;
        let (o, ht) = run_on(&c, &x, DType::F32, &dev)?;
        let (o_cpu, ht_cpu) = run_on(&c, &x, DType::F32, &Device::Cpu)?;
        check(&c, "o vs cpu", &o, &o_cpu, 1e-5)?;
        check(&c, "ht vs cpu", &ht, &ht_cpu, 1e-5)?;
        let (o_ref, ht_ref) = reference(&c, &x)?;
        check(&c, "o vs f64", &o, &o_ref, 1e-4)?;
        check(&c, "ht vs f64", &ht, &ht_ref, 1e-4)?;
    }
    Ok(())
}

#[test]
fn half_precision_matches_f64_reference() -> Result<()> {
    let dev = cuda()?;
    for dtype in [DType::BF16, DType::F16] {
        for c in cases() {
            let x = inputs(&c, dtype)?;
            let (o, ht) = run_on(&c, &x, dtype, &dev)?;
            let (o_ref, ht_ref) = reference(&c, &x)?;
            check(&c, &format!("o {dtype:?}"), &o, &o_ref, 1e-2)?;
            check(&c, &format!("ht {dtype:?}"), &ht, &ht_ref, 1e-2)?;
        }
    }
    Ok(())
}

#[test]
fn packed_entry_and_no_final_state() -> Result<()> {
    // The packed `qk [B, T, n+1, H, K]` entry point on CUDA gives the FLA-layout result, and
    // `output_final_state = false` returns no state.
    let dev = cuda()?;
    let c = Case::new("packed entry", 2, 90, 2, 40, 24, 2).h0();
    let x = inputs(&c, DType::F32)?;
    let (o_want, _) = run_on(&c, &x, DType::F32, &dev)?;
    let put = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?.to_device(&dev)?) };
    let k5 = x.k.reshape((c.b, c.t, c.n, c.h, c.k))?;
    let qk = put(&Tensor::cat(&[&x.q.unsqueeze(2)?, &k5], 2)?)?;
    let h0 = put(x.h0.as_ref().expect("h0"))?;
    let opts = GdpOptions {
        initial_state: Some(&h0),
        ..Default::default()
    };
    let (o, ht) = gated_delta_product_packed(&qk, &put(&x.v)?, &put(&x.g)?, &put(&x.beta)?, &opts)?;
    assert!(ht.is_none());
    check(&c, "o packed", &o.to_device(&Device::Cpu)?, &o_want, 1e-6)?;
    Ok(())
}

#[test]
fn inputs_on_different_devices_are_rejected() -> Result<()> {
    let dev = cuda()?;
    let c = Case::new("devices", 1, 10, 2, 8, 8, 2).h0();
    let x = inputs(&c, DType::F32)?;
    let f = |t: &Tensor| t.to_dtype(DType::F32);
    let gpu = |t: &Tensor| -> Result<Tensor> { Ok(f(t)?.to_device(&dev)?) };
    let (q, k, v, g, beta) = (
        gpu(&x.q)?,
        gpu(&x.k)?,
        gpu(&x.v)?,
        gpu(&x.g)?,
        gpu(&x.beta)?,
    );
    let v_cpu = f(&x.v)?;
    let h0_cpu = f(x.h0.as_ref().expect("h0"))?;
    let opts = GdpOptions::default();
    let err = gated_delta_product(&q, &k, &v_cpu, &g, &beta, &opts)
        .expect_err("v on the CPU must be rejected")
        .to_string();
    assert!(err.contains("`v`"), "unexpected error: {err}");
    let opts_h0 = GdpOptions {
        initial_state: Some(&h0_cpu),
        ..Default::default()
    };
    let err = gated_delta_product(&q, &k, &v, &g, &beta, &opts_h0)
        .expect_err("h0 on the CPU must be rejected")
        .to_string();
    assert!(err.contains("initial_state"), "unexpected error: {err}");
    let q_cpu = f(&x.q)?;
    assert!(gated_delta_product(&q_cpu, &k, &v, &g, &beta, &opts).is_err());
    Ok(())
}

#[test]
fn f64_is_a_clear_error() -> Result<()> {
    let dev = cuda()?;
    let c = Case::new("f64", 1, 10, 2, 8, 8, 1);
    let x = inputs(&c, DType::F64)?;
    let gpu = |t: &Tensor| t.to_device(&dev);
    let r = gated_delta_product(
        &gpu(&x.q)?,
        &gpu(&x.k)?,
        &gpu(&x.v)?,
        &gpu(&x.g)?,
        &gpu(&x.beta)?,
        &GdpOptions::default(),
    );
    let err = r.expect_err("f64 on CUDA must be rejected").to_string();
    assert!(err.contains("f64"), "unexpected error: {err}");
    Ok(())
}

#[test]
fn backward_on_cuda_is_an_error_not_a_panic() -> Result<()> {
    let dev = cuda()?;
    let c = Case::new("bwd", 1, 10, 2, 8, 8, 2);
    let x = inputs(&c, DType::F32)?;
    let var = |t: &Tensor| -> Result<Var> {
        Ok(Var::from_tensor(&t.to_dtype(DType::F32)?.to_device(&dev)?)?)
    };
    let (q, k, v, g, beta) = (
        var(&x.q)?,
        var(&x.k)?,
        var(&x.v)?,
        var(&x.g)?,
        var(&x.beta)?,
    );
    let (o, _) = gated_delta_product(&q, &k, &v, &g, &beta, &GdpOptions::default())?;
    assert!(o.sum_all()?.backward().is_err());
    Ok(())
}

/// Median wall time of `f` over `iters` runs after `warm` warm-up runs, synchronising the device
/// around each run.
fn median_ms(
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

#[test]
#[ignore = "timing; run with --ignored on a GPU"]
fn timing_bf16_b4_t4096_h16_k128_v128_n2() -> Result<()> {
    let dev = cuda()?;
    let (b, t, h, kd, vd, n) = (4usize, 4096usize, 16usize, 128usize, 128usize, 2usize);
    let unit = |shape: &[usize]| -> Result<Tensor> {
        let x = Tensor::randn(0f32, 1f32, shape, &dev)?;
        let norm = x.sqr()?.sum_keepdim(candle_core::D::Minus1)?.sqrt()?;
        Ok(x.broadcast_div(&norm)?.to_dtype(DType::BF16)?)
    };
    let q = unit(&[b, t, h, kd])?;
    let k5 = unit(&[b, t, n, h, kd])?;
    let qk = Tensor::cat(&[&q.unsqueeze(2)?, &k5], 2)?;
    let k = k5.reshape((b, t * n, h, kd))?;
    let v = Tensor::randn(0f32, 1f32, (b, t * n, h, vd), &dev)?.to_dtype(DType::BF16)?;
    let beta = (candle_nn::ops::sigmoid(&Tensor::randn(0f32, 1f32, (b, t * n, h), &dev)?)? * 2.0)?
        .to_dtype(DType::BF16)?;
    let g = (Tensor::rand(0f32, 1f32, (b, t, h), &dev)? * -0.5)?;
    let opts = GdpOptions {
        output_final_state: true,
        ..Default::default()
    };
    let flops_note = "B4 T4096 H16 K=V=128 n=2 bf16";
    let mut results = vec![];
    for bv in ["", "64", "32", "16"] {
        if bv.is_empty() {
            std::env::remove_var("GDP_CUDA_BV");
        } else {
            std::env::set_var("GDP_CUDA_BV", bv);
        }
        let ms = median_ms(&dev, 3, 20, || {
            gated_delta_product_packed(&qk, &v, &g, &beta, &opts)?;
            Ok(())
        })?;
        let label = if bv.is_empty() {
            "auto".to_string()
        } else {
            format!("BV={bv}")
        };
        println!("timing {flops_note}: packed entry, {label}: median {ms:.3} ms");
        results.push((label, ms));
    }
    std::env::remove_var("GDP_CUDA_BV");
    let ms = median_ms(&dev, 3, 20, || {
        gated_delta_product(&q, &k, &v, &g, &beta, &opts)?;
        Ok(())
    })?;
    println!("timing {flops_note}: FLA-layout entry (with the q/k packing copy), auto: median {ms:.3} ms");

    // Correctness at this size: against the CPU op on the same bf16 inputs.
    let (o, ht) = gated_delta_product_packed(&qk, &v, &g, &beta, &opts)?;
    let cpu = |x: &Tensor| x.to_device(&Device::Cpu);
    let (o_cpu, ht_cpu) =
        gated_delta_product_packed(&cpu(&qk)?, &cpu(&v)?, &cpu(&g)?, &cpu(&beta)?, &opts)?;
    let eo = rel_rms(&cpu(&o)?, &o_cpu)?;
    let eh = rel_rms(&cpu(&ht.expect("ht"))?, &ht_cpu.expect("ht"))?;
    println!("timing case vs CPU op: o rel RMS {eo:.2e}, ht rel RMS {eh:.2e}");
    assert!(eo <= 1e-2 && eh <= 1e-2);
    Ok(())
}
