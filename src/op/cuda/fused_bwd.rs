//! The per-value-tile backward kernel `gdp_bwd_*` (`cuda/gdp_bwd.cuh`, any dtype) in its three
//! modes: the backward itself, and the forward / backward summaries of context parallelism (the
//! final state of the forward run on value columns widened to `[v | 0_K]` from `[h0 | I_K]`,
//! and the initial-state gradient of the backward run with `do = [do | 0_K]`,
//! `dht = [dht | I_K]`).

use super::device::{
    allow_smem, check_inputs, check_states, shape_i32, smem_and_sms, to_i32, view, In,
};
use super::fused_fwd::THREADS;
use super::inputs::CudaCall;
use super::module::load_kernel;
use super::plan::fused_tile;
use crate::op::kernel_params::FusedBwdParams;
use crate::op::shape::{GdpShape, CHUNK};
use crate::op::KernelConfig;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{DType, Result};

pub(super) const MODE_FULL: i32 = 0;

const MODE_FWD_SUM: i32 = 1;

const MODE_BWD_SUM: i32 = 2;

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
        let smem = |bv: usize| bwd_smem_bytes(dk, bv, elem);
        let what = "tiles.fused_backward";
        let (bv, grid) = fused_tile(width, rows, smem, max_smem, sms, forced, what)?;
        Ok(Self {
            bv,
            smem: smem(bv),
            grid,
        })
    }
}

/// One launch of `gdp_bwd_*`.
pub(super) struct Launch<'a> {
    pub(super) sh: &'a GdpShape,
    pub(super) scale: f32,
    /// Whether the gate buffer carries initial states.
    pub(super) has_h0: bool,
    /// Sequences of the table (their state rows); summaries are written in this order.
    pub(super) seqs: &'a [usize],
    pub(super) mode: i32,
    /// Initial states `[N, H, K, V]` replacing the gate buffer's (modes FULL and FWD_SUM).
    pub(super) h0: Option<&'a CudaSlice<f32>>,
    /// `[do | dht]` (modes FULL and BWD_SUM).
    pub(super) grad: Option<In<'a>>,
    /// Replaces the `dht` part of `grad`.
    pub(super) dht: Option<&'a CudaSlice<f32>>,
    /// The forced value tile (`tiles.fused_backward`) and the shared-memory limit.
    pub(super) cfg: &'a KernelConfig,
}

impl Launch<'_> {
    pub(super) fn run(&self, qk: In, v: In, aux: In, out: &mut CudaSlice<f32>) -> Result<()> {
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
        let (max_smem, sms) = smem_and_sms(dev, self.cfg.shared_memory_limit)?;
        let plan = BwdPlan::new(
            sh.dk,
            sh.dv + ext,
            rows,
            std::mem::size_of::<T>(),
            max_smem,
            sms,
            self.cfg.tiles.fused_backward,
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
        let mut args = func.args();
        // Placeholders (valid, never read) where the mode has no gradient.
        let params = FusedBwdParams {
            qk: args.read(&qk_v),
            v: args.read(&v_v),
            aux: args.read(&aux_v),
            table: args.read(&table),
            h0: match self.h0 {
                Some(h0) => args.read(h0),
                None => args.read(&aux_h0),
            },
            dout: match &do_v {
                Some(d) => args.read(d),
                None => args.read(&aux_v),
            },
            dht: match (self.dht, &dht_v) {
                (Some(d), _) => args.read(d),
                (None, Some(d)) => args.read(d),
                (None, None) => args.read(&aux_v),
            },
            hs: args.write(&mut hs),
            out: args.write(out),
            has_h0src,
            batch: b,
            tokens: t,
            heads: h,
            dk: k,
            dv: vd,
            n,
            ext: ext_i,
            mode,
            write_dh0,
            scale,
            bv,
        };
        let cfg = LaunchConfig {
            grid_dim: (plan.grid.0, plan.grid.1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: plan.smem as u32,
        };
        // SAFETY: `gdp_bwd_*` takes `GdpFusedBwdParams`: buffers whose lengths were checked
        // above against the shape the kernel indexes with (the output was sized by the caller
        // for this mode, the scratch for the table's chunks); the dynamic shared memory equals
        // `bwd_smem_bytes`.
        unsafe { args.launch(cfg, &params) }?;
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

/// Which summary the per-value-tile kernel computes ([`summaries`]).
#[derive(Clone, Copy)]
pub(super) enum Summary<'a> {
    /// `[ΔS | M]`, from the initial states `h0 [N, H, K, V]` (f32, on the device).
    Forward(&'a CudaSlice<f32>),
    /// `[γ | Mᵀ]`, with the gradient `[do | dht]` (f32).
    Backward(In<'a>),
}

/// The summaries `which` (`[K, V + K]` per head, in `(fragment, head)` order) of the sequences
/// `frags` on the per-value-tile kernel, copied to the host.
pub(super) fn summaries(
    qk: In,
    v: In,
    aux: In,
    call: &CudaCall,
    frags: &[usize],
    which: Summary,
) -> Result<Vec<f32>> {
    let sh = call.shape;
    let len = frags.len() * sh.heads * sh.dk * (sh.dv + sh.dk);
    if len == 0 {
        return Ok(vec![]);
    }
    let (mode, h0, grad) = match which {
        Summary::Forward(h0) => (MODE_FWD_SUM, Some(h0), None),
        Summary::Backward(grad) => (MODE_BWD_SUM, None, Some(grad)),
    };
    let dev = check_inputs(qk, v, aux, grad)?;
    let mut out = dev.alloc_zeros::<f32>(len)?;
    Launch {
        sh,
        scale: call.scale,
        has_h0: call.has_h0,
        seqs: frags,
        mode,
        h0,
        grad,
        dht: None,
        cfg: call.kernels,
    }
    .run(qk, v, aux, &mut out)?;
    dev.clone_dtoh(&out)
}
