//! The explicit backward (`gated_delta_product_vjp`) against the f64 reference and against the
//! op under Candle's autograd, on the CPU; its checks of the cotangents.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gdp::{gated_delta_product_vjp, GdpOptions, SaveIntermediates::Nothing};
use common::{assert_close, inputs, run_op, run_op_plain_on, run_op_vjp_on, run_reference, Case};

fn cases() -> Vec<Case> {
    vec![
        Case::new("dense n1 T75 K16 V24 h0", 2, 75, 2, 16, 24, 1).h0(),
        Case::new("dense n2 T130 K32 V20", 1, 130, 3, 32, 20, 2),
        Case::new("strong n3 T67 K20 V32 h0", 2, 67, 2, 20, 32, 3)
            .strong_gates()
            .h0()
            .seed(11),
        Case::new("packed n2 h0", 1, 213, 2, 16, 12, 2)
            .packed(&[0, 5, 5, 70, 200, 213])
            .h0(),
    ]
}

#[test]
fn f32_matches_reference_and_autograd() -> Result<()> {
    let cpu = Device::Cpu;
    for c in cases() {
        let x = inputs(&c, DType::F32)?;
        let want = run_reference(&c, &x)?;
        let got = run_op_vjp_on(&c, &x, DType::F32, &cpu, true, Nothing)?;
        assert_close(&c, &got, &want, 1e-5)?;
        // The same kernels as under autograd, so the same numbers.
        assert_close(&c, &got, &run_op(&c, &x, DType::F32)?, 1e-12)?;

        let plain = x.without_dht()?;
        let want = run_reference(&c, &plain)?;
        let got = run_op_vjp_on(&c, &plain, DType::F32, &cpu, false, Nothing)?;
        assert_close(&c, &got, &want, 1e-5)?;
        let autograd = run_op_plain_on(&c, &plain, DType::F32, &cpu)?;
        assert_close(&c, &got, &autograd, 1e-12)?;
    }
    Ok(())
}

#[test]
fn half_precision_matches_reference() -> Result<()> {
    let cpu = Device::Cpu;
    for dtype in [DType::BF16, DType::F16] {
        for c in cases() {
            let x = inputs(&c, dtype)?;
            let got = run_op_vjp_on(&c, &x, dtype, &cpu, true, Nothing)?;
            assert_close(&c, &got, &run_reference(&c, &x)?, 1e-2)?;
        }
    }
    Ok(())
}

fn small() -> Result<(Tensor, Tensor, Tensor, Tensor, Tensor)> {
    let dev = Device::Cpu;
    let (b, t, h, k, n) = (1, 5, 2, 4, 2);
    Ok((
        Tensor::randn(0f32, 0.5, (b, t, h, k), &dev)?,
        Tensor::randn(0f32, 0.5, (b, t * n, h, k), &dev)?,
        Tensor::randn(0f32, 1.0, (b, t * n, h, k), &dev)?,
        Tensor::full(-0.1f32, (b, t, h), &dev)?,
        Tensor::full(0.5f32, (b, t * n, h), &dev)?,
    ))
}

#[test]
fn checks_the_cotangents() -> Result<()> {
    let (q, k, v, g, beta) = small()?;
    let vjp = gated_delta_product_vjp(&q, &k, &v, &g, &beta, &GdpOptions::default())?;
    let d_o = vjp.o.ones_like()?;
    let err = vjp.backward(
        &d_o,
        Some(&Tensor::zeros((1, 2, 4, 4), DType::F32, &Device::Cpu)?),
    );
    let msg = err
        .expect_err("a final-state cotangent without a final state")
        .to_string();
    assert!(msg.contains("d_final_state"), "{msg}");

    let vjp = gated_delta_product_vjp(&q, &k, &v, &g, &beta, &GdpOptions::default())?;
    let msg = vjp
        .backward(
            &Tensor::zeros((1, 4, 2, 4), DType::F32, &Device::Cpu)?,
            None,
        )
        .expect_err("a cotangent of the wrong shape")
        .to_string();
    assert!(msg.contains("d_o") && msg.contains("[1, 5, 2, 4]"), "{msg}");

    let opts = GdpOptions {
        output_final_state: true,
        ..Default::default()
    };
    let vjp = gated_delta_product_vjp(&q, &k, &v, &g, &beta, &opts)?;
    let d_o = vjp.o.ones_like()?;
    let msg = vjp
        .backward(
            &d_o,
            Some(&Tensor::zeros((1, 2, 4, 3), DType::F32, &Device::Cpu)?),
        )
        .expect_err("a final-state cotangent of the wrong shape")
        .to_string();
    assert!(msg.contains("d_final_state"), "{msg}");
    Ok(())
}

#[test]
fn inputs_are_checked_as_by_the_op() -> Result<()> {
    let (q, k, v, g, beta) = small()?;
    let g_bad = g.narrow(1, 0, 4)?;
    let msg = gated_delta_product_vjp(&q, &k, &v, &g_bad, &beta, &GdpOptions::default())
        .expect_err("a gate of the wrong shape")
        .to_string();
    assert!(
        msg.contains("`g`: expected shape [1, 5, 2] [B, T, H], got [1, 4, 2]"),
        "{msg}"
    );
    Ok(())
}
