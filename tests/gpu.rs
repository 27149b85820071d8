//! The CUDA op (feature `cuda`, needs a GPU): forward outputs and final states, every gradient
//! of the backward, the decode step and context parallelism over several CUDA devices, against
//! the CPU op (f32) and the f64 reference (bf16/f16) on odd shapes, plus the device and dtype
//! errors. A CUDA-linked binary cannot even start without `libcuda.so.1`, so CI (no GPU) only
//! compiles this. Run on a GPU machine: `cargo test --release --features cuda --test gpu`.
//! `--ignored` adds the timings of the bf16 B4 T4096 H16 K=V=128 n=2 forward and backward.
#![cfg(feature = "cuda")]

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_gdp::op::naive::gated_delta_product_naive;
use candle_gdp::op::recurrent::gated_delta_product_step;
use candle_gdp::op::{KernelConfig, KernelPath, TileConfig};
use candle_gdp::SaveIntermediates::{self, All, Nothing, WyFactors};
use candle_gdp::{
    gated_delta_product, gated_delta_product_packed, ContextParallel, Cotangents, GdpOptions,
};
use common::{
    inputs, median_ms, rel_rms, run_op_configured_on, run_op_on, run_op_packed_on, run_op_plain_on,
    run_op_saving_on, run_op_vjp_on, run_reference, Case, Inputs, Results,
};

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
    run_configured_on(c, x, dtype, dev, KernelConfig::default())
}

/// [`run_on`] with the CUDA kernel choices `kernels`.
fn run_configured_on(
    c: &Case,
    x: &Inputs,
    dtype: DType,
    dev: &Device,
    kernels: KernelConfig,
) -> Result<(Tensor, Tensor)> {
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
        kernels,
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
        check(&c, "o vs f64", &o, &o_ref, 1e-5)?;
        check(&c, "ht vs f64", &ht, &ht_ref, 1e-5)?;
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
fn backward_f32_matches_cpu_op() -> Result<()> {
    let dev = cuda()?;
    for c in cases() {
        let x = inputs(&c, DType::F32)?;
        let got = run_op_on(&c, &x, DType::F32, &dev)?;
        let want = run_op_on(&c, &x, DType::F32, &Device::Cpu)?;
        let refr = run_reference(&c, &x)?;
        assert_eq!(got.grads.len(), want.grads.len());
        common::assert_same_grads(&got.grads, &want.grads);
        common::assert_same_grads(&got.grads, &refr.grads);
        for (((name, a), (_, b)), (_, r)) in got.grads.iter().zip(&want.grads).zip(&refr.grads) {
            let e = rel_rms(a, b)?;
            if e <= 1e-5 {
                check(&c, &format!("{name} vs cpu"), a, b, 1e-5)?;
            } else {
                // Two f32 results that are each within 1e-5 of the f64 reference can be a
                // little further apart (the gate gradient under strong gates at K = 256 is
                // ~5e-6 from f64 on the CPU). Then both must be within 1e-5 of f64.
                let (e_gpu, e_cpu) = (rel_rms(a, r)?, rel_rms(b, r)?);
                println!(
                    "{:<28} {name} vs cpu {e:.2e}: vs f64 cuda {e_gpu:.2e}, cpu {e_cpu:.2e}",
                    c.name
                );
                assert!(
                    e_gpu <= 1e-5 && e_cpu <= 1e-5,
                    "{}: {name} vs cpu {e:.2e}, vs f64: cuda {e_gpu:.2e}, cpu {e_cpu:.2e}",
                    c.name
                );
            }
            check(&c, &format!("{name} vs f64"), a, r, 1e-5)?;
        }
    }
    Ok(())
}

#[test]
fn without_final_state_matches_f64_reference() -> Result<()> {
    // `output_final_state = false`: `o` alone in the inputs' dtype (bf16: written by the scan
    // directly), and the backward from a plain `do` (bf16: straight to bf16 dqk, dv).
    let dev = cuda()?;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        for c in cases() {
            let x = inputs(&c, dtype)?;
            let got = run_op_plain_on(&c, &x, dtype, &dev)?;
            let want = run_reference(&c, &x.without_dht()?)?;
            check(&c, &format!("o {dtype:?} plain"), &got.o, &want.o, tol)?;
            common::assert_same_grads(&got.grads, &want.grads);
            for ((name, a), (_, b)) in got.grads.iter().zip(&want.grads) {
                check(&c, &format!("{name} {dtype:?} plain"), a, b, tol)?;
            }
        }
    }
    Ok(())
}

/// `got` from the same kernels as `base` (called `base_name`) run another way: `o`
/// bit-identical, every gradient within 1e-3 relative RMS (the per-value-tile backward sums
/// dq, dk over value tiles in another order), and all within `tol` of the reference `want`.
fn check_same_kernels(
    c: &Case,
    what: &str,
    base_name: &str,
    (got, base, want): (&Results, &Results, &Results),
    tol: f64,
) -> Result<()> {
    check(c, &format!("o {what}"), &got.o, &want.o, tol)?;
    assert_eq!(rel_rms(&got.o, &base.o)?, 0.0, "{}: o {what}", c.name);
    common::assert_same_grads(&got.grads, &base.grads);
    common::assert_same_grads(&got.grads, &want.grads);
    for (((name, a), (_, b)), (_, w)) in got.grads.iter().zip(&base.grads).zip(&want.grads) {
        check(c, &format!("{name} {what}"), a, w, tol)?;
        let diff = rel_rms(a, b)?;
        assert!(
            diff <= 1e-3,
            "{}: {name} {what} differs from {base_name} by {diff:.2e}",
            c.name
        );
    }
    Ok(())
}

