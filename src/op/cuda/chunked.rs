//! Launchers of the bf16 kernels of `cuda/gdp_fwd_chunked.cuh`: the WY factors of every chunk
//! in parallel (`gdp_fwd_wy_bf16`), then the state scan with the output fused in
//! (`gdp_fwd_scan_bf16_<BV>_<KPT>`: the state in registers, the next chunk's operands copied
//! with cp.async while the current one computes). The one-kernel forward of `launch.rs`
//! recomputes the V-independent WY factors in every value tile and keeps them on the sequential
//! path; this split takes them off it. It is the bf16 default wherever its shared memory fits
//! (K up to 128 for every n, K = 256 for n >= 2 on an H200); `KernelConfig::forward` forces the
//! one-kernel forward (`Fused`) or this one (`Chunked`, an error where it does not fit). The
//! bf16 backward (`chunked_bwd.rs`) reruns the WY kernel and the scan without its output
//! ([`STATES_SCAN`]) to get each chunk's start state and Delta. Design in `docs/cuda.md`,
//! timings in `docs/perf-log.md`.

use super::backward::In;
use super::launch::{allow_smem, check_states, device_attr, shape_i32, to_i32, view};
use super::module::load_kernel;
use super::pipeline::{wy_then_scan, Pipeline};
use crate::op::config::{KernelConfig, KernelPath, TileConfig};
use crate::op::shape::{GdpShape, CHUNK};
use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{CudaStorage, DType, Device, Layout, Result, Tensor};
use half::bf16;
use std::sync::Arc;

/// Threads per block of the WY kernel (`GDPC_THREADS`).
const THREADS: u32 = 128;

/// f32 row stride of the inverse's tiles (`GDP_INV_LD`).
const INV_LD: usize = 68;

/// Shared memory of the WY kernel, bytes (the carve-up at the top of `gdp_fwd_wy_bf16`).
pub fn wy_smem_bytes(dk: usize, dv: usize) -> usize {
    let c = CHUNK;
    let (kp, vp) = (dk.next_multiple_of(16), dv.next_multiple_of(16));
    4 * (c * INV_LD + 6 * c) + 2 * c * ((kp + 8) + (kp + 8).max(vp + 8))
}

/// Query rows per chunk that the scans stage: 16-row tiles of `ceil(64 / n)`.
pub(super) fn query_rows(n: usize) -> usize {
    CHUNK.div_ceil(n).next_multiple_of(16)
}

/// The scans' compile-time key tile (`KPT`): K padded to 64, 128 or 256.
pub(super) fn key_tile(dk: usize) -> Option<usize> {
    [64, 128, 256].into_iter().find(|&t| dk <= t)
}

/// Threads per block of a scan (`NW` warps): 4 for 16 value columns, else 8.
fn scan_threads(bv: usize) -> u32 {
    if bv == 16 {
        128
    } else {
        256
    }
}

/// Shared memory of the forward scan for `bv` value columns, `qr` staged query rows per chunk
/// (0 for the states-only kernels) and `ns` stage buffers, bytes (`gdp_fwd_scan_bf16_impl`: `ns`
/// stages of `gdpc_stage_bytes`, the bf16 state twice, Delta twice, `ns` chunks' row tables and
/// geometry).
pub fn scan_smem_bytes(kpt: usize, qr: usize, bv: usize, ns: usize) -> usize {
    let c = CHUNK;
    let stage = 2 * ((2 * c + qr) * (kpt + 8) + qr * (c + 8) + c * (bv + 8)) + 4 * 3 * c;
    ns * stage + 2 * 2 * kpt * (bv + 8) + 2 * 2 * c * (bv + 8) + 8 * ns * 2 * c + 12 * ns
}

/// A scan's launch plan: value columns per block, stage buffers, query rows staged per chunk
/// (the kernels' `QR`), threads, shared memory and kernel name.
pub(super) struct ScanPlan {
    pub bv: usize,
    pub stages: usize,
    pub qr: usize,
    pub threads: u32,
    pub smem: usize,
    pub kernel: String,
}

/// What a scan kernel family needs to be planned: its kernel-name prefix (`<prefix>_<BV>_<KPT>`),
/// its shared memory `(kpt, query rows, bv, stages) -> bytes`, the largest key tile it exists
/// for, its value tile in [`TileConfig`] (forced when set), whether it stages query rows
/// (`query_rows(n)` of them, else none), the most stage buffers worth giving it, and whether
/// it has kernels of 128 value columns (for K <= 128), planned only for two scans side by side
/// ([`scan_pair_plan`]) or when forced.
pub(super) struct ScanKind {
    pub prefix: &'static str,
    pub smem: fn(usize, usize, usize, usize) -> usize,
    pub max_kpt: usize,
    pub tile: fn(&TileConfig) -> Option<usize>,
    pub tile_name: &'static str,
    pub queries: bool,
    pub max_stages: usize,
    pub wide: bool,
}

