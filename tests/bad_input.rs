//! Bad input never panics: every public entry point returns an error whose message names the
//! offending argument in backticks, as `GdpError` formats it (e.g. "`q`: expected ...").

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gdp::op::cu_seqlens_from_tensor;
use candle_gdp::{gated_delta_product, gated_delta_product_packed, GdpOptions};
use std::panic::{catch_unwind, AssertUnwindSafe};

const B: usize = 2;
const T: usize = 4;
const H: usize = 2;
const K: usize = 3;
const V: usize = 5;
const N: usize = 2;

fn randn(shape: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1f32, shape, &Device::Cpu).unwrap()
}

/// A valid FLA-layout problem that each case breaks in one place.
#[derive(Clone)]
struct Args {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    h0: Option<Tensor>,
    cu: Option<Vec<usize>>,
    n: Option<usize>,
    scale: Option<f64>,
}

impl Args {
    fn new(b: usize, t: usize, h: usize, k: usize, v: usize, n: usize) -> Self {
        Self {
            q: randn(&[b, t, h, k]),
            k: randn(&[b, t * n, h, k]),
            v: randn(&[b, t * n, h, v]),
            g: randn(&[b, t, h]).neg().unwrap(),
            beta: randn(&[b, t * n, h]).abs().unwrap(),
            h0: None,
            cu: None,
            n: None,
            scale: None,
        }
    }

    fn dense() -> Self {
        Self::new(B, T, H, K, V, N)
    }

    fn packed_b1() -> Self {
        Self::new(1, 6, H, K, V, N)
    }

    fn run(&self) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let opts = GdpOptions {
            num_householder: self.n,
            scale: self.scale,
            initial_state: self.h0.as_ref(),
            output_final_state: true,
            cu_seqlens: self.cu.as_deref(),
            ..Default::default()
        };
        gated_delta_product(&self.q, &self.k, &self.v, &self.g, &self.beta, &opts)
    }

    /// The same problem through the packed `qk [B, T, n+1, H, K]` entry point.
    fn run_packed(&self, qk: &Tensor) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let opts = GdpOptions {
            num_householder: self.n,
            scale: self.scale,
            initial_state: self.h0.as_ref(),
            output_final_state: true,
            cu_seqlens: self.cu.as_deref(),
            ..Default::default()
        };
        gated_delta_product_packed(qk, &self.v, &self.g, &self.beta, &opts)
    }

    fn qk(&self) -> Tensor {
        let (b, t, h, k) = self.q.dims4().unwrap();
        let n = self.k.dim(1).unwrap() / t;
        let k5 = self.k.reshape((b, t, n, h, k)).unwrap();
        Tensor::cat(&[&self.q.unsqueeze(2).unwrap(), &k5], 2).unwrap()
    }
}

/// Runs `f` (which must fail) and returns a description of what went wrong, or `None` when it
/// returned an error naming one of `names` in backticks.
fn check<R>(
    label: &str,
    names: &[&str],
    f: impl FnOnce() -> candle_core::Result<R>,
) -> Option<String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Some(format!("{label}: PANICKED: {msg}"))
        }
        Ok(Ok(_)) => Some(format!(
            "{label}: returned Ok, expected an error naming {names:?}"
        )),
        Ok(Err(e)) => {
            let s = e.to_string();
            if names.iter().any(|n| s.contains(&format!("`{n}`"))) {
                None
            } else {
                Some(format!("{label}: error does not name {names:?}: {s}"))
            }
        }
    }
}

