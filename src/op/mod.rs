//! The Gated DeltaProduct operator: checked public entry points, the packed layout, and the
//! split into `naive` (the readable f64 specification), `chunk` kernels (training, in
//! [`cpu`]) and [`recurrent`] (one decode step).

pub mod config;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod custom;
pub(crate) mod heads;
// Without CUDA only the mirror test of `cuda/params.cuh` reads these structs.
#[cfg(any(feature = "cuda", test))]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod kernel_params;
pub(crate) mod link;
pub mod naive;
pub(crate) mod pack;
pub mod recurrent;
// Without CUDA only its tests read it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod row_fix;
// Without CUDA only its tests read it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod segments;
pub mod shape;
pub mod vjp;

use crate::error::GdpError;
use candle_core::{DType, Device, Result, Tensor};
pub use config::{KernelConfig, KernelPath, Segments, TileConfig};
use custom::GdpForward;
use shape::{validate_cu_seqlens, GdpShape};
pub use vjp::{gated_delta_product_vjp, GdpGrads, GdpVjp};

/// Options of [`gated_delta_product`], mirroring FLA's `chunk_gated_delta_product` keywords.
#[derive(Debug, Clone, Default)]
pub struct GdpOptions<'a> {
    /// Householder sub-steps per token `n`; inferred from `k.dim(1) / q.dim(1)` when `None`,
    /// checked against it otherwise.
    pub num_householder: Option<usize>,
    /// Output scale; `K^-0.5` when `None`.
    pub scale: Option<f64>,
    /// Initial state `[N, H, K, V]` (any float dtype; used in f32). Zeros when `None`.
    pub initial_state: Option<&'a Tensor>,
    /// Return the final state `[N, H, K, V]` (f32).
    pub output_final_state: bool,
    /// Packed sequences: `N + 1` offsets over the `T` tokens of the single batch row (`B = 1`).
    pub cu_seqlens: Option<&'a [usize]>,
    /// What the chunked forward keeps for the backward instead of recomputing it there (bf16 on
    /// CUDA with the split backward, context-parallel ranks included; ignored elsewhere, and
    /// when no input tracks gradients): see [`SaveIntermediates`]. The op's backward frees
    /// what was kept; it lives as long as the output's graph until then.
    pub save_intermediates: SaveIntermediates,
    /// CUDA kernel choices and tiles (automatic by default; ignored on the CPU).
    pub kernels: KernelConfig,
}

/// What the chunked bf16 CUDA forward keeps for its backward
/// ([`GdpOptions::save_intermediates`]): memory held from the forward to the backward, for
/// backward time. Bytes are per token and head at K = V = 128 with `n` Householder sub-steps
/// (the inputs `q, k, v` take `256 + 512·n`); times on an H200 (`docs/perf-log.md`).
///
/// The default keeps the WY factors, as PyTorch and Megatron-Core keep activations unless
/// asked to recompute them: through Candle's autograd it made forward+backward 1.02–1.28x
/// FLA's at the benchmark shapes, against 0.92–1.18x keeping nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum SaveIntermediates {
    /// Nothing: the backward computes the WY factors again and reruns the forward's state
    /// scan. FLA's memory (it keeps only `(I + A)^-1`, `128·n` bytes).
    Nothing,
    /// The WY factors `W`, `U`, `P`, their decay coefficients and `(I + A)^-1`, about `780·n`
    /// bytes (about `k` and `v` again): the backward skips its WY kernel and reruns only the
    /// state scan, beside its state-gradient scan. The forward writes `(I + A)^-1` too (1–6%).
    #[default]
    WyFactors,
    /// The WY factors, every chunk's start state and Delta, about `1548·n` bytes: the backward
    /// reruns nothing; the forward stores the states as it goes (11–21% slower).
    All,
}

impl From<bool> for SaveIntermediates {
    /// `true`: [`SaveIntermediates::All`]; `false`: [`SaveIntermediates::Nothing`] (the two
    /// values of the option before it had three).
    fn from(all: bool) -> Self {
        if all {
            Self::All
        } else {
            Self::Nothing
        }
    }
}