/// The forward scan (`gdp_fwd_scan_bf16_<BV>_<KPT>`).
pub(super) const FWD_SCAN: ScanKind = ScanKind {
    prefix: "gdp_fwd_scan_bf16",
    smem: scan_smem_bytes,
    max_kpt: 256,
    tile: |t| t.forward_scan,
    tile_name: "tiles.forward_scan",
    queries: true,
    max_stages: 3,
    wide: false,
};

/// The forward scan without an output (`gdp_fwd_states_bf16_<BV>_<KPT>`): each chunk's start
/// state and Delta (the backward's rerun) or the final states (context parallelism's
/// summaries). It stages no query rows and no P (41.7 of the forward scan's 54.0 KB per chunk
/// and block at BV 64, n = 2). Two stages: at B4 T4096 H16 n2 on an H200, 0.379
/// ms against 0.383 with three and 0.414 for the forward scan without its output; at B1 T32768
/// (BV 32) 2.397 against 2.465 and 2.586.
pub(super) const STATES_SCAN: ScanKind = ScanKind {
    prefix: "gdp_fwd_states_bf16",
    smem: scan_smem_bytes,
    max_kpt: 256,
    tile: |t| t.states_scan,
    tile_name: "tiles.states_scan",
    queries: false,
    max_stages: 2,
    wide: true,
};

/// Picks a scan's value tile: the one `tiles` forces for `kind` (16, 32 or 64, or 128 for a
/// [`ScanKind::wide`] kind at K <= 128) when set; else the widest of 64, 32 and 16 that still gives about one block per
/// two multiprocessors, or 16. Fewer, wider blocks stage each chunk's W, K and Q fewer times,
/// and a scan's chunk step is latency-bound: at B1 T32768 H16 on an H200, 64
/// blocks of BV = 32 (eight warps) took 2.85 / 2.86 / 3.30 ms for the forward scan, its rerun
/// and the dS scan against 3.20 / 3.22 / 3.74 ms for 128 blocks of BV = 16 (four warps); a scan
/// alone at BV 128 is slower than at 64 where both give enough blocks (B4 T4096 H16 n2: the dS
/// scan 0.774 ms against 0.493). Three stage buffers (copies two chunks ahead) where they
/// fit and `kind.max_stages` allows, else two. `None` where nothing fits (K too large, or shared
/// memory).
pub(super) fn scan_plan(
    kind: &ScanKind,
    sh: &GdpShape,
    max_smem: usize,
    sms: usize,
    forced: &TileConfig,
) -> Result<Option<ScanPlan>> {
    let Some(tiles) = ScanTiles::new(kind, sh, max_smem) else {
        return Ok(None);
    };
    if let Some(bv) = forced_tile(kind, sh, &tiles, max_smem, forced)? {
        return Ok(Some(tiles.plan(bv)));
    }
    let rows = sh.num_seqs() * sh.heads;
    let fitting: Vec<usize> = [64, 32, 16]
        .into_iter()
        .filter(|&bv| tiles.fits(bv))
        .collect();
    let enough = |bv: usize| 20 * rows * sh.dv.div_ceil(bv) >= 9 * sms;
    Ok(fitting
        .iter()
        .copied()
        .find(|&bv| enough(bv))
        .or(fitting.last().copied())
        .map(|bv| tiles.plan(bv)))
}

/// Plans a context-parallel rank's widened scan (`V + K` value columns, [`super::summary`]):
/// the tile that gives the most blocks that still run at once on the `budget` multiprocessors
/// it has (all, or those a scan beside it leaves), one per multiprocessor, else [`scan_plan`]'s. The widened columns are what a rank adds to the plain op's scan, and at
/// small `B·H` they fit beside it on the multiprocessors it leaves idle: at B1 H16 K = V = 128
/// (H200) 128 blocks of 32 columns ran the widened forward scan in the plain scan's time, 64
/// of 64 took 1.28x; the widened state-gradient scan, which shares the GPU with the states
/// rerun's 64 blocks, runs at 64 columns so that both fit at once (`docs/cp.md`).
pub(super) fn widened_scan_plan(
    kind: &ScanKind,
    wide: &GdpShape,
    max_smem: usize,
    sms: usize,
    budget: usize,
    forced: &TileConfig,
) -> Result<Option<ScanPlan>> {
    let Some(tiles) = ScanTiles::new(kind, wide, max_smem) else {
        return Ok(None);
    };
    if forced_tile(kind, wide, &tiles, max_smem, forced)?.is_some() {
        return scan_plan(kind, wide, max_smem, sms, forced);
    }
    let rows = wide.num_seqs() * wide.heads;
    let one_wave = [32, 64]
        .into_iter()
        .find(|&bv| tiles.fits(bv) && rows * wide.dv.div_ceil(bv) <= budget);
    match one_wave {
        Some(bv) => Ok(Some(tiles.plan(bv))),
        None => scan_plan(kind, wide, max_smem, sms, forced),
    }
}