#[test]
fn saved_intermediates_give_the_same_results() -> Result<()> {
    // `save_intermediates`: the bf16 backward reads the forward's WY factors and chunk states
    // instead of recomputing them with the same kernels, so `o` is bit-identical to the
    // recomputing op's and every gradient equal to it up to the order of sums (the
    // per-value-tile backward, which serves K, V > 128 and keeps nothing, sums dq, dk over
    // value tiles: an element may round to the neighbouring bf16 value, ~3e-5 relative RMS in
    // all; a wrong cache would differ by O(1)). Every result is within the bf16 tolerance of
    // the reference. At K = V = 128, n = 2 (two heads: few state-gradient scan blocks) the
    // saved backward runs its gradient kernel beside that scan (persistent blocks waiting for
    // each group of chunks' dS, then the rest after the scan: `src/op/cuda/backward.rs`).
    let dev = cuda()?;
    let dtype = DType::BF16;
    for c in cases() {
        let x = inputs(&c, dtype)?;
        for (plain, what) in [false, true]
            .into_iter()
            .flat_map(|p| [(p, WyFactors), (p, All)])
        {
            let (got, base, want) = if plain {
                let want = run_reference(&c, &x.without_dht()?)?;
                (
                    run_op_saving_on(&c, &x, dtype, &dev, true, what)?,
                    run_op_plain_on(&c, &x, dtype, &dev)?,
                    want,
                )
            } else {
                let want = run_reference(&c, &x)?;
                (
                    run_op_saving_on(&c, &x, dtype, &dev, false, what)?,
                    run_op_on(&c, &x, dtype, &dev)?,
                    want,
                )
            };
            let label = format!("saved {what:?}{}", if plain { " plain" } else { "" });
            check_same_kernels(&c, &label, "recomputing", (&got, &base, &want), 1e-2)?;
        }
    }
    Ok(())
}

#[test]
fn explicit_backward_equals_autograd() -> Result<()> {
    // `gated_delta_product_vjp` runs the kernels of the op under autograd without a graph
    // node: `o` bit-identical, every gradient equal up to the order of sums (see above), with
    // and without the final state and `save_intermediates` (bf16 only). Against f64 at the
    // tolerances of the tests above.
    let dev = cuda()?;
    for (dtype, tol) in [(DType::BF16, 1e-2), (DType::F32, 1e-5)] {
        for c in cases() {
            let x = inputs(&c, dtype)?;
            let saves = [
                (true, Nothing),
                (false, Nothing),
                (false, WyFactors),
                (false, All),
            ];
            for (final_state, save) in saves {
                let x = if final_state {
                    x.clone()
                } else {
                    x.without_dht()?
                };
                let got = run_op_vjp_on(&c, &x, dtype, &dev, final_state, save)?;
                let base = if final_state {
                    run_op_on(&c, &x, dtype, &dev)?
                } else {
                    run_op_plain_on(&c, &x, dtype, &dev)?
                };
                let want = run_reference(&c, &x)?;
                let what = format!("vjp {dtype:?} final {final_state} saved {save:?}");
                check_same_kernels(&c, &what, "autograd", (&got, &base, &want), tol)?;
            }
        }
    }
    Ok(())
}

