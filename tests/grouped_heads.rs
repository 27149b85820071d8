//! Grouped value heads (`Hv = r · Hk`, value head `h` reads key head `h / r`): the f64
//! reference against itself on explicitly repeated heads, and every CPU path (the op, its
//! packed layout, the explicit VJP, context parallelism, the decode step) against the reference.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gdp::op::recurrent::{gated_delta_product_step, gated_delta_product_step_fused};
use candle_gdp::{gated_delta_product, GdpOptions, SaveIntermediates};
use common::{
    assert_close, cp_check_cpu, inputs, rel_rms, run_op, run_op_packed_on, run_op_vjp_on,
    run_reference, Case, Inputs,
};

/// Odd sizes: T not a multiple of 64, K != V, n = 1..3, r = 2 and 3, packed sequences, an
/// initial state, strong gates.
fn cases() -> Vec<Case> {
    vec![
        Case::new("r2 n1 T70 K16 V24", 1, 70, 4, 16, 24, 1)
            .key_heads(2)
            .h0(),
        Case::new("r3 n2 packed", 1, 75, 6, 8, 12, 2)
            .key_heads(2)
            .packed(&[0, 9, 40, 75])
            .h0(),
        Case::new("r2 n3 B2 strong", 2, 33, 2, 12, 8, 3)
            .key_heads(1)
            .strong_gates(),
    ]
}

/// `x [.., Hk, D]` (heads on axis `dim`) with each head repeated `r` times in grouped order.
fn repeat_heads(x: &Tensor, dim: usize, r: usize) -> Result<Tensor> {
    let mut parts = vec![];
    for h in 0..x.dim(dim)? {
        for _ in 0..r {
            parts.push(x.narrow(dim, h, 1)?);
        }
    }
    Ok(Tensor::cat(&parts, dim)?)
}

/// `dx [.., Hk·r, D]` summed over each group of `r` heads.
fn sum_groups(dx: &Tensor, dim: usize, r: usize) -> Result<Tensor> {
    let mut parts = vec![];
    for h in 0..dx.dim(dim)? / r {
        parts.push(dx.narrow(dim, h * r, r)?.sum_keepdim(dim)?);
    }
    Ok(Tensor::cat(&parts, dim)?)
}

#[test]
fn reference_reads_key_head_h_over_r() -> Result<()> {
    for c in cases() {
        let r = c.h / c.hk();
        let x = inputs(&c, DType::F32)?;
        let got = run_reference(&c, &x)?;
        let repeated = Inputs {
            q: repeat_heads(&x.q, 2, r)?,
            k: repeat_heads(&x.k, 2, r)?,
            ..x.clone()
        };
        let flat = Case {
            key_heads: None,
            ..c.clone()
        };
        let mut want = run_reference(&flat, &repeated)?;
        for (name, g) in want.grads.iter_mut() {
            if *name == "dq" || *name == "dk" {
                *g = sum_groups(g, 2, r)?;
            }
        }
        let worst = assert_close(&c, &got, &want, 1e-12)?;
        assert!(worst <= 1e-12, "{}: {worst:e}", c.name);
    }
    Ok(())
}

#[test]
fn op_matches_reference_f32() -> Result<()> {
    for c in cases() {
        let x = inputs(&c, DType::F32)?;
        let want = run_reference(&c, &x)?;
        assert_close(&c, &run_op(&c, &x, DType::F32)?, &want, 1e-5)?;
        let packed = run_op_packed_on(&c, &x, DType::F32, &Device::Cpu)?;
        assert_close(&c, &packed, &want, 1e-5)?;
        let save = SaveIntermediates::WyFactors;
        let vjp = run_op_vjp_on(&c, &x, DType::F32, &Device::Cpu, true, save)?;
        assert_close(&c, &vjp, &want, 1e-5)?;
    }
    Ok(())
}

#[test]
fn op_matches_reference_bf16() -> Result<()> {
    let c = cases().remove(1);
    let x = inputs(&c, DType::BF16)?;
    assert_close(
        &c,
        &run_op(&c, &x, DType::BF16)?,
        &run_reference(&c, &x)?,
        1e-2,
    )?;
    Ok(())
}