/// Asserts every `(label, failure)` is `None`, listing all failures at once.
fn assert_all(failures: Vec<Option<String>>) {
    let bad: Vec<String> = failures.into_iter().flatten().collect();
    assert!(
        bad.is_empty(),
        "{} bad-input case(s) failed:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

fn with(f: impl FnOnce(&mut Args)) -> Args {
    let mut a = Args::dense();
    f(&mut a);
    a
}

#[test]
fn valid_baseline_runs() -> Result<()> {
    let mut a = Args::dense();
    a.h0 = Some(randn(&[B, H, K, V]));
    let (o, ht) = a.run()?;
    assert_eq!(o.dims(), &[B, T, H, V]);
    assert_eq!(ht.unwrap().dims(), &[B, H, K, V]);
    let (o2, _) = a.run_packed(&a.qk())?;
    assert_eq!(o2.dims(), &[B, T, H, V]);
    let mut p = Args::packed_b1();
    p.cu = Some(vec![0, 2, 2, 6]);
    let (_, ht) = p.run()?;
    assert_eq!(ht.unwrap().dims(), &[3, H, K, V]);
    Ok(())
}

#[test]
fn wrong_rank_names_the_tensor() {
    assert_all(vec![
        check("q rank 3", &["q"], || {
            with(|a| a.q = randn(&[B, T, H * K])).run()
        }),
        check("q rank 5", &["q"], || {
            with(|a| a.q = randn(&[B, T, H, K, 1])).run()
        }),
        check("q rank 0", &["q"], || {
            with(|a| a.q = Tensor::new(1f32, &Device::Cpu).unwrap()).run()
        }),
        check("k rank 3", &["k"], || {
            with(|a| a.k = randn(&[B, T * N, H * K])).run()
        }),
        check("k rank 5", &["k"], || {
            with(|a| a.k = randn(&[B, T, N, H, K])).run()
        }),
        check("v rank 3", &["v"], || {
            with(|a| a.v = randn(&[B, T * N, H * V])).run()
        }),
        check("v rank 5", &["v"], || {
            with(|a| a.v = randn(&[B, T, N, H, V])).run()
        }),
        check("g rank 2", &["g"], || {
            with(|a| a.g = randn(&[B, T * H])).run()
        }),
        check("g rank 4", &["g"], || {
            with(|a| a.g = randn(&[B, T, H, 1])).run()
        }),
        check("beta rank 2", &["beta"], || {
            with(|a| a.beta = randn(&[B, T * N * H])).run()
        }),
        check("beta rank 4", &["beta"], || {
            with(|a| a.beta = randn(&[B, T, N, H])).run()
        }),
        check("initial_state rank 3", &["initial_state"], || {
            with(|a| a.h0 = Some(randn(&[B * H, K, V]))).run()
        }),
    ]);
}

#[test]
fn mismatched_sizes_name_the_tensor() {
    assert_all(vec![
        check("k rows T*n + 1", &["k"], || {
            with(|a| a.k = randn(&[B, T * N + 1, H, K])).run()
        }),
        check("k rows T*n - 1", &["k"], || {
            with(|a| a.k = randn(&[B, T * N - 1, H, K])).run()
        }),
        check("k rows < T", &["k"], || {
            with(|a| a.k = randn(&[B, T - 1, H, K])).run()
        }),
        check("k rows 0", &["k"], || {
            with(|a| a.k = randn(&[B, 0, H, K])).run()
        }),
        check("k batch", &["k"], || {
            with(|a| a.k = randn(&[B + 1, T * N, H, K])).run()
        }),
        check("k heads", &["k"], || {
            with(|a| a.k = randn(&[B, T * N, H + 1, K])).run()
        }),
        check("k dim", &["k"], || {
            with(|a| a.k = randn(&[B, T * N, H, K + 1])).run()
        }),
        check("v batch", &["v"], || {
            with(|a| a.v = randn(&[1, T * N, H, V])).run()
        }),
        check("v rows", &["v"], || {
            with(|a| a.v = randn(&[B, T, H, V])).run()
        }),
        check("v heads", &["v"], || {
            with(|a| a.v = randn(&[B, T * N, 1, V])).run()
        }),
        check("g batch", &["g"], || {
            with(|a| a.g = randn(&[1, T, H])).run()
        }),
        check("g rows T*n", &["g"], || {
            with(|a| a.g = randn(&[B, T * N, H])).run()
        }),
        check("g heads", &["g"], || {
            with(|a| a.g = randn(&[B, T, H + 1])).run()
        }),
        check("beta rows T", &["beta"], || {
            with(|a| a.beta = randn(&[B, T, H])).run()
        }),
        check("beta batch", &["beta"], || {
            with(|a| a.beta = randn(&[1, T * N, H])).run()
        }),
        check("beta heads", &["beta"], || {
            with(|a| a.beta = randn(&[B, T * N, 1])).run()
        }),
    ]);
}

#[test]
fn wrong_dtypes_name_the_tensor() {
    let int = |a: &Tensor, dt: DType| a.to_dtype(dt).unwrap();
    assert_all(vec![
        check("v f64, q f32", &["v"], || {
            with(|a| a.v = int(&a.v, DType::F64)).run()
        }),
        check("v bf16, q f32", &["v"], || {
            with(|a| a.v = int(&a.v, DType::BF16)).run()
        }),
        check("q,k,v u32", &["q"], || {
            with(|a| {
                a.q = int(&a.q, DType::U32);
                a.k = int(&a.k, DType::U32);
                a.v = int(&a.v, DType::U32);
            })
            .run()
        }),
        check("q,k,v i64", &["q"], || {
            with(|a| {
                a.q = int(&a.q, DType::I64);
                a.k = int(&a.k, DType::I64);
                a.v = int(&a.v, DType::I64);
            })
            .run()
        }),
        check("q u32 only", &["q"], || {
            with(|a| a.q = int(&a.q, DType::U32)).run()
        }),
        check("q,k f32, v i64", &["v"], || {
            with(|a| a.v = int(&a.v, DType::I64)).run()
        }),
        check("g u32", &["g"], || {
            with(|a| a.g = int(&a.g, DType::U32)).run()
        }),
        check("g i64", &["g"], || {
            with(|a| a.g = int(&a.g, DType::I64)).run()
        }),
        check("beta u8", &["beta"], || {
            with(|a| a.beta = int(&a.beta, DType::U8)).run()
        }),
        check("beta i64", &["beta"], || {
            with(|a| a.beta = int(&a.beta, DType::I64)).run()
        }),
        check("initial_state i64", &["initial_state"], || {
            with(|a| a.h0 = Some(randn(&[B, H, K, V]).to_dtype(DType::I64).unwrap())).run()
        }),
    ]);
}

/// A `k` whose dtype differs from `q`'s is an error naming `k`: `validate_fla` compares the two
/// before `gated_delta_product` concatenates them (whose Candle error, "dtype mismatch in cat",
/// would not name `k`).
#[test]
fn k_dtype_differing_from_q_names_k() {
    assert_all(vec![
        check("k f64, q f32", &["k"], || {
            with(|a| a.k = a.k.to_dtype(DType::F64).unwrap()).run()
        }),
        check("k u32, q f32", &["k"], || {
            with(|a| a.k = a.k.to_dtype(DType::U32).unwrap()).run()
        }),
    ]);
}

#[test]
fn k_dtype_differing_from_q_is_an_error_not_a_panic() {
    for dt in [DType::F64, DType::BF16, DType::U32] {
        let a = with(|a| a.k = a.k.to_dtype(dt).unwrap());
        let r = catch_unwind(AssertUnwindSafe(|| a.run()));
        assert!(
            matches!(r, Ok(Err(_))),
            "k {dt:?}: expected an error, not a panic or Ok"
        );
    }
}

#[test]
fn initial_state_wrong_shape_names_it() {
    assert_all(vec![
        check("h0 N = B + 1", &["initial_state"], || {
            with(|a| a.h0 = Some(randn(&[B + 1, H, K, V]))).run()
        }),
        check("h0 [B, H, V, K]", &["initial_state"], || {
            with(|a| a.h0 = Some(randn(&[B, H, V, K]))).run()
        }),
        check("h0 heads", &["initial_state"], || {
            with(|a| a.h0 = Some(randn(&[B, 1, K, V]))).run()
        }),
        check("h0 [B, H, K, V, 1]", &["initial_state"], || {
            with(|a| a.h0 = Some(randn(&[B, H, K, V, 1]))).run()
        }),
        check(
            "packed h0 N = B instead of #seqs",
            &["initial_state"],
            || {
                let mut a = Args::packed_b1();
                a.cu = Some(vec![0, 2, 6]);
                a.h0 = Some(randn(&[1, H, K, V]));
                a.run()
            },
        ),
    ]);
}

#[test]
fn invalid_cu_seqlens_named() {
    let packed = |cu: &[usize]| {
        let mut a = Args::packed_b1();
        a.cu = Some(cu.to_vec());
        a
    };
    assert_all(vec![
        check("cu not starting at 0", &["cu_seqlens"], || {
            packed(&[1, 3, 6]).run()
        }),
        check("cu ending before T", &["cu_seqlens"], || {
            packed(&[0, 3, 5]).run()
        }),
        check("cu ending after T", &["cu_seqlens"], || {
            packed(&[0, 3, 7]).run()
        }),
        check("cu decreasing", &["cu_seqlens"], || {
            packed(&[0, 4, 2, 6]).run()
        }),
        check("cu one entry", &["cu_seqlens"], || packed(&[0]).run()),
        check("cu one entry T", &["cu_seqlens"], || packed(&[6]).run()),
        check("cu empty", &["cu_seqlens"], || packed(&[]).run()),
        check("cu with B = 2", &["cu_seqlens"], || {
            with(|a| a.cu = Some(vec![0, 2, T])).run()
        }),
        check("cu packed entry point, B = 2", &["cu_seqlens"], || {
            let a = with(|a| a.cu = Some(vec![0, 2, T]));
            a.run_packed(&a.qk())
        }),
        check("cu packed entry point, decreasing", &["cu_seqlens"], || {
            let a = packed(&[0, 4, 3, 6]);
            a.run_packed(&a.qk())
        }),
    ]);
}

#[test]
fn valid_cu_seqlens_edge_cases_run() -> Result<()> {
    for cu in [
        vec![0, 6],
        vec![0, 0, 6],
        vec![0, 6, 6],
        vec![0, 1, 1, 1, 5, 6],
    ] {
        let mut a = Args::packed_b1();
        a.cu = Some(cu.clone());
        let (o, ht) = a.run()?;
        assert_eq!(o.dims(), &[1, 6, H, V], "{cu:?}");
        assert_eq!(ht.unwrap().dims(), &[cu.len() - 1, H, K, V], "{cu:?}");
    }
    Ok(())
}

#[test]
fn num_householder_inconsistent() {
    let packed_n = |n: usize| {
        let mut a = Args::dense();
        a.n = Some(n);
        let qk = a.qk();
        a.run_packed(&qk)
    };
    assert_all(vec![
        // The dense entry point takes `n` as given and reports the tensor that disagrees.
        check("n = 3 with T*2 rows", &["num_householder", "k"], || {
            with(|a| a.n = Some(3)).run()
        }),
        check("n = 1 with T*2 rows", &["num_householder", "k"], || {
            with(|a| a.n = Some(1)).run()
        }),
        check("n = 0", &["num_householder", "k"], || {
            with(|a| a.n = Some(0)).run()
        }),
        check("packed n = 3 with 2+1 slots", &["num_householder"], || {
            packed_n(3)
        }),
        check("packed n = 1 with 2+1 slots", &["num_householder"], || {
            packed_n(1)
        }),
        check("packed n = 0", &["num_householder"], || packed_n(0)),
    ]);
}

/// `num_householder: Some(0)` on the dense entry point is an error naming `num_householder`:
/// `validate_fla` rejects `n = 0` before it derives the expected shape of `k` from `n`.
#[test]
fn zero_num_householder_names_the_option() {
    assert_all(vec![check("n = 0", &["num_householder"], || {
        with(|a| a.n = Some(0)).run()
    })]);
}

#[test]
fn consistent_num_householder_runs() -> Result<()> {
    let a = with(|a| a.n = Some(N));
    a.run()?;
    a.run_packed(&a.qk())?;
    Ok(())
}

#[test]
fn non_finite_scale_named() {
    assert_all(
        [f64::NAN, f64::INFINITY, f64::NEG_INFINITY]
            .into_iter()
            .flat_map(|s| {
                [
                    check(&format!("scale {s}"), &["scale"], || {
                        with(|a| a.scale = Some(s)).run()
                    }),
                    check(&format!("packed scale {s}"), &["scale"], || {
                        let a = with(|a| a.scale = Some(s));
                        a.run_packed(&a.qk())
                    }),
                ]
            })
            .collect(),
    );
}

/// A finite f64 scale that overflows f32 (the kernels' type) is an error naming `scale`, for the
/// op, the packed op and the decode steps, instead of silently becoming infinite.
#[test]
fn scale_beyond_f32_named() {
    use candle_gdp::op::recurrent::{gated_delta_product_step, gated_delta_product_step_fused};
    let step_args = [
        randn(&[B, H, K, V]),
        randn(&[B, H, K]),
        randn(&[B, N, H, K]),
        randn(&[B, N, H, V]),
        randn(&[B, H]),
        randn(&[B, N, H]),
    ];
    let [s0, q, k, v, g, beta] = &step_args;
    let mut failures = vec![];
    for s in [1e39, -1e39, f64::MAX, f32::MAX as f64 * 1.0001] {
        failures.extend([
            check(&format!("scale {s:e}"), &["scale"], || {
                with(|a| a.scale = Some(s)).run()
            }),
            check(&format!("packed scale {s:e}"), &["scale"], || {
                let a = with(|a| a.scale = Some(s));
                a.run_packed(&a.qk())
            }),
            check(&format!("step scale {s:e}"), &["scale"], || {
                gated_delta_product_step(s0, q, k, v, g, beta, Some(s))
            }),
            check(&format!("fused step scale {s:e}"), &["scale"], || {
                gated_delta_product_step_fused(s0, q, k, v, g, beta, Some(s))
            }),
        ]);
    }
    assert_all(failures);
    // f32::MAX itself is representable and accepted.
    with(|a| a.scale = Some(f32::MAX as f64))
        .run()
        .expect("scale f32::MAX");
}

#[test]
fn zero_size_dimensions_named() {
    let sized = |b, t, h, k, v| Args::new(b, t, h, k, v, N);
    assert_all(vec![
        check("T = 0", &["q"], || sized(B, 0, H, K, V).run()),
        check("K = 0", &["q"], || sized(B, T, H, 0, V).run()),
        check("H = 0", &["q"], || sized(B, T, 0, K, V).run()),
        check("B = 0", &["q"], || sized(0, T, H, K, V).run()),
        check("V = 0", &["v"], || sized(B, T, H, K, 0).run()),
        check("T = 0, K = 0", &["q"], || sized(B, 0, H, 0, V).run()),
        check("T = 0 with h0", &["q"], || {
            let mut a = sized(B, 0, H, K, V);
            a.h0 = Some(randn(&[B, H, K, V]));
            a.run()
        }),
        check("packed T = 0", &["qk"], || {
            let a = sized(B, 0, H, K, V);
            a.run_packed(&randn(&[B, 0, N + 1, H, K]))
        }),
        check("packed K = 0", &["qk"], || {
            let a = sized(B, T, H, 0, V);
            a.run_packed(&a.qk())
        }),
        check("packed V = 0", &["v"], || {
            let a = sized(B, T, H, K, 0);
            a.run_packed(&a.qk())
        }),
        check("packed H = 0", &["qk"], || {
            let a = sized(B, T, 0, K, V);
            a.run_packed(&a.qk())
        }),
    ]);
}

#[test]
fn packed_entry_point_bad_input_named() {
    let a = Args::dense();
    let qk = a.qk();
    assert_all(vec![
        check("qk rank 4", &["qk"], || a.run_packed(&randn(&[B, T, H, K]))),
        check("qk rank 6", &["qk"], || {
            a.run_packed(&randn(&[B, T, N + 1, H, K, 1]))
        }),
        check("qk rank 3", &["qk"], || {
            a.run_packed(&randn(&[B, T, (N + 1) * H * K]))
        }),
        check("qk one slot (n = 0)", &["qk"], || {
            a.run_packed(&randn(&[B, T, 1, H, K]))
        }),
        check("qk zero slots", &["qk"], || {
            a.run_packed(&randn(&[B, T, 0, H, K]))
        }),
        check("qk u32", &["qk"], || {
            let mut b = a.clone();
            b.v = b.v.to_dtype(DType::U32).unwrap();
            b.run_packed(&qk.to_dtype(DType::U32).unwrap())
        }),
        check("qk slots disagree with v rows", &["v"], || {
            a.run_packed(&randn(&[B, T, N + 2, H, K]))
        }),
        check("v dtype != qk dtype", &["v"], || {
            with(|b| b.v = b.v.to_dtype(DType::F64).unwrap()).run_packed(&qk)
        }),
        check("g rank 2", &["g"], || {
            with(|b| b.g = randn(&[B, T * H])).run_packed(&qk)
        }),
        check("beta rows", &["beta"], || {
            with(|b| b.beta = randn(&[B, T, H])).run_packed(&qk)
        }),
        check("v rank 3", &["v"], || {
            with(|b| b.v = randn(&[B, T * N, H * V])).run_packed(&qk)
        }),
        check("initial_state", &["initial_state"], || {
            with(|b| b.h0 = Some(randn(&[B, H, V, K]))).run_packed(&qk)
        }),
    ]);
}

#[test]
fn cu_seqlens_from_tensor_rules() -> Result<()> {
    let dev = Device::Cpu;
    for dt in [DType::I64, DType::I32, DType::I16, DType::U32, DType::U8] {
        let t = Tensor::new(&[0i64, 3, 3, 10], &dev)?.to_dtype(dt)?;
        let cu = cu_seqlens_from_tensor(&t).map_err(|e| anyhow::anyhow!("{dt:?}: {e}"))?;
        assert_eq!(cu, vec![0, 3, 3, 10], "{dt:?}");
    }
    assert_all(vec![
        check("f32 tensor", &["cu_seqlens"], || {
            cu_seqlens_from_tensor(&Tensor::new(&[0f32, 3., 10.], &dev)?)
        }),
        check("f64 tensor", &["cu_seqlens"], || {
            cu_seqlens_from_tensor(&Tensor::new(&[0f64, 10.], &dev)?)
        }),
        check("bf16 tensor", &["cu_seqlens"], || {
            cu_seqlens_from_tensor(&Tensor::new(&[0f32, 10.], &dev)?.to_dtype(DType::BF16)?)
        }),
        check("negative i64", &["cu_seqlens"], || {
            cu_seqlens_from_tensor(&Tensor::new(&[0i64, -3, 10], &dev)?)
        }),
        check("negative i32", &["cu_seqlens"], || {
            cu_seqlens_from_tensor(&Tensor::new(&[-1i32, 3, 10], &dev)?)
        }),
        check("rank 2", &["cu_seqlens"], || {
            cu_seqlens_from_tensor(&Tensor::new(&[[0i64, 3], [3, 10]], &dev)?)
        }),
        check("rank 0", &["cu_seqlens"], || {
            cu_seqlens_from_tensor(&Tensor::new(3i64, &dev)?)
        }),
    ]);
    Ok(())
}

#[test]
fn non_contiguous_inputs_match_contiguous() -> Result<()> {
    let mut a = Args::dense();
    a.h0 = Some(randn(&[B, H, K, V]));
    let (o_ref, ht_ref) = a.run()?;
    // Same values, strided storage: build each tensor transposed and transpose it back.
    let strided = |x: &Tensor| -> Result<Tensor> {
        let r = x.rank();
        let y = x.transpose(0, r - 1)?.contiguous()?.transpose(0, r - 1)?;
        assert!(!y.is_contiguous() || x.dims()[0] == 1 || x.dims()[r - 1] == 1);
        Ok(y)
    };
    let b = Args {
        q: strided(&a.q)?,
        k: strided(&a.k)?,
        v: strided(&a.v)?,
        g: strided(&a.g)?,
        beta: strided(&a.beta)?,
        h0: Some(strided(a.h0.as_ref().unwrap())?),
        ..a.clone()
    };
    let (o, ht) = b.run()?;
    let diff = |x: &Tensor, y: &Tensor| -> Result<f32> {
        Ok((x - y)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
    };
    assert_eq!(diff(&o, &o_ref)?, 0.0);
    assert_eq!(diff(&ht.unwrap(), &ht_ref.unwrap())?, 0.0);
    Ok(())
}

/// `op::cpu::forward` / `backward` write through raw pointers at offsets derived from a
/// `GdpShape`, whose fields are public: an inconsistent shape, or buffers of the wrong length,
/// are errors naming what is wrong, never out-of-bounds writes.
#[test]
fn cpu_kernels_refuse_inconsistent_shapes() {
    use candle_gdp::op::cpu::{backward, forward, PackedInputs};
    use candle_gdp::op::shape::{GdpShape, SeqSpan};
    let good = GdpShape::new(B, T, H, K, V, N, None);
    let qk = vec![0.5f32; good.qk_len()];
    let v = vec![0.5f32; good.v_len()];
    let aux = vec![-0.1f32; good.aux_len(false)];
    let x = PackedInputs {
        qk: &qk,
        v: &v,
        aux: &aux,
        has_h0: false,
    };
    let grad = vec![1.0f32; good.o_len() + good.state_len()];
    let out = forward(&x, &good, 0.5, None).expect("a consistent shape runs");
    assert_eq!(out.len(), good.o_len() + good.state_len());
    backward(&x, &good, 0.5, &grad, None).expect("a consistent shape runs");

    let span = |batch, start, len| SeqSpan { batch, start, len };
    let edit = |f: &dyn Fn(&mut GdpShape)| {
        let mut s = good.clone();
        f(&mut s);
        s
    };
    let shapes = [
        (
            "batch row",
            edit(&|s| s.seqs[1] = span(B, 0, T)),
            "outside the batch",
        ),
        (
            "past T",
            edit(&|s| s.seqs[1] = span(1, 1, T)),
            "outside the batch",
        ),
        (
            "start overflow",
            edit(&|s| s.seqs[1] = span(1, usize::MAX, 2)),
            "outside",
        ),
        ("overlap", edit(&|s| s.seqs[1] = span(0, 1, 2)), "overlap"),
        (
            "size overflow",
            edit(&|s| s.dv = usize::MAX / 2),
            "overflows",
        ),
        (
            "extra sequence",
            edit(&|s| s.seqs.push(span(0, 0, 1))),
            "overlap",
        ),
    ];
    for (what, sh, needle) in &shapes {
        for r in [
            forward(&x, sh, 0.5, None).map(drop),
            backward(&x, sh, 0.5, &grad, None).map(drop),
        ] {
            let msg = r.expect_err(what).to_string();
            assert!(
                msg.contains("`shape`") && msg.contains(needle),
                "{what}: {msg}"
            );
        }
    }
    // A consistent shape with buffers of the wrong length.
    let short = &qk[..qk.len() - 1];
    let bad_x = PackedInputs { qk: short, ..x };
    let msg = forward(&bad_x, &good, 0.5, None).unwrap_err().to_string();
    assert!(msg.contains("`qk`"), "{msg}");
    let msg = forward(&x, &good, 0.5, Some(&[0.0; 3]))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("`h0`"), "{msg}");
    let msg = backward(&x, &good, 0.5, &grad[1..], None)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("`grad`"), "{msg}");
    // Fewer tokens in `T` than the buffers hold is caught by the length checks too.
    let smaller = edit(&|s| {
        s.tokens = 1;
        s.seqs = vec![span(0, 0, 1), span(1, 0, 1)];
    });
    let msg = forward(&x, &smaller, 0.5, None).unwrap_err().to_string();
    assert!(msg.contains("`qk`"), "{msg}");
}