/// Gated DeltaProduct with flash-linear-attention's layout and semantics.
///
/// * `q [B, T, H, K]`, `k [B, T·n, H, K]`, `v [B, T·n, H, V]`: one dtype among f32, bf16, f16,
///   f64 (row `t·n + j` of `k`, `v`, `beta` is sub-step `j` of token `t`);
/// * `g [B, T, H]`: natural-log forget gate, applied once per token before its `n` updates;
/// * `beta [B, T·n, H]`: update strengths (any float dtype).
///
/// Returns `o [B, T, H, V]` in `q`'s dtype and, with `output_final_state`, the final state
/// `[N, H, K, V]` in f32. Differentiable in all of `q, k, v, g, beta` and the initial state.
///
/// **Grouped value heads.** `q` and `k` may have fewer heads `Hk` than the rest (`H = Hv`, a
/// multiple of `Hk`), as in Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next) and FLA's
/// `num_v_heads`: value head `h` reads key head `h / (Hv / Hk)` (grouped order, as Hugging Face
/// checkpoints store them), and the gradients of `q` and `k` sum over each group. `Hk = Hv` is
/// FLA's layout.
///
/// This wrapper copies `q` and `k` into the packed layout of
/// [`gated_delta_product_packed`]; a model that produces that layout directly avoids the copy.
///
/// # Non-finite inputs
///
/// The op does not scan its inputs for NaN or ±Inf, which would cost a pass over `q`, `k` and `v`
/// (and a device synchronisation on CUDA) on every call; it computes with them as the f64
/// reference [`naive`] does:
///
/// * every output and gradient that the reference makes non-finite is non-finite here too. A NaN
///   or ±Inf in `k`, `v`, `beta` or the initial state, or a NaN or +Inf in `g`, reaches the
///   outputs of its (sequence, head) from its token on (from the first token, for the initial
///   state) and its final state; one in `q` reaches the output of its token alone;
/// * nothing reaches another sequence (packed, or batch row) or another head: their outputs,
///   final states and gradients are bit for bit those of the call without the value, through
///   [`crate::ContextParallel`] too;
/// * within its (sequence, head), the chunked kernels mix the 64 sub-steps of a chunk, so the
///   outputs of up to 63 sub-steps before the value, and gradients that the reference keeps
///   finite, can be non-finite as well; outputs of tokens that end at least 64 sub-steps
///   before it are unaffected.
///
/// A gate of `-inf` is no error but a complete reset (`exp(-inf) = 0`, as for any gate below
/// about -104 in f32): the kernels take it as -1e4, so the results are finite and bit for bit
/// those of a gate of -1e4, except its own gradient, which is exactly 0 (as in the reference).
/// Tested on the CPU, single-device and context-parallel (`tests/edges.rs`), and on CUDA
/// (`tests/gpu.rs`).
pub fn gated_delta_product(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    opts: &GdpOptions,
) -> Result<(Tensor, Option<Tensor>)> {
    let sh = validate_fla(q, k, v, g, beta, opts)?;
    apply(QueryKeys::Split(q, k), v, g, beta, sh, opts, None)
}

/// `q [B, T, Hk, K]` and `k [B, T·n, Hk, K]` with their heads repeated to the `H = Hv` heads of
/// the checked geometry `sh` (grouped order, [`heads`]); themselves when `Hk = Hv`.
pub(crate) fn expand_key_heads(q: &Tensor, k: &Tensor, sh: &GdpShape) -> Result<(Tensor, Tensor)> {
    let r = sh.heads / q.dim(2)?;
    Ok((
        heads::expand_key_heads(q, 2, r)?,
        heads::expand_key_heads(k, 2, r)?,
    ))
}

