//! The chunked CPU op (forward and every gradient) against the f64 token-by-token reference on
//! fresh random inputs: odd sizes, K ≠ V, n = 1..3, packed sequences, strong gates, bf16/f16.

mod common;

use anyhow::Result;
use candle_core::DType;
use candle_core::Device;
use common::{
    assert_close, inputs, rel_rms, run_op, run_op_packed_on, run_op_plain_on, run_reference, Case,
};

fn cases() -> Vec<Case> {
    vec![
        Case::new("dense n1 T75 K16 V24 h0", 2, 75, 2, 16, 24, 1).h0(),
        Case::new("dense n2 T130 K32 V20", 1, 130, 3, 32, 20, 2),
        Case::new("dense n3 T67 K20 V32 h0", 2, 67, 2, 20, 32, 3)
            .h0()
            .seed(11),
        Case::new("dense n2 T1", 2, 1, 2, 8, 8, 2).h0(),
        Case::new("strong n2 T150 K24 V16", 1, 150, 2, 24, 16, 2)
            .strong_gates()
            .h0(),
        Case::new("strong n3 T100 K16 V16", 2, 100, 1, 16, 16, 3).strong_gates(),
        Case::new("packed n2 h0", 1, 213, 2, 16, 12, 2)
            .packed(&[0, 5, 5, 70, 200, 213])
            .h0(),
        Case::new("packed n3 strong", 1, 129, 2, 12, 20, 3)
            .packed(&[0, 1, 64, 129])
            .strong_gates(),
        Case::new("packed n1", 1, 97, 3, 16, 16, 1)
            .packed(&[0, 33, 96, 97])
            .h0(),
        // Wide keys under strong gates: the gate gradient sums large dS-driven terms.
        Case::new("strong n1 T70 K256 V200", 1, 70, 2, 256, 200, 1)
            .strong_gates()
            .seed(29),
        Case::new("strong n2 T130 K64 V64 h0", 2, 130, 2, 64, 64, 2)
            .strong_gates()
            .h0()
            .seed(19),
    ]
}

#[test]
fn f32_matches_f64_reference() -> Result<()> {
    for c in cases() {
        let x = inputs(&c, DType::F32)?;
        let got = run_op(&c, &x, DType::F32)?;
        let want = run_reference(&c, &x)?;
        assert_close(&c, &got, &want, 1e-5)?;
    }
    Ok(())
}

#[test]
fn half_precision_matches_f64_reference() -> Result<()> {
    for dtype in [DType::BF16, DType::F16] {
        for c in cases().into_iter().step_by(2) {
            let x = inputs(&c, dtype)?;
            let got = run_op(&c, &x, dtype)?;
            let want = run_reference(&c, &x)?;
            assert_close(&c, &got, &want, 1e-2)?;
        }
    }
    Ok(())
}

#[test]
fn without_final_state_matches_f64_reference() -> Result<()> {
    // `output_final_state = false`: `o` alone in the inputs' dtype, backpropagated from `do`
    // alone (the reference with a zero final-state cotangent).
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
        for c in cases().into_iter().step_by(3) {
            let x = inputs(&c, dtype)?;
            let got = run_op_plain_on(&c, &x, dtype, &Device::Cpu)?;
            let want = run_reference(&c, &x.without_dht()?)?;
            assert_close(&c, &got, &want, tol)?;
        }
    }
    Ok(())
}

#[test]
fn packed_and_separate_queries_and_keys_agree() -> Result<()> {
    // `gated_delta_product` hands `dq`, `dk` back without a packed graph node (and `dv`,
    // `dg`, `dbeta`, `dh0` through a tie); the packed entry point goes through Candle's `cat`.
    for c in cases() {
        let x = inputs(&c, DType::F32)?;
        let split = run_op(&c, &x, DType::F32)?;
        let packed = run_op_packed_on(&c, &x, DType::F32, &Device::Cpu)?;
        assert_eq!(rel_rms(&split.o, &packed.o)?, 0.0, "{}: o", c.name);
        assert_eq!(rel_rms(&split.ht, &packed.ht)?, 0.0, "{}: ht", c.name);
        common::assert_same_grads(&split.grads, &packed.grads);
        for ((name, a), (_, b)) in split.grads.iter().zip(&packed.grads) {
            assert_eq!(rel_rms(a, b)?, 0.0, "{}: {name}", c.name);
        }
    }
    Ok(())
}

#[test]
fn gradients_of_a_subset_of_variables_and_repeated_backward() -> Result<()> {
    // Only `q` and `v` tracked (the gate tie then carries `v` alone); two losses backpropagated
    // through the same graph give the same gradients each time.
    use candle_core::{Tensor, Var};
    use candle_gdp::{gated_delta_product, GdpOptions};
    let c = Case::new("subset n2", 1, 37, 2, 8, 6, 2);
    let x = inputs(&c, DType::F32)?;
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let full = run_op(&c, &x, DType::F32)?;
    let q = Var::from_tensor(&f32(&x.q)?)?;
    let v = Var::from_tensor(&f32(&x.v)?)?;
    let opts = GdpOptions {
        output_final_state: true,
        ..Default::default()
    };
    let (o, ht) = gated_delta_product(&q, &f32(&x.k)?, &v, &f32(&x.g)?, &f32(&x.beta)?, &opts)?;
    let loss = ((o * f32(&x.dout)?)?.sum_all()? + (ht.expect("ht") * f32(&x.dht)?)?.sum_all()?)?;
    for pass in 0..2 {
        let gs = loss.backward()?;
        for (name, var) in [("dq", &q), ("dv", &v)] {
            let want = &full.grads.iter().find(|(n, _)| *n == name).expect("grad").1;
            let got = gs.get(var.as_tensor()).expect("gradient");
            let err = rel_rms(got, want)?;
            assert!(err < 1e-6, "pass {pass}: {name} differs by {err:.2e}");
        }
    }
    Ok(())
}
