//! The CUDA op on shapes drawn at random (feature `cuda`, needs a GPU): every output and
//! gradient of the default configuration against the f64 reference, where the op picks its
//! own paths (the bf16 two-kernel forward with or without the WY kernel beside the scan, the
//! split backward, segments for few heads and long sequences, the fused f32 / f16 kernels).
//! The fixed tests name their shapes; this one draws `K`, `V`, `n`, grouped value heads,
//! batch, lengths, packing, initial states and gate strength from a seeded generator, so that
//! it meets combinations nobody wrote down, and long sequences with 9–14 heads, where the
//! default splits them into two or three segments. Each case prints its draw, so a failure
//! names the shape to reproduce. Run on a GPU machine:
//! `cargo test --release --features cuda --test gpu_sweep`.
#![cfg(feature = "cuda")]

mod common;

use anyhow::{Context as _, Result};
use candle_core::{DType, Device};
use common::{assert_close, inputs, run_op_on, run_reference, Case};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Head dimensions drawn for `K` and `V`: below, at and above the kernels' tiles (64, 128),
/// multiples of 8 and not, up to the largest the CUDA kernels take (256).
const DIMS: [usize; 9] = [32, 40, 64, 72, 100, 128, 160, 200, 256];

/// One drawn case: the shape (as the fixed tests' [`Case`]) and the dtype of `q, k, v, beta`.
struct Draw {
    case: Case,
    dtype: DType,
}

/// Cumulative lengths of `seqs` sequences over `total` tokens, some of them empty.
fn cu_seqlens(rng: &mut StdRng, total: usize, seqs: usize) -> Vec<usize> {
    let mut cuts: Vec<usize> = (0..seqs - 1).map(|_| rng.random_range(0..=total)).collect();
    cuts.sort_unstable();
    let mut cu = vec![0];
    cu.extend(cuts);
    cu.push(total);
    cu
}

/// `case` with an initial state half the time and strong gates a quarter of the time.
fn with_state_and_gates(rng: &mut StdRng, mut case: Case) -> Case {
    if rng.random_bool(0.5) {
        case = case.h0();
    }
    if rng.random_bool(0.25) {
        case = case.strong_gates();
    }
    case
}

/// Draw `i` of the sweep. Every fourth case is long with few heads (`B·H <= 6`, 8K–17K
/// tokens), where the default splits sequences into segments; the others are short, with up
/// to 12 heads.
fn draw(rng: &mut StdRng, i: usize) -> Draw {
    let dtype = match i % 6 {
        4 => DType::F16,
        5 => DType::F32,
        _ => DType::BF16,
    };
    let long = i % 4 == 3;
    // Long cases stay at n <= 2 and K, V <= 128, where the f64 reference takes seconds.
    let n = rng.random_range(1..=if long { 2 } else { 4usize });
    let dims = if long { &DIMS[..6] } else { &DIMS[..] };
    let k = dims[rng.random_range(0..dims.len())];
    let v = dims[rng.random_range(0..dims.len())];
    let group = [1usize, 1, 2, 3][rng.random_range(0..4)];
    let key_heads = if long {
        rng.random_range(1..=2usize)
    } else {
        rng.random_range(1..=4usize)
    };
    let h = key_heads * group;
    let b = if long {
        1
    } else {
        rng.random_range(1..=3usize)
    };
    let t = if long {
        rng.random_range(8192..=17_000usize)
    } else {
        rng.random_range(1..=1500usize)
    };
    let name = format!("draw {i}: {dtype:?} B{b} T{t} H{h}/{key_heads} K{k} V{v} n{n}");
    let case = Case::new(Box::leak(name.into_boxed_str()), b, t, h, k, v, n)
        .seed(1000 + i as u64)
        .key_heads(key_heads);
    let mut case = with_state_and_gates(rng, case);
    if b == 1 && !long && rng.random_bool(0.4) {
        let seqs = rng.random_range(2..=5usize);
        case = case.packed(&cu_seqlens(rng, t, seqs));
    }
    Draw { case, dtype }
}

#[test]
fn random_shapes_match_f64_reference() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    let mut rng = StdRng::seed_from_u64(0x5eed_2026_1206);
    for i in 0..24 {
        let Draw { case, dtype } = draw(&mut rng, i);
        let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
        println!("{} {:?}", case.name, case.cu);
        let x = inputs(&case, dtype)?;
        let got = run_op_on(&case, &x, dtype, &dev).with_context(|| case.name)?;
        let want = run_reference(&case, &x)?;
        assert_close(&case, &got, &want, tol)?;
    }
    Ok(())
}

/// Long sequences with 9–14 heads (B1, `n = 1`, `K`, `V` 100 or 128, bf16), where
/// `Segments::Auto` takes three segments per sequence (case 0: 9–11 heads, 24.6K–25K tokens)
/// or two (case 1: 12–14 heads, 16K–20K tokens).
fn draw_mid_heads(rng: &mut StdRng, i: usize) -> Case {
    let (heads, tokens): (&[(usize, usize)], _) = match i {
        0 => (&[(9, 3), (10, 5), (11, 11)], 24_576..=25_000usize),
        _ => (&[(12, 4), (12, 6), (13, 13), (14, 7)], 16_384..=20_000),
    };
    let (h, key_heads) = heads[rng.random_range(0..heads.len())];
    let k = [100, 128][rng.random_range(0..2)];
    let v = [100, 128][rng.random_range(0..2)];
    let t = rng.random_range(tokens);
    let name = format!("mid {i}: BF16 B1 T{t} H{h}/{key_heads} K{k} V{v} n1");
    let case = Case::new(Box::leak(name.into_boxed_str()), 1, t, h, k, v, 1)
        .seed(2000 + i as u64)
        .key_heads(key_heads);
    with_state_and_gates(rng, case)
}

#[test]
fn mid_heads_long_shapes_match_f64_reference() -> Result<()> {
    let dev = Device::new_cuda(0)?;
    let mut rng = StdRng::seed_from_u64(0x5eed_2026_1207);
    for i in 0..2 {
        let case = draw_mid_heads(&mut rng, i);
        println!("{}", case.name);
        let x = inputs(&case, DType::BF16)?;
        let got = run_op_on(&case, &x, DType::BF16, &dev).with_context(|| case.name)?;
        let want = run_reference(&case, &x)?;
        assert_close(&case, &got, &want, 1e-2)?;
    }
    Ok(())
}