#[test]
fn context_parallel_matches_single_device() -> Result<()> {
    for c in cases() {
        cp_check_cpu(&c, &[2, 3])?;
    }
    Ok(())
}

#[test]
fn decode_step_matches_repeated_heads() -> Result<()> {
    let (b, hk, r, dk, dv, n) = (2, 2, 3, 8, 6, 2);
    let dev = Device::Cpu;
    let [state, q, k, v, g, beta] = common::step_inputs(b, hk * r, dk, dv, n, &dev)?;
    // Keep one key head per group: the grouped call sees those, the flat call their repeats.
    let (q, k) = (q.narrow(1, 0, hk)?, k.narrow(2, 0, hk)?);
    let (qr, kr) = (repeat_heads(&q, 1, r)?, repeat_heads(&k, 2, r)?);
    let (o_want, s_want) = gated_delta_product_step(&state, &qr, &kr, &v, &g, &beta, None)?;
    for fused in [false, true] {
        let step = if fused {
            gated_delta_product_step_fused
        } else {
            gated_delta_product_step
        };
        let (o, s) = step(&state, &q, &k, &v, &g, &beta, None)?;
        assert!(rel_rms(&o, &o_want)? <= 1e-6, "fused {fused}: o");
        assert!(rel_rms(&s, &s_want)? <= 1e-6, "fused {fused}: state");
    }
    Ok(())
}

#[test]
fn value_heads_must_be_a_multiple_of_key_heads() -> Result<()> {
    let dev = Device::Cpu;
    let (b, t, dk, dv) = (1, 5, 4, 4);
    let q = Tensor::zeros((b, t, 4, dk), DType::F32, &dev)?;
    let v = Tensor::zeros((b, t, 6, dv), DType::F32, &dev)?;
    let g = Tensor::zeros((b, t, 6), DType::F32, &dev)?;
    let beta = Tensor::zeros((b, t, 6), DType::F32, &dev)?;
    let err = gated_delta_product(&q, &q, &v, &g, &beta, &GdpOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`v` has 6 heads") && err.contains("4 heads"),
        "{err}"
    );
    // Fewer value heads than key heads is no grouping either.
    let v2 = v.narrow(2, 0, 2)?;
    let (g2, b2) = (g.narrow(2, 0, 2)?, beta.narrow(2, 0, 2)?);
    let err = gated_delta_product(&q, &q, &v2, &g2, &b2, &GdpOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("`v` has 2 heads"), "{err}");
    Ok(())
}

/// The same on CUDA: f32 against the f64 reference at 1e-5, bf16 at 1e-2, and a context-parallel
/// group of two ranks on one GPU against the single-device op.
#[cfg(feature = "cuda")]
#[test]
fn cuda_matches_reference() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    for c in cases() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
            let x = inputs(&c, dtype)?;
            let want = run_reference(&c, &x)?;
            assert_close(&c, &common::run_op_on(&c, &x, dtype, &dev)?, &want, tol)?;
        }
    }
    let c = cases().remove(1);
    let x = inputs(&c, DType::BF16)?.cast(DType::BF16)?;
    let opts = GdpOptions {
        initial_state: x.h0.as_ref(),
        output_final_state: true,
        cu_seqlens: c.cu.as_deref(),
        ..Default::default()
    };
    let on = |t: &Tensor| t.to_device(&dev);
    let (q, k, v, g, beta) = (on(&x.q)?, on(&x.k)?, on(&x.v)?, on(&x.g)?, on(&x.beta)?);
    let h0 = x.h0.as_ref().map(on).transpose()?;
    let on_gpu = GdpOptions {
        initial_state: h0.as_ref(),
        ..opts.clone()
    };
    let (o, ht) = gated_delta_product(&q, &k, &v, &g, &beta, &on_gpu)?;
    let cp = candle_gdp::ContextParallel::new(vec![dev.clone(), Device::new_cuda(0)?])?;
    let got = cp.gated_delta_product(&x.q, &x.k, &x.v, &x.g, &x.beta, &opts, None)?;
    assert!(
        rel_rms(&got.o, &o.to_device(&Device::Cpu)?)? <= 1e-2,
        "cp o"
    );
    let ht = ht.expect("final state").to_device(&Device::Cpu)?;
    let got_ht = got.final_state.expect("final state");
    assert!(rel_rms(&got_ht, &ht)? <= 1e-2, "cp ht");
    Ok(())
}

