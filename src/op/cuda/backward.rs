//! Safe launchers of the CUDA backward kernel `gdp_bwd_*` (`cuda/gdp_bwd.cuh`) in its three
//! modes: the backward itself, and the forward / backward summaries of context parallelism
//! (the final state of the forward run on value columns widened to `[v | 0_K]` from
//! `[h0 | I_K]`, and the initial-state gradient of the backward run with `do = [do | 0_K]`,
//! `dht = [dht | I_K]`). Every CUDA failure is returned as a [`candle_core::Error`].

use super::launch::{allow_smem, check_states, device_attr, shape_i32, to_i32, view, THREADS};
use super::module::load_kernel;
use crate::op::config::KernelConfig;
use crate::op::shape::{GdpShape, CHUNK};
use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result};

/// A storage and its layout.
pub type In<'a> = (&'a CudaStorage, &'a Layout);

const MODE_FULL: i32 = 0;
const MODE_FWD_SUM: i32 = 1;
const MODE_BWD_SUM: i32 = 2;

/// Candidate value-column tile widths, widest first.
const BV_CANDIDATES: [usize; 4] = [64, 32, 16, 8];

/// Dynamic shared memory of one backward block, in bytes, for key dimension `dk`, `bv` value
/// columns and input elements of `elem` bytes. Must match the carve-up at the top of `gdp_bwd`
/// in `cuda/gdp_bwd.cuh`.
pub fn bwd_smem_bytes(dk: usize, bv: usize, elem: usize) -> usize {
    let c = CHUNK;
    let kstr = dk + if elem == 4 { 1 } else { 2 };
    let sb = bv + 1; // padded row stride of the [*][BV] buffers
    4 * (2 * dk * sb + 6 * c * sb + 4 * c * c + 11 * c + 4) + 2 * c * kstr * elem
}

/// Block shape of one backward-kernel launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BwdPlan {
    /// Value columns per block.
    pub bv: usize,
    /// Dynamic shared memory per block, bytes.
    pub smem: usize,
    /// Grid `(entries·H, ceil(width / bv))`.
    pub grid: (u32, u32),
}

impl BwdPlan {
    /// Picks the value tile for `rows` (entry, head) pairs over `width` state columns:
    /// `forced` when set, else the widest fitting tile that still gives at least
    /// `sms / 2` blocks (else the narrowest fitting tile of at least 16 columns).
    pub fn new(
        dk: usize,
        width: usize,
        rows: usize,
        elem: usize,
        max_smem: usize,
        sms: usize,
        forced: Option<usize>,
    ) -> Result<Self> {
        let cap = width.next_power_of_two().clamp(8, 64);
        let fits = |bv: usize| bwd_smem_bytes(dk, bv, elem) <= max_smem;
        let blocks = |bv: usize| rows * width.div_ceil(bv);
        let bv = match forced {
            Some(bv) => {
                if !BV_CANDIDATES.contains(&bv) || !fits(bv) {
                    candle_core::bail!(
                        "gdp cuda: KernelConfig::tiles.fused_backward = {bv} must be one of {BV_CANDIDATES:?} and fit \
                         in {max_smem} bytes of shared memory (needs {})",
                        bwd_smem_bytes(dk, bv, elem)
                    );
                }
                bv
            }
            None => {
                let fitting: Vec<usize> = BV_CANDIDATES
                    .iter()
                    .copied()
                    .filter(|&bv| bv <= cap && fits(bv))
                    .collect();
                let Some(&narrowest) = fitting.last() else {
                    candle_core::bail!(
                        "gdp cuda backward: K = {dk} needs {} bytes of shared memory even with 8 \
                         value columns per block, the device allows {max_smem}",
                        bwd_smem_bytes(dk, 8, elem)
                    );
                };
                match fitting.iter().copied().find(|&bv| 2 * blocks(bv) >= sms) {
                    Some(bv) => bv,
                    None => fitting
                        .iter()
                        .rev()
                        .copied()
                        .find(|&bv| bv >= 16)
                        .unwrap_or(narrowest),
                }
            }
        };
        let (gx, gy) = (rows, width.div_ceil(bv));
        if gx > i32::MAX as usize || gy > 65_535 {
            candle_core::bail!("gdp cuda: grid ({gx}, {gy}) is too large");
        }
        Ok(Self {
            bv,
            smem: bwd_smem_bytes(dk, bv, elem),
            grid: (gx as u32, gy as u32),
        })
    }
}

