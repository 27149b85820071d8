//! Context parallelism on 1..8 CPU ranks equals the single-device op: outputs, final states and
//! every gradient, for dense and packed inputs, n = 1..3, with and without an initial state,
//! sequences spanning many ranks and sequences shorter than a shard, uneven shards.

mod common;

use anyhow::Result;
use candle_core::{DType, Tensor};
use candle_gdp::cp::Composition;
use candle_gdp::{ContextParallel, Cotangents, GdpOptions};
use common::{cp_pairs, inputs, rel_rms, run_op, Case};

use common::cp_check_cpu as check;

#[test]
fn dense_equals_single_device() -> Result<()> {
    check(
        &Case::new("dense n1 h0", 2, 75, 2, 16, 12, 1).h0(),
        &[1, 2, 3, 8],
    )?;
    check(
        &Case::new("dense n2", 1, 130, 2, 12, 16, 2),
        &[1, 2, 4, 5, 7],
    )?;
    check(
        &Case::new("dense n3 h0 strong", 2, 61, 1, 8, 10, 3)
            .h0()
            .strong_gates(),
        &[3, 6, 8],
    )?;
    Ok(())
}

#[test]
fn packed_equals_single_device() -> Result<()> {
    // Long sequences spanning many ranks, short ones inside a shard, and empty ones.
    let cu = [0, 3, 3, 90, 95, 96, 160, 200];
    check(
        &Case::new("packed n2 h0", 1, 200, 2, 12, 8, 2)
            .packed(&cu)
            .h0(),
        &[1, 2, 3, 4, 6, 8],
    )?;
    check(
        &Case::new("packed n1", 1, 200, 2, 8, 12, 1).packed(&cu),
        &[3, 7],
    )?;
    check(
        &Case::new("packed n3 h0", 1, 200, 1, 10, 10, 3)
            .packed(&[0, 150, 151, 200])
            .h0(),
        &[2, 5, 8],
    )?;
    check(
        &Case::new("packed one seq", 1, 97, 2, 8, 8, 2)
            .packed(&[0, 97])
            .h0(),
        &[4, 8],
    )?;
    Ok(())
}

#[test]
fn hillis_steele_composition_equals_single_device() -> Result<()> {
    let c = Case::new("packed scan", 1, 120, 2, 8, 8, 2)
        .packed(&[0, 100, 120])
        .h0();
    let x = inputs(&c, DType::F32)?;
    let want = run_op(&c, &x, DType::F32)?;
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let h0 = f32(x.h0.as_ref().expect("h0"))?;
    let opts = GdpOptions {
        initial_state: Some(&h0),
        output_final_state: true,
        cu_seqlens: c.cu.as_deref(),
        ..Default::default()
    };
    let (dout, dht) = (f32(&x.dout)?, f32(&x.dht)?);
    let cp = ContextParallel::cpu(7)?.with_composition(Composition::Scan);
    let got = cp.gated_delta_product(
        &f32(&x.q)?,
        &f32(&x.k)?,
        &f32(&x.v)?,
        &f32(&x.g)?,
        &f32(&x.beta)?,
        &opts,
        Some(Cotangents {
            dout: &dout,
            dht: Some(&dht),
        }),
    )?;
    let grads = got.grads.expect("grads");
    for (name, a, b) in [
        ("o", &got.o, &want.o),
        ("ht", got.final_state.as_ref().expect("ht"), &want.ht),
        ("dk", &grads.dk, &want.grads[1].1),
        ("dg", &grads.dg, &want.grads[3].1),
        ("dh0", grads.dh0.as_ref().expect("dh0"), &want.grads[5].1),
    ] {
        let e = rel_rms(a, b)?;
        assert!(e <= 1e-5, "scan: {name} relative RMS {e:.2e}");
    }
    Ok(())
}

#[test]
fn forward_only_and_bad_sizes() -> Result<()> {
    let c = Case::new("fwd", 1, 10, 1, 4, 4, 1);
    let x = inputs(&c, DType::F32)?;
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let (q, k, v, g, b) = (
        f32(&x.q)?,
        f32(&x.k)?,
        f32(&x.v)?,
        f32(&x.g)?,
        f32(&x.beta)?,
    );
    let opts = GdpOptions::default();
    let out = ContextParallel::cpu(3)?.gated_delta_product(&q, &k, &v, &g, &b, &opts, None)?;
    assert!(out.grads.is_none() && out.final_state.is_none());
    let err = ContextParallel::cpu(11)?
        .gated_delta_product(&q, &k, &v, &g, &b, &opts, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("cp_size"), "{err}");
    assert!(ContextParallel::cpu(0).is_err());
    Ok(())
}

/// The multi-process entry point (every rank holds the full inputs, runs its shard through its
/// communicator and gets the gathered result) on in-process ranks: every rank's result equals
/// the single-device op, dense and packed, f32 and bf16.
#[test]
fn distributed_entry_point_equals_single_device() -> Result<()> {
    use candle_core::Device;
    use candle_gdp::cp::{distributed_gated_delta_product, run_ranks, Communicator};
    use std::sync::Arc;
    let cases = [
        Case::new("dist dense n2 h0", 2, 41, 2, 8, 12, 2).h0(),
        Case::new("dist packed n3 h0", 1, 90, 2, 8, 8, 3)
            .packed(&[0, 2, 2, 60, 61, 90])
            .h0(),
    ];
    for c in &cases {
        for dtype in [DType::F32, DType::BF16] {
            let x = inputs(c, dtype)?;
            let want = run_op(c, &x, dtype)?;
            let cast = |t: &Tensor| t.to_dtype(dtype);
            let f32 = |t: &Tensor| t.to_dtype(DType::F32);
            let (q, k, v, beta) = (cast(&x.q)?, cast(&x.k)?, cast(&x.v)?, cast(&x.beta)?);
            let g = f32(&x.g)?;
            let h0 = x.h0.as_ref().map(f32).transpose()?;
            let (dout, dht) = (f32(&x.dout)?, f32(&x.dht)?);
            for world in [1, 2, 3] {
                let outs = run_ranks(world, candle_gdp::cp::DEFAULT_TIMEOUT, |comm| {
                    let comm: Arc<dyn Communicator> = Arc::new(comm.clone());
                    let opts = GdpOptions {
                        initial_state: h0.as_ref(),
                        output_final_state: true,
                        cu_seqlens: c.cu.as_deref(),
                        ..Default::default()
                    };
                    distributed_gated_delta_product(
                        comm,
                        &Device::Cpu,
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
                        Composition::Fold,
                    )
                })?;
                let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                for (r, got) in outs.into_iter().enumerate() {
                    assert_eq!(got.o.dtype(), dtype);
                    let dq = got.grads.as_ref().map(|g| g.dq.dtype());
                    assert_eq!(dq, Some(dtype));
                    let pairs = cp_pairs(got, &want)?;
                    assert_eq!(pairs.last().map(|p| p.0), Some("dh0"), "{}: dh0", c.name);
                    for (name, a, b) in pairs {
                        assert_eq!(a.dims(), b.dims(), "{} world {world}: {name}", c.name);
                        let e = rel_rms(&a, &b)?;
                        assert!(
                            e <= tol,
                            "{} {dtype:?} world {world} rank {r}: {name} rel RMS {e:.2e}",
                            c.name
                        );
                    }
                }
            }
        }
    }
    Ok(())
}