/// The queries and keys the op's kernels get from FLA's `q [B, T, Hk, K]`, `k [B, T·n, Hk, K]`,
/// and whether they read them in place: the CUDA bf16 chunked kernels read `q`, `k` themselves
/// (grouped value heads too: value head `h` reads key head `h / (H / Hk)`, and the backward
/// sums `dq`, `dk` over each group), outside context parallelism; everywhere else they get `q`,
/// `k` repeated to the value heads of `sh` ([`expand_key_heads`]).
pub(crate) fn kernel_keys(
    q: &Tensor,
    k: &Tensor,
    sh: &GdpShape,
    opts: &GdpOptions,
    cp: bool,
) -> Result<(Tensor, Tensor, bool)> {
    #[cfg(feature = "cuda")]
    let in_place = match cp {
        true => cuda::rank_reads_qk_in_place(q, sh, &opts.kernels)?,
        false => cuda::reads_qk_in_place(q, sh, &opts.kernels)?,
    };
    #[cfg(not(feature = "cuda"))]
    let in_place = {
        let _ = (opts, cp);
        false
    };
    if in_place {
        return Ok((q.clone(), k.clone(), true));
    }
    let (q, k) = expand_key_heads(q, k, sh)?;
    Ok((q, k, false))
}

/// Where the op's queries and keys come from.
#[derive(Clone, Copy)]
pub(crate) enum QueryKeys<'a> {
    /// `qk [B, T, n+1, H, K]`, one graph input.
    Packed(&'a Tensor),
    /// FLA's `q [B, T, H, K]` and `k [B, T·n, H, K]`, two graph inputs; the CUDA bf16 kernels
    /// read them in place, the others run on a packed copy held outside the graph
    /// ([`custom::GdpForwardSplit`]).
    Split(&'a Tensor, &'a Tensor),
}

/// Gated DeltaProduct on the packed query/key layout `qk [B, T, n+1, H, K]`: slot 0 holds
/// `q_t`, slot `1 + j` holds `k_{t·n+j}`. This is what one fused projection `[q | k_0..k_{n-1}]`
/// per token produces, so no copy of `q` or `k` is needed. `v [B, T·n, H, V]`, `g [B, T, H]`,
/// `beta [B, T·n, H]` and the options are as in [`gated_delta_product`].
pub fn gated_delta_product_packed(
    qk: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    opts: &GdpOptions,
) -> Result<(Tensor, Option<Tensor>)> {
    let sh = validate_packed(qk, v, g, beta, opts)?;
    apply(QueryKeys::Packed(qk), v, g, beta, sh, opts, None)
}

/// Checks the packed-layout inputs of [`gated_delta_product_packed`] and returns the geometry.
pub(crate) fn validate_packed(
    qk: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    opts: &GdpOptions,
) -> Result<GdpShape> {
    let (b, t, slots, h, k) = dims5(qk, "qk", "[B, T, n+1, H, K]")?;
    if slots < 2 || t == 0 {
        return Err(GdpError::Shape {
            name: "qk".into(),
            expected: vec![b, t.max(1), slots.max(2), h, k],
            layout: "[B, T, n+1, H, K] with T >= 1 and n >= 1",
            got: qk.dims().to_vec(),
        }
        .into());
    }
    let hv = value_heads(v, h)?;
    validate_rest((qk, "qk"), (b, t, hv, k, slots - 1), v, g, beta, opts)
}

/// Repeats grouped key heads to the value heads of `sh` ([`heads`]) where the kernels do not
/// read them in place ([`kernel_keys`]), packs the gates, builds the op (with this rank's
/// context-parallel link, if any) and applies it.
pub(crate) fn apply(
    qk: QueryKeys,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    sh: GdpShape,
    opts: &GdpOptions,
    cp: Option<std::sync::Arc<dyn link::RankLink>>,
) -> Result<(Tensor, Option<Tensor>)> {
    let (first, second);
    let mut in_place = false;
    let qk = match qk {
        QueryKeys::Packed(qk) => {
            first = heads::expand_key_heads(qk, 3, sh.heads / qk.dim(3)?)?;
            QueryKeys::Packed(&first)
        }
        QueryKeys::Split(q, k) => {
            (first, second, in_place) = kernel_keys(q, k, &sh, opts, cp.is_some())?;
            QueryKeys::Split(&first, &second)
        }
    };
    let aux = gate_buffer(g, beta, opts.initial_state)?;
    let tracked = match qk {
        QueryKeys::Packed(qk) => qk.track_op(),
        QueryKeys::Split(q, k) => q.track_op() || k.track_op(),
    } || v.track_op()
        || aux.track_op();
    let op = forward_op(sh.clone(), opts, cp, tracked, v.device())?;
    let (v, dtype) = (v.contiguous()?, v.dtype());
    let out = match qk {
        QueryKeys::Packed(qk) => qk.contiguous()?.apply_op3(&v, &aux, op)?,
        QueryKeys::Split(q, k) => {
            let (q, k) = (q.contiguous()?, k.contiguous()?);
            let split = custom::GdpForwardSplit::new(op, &q, &k, v.clone(), aux.clone(), in_place)?;
            let tie = v.apply_op2(
                &aux,
                custom::GradTie {
                    stash: split.stash.clone(),
                },
            )?;
            q.apply_op3(&k, &tie, split)?
        }
    };
    split_output(out, &sh, dtype, opts.output_final_state)
}