#[test]
fn overlapped_forward_is_bit_identical_and_matches_f64_reference() -> Result<()> {
    // Sequences of 35, 13 and 25 chunks with 6 scan blocks: the bf16 forward runs its WY
    // kernel and its scan side by side, the scan waiting for each group of chunks
    // (`src/op/cuda/pipeline.rs`); the recomputing backward runs its state-gradient scan beside
    // its WY kernel the same way. Outputs, final states and (through the saved
    // intermediates, and recomputed) every gradient must be bit-identical to those of the
    // kernels one after the other (`KernelConfig::overlap` off; dg and dβ too: the gradient
    // kernel adds its partial sums in a fixed order), and within the bf16 tolerance of the
    // f64 reference; so must the overlapped launches queued on one stream (`side_streams`
    // off). The small shapes of the other tests take the overlapped path too.
    let dev = cuda()?;
    let dtype = DType::BF16;
    let c = Case::new("packed n2 long overlapped", 1, 2300, 2, 64, 48, 2)
        .packed(&[0, 1100, 1500, 2300])
        .strong_gates()
        .h0()
        .seed(31);
    let x = inputs(&c, dtype)?;
    let want = run_reference(&c, &x)?;
    let run = |kernels: KernelConfig| -> Result<_> {
        Ok((
            run_configured_on(&c, &x, dtype, &dev, kernels)?,
            run_op_configured_on(&c, &x, dtype, &dev, false, All, kernels)?,
            run_op_configured_on(&c, &x, dtype, &dev, true, All, kernels)?,
            run_op_configured_on(&c, &x, dtype, &dev, false, WyFactors, kernels)?,
        ))
    };
    let (off, off_saved, off_plain, off_wy) = run(KernelConfig {
        overlap: false,
        ..Default::default()
    })?;
    let one_stream = KernelConfig {
        side_streams: false,
        ..Default::default()
    };
    for (value, kernels) in [
        ("overlap", KernelConfig::default()),
        ("one stream", one_stream),
    ] {
        let ((o, ht), saved, plain, wy) = run(kernels)?;
        let what = value.to_string();
        check(&c, &format!("o {value}"), &o, &want.o, 1e-2)?;
        check(&c, &format!("ht {value}"), &ht, &want.ht, 1e-2)?;
        assert_eq!(rel_rms(&o, &off.0)?, 0.0, "o with {what}");
        assert_eq!(rel_rms(&ht, &off.1)?, 0.0, "ht with {what}");
        assert_eq!(rel_rms(&saved.o, &off_saved.o)?, 0.0, "saved o with {what}");
        assert_eq!(rel_rms(&plain.o, &off_plain.o)?, 0.0, "plain o with {what}");
        assert_eq!(rel_rms(&wy.o, &off_wy.o)?, 0.0, "WY-saved o with {what}");
        for (run, off_run, label) in [(&saved, &off_saved, ""), (&wy, &off_wy, " (WY saved)")] {
            common::assert_same_grads(&run.grads, &off_run.grads);
            common::assert_same_grads(&run.grads, &want.grads);
            let pairs = run.grads.iter().zip(&off_run.grads);
            for (((name, a), (_, b)), (_, w)) in pairs.zip(&want.grads) {
                check(&c, &format!("{name} {value}{label}"), a, w, 1e-2)?;
                let diff = rel_rms(a, b)?;
                assert!(
                    diff == 0.0,
                    "{name}{label} with {what} differs by {diff:.2e}"
                );
            }
        }
        common::assert_same_grads(&plain.grads, &off_plain.grads);
        for ((name, a), (_, b)) in plain.grads.iter().zip(&off_plain.grads) {
            let diff = rel_rms(a, b)?;
            assert!(
                diff == 0.0,
                "plain {name} with {what} differs by {diff:.2e}"
            );
        }
    }
    Ok(())
}

#[test]
fn fla_layout_in_place_matches_the_packed_entry() -> Result<()> {
    // In bf16 where the chunked kernels serve both ways, `gated_delta_product` hands them `q`
    // and `k` in place; the packed entry point reads `qk` built by Candle's `cat`. The kernels
    // read the same values, so `o` and `ht` are bit-identical and every gradient equal up to
    // the order of sums (as in `saved_intermediates_give_the_same_results`); K = 256
    // (no split backward) takes the packed copy on both sides.
    let dev = cuda()?;
    let dtype = DType::BF16;
    for c in cases() {
        let x = inputs(&c, dtype)?;
        let split = run_op_on(&c, &x, dtype, &dev)?;
        let packed = run_op_packed_on(&c, &x, dtype, &dev)?;
        let want = run_reference(&c, &x)?;
        assert_eq!(rel_rms(&split.ht, &packed.ht)?, 0.0, "{}: ht", c.name);
        let results = (&split, &packed, &want);
        check_same_kernels(&c, "in place", "the packed entry", results, 1e-2)?;
    }
    Ok(())
}

#[test]
fn backward_half_precision_matches_f64_reference() -> Result<()> {
    let dev = cuda()?;
    for dtype in [DType::BF16, DType::F16] {
        for c in cases() {
            let x = inputs(&c, dtype)?;
            let got = run_op_on(&c, &x, dtype, &dev)?;
            let want = run_reference(&c, &x)?;
            assert_eq!(got.grads.len(), want.grads.len());
            common::assert_same_grads(&got.grads, &want.grads);
            for ((name, a), (_, b)) in got.grads.iter().zip(&want.grads) {
                check(&c, &format!("{name} {dtype:?}"), a, b, 1e-2)?;
            }
        }
    }
    Ok(())
}