/// On CUDA in bf16 the chunked kernels read grouped `q`, `k` in place (no repeated copy):
/// the same output bits as the op on explicitly repeated heads, and `dq`, `dk` the group sums
/// of its gradients (per value head, summed in f32, so equal up to the order of those sums), at
/// Qwen's K = V = 128 and at odd sizes with packed sequences.
#[cfg(feature = "cuda")]
#[test]
fn cuda_reads_key_heads_in_place() -> Result<()> {
    use candle_core::Var;
    use candle_gdp::op::shape::GdpShape;
    let dev = Device::new_cuda(0)?;
    let cases = [
        Case::new("r2 n1 T150 K128 V128", 1, 150, 4, 128, 128, 1)
            .key_heads(2)
            .h0(),
        Case::new("r3 n2 packed K64 V96", 1, 130, 6, 64, 96, 2)
            .key_heads(2)
            .packed(&[0, 50, 130]),
    ];
    for c in cases {
        let r = c.h / c.hk();
        let x = inputs(&c, DType::BF16)?.cast(DType::BF16)?;
        let on = |t: &Tensor| t.to_device(&dev);
        let (q, k) = (Var::from_tensor(&on(&x.q)?)?, Var::from_tensor(&on(&x.k)?)?);
        let (qr, kr) = (
            Var::from_tensor(&repeat_heads(&q, 2, r)?)?,
            Var::from_tensor(&repeat_heads(&k, 2, r)?)?,
        );
        let (v, g, beta, dout) = (on(&x.v)?, on(&x.g)?, on(&x.beta)?, on(&x.dout)?);
        let h0 = x.h0.as_ref().map(on).transpose()?;
        let opts = GdpOptions {
            initial_state: h0.as_ref(),
            cu_seqlens: c.cu.as_deref(),
            ..Default::default()
        };
        let sh = GdpShape::new(c.b, c.t, c.h, c.k, c.v, c.n, c.cu.as_deref());
        assert!(
            candle_gdp::op::cuda::reads_qk_in_place(&q, &sh, &opts.kernels)?,
            "{}: the bf16 chunked kernels should read q, k in place",
            c.name
        );
        let run =
            |q: &Tensor, k: &Tensor| -> Result<(Vec<f32>, candle_core::backprop::GradStore)> {
                let (o, _) = gated_delta_product(q, k, &v, &g, &beta, &opts)?;
                let loss = (o.to_dtype(DType::F32)? * dout.to_dtype(DType::F32)?)?.sum_all()?;
                let bits = o.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                Ok((bits, loss.backward()?))
            };
        let (o, grads) = run(&q, &k)?;
        let (o_rep, grads_rep) = run(&qr, &kr)?;
        assert_eq!(o, o_rep, "{}: o differs from the repeated heads'", c.name);
        for (name, x, xr) in [("dq", &q, &qr), ("dk", &k, &kr)] {
            let got = grads.get(x).expect("gradient").to_dtype(DType::F32)?;
            let per_head = grads_rep.get(xr).expect("gradient").to_dtype(DType::F32)?;
            let want = sum_groups(&per_head, 2, r)?.to_dtype(DType::BF16)?;
            // The same per-head values summed in f32 and rounded: equal up to the order of
            // the f32 sums (a wrong head or row would be off by O(1)).
            let err = rel_rms(&got, &want.to_dtype(DType::F32)?)?;
            assert!(
                err <= 1e-3,
                "{}: {name} is not the group sum ({err:e})",
                c.name
            );
        }
    }
    Ok(())
}