/// The gate the kernels see for a gate of `-inf`: as complete a reset (`exp` of it is 0 in f32
/// and f64), with finite differences of the chunked kernels' gate cumsums (`-inf - -inf` is
/// NaN). Its gradient goes to the constant; a gate this low has a gradient of 0 anyway.
const GATE_FLOOR: f32 = -1e4;

/// The f32 gate buffer `[g | beta | h0?]` (each flattened) that the op takes as one input, with
/// a gate of `-inf` as [`GATE_FLOOR`] (NaN and `+inf` unchanged).
pub(crate) fn gate_buffer(g: &Tensor, beta: &Tensor, h0: Option<&Tensor>) -> Result<Tensor> {
    let g = g.flatten_all()?.to_dtype(DType::F32)?;
    let reset = g.eq(f64::NEG_INFINITY)?;
    let g = reset.where_cond(&Tensor::full(GATE_FLOOR, g.shape(), g.device())?, &g)?;
    let mut parts = vec![g, beta.flatten_all()?.to_dtype(DType::F32)?];
    if let Some(h0) = h0 {
        parts.push(h0.flatten_all()?.to_dtype(DType::F32)?);
    }
    Tensor::cat(&parts, 0)
}

/// The forward op for checked geometry `sh`; `tracked`: whether a backward may follow (only
/// then does [`GdpOptions::save_intermediates`] keep anything).
pub(crate) fn forward_op(
    sh: GdpShape,
    opts: &GdpOptions,
    cp: Option<std::sync::Arc<dyn link::RankLink>>,
    tracked: bool,
    device: &Device,
) -> Result<GdpForward> {
    let scale = effective_scale(opts, sh.dk);
    #[cfg(feature = "cuda")]
    let cache = {
        let keep = opts.save_intermediates;
        (keep != SaveIntermediates::Nothing && tracked && device.is_cuda())
            .then(|| std::sync::Arc::new(cuda::CacheSlot::new(keep == SaveIntermediates::All)))
    };
    #[cfg(not(feature = "cuda"))]
    let _ = (tracked, device);
    Ok(GdpForward {
        shape: sh,
        scale,
        has_h0: opts.initial_state.is_some(),
        cp,
        with_final_state: opts.output_final_state,
        #[cfg(feature = "cuda")]
        kernels: opts.kernels,
        #[cfg(feature = "cuda")]
        cache,
    })
}

/// `(o [B, T, H, V]` in `dtype`, final state `[N, H, K, V]` f32`)` from the op's output: `o`
/// itself, or the packed f32 `[o | final state]` when the final state was asked for.
pub(crate) fn split_output(
    out: Tensor,
    sh: &GdpShape,
    dtype: DType,
    with_final_state: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    if !with_final_state {
        return Ok((out, None));
    }
    let (o_len, s_len) = (sh.o_len(), sh.state_len());
    let o_shape = (sh.batch, sh.tokens, sh.heads, sh.dv);
    let s_shape = (sh.num_seqs(), sh.heads, sh.dk, sh.dv);
    let o = out.narrow(0, 0, o_len)?.reshape(o_shape)?.to_dtype(dtype)?;
    let ht = out.narrow(0, o_len, s_len)?.reshape(s_shape)?;
    Ok((o, Some(ht)))
}