#[test]
fn model_prefill_and_fused_decode_on_cuda_match_the_cpu() -> Result<()> {
    // Weights loaded as plain tensors (as for inference), so the layer's one-token steps take
    // the fused step's CUDA kernel; the same weights on the CPU give the reference logits.
    use candle_gdp::nn::{Cache, GdpConfig, GdpForCausalLM};
    use candle_nn::{VarBuilder, VarMap};
    let dev = cuda()?;
    let cfg = GdpConfig {
        head_dim: 64,
        hidden_size: 128,
        intermediate_size: Some(128),
        vocab_size: 96,
        ..GdpConfig::tiny()
    };
    let varmap = VarMap::new();
    GdpForCausalLM::new(
        &cfg,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
    )?;
    let weights = |d: &Device| -> Result<GdpForCausalLM> {
        let data = varmap.data().lock().map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut tensors = std::collections::HashMap::new();
        for (name, var) in data.iter() {
            tensors.insert(name.clone(), var.as_tensor().detach().to_device(d)?);
        }
        Ok(GdpForCausalLM::new(
            &cfg,
            VarBuilder::from_tensors(tensors, DType::F32, d),
        )?)
    };
    let (b, t, prefix) = (2, 90, 70);
    let ids: Vec<u32> = (0..b * t)
        .map(|i| ((i * 37 + 11) % cfg.vocab_size) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (b, t), &Device::Cpu)?;
    let run = |d: &Device| -> Result<Tensor> {
        let model = weights(d)?;
        let x = ids.to_device(d)?;
        let mut cache = Cache::new(&cfg, b, DType::F32, d)?;
        let mut parts = vec![model.forward(&x.narrow(1, 0, prefix)?, Some(&mut cache))?];
        for i in prefix..t {
            parts.push(model.forward(&x.narrow(1, i, 1)?, Some(&mut cache))?);
        }
        Ok(Tensor::cat(&parts, 1)?.to_device(&Device::Cpu)?)
    };
    let (got, want) = (run(&dev)?, run(&Device::Cpu)?);
    let e = rel_rms(&got, &want)?;
    println!(
        "model prefill {prefix} + {} fused decode steps, CUDA vs CPU logits: rel RMS {e:.2e}",
        t - prefix
    );
    assert!(e <= 1e-5, "CUDA vs CPU logits rel RMS {e:.2e}");
    Ok(())
}

#[test]
fn decode_step_matches_cpu_and_the_chunked_op() -> Result<()> {
    // One token per sequence: the step from h0 equals the step on the CPU and the chunked
    // CUDA op on a one-token sequence with that initial state.
    let dev = cuda()?;
    let c = Case::new("step", 2, 1, 3, 24, 40, 2).h0().seed(31);
    for dtype in [DType::F32, DType::BF16] {
        let x = inputs(&c, dtype)?;
        let step = |d: &Device| -> Result<(Tensor, Tensor)> {
            let put =
                |t: &Tensor, dt: DType| -> Result<Tensor> { Ok(t.to_dtype(dt)?.to_device(d)?) };
            let h0 = x.h0.as_ref().expect("h0");
            let (o, s) = gated_delta_product_step(
                &put(h0, DType::F32)?,
                &put(&x.q.squeeze(1)?, dtype)?,
                &put(&x.k, dtype)?,
                &put(&x.v, dtype)?,
                &put(&x.g.squeeze(1)?, DType::F32)?,
                &put(&x.beta, dtype)?,
                None,
            )?;
            assert_eq!(o.dtype(), dtype);
            assert!(o.device().same_device(d) && s.device().same_device(d));
            Ok((
                o.to_dtype(DType::F32)?.to_device(&Device::Cpu)?,
                s.to_dtype(DType::F32)?.to_device(&Device::Cpu)?,
            ))
        };
        let (o_gpu, s_gpu) = step(&dev)?;
        let (o_cpu, s_cpu) = step(&Device::Cpu)?;
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        check(&c, &format!("step o {dtype:?}"), &o_gpu, &o_cpu, tol)?;
        check(&c, &format!("step S {dtype:?}"), &s_gpu, &s_cpu, tol)?;
        let (o_op, ht_op) = run_on(&c, &x, dtype, &dev)?;
        let o_op = o_op.squeeze(1)?.to_dtype(DType::F32)?;
        check(&c, &format!("step/op o {dtype:?}"), &o_gpu, &o_op, tol)?;
        check(&c, &format!("step/op S {dtype:?}"), &s_gpu, &ht_op, tol)?;
    }
    Ok(())
}

/// Context parallelism over `R` distinct CUDA devices (one `Device::new_cuda(0)` call each)
/// equals the single-device CUDA op: outputs, final states and every gradient (f32, relative
/// RMS within 1e-5).
fn cp_check(c: &Case, ranks: &[usize]) -> Result<()> {
    cp_check_in(c, ranks, DType::F32, 1e-5, Nothing)
}

/// [`cp_check`] with the inputs in `dtype` (gates, states and cotangents in f32), within `tol`
/// of the single-device CUDA op on the same inputs; the ranks keep what `save` names of their
/// forward's intermediates for the backward (`save_intermediates`).
fn cp_check_in(
    c: &Case,
    ranks: &[usize],
    dtype: DType,
    tol: f64,
    save: SaveIntermediates,
) -> Result<()> {
    cp_check_with(c, ranks, dtype, tol, save, true)
}

