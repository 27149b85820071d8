//! CPU throughput of the Gated DeltaProduct op: forward and forward+backward tokens/s at
//! B1 T8192 H4 K=V=64 n=2 (f32 and bf16), and the achieved FLOP rate as a fraction of candle's
//! own f32 matmul rate measured in the same run; then the decode step, fused against the
//! tensor-op step in the same run.
//!
//! FLOP model (per head, per interleaved chunk of `c ≤ 64` sub-token rows with `q` query rows,
//! counting a multiply-add as 2): forward = 2c²K (KKᵀ) + c³/3 (triangular inverse) + 2c²(K+V)
//! (W, U) + 4cKV (Δ, state update) + 2qKV + 2qc(K+V) (output). The backward runs the state
//! scan again (the forward without the output), rebuilds the WY factors and Δ of each chunk in
//! the reverse pass (the same minus the state update), and adds the matrix products of
//! `cpu/backward.rs`: 6cKV + 4qKV + 4qc(K+V) + 2qcK + 4c²(K+V) + 4c²K + 4c³.
//!
//! Run: `cargo bench --bench op` (add `-- --quick` for fewer repetitions).

use candle_core::{DType, Device, Tensor, Var};
use candle_gdp::op::recurrent::{gated_delta_product_step, gated_delta_product_step_fused};
use candle_gdp::{gated_delta_product, gated_delta_product_packed, GdpOptions};
use std::time::Instant;

const CHUNK: f64 = 64.0;

struct Shape {
    b: usize,
    t: usize,
    h: usize,
    k: usize,
    v: usize,
    n: usize,
}

fn flops(s: &Shape) -> (f64, f64) {
    let rows = (s.t * s.n) as f64;
    let chunks = rows / CHUNK;
    let (c, k, v) = (CHUNK, s.k as f64, s.v as f64);
    let q = c / s.n as f64;
    let fwd_nout = 2.0 * c * c * k + c * c * c / 3.0 + 2.0 * c * c * (k + v) + 4.0 * c * k * v;
    let out = 2.0 * q * k * v + 2.0 * q * c * (k + v);
    let bwd_extra = 6.0 * c * k * v
        + 4.0 * q * k * v
        + 4.0 * q * c * (k + v)
        + 2.0 * q * c * k
        + 4.0 * c * c * (k + v)
        + 4.0 * c * c * k
        + 4.0 * c * c * c;
    let per_head = chunks * (s.b * s.h) as f64;
    (
        per_head * (fwd_nout + out),
        per_head * (fwd_nout + out + fwd_nout + (fwd_nout - 2.0 * c * k * v) + bwd_extra),
    )
}

fn median_ms(
    reps: usize,
    mut f: impl FnMut() -> candle_core::Result<()>,
) -> candle_core::Result<f64> {
    f()?; // warm-up
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[reps / 2])
}

/// Candle's own f32 matmul rate (GFLOP/s) on 1024×1024×1024.
fn matmul_gflops(reps: usize) -> candle_core::Result<f64> {
    let dev = Device::Cpu;
    let a = Tensor::randn(0f32, 1.0, (1024, 1024), &dev)?;
    let b = Tensor::randn(0f32, 1.0, (1024, 1024), &dev)?;
    let ms = median_ms(reps, || a.matmul(&b).map(|_| ()))?;
    Ok(2.0 * 1024f64.powi(3) / (ms * 1e-3) / 1e9)
}