/// Checks the FLA-layout inputs and returns the problem geometry.
pub(crate) fn validate_fla(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    opts: &GdpOptions,
) -> Result<GdpShape> {
    let (b, t, h, dk) = dims4(q, "q", "[B, T, H, K]")?;
    if t == 0 {
        return Err(GdpError::Empty {
            name: "q".into(),
            got: q.dims().to_vec(),
        }
        .into());
    }
    let (_, tn, _, _) = dims4(k, "k", "[B, T·n, H, K]")?;
    if opts.num_householder == Some(0) {
        return Err(GdpError::Option {
            name: "num_householder".into(),
            reason: "must be at least 1, got 0".into(),
        }
        .into());
    }
    let n = opts.num_householder.unwrap_or((tn / t).max(1));
    if !matches!(
        q.dtype(),
        DType::F32 | DType::F16 | DType::BF16 | DType::F64
    ) {
        return Err(GdpError::DType {
            name: "q".into(),
            expected: "a float dtype (f32, bf16, f16 or f64)",
            got: q.dtype(),
        }
        .into());
    }
    if k.dtype() != q.dtype() {
        return Err(GdpError::DType {
            name: "k".into(),
            expected: "the dtype of q",
            got: k.dtype(),
        }
        .into());
    }
    check_shape(k, "k", &[b, t * n, h, dk], "[B, T·n, Hk, K]")?;
    let hv = value_heads(v, h)?;
    validate_rest((q, "q"), (b, t, hv, dk, n), v, g, beta, opts)
}

/// The heads `Hv` of the values (a multiple of the `hk` key heads, [`heads`]), or `hk` where
/// `v` is not a rank-4 tensor (its shape check then names it).
fn value_heads(v: &Tensor, hk: usize) -> Result<usize> {
    match v.dims() {
        &[_, _, hv, _] if hk > 0 => heads::key_groups(hk, hv, "v").map(|r| r * hk),
        _ => Ok(hk),
    }
}

/// The checks shared by both layouts, given the query input `(q, its name)` and the sizes
/// `(B, T, H, K, n)` read from the queries and keys: the values, gates, options.
fn validate_rest(
    (q, q_name): (&Tensor, &str),
    (b, t, h, dk, n): (usize, usize, usize, usize, usize),
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    opts: &GdpOptions,
) -> Result<GdpShape> {
    if let Some(want) = opts.num_householder {
        if want != n || want == 0 {
            return Err(GdpError::Option {
                name: "num_householder".into(),
                reason: format!("is {want}, but the inputs hold {n} sub-steps per token"),
            }
            .into());
        }
    }
    if [b, t, h, dk].contains(&0) {
        return Err(GdpError::Empty {
            name: q_name.into(),
            got: q.dims().to_vec(),
        }
        .into());
    }
    let float_dtype = |x: &Tensor, name: &str| -> Result<()> {
        match x.dtype() {
            DType::F32 | DType::F16 | DType::BF16 | DType::F64 => Ok(()),
            dt => Err(GdpError::DType {
                name: name.into(),
                expected: "a float dtype (f32, bf16, f16 or f64)",
                got: dt,
            }
            .into()),
        }
    };
    float_dtype(q, q_name)?;
    let (_, _, _, dv) = dims4(v, "v", "[B, T·n, H, V]")?;
    check_shape(v, "v", &[b, t * n, h, dv], "[B, T·n, H, V]")?;
    if dv == 0 {
        return Err(GdpError::Empty {
            name: "v".into(),
            got: v.dims().to_vec(),
        }
        .into());
    }
    check_shape(g, "g", &[b, t, h], "[B, T, H]")?;
    check_shape(beta, "beta", &[b, t * n, h], "[B, T·n, H]")?;
    float_dtype(v, "v")?;
    float_dtype(g, "g")?;
    float_dtype(beta, "beta")?;
    if v.dtype() != q.dtype() {
        return Err(GdpError::DType {
            name: "v".into(),
            expected: "the dtype of q and k",
            got: v.dtype(),
        }
        .into());
    }
    let dev = q.device();
    for (x, name) in [(v, "v"), (g, "g"), (beta, "beta")] {
        same_device(x, name, dev, q_name)?;
    }
    if let Some(cu) = opts.cu_seqlens {
        if b != 1 {
            return Err(GdpError::CuSeqlens(format!(
                "packed sequences need batch size B = 1, got B = {b}"
            ))
            .into());
        }
        validate_cu_seqlens(cu, t)?;
    }
    let sh = GdpShape::new(b, t, h, dk, dv, n, opts.cu_seqlens);
    if let Some(h0) = opts.initial_state {
        check_shape(
            h0,
            "initial_state",
            &[sh.num_seqs(), h, dk, dv],
            "[N, H, K, V]",
        )?;
        float_dtype(h0, "initial_state")?;
        same_device(h0, "initial_state", dev, q_name)?;
    }
    if let Some(s) = opts.scale {
        check_scale(s)?;
    }
    Ok(sh)
}