/// Plans two scans that run side by side (the backward's states rerun and state-gradient scan)
/// with one value tile: the widest (128 where both kinds have it) at which their blocks
/// together fill from about 90% to all of the multiprocessors, one block of each per
/// multiprocessor. Tiles that [`scan_plan`] picks for one scan can give each scan blocks for
/// the whole GPU, so that the two, which cannot share a multiprocessor, run one after the other:
/// at B4 T4096 H16 n2 on an H200, 128 blocks each of BV 64 took 0.883 ms side by
/// side, 64 each of BV 128 0.793 (n3: 1.309 against 1.176). `None` where no tile does that, or
/// where either scan's tile is forced in `forced`: then each is planned alone.
pub(super) fn scan_pair_plan(
    kinds: [&ScanKind; 2],
    sh: &GdpShape,
    max_smem: usize,
    sms: usize,
    forced: &TileConfig,
) -> Result<Option<[ScanPlan; 2]>> {
    if kinds.iter().any(|k| (k.tile)(forced).is_some()) {
        return Ok(None);
    }
    let (Some(a), Some(b)) = (
        ScanTiles::new(kinds[0], sh, max_smem),
        ScanTiles::new(kinds[1], sh, max_smem),
    ) else {
        return Ok(None);
    };
    let blocks = |bv: usize| sh.num_seqs() * sh.heads * sh.dv.div_ceil(bv);
    Ok([128, 64, 32, 16]
        .into_iter()
        .filter(|&bv| a.fits(bv) && b.fits(bv))
        .find(|&bv| 2 * blocks(bv) <= sms && 20 * blocks(bv) >= 9 * sms)
        .map(|bv| [a.plan(bv), b.plan(bv)]))
}

/// The value tiles of one scan kind at one shape: which kernels exist and fit, and their plans.
struct ScanTiles<'a> {
    kind: &'a ScanKind,
    kpt: usize,
    qr: usize,
    max_smem: usize,
}

impl<'a> ScanTiles<'a> {
    /// `None` where the kind has no kernel for this key dimension.
    fn new(kind: &'a ScanKind, sh: &GdpShape, max_smem: usize) -> Option<Self> {
        let kpt = key_tile(sh.dk).filter(|&t| t <= kind.max_kpt)?;
        let qr = if kind.queries { query_rows(sh.n) } else { 0 };
        Some(Self {
            kind,
            kpt,
            qr,
            max_smem,
        })
    }

    /// Whether a kernel of `bv` value columns exists for this key tile (the state lives in
    /// registers: at most 32 f32 per thread, 64 at BV 128) and fits with two stages.
    fn fits(&self, bv: usize) -> bool {
        let exists = match bv {
            16 | 32 => true,
            64 => self.kpt <= 128,
            128 => self.kind.wide && self.kpt <= 128,
            _ => false,
        };
        exists && (self.kind.smem)(self.kpt, self.qr, bv, 2) <= self.max_smem
    }

    /// Three stages where they fit and the kind allows, else two.
    fn plan(&self, bv: usize) -> ScanPlan {
        let smem = self.kind.smem;
        let stages = if self.kind.max_stages >= 3 && smem(self.kpt, self.qr, bv, 3) <= self.max_smem
        {
            3
        } else {
            2
        };
        ScanPlan {
            bv,
            stages,
            qr: self.qr,
            threads: scan_threads(bv),
            smem: smem(self.kpt, self.qr, bv, stages),
            kernel: format!("{}_{bv}_{}", self.kind.prefix, self.kpt),
        }
    }
}

/// The value tile that `forced` sets for `kind`, checked against the kernels that exist and
/// fit.
fn forced_tile(
    kind: &ScanKind,
    sh: &GdpShape,
    tiles: &ScanTiles,
    max_smem: usize,
    forced: &TileConfig,
) -> Result<Option<usize>> {
    let Some(bv) = (kind.tile)(forced) else {
        return Ok(None);
    };
    if !tiles.fits(bv) {
        let allowed = if kind.wide {
            "16, 32, 64 or 128"
        } else {
            "16, 32 or 64"
        };
        candle_core::bail!(
            "gdp cuda: KernelConfig::{} must be {allowed} and fit (K = {}, n = {}, {max_smem} \
             bytes of shared memory), got {bv}",
            kind.tile_name,
            sh.dk,
            sh.n
        );
    }
    Ok(Some(bv))
}

/// The device's opt-in shared memory per block and its multiprocessor count.
pub(super) fn smem_and_sms(dev: &CudaDevice) -> Result<(usize, usize)> {
    Ok((
        device_attr(
            dev,
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )?,
        device_attr(
            dev,
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?,
    ))
}

/// Where the bf16 chunked kernels read the queries and keys (their `qb, kb, split` arguments,
/// `GdpcRows` in `cuda/gdp_fwd_chunked.cuh`).
#[derive(Clone, Copy)]
pub enum QkIn<'a> {
    /// `qk [B, T, n+1, H, K]` (every kernel takes it).
    Packed(In<'a>),
    /// FLA's `q [B, T, H, K]` and `k [B, T·n, H, K]`, read in place (the bf16 chunked kernels
    /// only: see [`reads_qk_in_place`]).
    Split(In<'a>, In<'a>),
}

impl<'a> QkIn<'a> {
    /// `qk`, or `q`: the storage whose device and dtype the op runs on.
    pub fn lead(&self) -> In<'a> {
        match *self {
            QkIn::Packed(qk) | QkIn::Split(qk, _) => qk,
        }
    }
}