/// Checks that the inputs share `qk`'s device and dtype (gates: f32); returns the device.
fn check_inputs(qk: In, v: In, aux: In, grad: Option<In>) -> Result<CudaDevice> {
    let dev = qk.0.device().clone();
    for (s, name) in [(v.0, "v"), (aux.0, "gates")]
        .into_iter()
        .chain(grad.map(|g| (g.0, "gradient")))
    {
        if !s.device().same_device(&dev) {
            candle_core::bail!("gdp cuda: `{name}` is on another device than `qk`");
        }
    }
    if v.0.dtype() != qk.0.dtype() {
        candle_core::bail!(
            "gdp cuda: `v` is {:?} but `qk` is {:?}",
            v.0.dtype(),
            qk.0.dtype()
        );
    }
    if aux.0.dtype() != DType::F32 {
        candle_core::bail!(
            "gdp cuda: the gate buffer must be f32, got {:?}",
            aux.0.dtype()
        );
    }
    if let Some(g) = grad {
        if g.0.dtype() != DType::F32 {
            candle_core::bail!("gdp cuda: the gradient must be f32, got {:?}", g.0.dtype());
        }
    }
    Ok(dev)
}

/// One launch of `gdp_bwd_*`.
struct Launch<'a> {
    sh: &'a GdpShape,
    scale: f32,
    /// Whether the gate buffer carries initial states.
    has_h0: bool,
    /// Sequences of the table (their state rows); summaries are written in this order.
    seqs: &'a [usize],
    mode: i32,
    /// Initial states `[N, H, K, V]` replacing the gate buffer's (modes FULL and FWD_SUM).
    h0: Option<&'a CudaSlice<f32>>,
    /// `[do | dht]` (modes FULL and BWD_SUM).
    grad: Option<In<'a>>,
    /// Replaces the `dht` part of `grad`.
    dht: Option<&'a CudaSlice<f32>>,
    /// The value tile forced by [`KernelConfig`]'s `tiles.fused_backward`.
    forced_bv: Option<usize>,
}