/// The scale the op multiplies queries by: `opts.scale`, else `1/sqrt(K)` (already checked to
/// fit in f32 by the validation).
pub(crate) fn effective_scale(opts: &GdpOptions, dk: usize) -> f32 {
    opts.scale.unwrap_or((dk as f64).powf(-0.5)) as f32
}

/// `scale` must be finite, also once rounded to the f32 that the kernels compute with (a finite
/// f64 above `f32::MAX` would silently become infinite).
pub(crate) fn check_scale(s: f64) -> Result<()> {
    let reason = if !s.is_finite() {
        format!("must be finite, got {s}")
    } else if (s as f32).is_infinite() {
        format!("must fit in f32 (|scale| <= {:e}), got {s:e}", f32::MAX)
    } else {
        return Ok(());
    };
    Err(GdpError::Option {
        name: "scale".into(),
        reason,
    }
    .into())
}

fn same_device(x: &Tensor, name: &str, dev: &Device, reference: &str) -> Result<()> {
    if !x.device().same_device(dev) {
        return Err(GdpError::Device {
            name: name.into(),
            reference: reference.into(),
            expected: format!("{:?}", dev.location()),
            got: format!("{:?}", x.device().location()),
        }
        .into());
    }
    Ok(())
}

fn check_shape(x: &Tensor, name: &str, want: &[usize], layout: &'static str) -> Result<()> {
    if x.dims() != want {
        return Err(GdpError::Shape {
            name: name.into(),
            expected: want.to_vec(),
            layout,
            got: x.dims().to_vec(),
        }
        .into());
    }
    Ok(())
}

fn rank_err(x: &Tensor, name: &str, expected: usize, layout: &'static str) -> candle_core::Error {
    GdpError::Rank {
        name: name.into(),
        expected,
        layout,
        got: x.dims().to_vec(),
    }
    .into()
}

fn dims4(x: &Tensor, name: &str, layout: &'static str) -> Result<(usize, usize, usize, usize)> {
    match *x.dims() {
        [a, b, c, d] => Ok((a, b, c, d)),
        _ => Err(rank_err(x, name, 4, layout)),
    }
}

fn dims5(
    x: &Tensor,
    name: &str,
    layout: &'static str,
) -> Result<(usize, usize, usize, usize, usize)> {
    match *x.dims() {
        [a, b, c, d, e] => Ok((a, b, c, d, e)),
        _ => Err(rank_err(x, name, 5, layout)),
    }
}

/// Reads packed-sequence offsets from an integer tensor `[N+1]` (any integer dtype, as FLA's
/// `cu_seqlens`), rejecting negative values.
pub fn cu_seqlens_from_tensor(t: &Tensor) -> Result<Vec<usize>> {
    if t.rank() != 1 {
        return Err(GdpError::Rank {
            name: "cu_seqlens".into(),
            expected: 1,
            layout: "[N+1]",
            got: t.dims().to_vec(),
        }
        .into());
    }
    let vals: Vec<i64> = match t.dtype() {
        DType::I64 | DType::I32 | DType::I16 | DType::U32 | DType::U8 => {
            t.to_dtype(DType::I64)?.to_vec1::<i64>()?
        }
        dt => {
            return Err(GdpError::DType {
                name: "cu_seqlens".into(),
                expected: "an integer dtype (i64, i32, i16, u32 or u8)",
                got: dt,
            }
            .into())
        }
    };
    vals.iter()
        .map(|&x| {
            usize::try_from(x).map_err(|_| {
                GdpError::CuSeqlens(format!("offsets must be non-negative, got {x}")).into()
            })
        })
        .collect()
}