/// Whether the bf16 chunked kernels serve this shape both ways under `cfg` (the two-kernel
/// forward, and the split backward), so that the op can give them FLA's `q`, `k` in place
/// instead of a packed copy. `q` says the device and dtype.
pub fn reads_qk_in_place(q: &Tensor, sh: &GdpShape, cfg: &KernelConfig) -> Result<bool> {
    let Device::Cuda(dev) = q.device() else {
        return Ok(false);
    };
    if q.dtype() != DType::BF16 || cfg.forward == KernelPath::Fused {
        return Ok(false);
    }
    let (max_smem, sms) = smem_and_sms(dev)?;
    let forward = wy_smem_bytes(sh.dk, sh.dv) <= max_smem
        && scan_plan(&FWD_SCAN, sh, max_smem, sms, &cfg.tiles)?.is_some();
    Ok(forward && super::chunked_bwd::split_backward_fits(dev, sh, cfg)?)
}

/// Runs the two-kernel bf16 forward if `cfg.forward` allows it and it fits this shape: the
/// packed f32 `[o | final state]`, or with `plain` only `o` in bf16; `Ok(None)` means: use the
/// one-kernel forward.
#[allow(clippy::too_many_arguments)]
pub fn try_forward_bf16(
    dev: &CudaDevice,
    qk: QkIn,
    v: (&CudaStorage, &Layout),
    aux: (&CudaStorage, &Layout),
    sh: &GdpShape,
    scale: f32,
    has_h0: bool,
    h0_override: Option<&CudaSlice<f32>>,
    plain: bool,
    cache: Option<&CacheSlot>,
    cfg: &KernelConfig,
) -> Result<Option<CudaStorage>> {
    if cfg.forward == KernelPath::Fused {
        return Ok(None);
    }
    let (max_smem, sms) = smem_and_sms(dev)?;
    let wy_smem = wy_smem_bytes(sh.dk, sh.dv);
    let plan = scan_plan(&FWD_SCAN, sh, max_smem, sms, &cfg.tiles)?.filter(|_| wy_smem <= max_smem);
    match (plan, cfg.forward) {
        (Some(plan), _) => {
            let inp = Bf16Inputs::new(qk, v, aux, sh, has_h0)?;
            check_states(h0_override, sh, "initial-state override")?;
            let table = ChunkTable::new(dev, sh)?;
            // Keep the intermediates only where the split backward will read them.
            let cache = match cache {
                Some(slot) if super::chunked_bwd::split_backward_fits(dev, sh, cfg)? => Some(slot),
                _ => None,
            };
            let order = sh.chunks_time_major();
            let pipeline = Pipeline::plan(dev, sh, &table, &plan, sms, order, cfg)?;
            let mut wy = WyFactors::alloc(dev, &table, sh, cache.is_some())?;
            let mut states = cache
                .filter(|slot| slot.states)
                .map(|_| ChunkStates::alloc(dev, &table, sh))
                .transpose()?;
            let mut scan = |out: ScanOut, states: Option<&mut ChunkStates>| {
                let dest = ScanDest { out, states };
                let (pipe, h0o) = (pipeline.as_ref(), h0_override);
                wy_then_scan(
                    pipe, dev, &inp, &table, &mut wy, sh, scale, has_h0, h0o, &plan, dest,
                )
            };
            let out = if plain {
                // SAFETY: the scan writes o for every query row (`cu_seqlens` covers every
                // token); with no (sequence, head) pair it is empty.
                let mut o = unsafe { dev.alloc::<bf16>(sh.o_len())? };
                scan(ScanOut::Plain(&mut o), states.as_mut())?;
                CudaStorage::wrap_cuda_slice(o, dev.clone())
            } else {
                let mut out = dev.alloc_zeros::<f32>(sh.o_len() + sh.state_len())?;
                scan(ScanOut::Packed(&mut out), states.as_mut())?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            };
            if let Some(slot) = cache {
                slot.put(ForwardCache { wy, states });
            }
            Ok(Some(out))
        }
        (None, KernelPath::Chunked) => candle_core::bail!(
            "gdp cuda: KernelConfig::forward = Chunked does not fit K = {}, V = {}, n = {} in {max_smem} \
             bytes of shared memory",
            sh.dk,
            sh.dv,
            sh.n
        ),
        (None, _) => Ok(None),
    }
}