impl Launch<'_> {
    fn run(&self, qk: In, v: In, aux: In, out: &mut CudaSlice<f32>) -> Result<()> {
        let dev = check_inputs(qk, v, aux, self.grad)?;
        match qk.0.dtype() {
            DType::F32 => self.run_t::<f32>("gdp_bwd_f32", &dev, qk, v, aux, out),
            DType::BF16 => self.run_t::<half::bf16>("gdp_bwd_bf16", &dev, qk, v, aux, out),
            DType::F16 => self.run_t::<half::f16>("gdp_bwd_f16", &dev, qk, v, aux, out),
            DType::F64 => candle_core::bail!(
                "gdp cuda: f64 inputs are not supported on CUDA; use f32, bf16 or f16 (or the CPU op)"
            ),
            dt => candle_core::bail!("gdp cuda: unsupported dtype {dt:?} for q/k/v"),
        }
    }

    fn run_t<T: CudaDType + DeviceRepr>(
        &self,
        kernel: &str,
        dev: &CudaDevice,
        qk: In,
        v: In,
        aux: In,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let sh = self.sh;
        let qk_v = view::<T>(qk.0, qk.1, sh.qk_len(), "qk")?;
        let v_v = view::<T>(v.0, v.1, sh.v_len(), "v")?;
        let aux_v = view::<f32>(aux.0, aux.1, sh.aux_len(self.has_h0), "gates")?;
        let (o_len, s_len) = (sh.o_len(), sh.state_len());
        let grad_v = match self.grad {
            Some(g) => Some(view::<f32>(g.0, g.1, o_len + s_len, "grad")?),
            None => None,
        };
        check_states(self.h0, sh, "initial-state override")?;
        check_states(self.dht, sh, "dht override")?;
        let [b, t, h, k, vd, n] = shape_i32(sh)?;
        let ext = if self.mode == MODE_FULL { 0 } else { sh.dk };
        to_i32(sh.dv + ext, "V + K")?;
        let mut table = Vec::with_capacity(5 * self.seqs.len());
        let mut chunks = 0usize;
        for &s in self.seqs {
            let sp = &sh.seqs[s];
            table.extend([
                to_i32(sp.batch, "batch")?,
                to_i32(sp.start, "start")?,
                to_i32(sp.len, "len")?,
                to_i32(s, "state row")?,
                to_i32(chunks, "chunk offset")?,
            ]);
            chunks += (sp.len * sh.n).div_ceil(CHUNK);
        }
        let rows = self.seqs.len() * sh.heads;
        if rows == 0 {
            return Ok(());
        }
        let max_smem = device_attr(
            dev,
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?;
        let sms = device_attr(
            dev,
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?;
        let plan = BwdPlan::new(
            sh.dk,
            sh.dv + ext,
            rows,
            std::mem::size_of::<T>(),
            max_smem,
            sms,
            self.forced_bv,
        )?;
        let table = dev.clone_htod(&table)?;
        // Chunk start states [chunks, H, K, V] (FULL only); every element the kernel reads it
        // wrote first, zeros keep the buffer defined anyway.
        let hs_len = if self.mode == MODE_FULL {
            (chunks * sh.heads * sh.dk * sh.dv).max(1)
        } else {
            1
        };
        let mut hs = dev.alloc_zeros::<f32>(hs_len)?;

        let func = load_kernel(dev, kernel)?;
        allow_smem(&func, plan.smem)?;

        let h0_off = sh.token_heads() * (1 + sh.n);
        let aux_h0 = aux_v.slice(h0_off.min(aux_v.len())..);
        let has_h0src = i32::from(self.h0.is_some() || self.has_h0);
        let (do_v, dht_v) = match &grad_v {
            Some(g) => (Some(g.slice(0..o_len)), Some(g.slice(o_len..o_len + s_len))),
            None => (None, None),
        };
        let write_dh0 = i32::from(self.mode == MODE_FULL && self.has_h0);
        let (ext_i, mode, bv) = (ext as i32, self.mode, plan.bv as i32);
        let scale = self.scale;
        let mut args = func.builder();
        args.arg(&qk_v);
        args.arg(&v_v);
        args.arg(&aux_v);
        args.arg(&table);
        match self.h0 {
            Some(h0) => args.arg(h0),
            None => args.arg(&aux_h0),
        };
        args.arg(&has_h0src);
        // Placeholders (never read) where the mode has no gradient.
        match &do_v {
            Some(d) => args.arg(d),
            None => args.arg(&aux_v),
        };
        match (self.dht, &dht_v) {
            (Some(d), _) => args.arg(d),
            (None, Some(d)) => args.arg(d),
            (None, None) => args.arg(&aux_v),
        };
        args.arg(&mut hs);
        args.arg(out);
        for x in [&b, &t, &h, &k, &vd, &n, &ext_i, &mode, &write_dh0] {
            args.arg(x);
        }
        args.arg(&scale);
        args.arg(&bv);
        let cfg = LaunchConfig {
            grid_dim: (plan.grid.0, plan.grid.1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: plan.smem as u32,
        };
        // SAFETY: the argument list matches `gdp_bwd_*` in cuda/gdp_bwd.cuh: buffers whose
        // lengths were checked above against the shape the kernel indexes with (the output
        // was sized by the caller for this mode, the scratch for the table's chunks), then the
        // i32 sizes and flags, the f32 scale and the tile width; the dynamic shared memory
        // equals `bwd_smem_bytes`.
        unsafe { args.launch(cfg) }.w()?;
        drop(args);
        Ok(())
    }
}

/// Elements of the backward's packed output `[dqk | dv | dg | dbeta | dh0?]`.
pub fn backward_len(sh: &GdpShape, has_h0: bool) -> usize {
    sh.qk_len()
        + sh.v_len()
        + sh.token_heads() * (1 + sh.n)
        + if has_h0 { sh.state_len() } else { 0 }
}

/// Backward on CUDA: `grad` is the f32 `[do (B·T·H·V) | dht (N·H·K·V)]`; returns the packed f32
/// `[dqk | dv | dg | dbeta | dh0?]` of [`crate::op::cpu::backward`]. bf16 inputs take the
/// split backward of `chunked_bwd.rs` where it fits (`KernelConfig::backward`), everything else the
/// per-value-tile kernel `gdp_bwd_*`. `h0_override` replaces the
/// initial states and `dht_override` the `dht` part of `grad` (context parallelism); the
/// initial-state gradients of the sequences in `zero_dh0` are set to zero. `cache`, what the
/// bf16 chunked forward of these inputs (and initial states) kept, spares the split backward
/// its rerun of the WY kernel and the forward scan.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    qk: In,
    v: In,
    aux: In,
    grad: In,
    sh: &GdpShape,
    scale: f32,
    has_h0: bool,
    h0_override: Option<&CudaSlice<f32>>,
    dht_override: Option<&CudaSlice<f32>>,
    zero_dh0: &[usize],
    cache: Option<super::chunked::ForwardCache>,
    cfg: &KernelConfig,
) -> Result<CudaStorage> {
    let dev = check_inputs(qk, v, aux, Some(grad))?;
    let total = backward_len(sh, has_h0);
    let split = if qk.0.dtype() == DType::BF16 {
        use super::chunked::QkIn;
        use super::chunked_bwd::{try_backward_bf16, Cotangent, GradLayout, Grads};
        let cot = Cotangent::Packed(grad);
        let layout = GradLayout::Packed;
        match try_backward_bf16(
            &dev,
            QkIn::Packed(qk),
            v,
            aux,
            cot,
            sh,
            scale,
            has_h0,
            h0_override,
            dht_override,
            layout,
            cache,
            None,
            cfg,
        )? {
            Some(Grads::Packed(out)) => Some(out),
            Some(Grads::Parts { .. }) => candle_core::bail!("gdp cuda: packed gradients expected"),
            None => None,
        }
    } else {
        None
    };
    let mut out = match split {
        Some(out) => out,
        None => {
            let mut out = dev.alloc_zeros::<f32>(total)?;
            let seqs: Vec<usize> = (0..sh.num_seqs()).collect();
            Launch {
                sh,
                scale,
                has_h0,
                seqs: &seqs,
                mode: MODE_FULL,
                h0: h0_override,
                grad: Some(grad),
                dht: dht_override,
                forced_bv: cfg.tiles.fused_backward,
            }
            .run(qk, v, aux, &mut out)?;
            out
        }
    };
    if has_h0 {
        let kv = sh.dk * sh.dv;
        let dh0 = total - sh.state_len();
        for &s in zero_dh0 {
            let at = dh0 + s * sh.heads * kv;
            let mut part = out.slice_mut(at..at + sh.heads * kv);
            dev.cuda_stream().memset_zeros(&mut part).w()?;
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// Forward summaries `[ΔS | M]` (`[K, V + K]` per head, in `(fragment, head)` order) of the
/// sequences `frags`, from the initial states `h0 [N, H, K, V]` (see `cp::protocol`): on the
/// bf16 chunked kernels where they serve (`summary.rs`), else on the per-value-tile kernel.
#[allow(clippy::too_many_arguments)]
pub fn forward_summaries(
    qk: In,
    v: In,
    aux: In,
    sh: &GdpShape,
    scale: f32,
    has_h0: bool,
    frags: &[usize],
    h0: &[f32],
    cfg: &KernelConfig,
) -> Result<Vec<f32>> {
    if frags.is_empty() {
        return Ok(vec![]);
    }
    check_inputs(qk, v, aux, None)?;
    if h0.len() != sh.state_len() {
        candle_core::bail!(
            "gdp cuda: {} initial-state values for the summaries, expected {}",
            h0.len(),
            sh.state_len()
        );
    }
    if let Some(s) =
        super::summary::forward_summaries_bf16(qk, v, aux, sh, scale, has_h0, frags, h0, cfg)?
    {
        return Ok(s);
    }
    let h0 = qk.0.device().clone_htod(h0)?;
    summaries(
        qk,
        v,
        aux,
        sh,
        scale,
        has_h0,
        frags,
        MODE_FWD_SUM,
        Some(&h0),
        None,
        cfg.tiles.fused_backward,
    )
}

/// Backward summaries `[γ | Mᵀ]` (`[K, V + K]` per head, in `(fragment, head)` order) of the
/// sequences `frags`, with the output gradients and end-state gradients of `grad [do | dht]`
/// (`dht`, the same end-state gradients on the host): on the bf16 chunked kernels where they
/// serve (`summary.rs`), else on the per-value-tile kernel.
#[allow(clippy::too_many_arguments)]
pub fn backward_summaries(
    qk: In,
    v: In,
    aux: In,
    grad: In,
    sh: &GdpShape,
    scale: f32,
    has_h0: bool,
    frags: &[usize],
    dht: &[f32],
    cfg: &KernelConfig,
) -> Result<Vec<f32>> {
    if frags.is_empty() {
        return Ok(vec![]);
    }
    check_inputs(qk, v, aux, Some(grad))?;
    if dht.len() != sh.state_len() {
        candle_core::bail!(
            "gdp cuda: {} end-state gradient values for the summaries, expected {}",
            dht.len(),
            sh.state_len()
        );
    }
    let cot = super::chunked_bwd::Cotangent::Packed(grad);
    if let Some(s) = super::summary::backward_summaries_bf16(
        qk, v, aux, cot, sh, scale, has_h0, frags, dht, cfg,
    )? {
        return Ok(s);
    }
    summaries(
        qk,
        v,
        aux,
        sh,
        scale,
        has_h0,
        frags,
        MODE_BWD_SUM,
        None,
        Some(grad),
        cfg.tiles.fused_backward,
    )
}

#[allow(clippy::too_many_arguments)]
fn summaries(
    qk: In,
    v: In,
    aux: In,
    sh: &GdpShape,
    scale: f32,
    has_h0: bool,
    frags: &[usize],
    mode: i32,
    h0: Option<&CudaSlice<f32>>,
    grad: Option<In>,
    forced_bv: Option<usize>,
) -> Result<Vec<f32>> {
    let len = frags.len() * sh.heads * sh.dk * (sh.dv + sh.dk);
    if len == 0 {
        return Ok(vec![]);
    }
    let dev = check_inputs(qk, v, aux, grad)?;
    let mut out = dev.alloc_zeros::<f32>(len)?;
    Launch {
        sh,
        scale,
        has_h0,
        seqs: frags,
        mode,
        h0,
        grad,
        dht: None,
        forced_bv,
    }
    .run(qk, v, aux, &mut out)?;
    dev.clone_dtoh(&out)
}

/// The gate buffer's initial states `[N, H, K, V]`, copied to the host.
pub fn initial_states_to_host(aux: In, sh: &GdpShape) -> Result<Vec<f32>> {
    let aux_v = view::<f32>(aux.0, aux.1, sh.aux_len(true), "gates")?;
    let off = sh.token_heads() * (1 + sh.n);
    aux.0
        .device()
        .clone_dtoh(&aux_v.slice(off..off + sh.state_len()))
}

/// The `dht` part of a gradient `[do | dht]`, copied to the host.
pub fn dht_to_host(grad: In, sh: &GdpShape) -> Result<Vec<f32>> {
    let o_len = sh.o_len();
    let g = view::<f32>(grad.0, grad.1, o_len + sh.state_len(), "grad")?;
    grad.0
        .device()
        .clone_dtoh(&g.slice(o_len..o_len + sh.state_len()))
}