/// [`cp_check_in`], with or without the final state (without it, `o` alone crosses the op in
/// the inputs' dtype and only `dout` is a cotangent).
fn cp_check_with(
    c: &Case,
    ranks: &[usize],
    dtype: DType,
    tol: f64,
    save: SaveIntermediates,
    final_state: bool,
) -> Result<()> {
    let dev = cuda()?;
    let x = inputs(c, DType::F32)?;
    let want = if final_state {
        run_op_on(c, &x, dtype, &dev)?
    } else {
        run_op_plain_on(c, &x, dtype, &dev)?
    };
    let Inputs {
        q,
        k,
        v,
        g,
        beta,
        h0,
        dout,
        dht,
    } = x.cast(dtype)?;
    for &r in ranks {
        let devices = (0..r)
            .map(|_| Device::new_cuda(0))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let cp = ContextParallel::new(devices)?;
        let opts = GdpOptions {
            initial_state: h0.as_ref(),
            output_final_state: final_state,
            cu_seqlens: c.cu.as_deref(),
            save_intermediates: save,
            ..Default::default()
        };
        let got = cp.gated_delta_product(
            &q,
            &k,
            &v,
            &g,
            &beta,
            &opts,
            Some(Cotangents {
                dout: &dout,
                dht: final_state.then_some(&dht),
            }),
        )?;
        let grads = got.grads.expect("grads");
        let mut pairs = vec![("o", got.o, want.o.clone())];
        if final_state {
            pairs.push(("ht", got.final_state.expect("ht"), want.ht.clone()));
        }
        pairs.extend([
            ("dq", grads.dq, want.grads[0].1.clone()),
            ("dk", grads.dk, want.grads[1].1.clone()),
            ("dv", grads.dv, want.grads[2].1.clone()),
            ("dg", grads.dg, want.grads[3].1.clone()),
            ("dbeta", grads.dbeta, want.grads[4].1.clone()),
        ]);
        match grads.dh0 {
            Some(dh0) => pairs.push(("dh0", dh0, want.grads[5].1.clone())),
            None => assert!(!c.h0, "{}: dh0 missing", c.name),
        }
        let mut report = vec![];
        for (name, a, b) in pairs {
            let a = a.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
            assert_eq!(a.dims(), b.dims(), "{} cp={r}: {name} shape", c.name);
            let e = rel_rms(&a, &b)?;
            report.push(format!("{name} {e:.0e}"));
            assert!(
                e.is_finite() && e <= tol,
                "{} cp={r} {dtype:?}: {name} relative RMS {e:.2e}",
                c.name
            );
        }
        println!("{:<26} cuda cp={r} {dtype:?} {}", c.name, report.join(" "));
    }
    Ok(())
}

#[test]
fn context_parallel_dense_on_cuda_equals_single_device() -> Result<()> {
    cp_check(
        &Case::new("dense n1 h0", 2, 75, 2, 16, 12, 1).h0(),
        &[1, 2, 3, 4],
    )?;
    cp_check(&Case::new("dense n2", 1, 130, 2, 12, 16, 2), &[1, 2, 3, 4])?;
    cp_check(
        &Case::new("dense n3 K64 V48 h0", 1, 300, 2, 64, 48, 3)
            .h0()
            .seed(41),
        &[2, 4],
    )?;
    Ok(())
}

#[test]
fn context_parallel_packed_on_cuda_equals_single_device() -> Result<()> {
    let cu = [0, 3, 3, 90, 95, 96, 160, 200];
    cp_check(
        &Case::new("packed n2 h0", 1, 200, 2, 12, 8, 2)
            .packed(&cu)
            .h0(),
        &[1, 2, 3, 4],
    )?;
    cp_check(
        &Case::new("packed n1", 1, 200, 2, 8, 12, 1).packed(&cu),
        &[3, 4],
    )?;
    cp_check(
        &Case::new("packed n3 h0", 1, 200, 1, 10, 10, 3)
            .packed(&[0, 150, 151, 200])
            .h0(),
        &[1, 2, 3, 4],
    )?;
    cp_check(
        &Case::new("packed strong n2 h0", 1, 260, 2, 32, 24, 2)
            .packed(&[0, 7, 200, 260])
            .strong_gates()
            .h0()
            .seed(43),
        &[2, 4],
    )?;
    Ok(())
}