/// The bf16 inputs as device views: the queries and keys as the kernels' `qb, kb, split` (see
/// [`QkIn`]; for the packed `qk`, `k` starts at its first key slot), `v [B, T·n, H, V]`, the
/// f32 gate buffer `[g | beta | h0?]`.
pub(super) struct Bf16Inputs<'a> {
    pub q: CudaView<'a, bf16>,
    pub k: CudaView<'a, bf16>,
    /// 1 for FLA's separate `q`, `k`; 0 for the packed `qk`.
    pub split: i32,
    pub v: CudaView<'a, bf16>,
    pub aux: CudaView<'a, f32>,
}

impl<'a> Bf16Inputs<'a> {
    pub fn new(
        qk: QkIn<'a>,
        v: (&'a CudaStorage, &Layout),
        aux: (&'a CudaStorage, &Layout),
        sh: &GdpShape,
        has_h0: bool,
    ) -> Result<Self> {
        let (q, k, split) = match qk {
            QkIn::Packed(qk) => {
                let all = view::<bf16>(qk.0, qk.1, sh.qk_len(), "qk")?;
                let slot = (sh.heads * sh.dk).min(all.len());
                (all.slice(..), all.slice(slot..), 0)
            }
            QkIn::Split(q, k) => {
                let q_len = sh.batch * sh.tokens * sh.heads * sh.dk;
                (
                    view::<bf16>(q.0, q.1, q_len, "q")?,
                    view::<bf16>(k.0, k.1, q_len * sh.n, "k")?,
                    1,
                )
            }
        };
        Ok(Self {
            q,
            k,
            split,
            v: view::<bf16>(v.0, v.1, sh.v_len(), "v")?,
            aux: view::<f32>(aux.0, aux.1, sh.aux_len(has_h0), "gates")?,
        })
    }
}

/// The chunk table of the split kernels, on the device: per sequence (batch, start, len, first
/// chunk), then per chunk (sequence, index within it).
pub(super) struct ChunkTable {
    pub table: CudaSlice<i32>,
    /// Chunks of all sequences.
    pub chunks: usize,
}

impl ChunkTable {
    pub fn new(dev: &CudaDevice, sh: &GdpShape) -> Result<Self> {
        let mut table = Vec::with_capacity(4 * sh.num_seqs());
        let mut chunks = vec![];
        for (si, (s, nch)) in sh.seqs.iter().zip(sh.chunks_per_seq()).enumerate() {
            table.extend([
                to_i32(s.batch, "batch")?,
                to_i32(s.start, "start")?,
                to_i32(s.len, "len")?,
                to_i32(chunks.len() / 2, "chunks")?,
            ]);
            for ci in 0..nch {
                chunks.extend([si as i32, ci as i32]);
            }
        }
        let total = chunks.len() / 2;
        if total > i32::MAX as usize || sh.heads > 65_535 {
            candle_core::bail!("gdp cuda: {total} chunks x {} heads is too large", sh.heads);
        }
        table.extend(chunks);
        Ok(Self {
            table: dev.clone_htod(&table)?,
            chunks: total,
        })
    }

    /// Scratch slots `(chunk, head)`, at least one head's worth (valid pointers when there is
    /// no chunk).
    pub fn slots(&self, sh: &GdpShape) -> usize {
        self.chunks.max(1) * sh.heads
    }
}

/// The WY kernel's per-chunk outputs, slot `(chunk · H + head)`: W `[64, K]`, U `[64, V]`,
/// P `[64, 64]` (bf16), coef `[3, 64]` (f32), and for the backward bf16(Ainv) `[64, 64]`.
pub(super) struct WyFactors {
    pub w: CudaSlice<bf16>,
    pub u: CudaSlice<bf16>,
    pub p: CudaSlice<bf16>,
    pub coef: CudaSlice<f32>,
    pub ainv: Option<CudaSlice<bf16>>,
}

impl WyFactors {
    /// Runs `gdp_fwd_wy_bf16` over every chunk on the device's stream (skipped when there is
    /// none).
    pub fn compute(
        dev: &CudaDevice,
        inp: &Bf16Inputs,
        table: &ChunkTable,
        sh: &GdpShape,
        scale: f32,
        with_ainv: bool,
    ) -> Result<Self> {
        let mut f = Self::alloc(dev, table, sh, with_ainv)?;
        f.launch(dev, inp, table, sh, scale, None)?;
        Ok(f)
    }

    /// Buffers for every slot of `table`, to be filled by [`WyFactors::launch`].
    pub fn alloc(
        dev: &CudaDevice,
        table: &ChunkTable,
        sh: &GdpShape,
        with_ainv: bool,
    ) -> Result<Self> {
        let slots = table.slots(sh);
        // SAFETY (all allocations): every element is written by the WY kernel before the
        // scans read it (rows past a chunk's end as zeros).
        unsafe {
            Ok(Self {
                w: dev.alloc::<bf16>(slots * CHUNK * sh.dk)?,
                u: dev.alloc::<bf16>(slots * CHUNK * sh.dv)?,
                p: dev.alloc::<bf16>(slots * CHUNK * CHUNK)?,
                coef: dev.alloc::<f32>(slots * 3 * CHUNK)?,
                ainv: if with_ainv {
                    Some(dev.alloc::<bf16>(slots * CHUNK * CHUNK)?)
                } else {
                    None
                },
            })
        }
    }

    /// Runs `gdp_fwd_wy_bf16` over every chunk of `table` on the device's stream; with
    /// `signal`, in its order of chunks (time-major across heads), counting each (chunk, head)
    /// in its readiness counters for a scan running beside it ([`super::pipeline::Pipeline`]).
    /// The outputs and counters are [`untracked`].
    pub fn launch(
        &mut self,
        dev: &CudaDevice,
        inp: &Bf16Inputs,
        table: &ChunkTable,
        sh: &GdpShape,
        scale: f32,
        signal: Option<Signal>,
    ) -> Result<()> {
        let [b, t, h, k, vd, n] = shape_i32(sh)?;
        let nseq = to_i32(sh.num_seqs(), "N")?;
        if table.chunks == 0 {
            return Ok(());
        }
        let (order, counters, two_per_sm) = match signal {
            Some(Signal {
                order,
                ready,
                two_per_sm,
            }) => {
                if order.len() != table.chunks || ready.len() < ready_counters(table, sh) {
                    candle_core::bail!(
                        "gdp cuda: a chunk order of {} and {} counters for {} chunks x {} heads",
                        order.len(),
                        ready.len(),
                        table.chunks,
                        sh.heads
                    );
                }
                (Some(order), Some(untracked(dev, ready)), two_per_sm)
            }
            None => (None, None, false),
        };
        let smem = if two_per_sm {
            wy_smem_two_per_sm(dev, sh)?
        } else {
            wy_smem_bytes(sh.dk, sh.dv)
        };
        let wy = load_kernel(dev, "gdp_fwd_wy_bf16")?;
        allow_smem(&wy, smem)?;
        let [w, u, p] = [&self.w, &self.u, &self.p].map(|x| untracked(dev, x));
        let coef = untracked(dev, &self.coef);
        let ainv = self.ainv.as_ref().map_or(0, |a| untracked(dev, a));
        let ready = counters.unwrap_or(0);
        let null = 0u64;
        let mut args = wy.builder();
        args.arg(&inp.q);
        args.arg(&inp.k);
        args.arg(&inp.split);
        args.arg(&inp.v);
        args.arg(&inp.aux);
        args.arg(&table.table);
        for x in [&w, &u, &p, &coef, &ainv] {
            args.arg(x);
        }
        for x in [&b, &t, &h, &k, &vd, &n, &nseq] {
            args.arg(x);
        }
        args.arg(&scale);
        match order {
            Some(o) => args.arg(o),
            None => args.arg(&null),
        };
        args.arg(&ready);
        // With an order, a 1-D grid of (chunk, head) pairs (time-major across heads).
        let grid_dim = if ready == 0 {
            (table.chunks as u32, sh.heads as u32, 1)
        } else {
            let blocks = table.chunks * sh.heads;
            (u32::try_from(blocks).ok().filter(|&b| b <= i32::MAX as u32))
                .map(|b| (b, 1, 1))
                .ok_or_else(|| {
                    candle_core::Error::Msg(format!("gdp cuda: {blocks} WY blocks in one launch"))
                })?
        };
        let cfg = LaunchConfig {
            grid_dim,
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: the arguments match `gdp_fwd_wy_bf16` (buffers sized in `alloc` from the
        // same shape and chunk table the kernel indexes with, alive for the call; a null `ag`
        // when Ainv is not wanted; with a signal, an order of the table's chunk ids, checked
        // to have one per chunk, and `ready_counters` counters); the dynamic shared memory is
        // at least `wy_smem_bytes`.
        unsafe { args.launch(cfg) }.w()?;
        Ok(())
    }
}

/// The WY kernel's dynamic shared memory padded so that at most two of its blocks share a
/// multiprocessor (half of it, less the per-block reservation), for the forward's WY kernel
/// beside its scan ([`Signal::two_per_sm`]).
fn wy_smem_two_per_sm(dev: &CudaDevice, sh: &GdpShape) -> Result<usize> {
    let per_sm = device_attr(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
    )?;
    let reserved = device_attr(
        dev,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
    )?;
    let (max_smem, _) = smem_and_sms(dev)?;
    let two_per_sm = (per_sm / 2).saturating_sub(reserved).min(max_smem);
    Ok(wy_smem_bytes(sh.dk, sh.dv).max(two_per_sm))
}

/// Chunks per readiness counter (`GDPC_READY_GROUP`).
const READY_GROUP: usize = 8;

/// The readiness counters a WY launch with a [`Signal`] needs: one per (group of
/// [`READY_GROUP`] chunks of a sequence, head), indexed as `gdpc_ready_index` does (below
/// `(chunks / G + N + 1) · H`).
pub(super) fn ready_counters(table: &ChunkTable, sh: &GdpShape) -> usize {
    (table.chunks / READY_GROUP + sh.num_seqs() + 1) * sh.heads
}

/// What a WY launch tells a scan running beside it: the order in which it takes the chunks
/// (ids of the table, one per chunk) and its readiness counters (zeroed, [`ready_counters`]).
pub(super) struct Signal<'a> {
    pub order: &'a CudaSlice<i32>,
    pub ready: &'a CudaSlice<i32>,
    /// At most two WY blocks per multiprocessor (padded shared memory: [`wy_smem_two_per_sm`]).
    /// The forward's scan runs faster beside two than beside four (53,760 bytes each at
    /// K = V = 128): at B1 T32768 H16 n2 the pair took 2.97 ms against the scan's 2.61 ms
    /// alone, padded 2.76 ms, the WY kernel then 1.14 ms alone instead of 0.88 and still ahead
    /// of the scan (`KB_WY_PAD` in `cuda/bench/kernels.cu`); the op's forward 3.17 -> 2.85 ms.
    /// The backward keeps four: its states rerun waits for the whole WY kernel, and padded
    /// its forward+backward took 0.6 ms longer.
    pub two_per_sm: bool,
}

/// The device address of `s` as a kernel argument outside cudarc's event tracking, which is
/// active where the context has several streams (context parallelism's ranks' devices) and
/// keeps one pair of events per buffer: the WY factors and counters are written by the WY
/// kernel while a scan beside it reads them on another stream (`pipeline.rs`), which those
/// events would serialise. Every use of the WY buffers is ordered by the streams it is queued
/// on instead (one stream, or the fork and join of `side.rs`).
pub(super) fn untracked<T>(dev: &CudaDevice, s: &CudaSlice<T>) -> u64 {
    // The pointer's guard records a read on the device's stream at once, after the work queued
    // there so far: it orders nothing that the streams do not order already.
    let main = dev.cuda_stream();
    let (ptr, _sync) = s.device_ptr(&main);
    ptr
}

/// Where a scan runs beside the WY kernel ([`super::pipeline::Pipeline`]): its stream and the
/// WY kernel's readiness counters it waits for.
#[derive(Clone, Copy)]
pub(super) struct Beside<'a> {
    pub stream: &'a Arc<CudaStream>,
    pub ready: &'a CudaSlice<i32>,
}

/// The forward scan's output: the packed f32 `[o | final state]`, `o` alone in bf16, `o` in
/// bf16 and the final states apart (a context-parallel rank's widened scan), the final states
/// alone (f32 `[N, H, K, V]`, context parallelism's summaries), or none (the backward's rerun).
pub(super) enum ScanOut<'a> {
    Packed(&'a mut CudaSlice<f32>),
    Plain(&'a mut CudaSlice<bf16>),
    PlainFinal(&'a mut CudaSlice<bf16>, &'a mut CudaSlice<f32>),
    Final(&'a mut CudaSlice<f32>),
    None,
}

/// Each chunk's start state `[slots, K, V]` and Delta `[slots, 64, V]` in bf16, which the
/// backward's gradient kernel reads.
pub(super) struct ChunkStates {
    pub hs: CudaSlice<bf16>,
    pub dn: CudaSlice<bf16>,
}

impl ChunkStates {
    /// Uninitialised buffers for every slot of `table` (the forward scan fills them).
    pub fn alloc(dev: &CudaDevice, table: &ChunkTable, sh: &GdpShape) -> Result<Self> {
        let slots = table.slots(sh);
        // SAFETY: the forward scan writes every element of every slot of the table's chunks
        // before anything reads them; slots of no chunk (none, or the one placeholder slot) are
        // never read.
        unsafe {
            Ok(Self {
                hs: dev.alloc::<bf16>(slots * sh.dk * sh.dv)?,
                dn: dev.alloc::<bf16>(slots * CHUNK * sh.dv)?,
            })
        }
    }
}

/// What the chunked forward leaves for the backward when asked to (`save_intermediates`): the
/// WY factors with Ainv (about `780 n` bytes per token and head at K = V = 128), so that the
/// backward skips its WY kernel, and where the slot says so every chunk's start state and Delta
/// too (about `1548 n` bytes in all), so that it skips its rerun of the forward scan as well.
pub struct ForwardCache {
    wy: WyFactors,
    states: Option<ChunkStates>,
}

/// Where an op instance keeps its [`ForwardCache`] between its forward and its backward (taken
/// by the backward, so that the memory goes with it).
pub struct CacheSlot {
    /// Keep the chunk states too, not only the WY factors.
    states: bool,
    cache: std::sync::Mutex<Option<ForwardCache>>,
}

impl CacheSlot {
    /// An empty slot for the WY factors and, with `states`, the chunk states.
    pub fn new(states: bool) -> Self {
        Self {
            states,
            cache: std::sync::Mutex::new(None),
        }
    }

    pub(super) fn put(&self, cache: ForwardCache) {
        *self.cache.lock().unwrap_or_else(|e| e.into_inner()) = Some(cache);
    }

    /// The cache, if the forward left one (once).
    pub(crate) fn take(&self) -> Option<ForwardCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl std::fmt::Debug for CacheSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let full = self.cache.lock().map(|c| c.is_some()).unwrap_or(false);
        let state = if full { "full" } else { "empty" };
        let what = if self.states { "all" } else { "WY factors" };
        write!(f, "CacheSlot({what}, {state})")
    }
}

impl ForwardCache {
    /// A cache of the WY factors alone (the backward reruns the state scan).
    pub(super) fn wy_only(wy: WyFactors) -> Self {
        Self { wy, states: None }
    }

    pub(super) fn into_parts(self) -> (WyFactors, Option<ChunkStates>) {
        (self.wy, self.states)
    }
}

/// Where the forward scan writes: its output and, for the backward, the chunk states.
pub(super) struct ScanDest<'a> {
    pub out: ScanOut<'a>,
    pub states: Option<&'a mut ChunkStates>,
}

/// Runs the forward scan `plan.kernel` on the WY factors of `table`'s chunks.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_scan(
    dev: &CudaDevice,
    inp: &Bf16Inputs,
    table: &ChunkTable,
    wy: &WyFactors,
    sh: &GdpShape,
    has_h0: bool,
    h0_override: Option<&CudaSlice<f32>>,
    plan: &ScanPlan,
    dest: ScanDest,
    beside: Option<Beside>,
) -> Result<()> {
    let [b, t, h, k, vd, n] = shape_i32(sh)?;
    let with_output = matches!(
        dest.out,
        ScanOut::Packed(_) | ScanOut::Plain(_) | ScanOut::PlainFinal(..)
    );
    if with_output && plan.qr == 0 {
        candle_core::bail!("gdp cuda: {} writes no output", plan.kernel);
    }
    let scan = load_kernel(dev, &plan.kernel)?;
    allow_smem(&scan, plan.smem)?;
    let use_override = i32::from(h0_override.is_some());
    let has_h0 = i32::from(has_h0);
    let qr = plan.qr as i32;
    let stages = plan.stages as i32;
    let null = 0u64;
    let wy_in = [
        untracked(dev, &wy.w),
        untracked(dev, &wy.u),
        untracked(dev, &wy.p),
        untracked(dev, &wy.coef),
    ];
    let ready = beside.map_or(0, |b| untracked(dev, b.ready));
    let mut args = match beside {
        Some(b) => scan.builder_on(b.stream),
        None => scan.builder(),
    };
    args.arg(&inp.q);
    args.arg(&inp.k);
    args.arg(&inp.split);
    args.arg(&inp.aux);
    args.arg(&table.table);
    for x in &wy_in {
        args.arg(x);
    }
    match h0_override {
        Some(h0) => args.arg(h0),
        // Never read (the flag is 0), but the kernel wants a valid pointer.
        None => args.arg(&inp.aux),
    };
    args.arg(&use_override);
    // The kernel's `out, outb, fin, hs, dn`: f32 o, bf16 o, final states, start states, Delta.
    let mut parts;
    match dest.out {
        ScanOut::Packed(out) => {
            parts = out.split_at_mut(sh.o_len());
            args.arg(&mut parts.0);
            args.arg(&null);
            args.arg(&mut parts.1);
        }
        ScanOut::Plain(o) => {
            args.arg(&null);
            args.arg(o);
            args.arg(&null);
        }
        ScanOut::PlainFinal(o, fin) => {
            args.arg(&null);
            args.arg(o);
            args.arg(fin);
        }
        ScanOut::Final(fin) => {
            args.arg(&null);
            args.arg(&null);
            args.arg(fin);
        }
        ScanOut::None => {
            for _ in 0..3 {
                args.arg(&null);
            }
        }
    }
    match dest.states {
        Some(st) => {
            args.arg(&mut st.hs);
            args.arg(&mut st.dn);
        }
        None => {
            args.arg(&null);
            args.arg(&null);
        }
    }
    for x in [&b, &t, &h, &k, &vd, &n, &has_h0, &qr, &stages] {
        args.arg(x);
    }
    args.arg(&ready);
    let rows = sh.num_seqs() * sh.heads;
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, sh.dv.div_ceil(plan.bv) as u32, 1),
        block_dim: (plan.threads, 1, 1),
        shared_mem_bytes: plan.smem as u32,
    };
    // SAFETY: the arguments match `gdp_fwd_scan_bf16_impl` (a null pointer for each output not
    // wanted: it writes what is not null); the scratch buffers were filled by the WY launch
    // before this one on the same stream, or (`beside`) are filled by one running beside it,
    // whose readiness counters the kernel waits for before reading a chunk's; the dynamic
    // shared memory is the plan's.
    unsafe { args.launch(cfg) }.w()?;
    drop(args);
    Ok(())
}