fn main() -> candle_core::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let reps = if quick { 3 } else { 11 };
    let dev = Device::Cpu;
    let s = Shape {
        b: 1,
        t: 8192,
        h: 4,
        k: 64,
        v: 64,
        n: 2,
    };
    let (fwd_flops, fb_flops) = flops(&s);
    let mm = matmul_gflops(reps)?;
    println!(
        "candle f32 matmul 1024^3: {mm:.1} GFLOP/s  (threads: {})",
        rayon::current_num_threads()
    );
    println!(
        "{:<34} {:>9} {:>12} {:>9} {:>10}",
        "case (B1 T8192 H4 K=V=64 n=2)", "ms", "tokens/s", "GFLOP/s", "vs matmul"
    );
    let tokens = (s.b * s.t) as f64;
    for dtype in [DType::F32, DType::BF16] {
        let q = Tensor::randn(0f32, 1.0, (s.b, s.t, s.h, s.k), &dev)?.to_dtype(dtype)?;
        let k = Tensor::randn(0f32, 0.125, (s.b, s.t * s.n, s.h, s.k), &dev)?.to_dtype(dtype)?;
        let v = Tensor::randn(0f32, 1.0, (s.b, s.t * s.n, s.h, s.v), &dev)?.to_dtype(dtype)?;
        let g = (Tensor::rand(0f32, 1.0, (s.b, s.t, s.h), &dev)? * -0.5)?;
        let beta = Tensor::rand(0f32, 1.0, (s.b, s.t * s.n, s.h), &dev)?.to_dtype(dtype)?;
        let opts = GdpOptions::default();
        let qk = Tensor::cat(
            &[&q.unsqueeze(2)?, &k.reshape((s.b, s.t, s.n, s.h, s.k))?],
            2,
        )?;
        let row = |name: String, ms: f64, fl: f64| {
            println!(
                "{name:<34} {ms:>9.2} {:>12.0} {:>9.1} {:>9.1}%",
                tokens / (ms * 1e-3),
                fl / (ms * 1e-3) / 1e9,
                100.0 * fl / (ms * 1e-3) / 1e9 / mm
            )
        };
        let ms = median_ms(reps, || {
            gated_delta_product(&q, &k, &v, &g, &beta, &opts).map(|_| ())
        })?;
        row(format!("fwd {dtype:?} (FLA layout)"), ms, fwd_flops);
        let ms = median_ms(reps, || {
            gated_delta_product_packed(&qk, &v, &g, &beta, &opts).map(|_| ())
        })?;
        row(format!("fwd {dtype:?} (packed qk)"), ms, fwd_flops);
        let (qv, kv, vv) = (
            Var::from_tensor(&q)?,
            Var::from_tensor(&k)?,
            Var::from_tensor(&v)?,
        );
        let (gv, bv) = (Var::from_tensor(&g)?, Var::from_tensor(&beta)?);
        let ms = median_ms(reps, || {
            let (o, _) = gated_delta_product(&qv, &kv, &vv, &gv, &bv, &opts)?;
            o.to_dtype(DType::F32)?.sum_all()?.backward().map(|_| ())
        })?;
        row(format!("fwd+bwd {dtype:?} (FLA layout)"), ms, fb_flops);
    }
    decode_steps(reps * 20)
}

/// The one-token decode step with an f32 state: the fused pass over the state against the
/// differentiable tensor-op step (the baseline, same run); tokens/s counts the `B` tokens of a
/// step, GB/s the state read and written.
fn decode_steps(reps: usize) -> candle_core::Result<()> {
    let dev = Device::Cpu;
    println!(
        "{:<34} {:>9} {:>12} {:>9} {:>10}",
        "decode step (f32 state)", "ms", "tokens/s", "GB/s", "speed-up"
    );
    for (b, h, k, v, n) in [(1, 2, 64, 128, 2), (8, 16, 128, 128, 2)] {
        let state = Tensor::randn(0f32, 1.0, (b, h, k, v), &dev)?;
        let q = Tensor::randn(0f32, 1.0, (b, h, k), &dev)?;
        let kk = Tensor::randn(0f32, 0.125, (b, n, h, k), &dev)?;
        let vv = Tensor::randn(0f32, 1.0, (b, n, h, v), &dev)?;
        let g = (Tensor::rand(0f32, 1.0, (b, h), &dev)? * -0.5)?;
        let beta = Tensor::rand(0f32, 1.0, (b, n, h), &dev)?;
        let tensor_ops = median_ms(reps, || {
            gated_delta_product_step(&state, &q, &kk, &vv, &g, &beta, None).map(|_| ())
        })?;
        let fused = median_ms(reps, || {
            gated_delta_product_step_fused(&state, &q, &kk, &vv, &g, &beta, None).map(|_| ())
        })?;
        let bytes = 2.0 * (b * h * k * v * 4) as f64;
        for (name, ms) in [("tensor ops", tensor_ops), ("fused", fused)] {
            println!(
                "{:<34} {ms:>9.3} {:>12.0} {:>9.1} {:>9.1}x",
                format!("B{b} H{h} K{k} V{v} n{n} {name}"),
                b as f64 / (ms * 1e-3),
                bytes / (ms * 1e-3) / 1e9,
                tensor_ops / ms
            );
        }
    }
    Ok(())
}