/// bf16 ranks take the summaries of the chunked bf16 kernels (`[u | 0]` from `[h0 | I]`, and
/// the state-gradient scan from `[dht | I]`), K + V up to 256.
#[test]
fn context_parallel_bf16_on_cuda_matches_single_device() -> Result<()> {
    let bf = |c: &Case, ranks: &[usize]| cp_check_in(c, ranks, DType::BF16, 1e-2, Nothing);
    // The ranks' backward on their forward's saved intermediates (of the folded states).
    for save in [WyFactors, All] {
        let c = Case::new("bf16 dense n2 h0 saved", 2, 300, 2, 64, 48, 2).h0();
        cp_check_in(&c, &[3], DType::BF16, 1e-2, save)?;
    }
    bf(
        &Case::new("bf16 dense n2 h0", 2, 300, 2, 64, 48, 2).h0(),
        &[2, 3],
    )?;
    bf(
        &Case::new("bf16 dense n1 K=V=128", 1, 333, 2, 128, 128, 1).seed(47),
        &[2, 4],
    )?;
    bf(
        &Case::new("bf16 dense n1 K33 V22", 1, 200, 2, 33, 22, 1).seed(71),
        &[2],
    )?;
    // Grouped value heads: the ranks read `q`, `k` of Hk heads in place, as the plain op does.
    bf(
        &Case::new("bf16 grouped r2 n1 h0", 1, 333, 4, 128, 64, 1)
            .key_heads(2)
            .h0()
            .seed(83),
        &[3],
    )?;
    bf(
        &Case::new("bf16 packed n3 strong h0", 1, 290, 2, 32, 40, 3)
            .packed(&[0, 5, 140, 141, 290])
            .strong_gates()
            .h0()
            .seed(53),
        &[2, 3],
    )?;
    // Without the final state: `o` in bf16 straight from the ranks' correction kernel, and
    // the backward's bf16 `do` alone; dense (every batch row continues) and packed.
    for (c, ranks) in [
        (
            Case::new("bf16 plain dense n2 h0", 2, 300, 2, 64, 48, 2).h0(),
            &[1, 3][..],
        ),
        (
            Case::new("bf16 plain dense n1 K=V=128", 1, 333, 3, 128, 128, 1).seed(59),
            &[4][..],
        ),
        (
            Case::new("bf16 plain grouped r4 n2", 2, 200, 4, 64, 64, 2)
                .key_heads(1)
                .seed(89),
            &[2][..],
        ),
        // Odd K (rows of odd width V + K): the correction's element-wise paths.
        (
            Case::new("bf16 plain dense n2 K33 V22", 2, 150, 2, 33, 22, 2)
                .h0()
                .seed(67),
            &[3][..],
        ),
        (
            Case::new("bf16 plain packed n2 strong", 1, 290, 2, 48, 32, 2)
                .packed(&[0, 100, 101, 290])
                .strong_gates()
                .seed(61),
            &[2, 4][..],
        ),
    ] {
        cp_check_with(&c, ranks, DType::BF16, 1e-2, WyFactors, false)?;
    }
    Ok(())
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
    for bv in [None, Some(64), Some(32), Some(16)] {
        let forced = GdpOptions {
            kernels: KernelConfig {
                forward: KernelPath::Fused,
                tiles: TileConfig {
                    fused_forward: bv,
                    ..Default::default()
                },
                ..Default::default()
            },
            ..opts.clone()
        };
        let ms = median_ms(&dev, 3, 20, || {
            gated_delta_product_packed(&qk, &v, &g, &beta, &forced)?;
            Ok(())
        })?;
        let label = bv.map_or("auto".to_string(), |bv| format!("BV={bv}"));
        println!("timing {flops_note}: packed entry, fused forward, {label}: median {ms:.3} ms");
        results.push((label, ms));
    }
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

#[test]
#[ignore = "timing; run with --ignored on a GPU"]
fn timing_backward_bf16_b4_t4096_h16_k128_v128_n2() -> Result<()> {
    let dev = cuda()?;
    let (b, t, h, kd, vd, n) = (4usize, 4096usize, 16usize, 128usize, 128usize, 2usize);
    let unit = |shape: &[usize]| -> Result<Tensor> {
        let x = Tensor::randn(0f32, 1f32, shape, &dev)?;
        let norm = x.sqr()?.sum_keepdim(candle_core::D::Minus1)?.sqrt()?;
        Ok(x.broadcast_div(&norm)?.to_dtype(DType::BF16)?)
    };
    let qk = Var::from_tensor(&unit(&[b, t, n + 1, h, kd])?)?;
    let v = Var::from_tensor(
        &Tensor::randn(0f32, 1f32, (b, t * n, h, vd), &dev)?.to_dtype(DType::BF16)?,
    )?;
    let beta = Var::from_tensor(
        &(candle_nn::ops::sigmoid(&Tensor::randn(0f32, 1f32, (b, t * n, h), &dev)?)? * 2.0)?
            .to_dtype(DType::BF16)?,
    )?;
    let g = Var::from_tensor(&(Tensor::rand(0f32, 1f32, (b, t, h), &dev)? * -0.5)?)?;
    let dout = Tensor::randn(0f32, 1f32, (b, t, h, vd), &dev)?;
    let opts = GdpOptions::default();
    let note = "B4 T4096 H16 K=V=128 n=2 bf16";
    let fwd = median_ms(&dev, 2, 10, || {
        gated_delta_product_packed(&qk, &v, &g, &beta, &opts)?;
        Ok(())
    })?;
    let both = median_ms(&dev, 2, 10, || {
        let (o, _) = gated_delta_product_packed(&qk, &v, &g, &beta, &opts)?;
        let gs = (o.to_dtype(DType::F32)? * &dout)?.sum_all()?.backward()?;
        assert!(gs.get(qk.as_tensor()).is_some());
        Ok(())
    })?;
    println!(
        "timing {note}: forward {fwd:.3} ms, forward + backward (incl. loss ops) {both:.3} ms"
    );
    Ok(())
}

#[test]
#[ignore = "timing; run with --ignored on a GPU"]
fn timing_context_parallel_bf16_b1_t32768_h16_k128_v128_n2() -> Result<()> {
    // R ranks share one GPU (each its own stream), each with T / R tokens; the same ranks also
    // run the plain op on their tokens at the same time (no protocol). The ratio of the two
    // times is what the protocol costs (summaries, collectives, fold), at this GPU sharing.
    use candle_gdp::cp::{cp_gated_delta_product, dense_rank_meta, CpRank, ShardPlan};
    let (t, h, d, n) = (32768usize, 16usize, 128usize, 2usize);
    let configs = [
        (2usize, KernelPath::Auto, false),
        (2, KernelPath::Fused, false),
        (2, KernelPath::Auto, true),
        (4, KernelPath::Auto, false),
    ];
    for (ranks, summaries, save) in configs {
        let devices = (0..ranks)
            .map(|_| Device::new_cuda(0))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let cp = ContextParallel::new(devices)?.with_timeout(std::time::Duration::from_secs(20));
        let per_rank = cp.run(|comm, dev| {
            let r = comm.rank();
            let tl = t / ranks;
            dev.set_seed(100 + r as u64)?;
            let unit = |rows: usize| -> candle_core::Result<Var> {
                let x = Tensor::randn(0f32, 1f32, (1, rows, h, d), dev)?;
                let norm = x.sqr()?.sum_keepdim(candle_core::D::Minus1)?.sqrt()?;
                Var::from_tensor(&x.broadcast_div(&norm)?.to_dtype(DType::BF16)?)
            };
            let (q, k) = (unit(tl)?, unit(tl * n)?);
            let v = Var::from_tensor(
                &Tensor::randn(0f32, 1f32, (1, tl * n, h, d), dev)?.to_dtype(DType::BF16)?,
            )?;
            let beta = Var::from_tensor(
                &candle_nn::ops::sigmoid(&Tensor::randn(0f32, 1f32, (1, tl * n, h), dev)?)?
                    .to_dtype(DType::BF16)?,
            )?;
            let g = Var::from_tensor(&(Tensor::rand(0f32, 1f32, (1, tl, h), dev)? * -0.1)?)?;
            let dout = Tensor::randn(0f32, 1f32, (1, tl, h, d), dev)?.to_dtype(DType::BF16)?;
            let rank = CpRank {
                comm: comm.clone(),
                meta: dense_rank_meta(&ShardPlan::new(t, ranks)?, r)?,
                composition: Default::default(),
            };
            let opts = GdpOptions {
                save_intermediates: save.into(),
                kernels: KernelConfig {
                    summaries,
                    ..Default::default()
                },
                ..Default::default()
            };
            // (forward ms on this rank, forward + backward ms until every rank is done)
            let step = |with_cp: bool| -> candle_core::Result<(f64, f64)> {
                comm.barrier()?;
                let t0 = std::time::Instant::now();
                let o = if with_cp {
                    cp_gated_delta_product(&q, &k, &v, &g, &beta, &opts, &rank)?.0
                } else {
                    gated_delta_product(&q, &k, &v, &g, &beta, &opts)?.0
                };
                dev.synchronize()?;
                let fwd = t0.elapsed().as_secs_f64() * 1e3;
                candle_gdp::backward_with(&[(&o, &dout)])?;
                dev.synchronize()?;
                comm.barrier()?;
                Ok((fwd, t0.elapsed().as_secs_f64() * 1e3))
            };
            let median = |mut xs: Vec<f64>| {
                xs.sort_by(f64::total_cmp);
                xs[xs.len() / 2]
            };
            let mut times = vec![];
            for with_cp in [false, true] {
                step(with_cp)?;
                step(with_cp)?;
                let ts = (0..5)
                    .map(|_| step(with_cp))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                times.push(median(ts.iter().map(|t| t.0).collect()));
                times.push(median(ts.iter().map(|t| t.1).collect()));
            }
            Ok(times)
        })?;
        let [pf, plain, cf, with_cp] = per_rank[0][..] else {
            anyhow::bail!("four timings per rank expected");
        };
        println!(
            "timing B1 T32768 H16 K=V=128 n=2 bf16, {ranks} ranks of {} tokens on one GPU \
             (summaries {summaries:?}, save_intermediates {save}): plain op on every rank fwd \
             {pf:.2} ms, fwd+bwd {plain:.2} ms; context parallel fwd {cf:.2} ms, fwd+bwd \
             {with_cp:.2} ms; ratio {:.2}",
            t / ranks,
            plain / with_cp
        );
    }
    // The whole-problem wrapper (shards, runs the ranks, gathers on `q`'s device).
    let dev = cuda()?;
    let unit = |rows: usize| -> Result<Tensor> {
        let x = Tensor::randn(0f32, 1f32, (1, rows, h, d), &dev)?;
        let norm = x.sqr()?.sum_keepdim(candle_core::D::Minus1)?.sqrt()?;
        Ok(x.broadcast_div(&norm)?.to_dtype(DType::BF16)?)
    };
    let (q, k) = (unit(t)?, unit(t * n)?);
    let v = Tensor::randn(0f32, 1f32, (1, t * n, h, d), &dev)?.to_dtype(DType::BF16)?;
    let beta = candle_nn::ops::sigmoid(&Tensor::randn(0f32, 1f32, (1, t * n, h), &dev)?)?
        .to_dtype(DType::BF16)?;
    let g = (Tensor::rand(0f32, 1f32, (1, t, h), &dev)? * -0.1)?;
    let dout = Tensor::randn(0f32, 1f32, (1, t, h, d), &dev)?.to_dtype(DType::BF16)?;
    for ranks in [1usize, 2] {
        let devices = (0..ranks)
            .map(|_| Device::new_cuda(0))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let cp = ContextParallel::new(devices)?.with_timeout(std::time::Duration::from_secs(20));
        let ms = median_ms(&dev, 1, 3, || {
            let cot = Cotangents {
                dout: &dout,
                dht: None,
            };
            let opts = GdpOptions::default();
            cp.gated_delta_product(&q, &k, &v, &g, &beta, &opts, Some(cot))?;
            Ok(())
        })?;
        println!(
            "timing ContextParallel::gated_delta_product, B1 T32768 H16 K=V=128 n=2 bf16, \
             {ranks} rank(s) on one GPU, outputs and all gradients gathered: {ms:.1} ms"
        );
    }
    Ok(())
}

/// Issue 43's edges on CUDA, f32, forward and every gradient: gates down to -1e4 and -inf, β
/// exactly 0 and 2, zero-length packed sequences (`tests/edges.rs` runs them on the CPU).
/// Each within 1e-5 of the CPU op, or else both within 1e-5 of f64 (as in
/// `backward_f32_matches_cpu_op`). Then a NaN in one (sequence, head) leaves every other
/// sequence's and head's outputs and final states bit for bit as they were.
#[test]
fn edge_numerics_match_cpu_and_nan_stays_in_its_sequence() -> Result<()> {
    use candle_core::IndexOp;
    let dev = cuda()?;
    let mut cases = common::deep_gate_cases(DType::F32, -1e4)?;
    cases.extend(common::deep_gate_cases(DType::F32, f64::NEG_INFINITY)?);
    cases.extend(common::edge_beta_cases(DType::F32)?);
    for c in common::empty_sequence_cases() {
        let x = inputs(&c, DType::F32)?;
        cases.push((c, x));
    }
    for (c, x) in &cases {
        let got = run_op_on(c, x, DType::F32, &dev)?;
        let cpu = run_op_on(c, x, DType::F32, &Device::Cpu)?;
        let refr = run_reference(c, x)?;
        common::assert_same_grads(&got.grads, &refr.grads);
        let outs = [
            ("o", &got.o, &cpu.o, &refr.o),
            ("ht", &got.ht, &cpu.ht, &refr.ht),
        ];
        let grads = got
            .grads
            .iter()
            .zip(&cpu.grads)
            .zip(&refr.grads)
            .map(|(((name, a), (_, b)), (_, r))| (*name, a, b, r));
        for (name, a, b, r) in outs.into_iter().chain(grads) {
            let e = rel_rms(a, b)?;
            if e <= 1e-5 {
                check(c, &format!("{name} vs cpu"), a, b, 1e-5)?;
            } else {
                let (e_gpu, e_cpu) = (rel_rms(a, r)?, rel_rms(b, r)?);
                println!(
                    "{:<28} {name} vs cpu {e:.2e}: vs f64 cuda {e_gpu:.2e}, cpu {e_cpu:.2e}",
                    c.name
                );
                assert!(
                    e_gpu <= 1e-5 && e_cpu <= 1e-5,
                    "{}: {name} vs cpu {e:.2e}, vs f64: cuda {e_gpu:.2e}, cpu {e_cpu:.2e}",
                    c.name
                );
            }
        }
    }
    // NaN in v at token 100 (sequence 1 of [0, 40, 150, 150, 240]), head 1.
    let c = Case::new("nan packed n2", 1, 240, 2, 16, 12, 2)
        .packed(&[0, 40, 150, 150, 240])
        .h0()
        .seed(53);
    let x = inputs(&c, DType::F32)?;
    let clean = run_op_on(&c, &x, DType::F32, &dev)?;
    let mut v = x.v.flatten_all()?.to_vec1::<f64>()?;
    v[((201 * 2) + 1) * 12 + 3] = f64::NAN;
    let xp = Inputs {
        v: Tensor::from_vec(v, x.v.dims(), &Device::Cpu)?,
        ..x.clone()
    };
    let dirty = run_op_on(&c, &xp, DType::F32, &dev)?;
    let bits = |t: &Tensor| -> Result<Vec<u64>> {
        let v = t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        Ok(v.iter().map(|x| x.to_bits()).collect())
    };
    for (what, a, b) in [
        (
            "o head 0",
            dirty.o.narrow(2, 0, 1)?,
            clean.o.narrow(2, 0, 1)?,
        ),
        (
            "o tokens 0..40",
            dirty.o.narrow(1, 0, 40)?,
            clean.o.narrow(1, 0, 40)?,
        ),
        (
            "o tokens 150..",
            dirty.o.narrow(1, 150, 90)?,
            clean.o.narrow(1, 150, 90)?,
        ),
        (
            "ht head 0",
            dirty.ht.narrow(1, 0, 1)?,
            clean.ht.narrow(1, 0, 1)?,
        ),
        (
            "ht seq 0",
            dirty.ht.narrow(0, 0, 1)?,
            clean.ht.narrow(0, 0, 1)?,
        ),
        (
            "ht seqs 2..",
            dirty.ht.narrow(0, 2, 2)?,
            clean.ht.narrow(0, 2, 2)?,
        ),
    ] {
        assert_eq!(
            bits(&a)?,
            bits(&b)?,
            "NaN in sequence 1, head 1 changed {what}"
        );
    }
    let o_nan = dirty.o.i((0, 100, 1))?.to_vec1::<f32>()?;
    assert!(
        o_nan.iter().any(|x| !x.is_finite()),
        "o at the NaN's token is finite"
    );
    let ht = dirty.ht.i((1, 1))?.flatten_all()?.to_vec1::<f32>()?;
    assert!(ht.iter().any(|x| !x.is_finite()), "final state finite");
    Ok(())
}
