//! Planning of the chunked bf16 kernels, in one place: the shared memory each kernel needs
//! (the carve-ups at the top of the kernels in `cuda/`), the value tiles of the sequential
//! scans and which kernels of the split backward serve a shape.

use super::device::smem_and_sms;
use crate::op::config::{KernelConfig, KernelPath, TileConfig};
use crate::op::shape::{GdpShape, CHUNK};
use candle_core::cuda_backend::CudaDevice;
use candle_core::Result;

/// Groups of the gradient kernel's per-chunk reductions (`GDPG_GROUPS`).
pub(super) const GRAD_GROUPS: usize = 4;
/// Warps per block of the gradient kernel (`GDPG_WARPS`), each with a partial sum of `h·dS`.
pub(super) const GRAD_WARPS: usize = 16;
/// f32 row stride of the inverse's tiles (`GDP_INV_LD`).
pub(super) const INV_LD: usize = 68;

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
pub(super) fn scan_threads(bv: usize) -> u32 {
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
/// and block at BV 64, n = 2). Two stages: a third measured no faster.
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
/// [`ScanKind::wide`] kind at K <= 128) when set; else the widest of 64, 32 and 16 that still gives
/// about one block per two multiprocessors, or 16. Fewer, wider blocks stage each chunk's W, K and
/// Q fewer times, and a scan's chunk step is latency-bound, so half as many blocks of twice the
/// columns are faster; a scan alone at BV 128 is slower than at 64 where both give enough
/// blocks. Three stage buffers (copies two chunks ahead) where they fit and
/// `kind.max_stages` allows, else two. `None` where nothing fits (K too large, or shared memory).
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
    let fitting: Vec<usize> = [64, 32, 16]
        .into_iter()
        .filter(|&bv| tiles.fits(bv))
        .collect();
    let enough = |bv: usize| sh.scan_fills_half(sh.dv, bv, sms);
    Ok(fitting
        .iter()
        .copied()
        .find(|&bv| enough(bv))
        .or(fitting.last().copied())
        .map(|bv| tiles.plan(bv)))
}

/// Plans the forward scan alone: [`scan_plan`]'s tile, except where that is 64 columns and tiles
/// of 32 give blocks that all run at once (no more than the multiprocessors; a forward-scan
/// block of 32 columns at K = 128 takes one of them): then 32. Twice the blocks run the same
/// chain of chunk steps, each step shorter, and the WY kernel runs before the scan on the whole
/// GPU instead of beside it on the multiprocessors the scan leaves. Where 32-column blocks would
/// need a second wave, 64 stays (measurements: `docs/cuda.md`, tile planning).
pub(super) fn forward_scan_plan(
    sh: &GdpShape,
    max_smem: usize,
    sms: usize,
    forced: &TileConfig,
) -> Result<Option<ScanPlan>> {
    let Some(plan) = scan_plan(&FWD_SCAN, sh, max_smem, sms, forced)? else {
        return Ok(None);
    };
    let narrower = ScanTiles::new(&FWD_SCAN, sh, max_smem)
        .filter(|tiles| plan.bv == 64 && (FWD_SCAN.tile)(forced).is_none() && tiles.fits(32))
        .filter(|_| sh.scan_blocks(sh.dv, 32) <= sms);
    Ok(Some(match narrower {
        Some(tiles) => tiles.plan(32),
        None => plan,
    }))
}

/// Plans a context-parallel rank's widened scan (`V + K` value columns, `summary.rs`): the tile
/// that gives the most blocks that still run at once on the `budget` multiprocessors it has (all,
/// or those a scan beside it leaves), one per multiprocessor, else [`scan_plan`]'s. The widened
/// columns are what a rank adds to the plain op's scan, and at small `B·H` they fit beside it on
/// the multiprocessors it leaves idle (at B1 H16 K = V = 128, 128 blocks of 32 columns run the
/// widened forward scan in the plain scan's time); the widened state-gradient scan, which shares
/// the GPU with the states rerun's blocks, takes the tile at which both fit at once
/// (`docs/cp.md`).
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
    let one_wave = [32, 64]
        .into_iter()
        .find(|&bv| tiles.fits(bv) && wide.scan_blocks(wide.dv, bv) <= budget);
    match one_wave {
        Some(bv) => Ok(Some(tiles.plan(bv))),
        None => scan_plan(kind, wide, max_smem, sms, forced),
    }
}

/// Plans two scans that run side by side (the backward's states rerun and state-gradient scan)
/// with one value tile: the widest (128 where both kinds have it) at which their blocks
/// together fill from about 90% to all of the multiprocessors, one block of each per
/// multiprocessor. Tiles that [`scan_plan`] picks for one scan can give each scan blocks for
/// the whole GPU, so that the two, which cannot share a multiprocessor, run one after the other,
/// slower than wider tiles side by side. `None` where no tile does that, or
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
    Ok([128, 64, 32, 16]
        .into_iter()
        .filter(|&bv| a.fits(bv) && b.fits(bv))
        .find(|&bv| 2 * sh.scan_blocks(sh.dv, bv) <= sms && sh.scan_fills_half(sh.dv, bv, sms))
        .map(|bv| [a.plan(bv), b.plan(bv)]))
}

/// The value tiles of one scan kind at one shape: which kernels exist and fit, and their plans.
pub(super) struct ScanTiles<'a> {
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
pub(super) fn forced_tile(
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

/// Shared memory of the state-gradient scan, bytes (`gdp_bwd_dh_bf16_impl`: `ns` stages of
/// `gdpd_stage_bytes`, the bf16 state gradient twice, -dDelta, coef_q ⊙ dO, `ns` chunks' row
/// tables); `qr` query rows staged per chunk.
pub fn dh_smem_bytes(kpt: usize, qr: usize, bv: usize, ns: usize) -> usize {
    let c = CHUNK;
    let lb = bv + 8;
    let stage = 2 * ((2 * c + qr) * (kpt + 8) + qr * (c + 8) + qr * lb) + 4 * 3 * c;
    ns * stage + 2 * (2 * kpt * lb + c * lb + qr * lb) + 8 * ns * 3 * c + 12 * ns
}

/// The state-gradient scan (`gdp_bwd_dh_bf16_<BV>_<KPT>`, K up to 128).
pub(super) const DH_SCAN: ScanKind = ScanKind {
    prefix: "gdp_bwd_dh_bf16",
    smem: dh_smem_bytes,
    max_kpt: 128,
    tile: |t| t.dh_scan,
    tile_name: "tiles.dh_scan",
    queries: true,
    max_stages: 3,
    wide: true,
};

/// Shared memory of the gradient kernel, bytes (`gdpg_smem_bytes` in the kernel file).
pub fn grads_smem_bytes(kp: usize, vp: usize, qr: usize) -> usize {
    let c = CHUNK;
    2 * ((c + qr) * (kp + 8) + (kp + 4 * c + qr) * (vp + 8) + (c + qr) * (c + 8))
        + 4 * (c * 68 + 5 * c + 6 * GRAD_GROUPS * c + (c / 16) * c + GRAD_WARPS)
}

/// K or V padded to the gradient kernel's tiles (64 or 128).
pub(super) fn grad_tile(d: usize) -> Option<usize> {
    [64, 128].into_iter().find(|&t| d <= t)
}

/// The tiles and scan plans of one split backward.
pub(super) struct SplitPlan {
    pub(super) kp: usize,
    pub(super) vp: usize,
    /// The states rerun and the state-gradient scan, each planned alone (the scan runs alone
    /// where the forward kept its intermediates).
    pub(super) rerun: ScanPlan,
    pub(super) dh: ScanPlan,
    /// The two planned to run side by side ([`scan_pair_plan`]), where a common tile lets them
    /// share the GPU.
    pub(super) side_by_side: Option<[ScanPlan; 2]>,
}

/// Whether the split backward serves this shape under `cfg.backward`: `Ok(None)` means the
/// per-value-tile backward; `Chunked` where it does not fit is an error.
pub(super) fn split_plan(
    dev: &CudaDevice,
    sh: &GdpShape,
    cfg: &KernelConfig,
) -> Result<Option<SplitPlan>> {
    if cfg.backward == KernelPath::Fused {
        return Ok(None);
    }
    let forced = &cfg.tiles;
    let (max_smem, sms) = smem_and_sms(dev, cfg.shared_memory_limit)?;
    let qr = query_rows(sh.n);
    let tiles = grad_tile(sh.dk)
        .zip(grad_tile(sh.dv))
        .filter(|&(kp, vp)| grads_smem_bytes(kp, vp, qr) <= max_smem);
    let fits = wy_smem_bytes(sh.dk, sh.dv) <= max_smem && key_tile(sh.dk).is_some();
    // The scans are planned only where the gradient and WY kernels fit (K, V <= 128), so that a
    // scan's forced value tile (`tiles.states_scan`, `tiles.dh_scan`) is not checked against
    // shapes the split backward never serves.
    let scans = match (tiles, fits) {
        (Some(_), true) => scan_plan(&STATES_SCAN, sh, max_smem, sms, forced)?
            .zip(scan_plan(&DH_SCAN, sh, max_smem, sms, forced)?),
        _ => None,
    };
    let side_by_side = match scans {
        Some(_) => scan_pair_plan([&STATES_SCAN, &DH_SCAN], sh, max_smem, sms, forced)?,
        None => None,
    };
    match (tiles, scans) {
        (Some((kp, vp)), Some((rerun, dh))) => Ok(Some(SplitPlan {
            kp,
            vp,
            rerun,
            dh,
            side_by_side,
        })),
        _ if cfg.backward == KernelPath::Chunked => candle_core::bail!(
            "gdp cuda: KernelConfig::backward = Chunked does not fit K = {}, V = {}, n = {} (needs K, V <= \
             128 and {max_smem} bytes of shared memory)",
            sh.dk,
            sh.dv,
            sh.n
        ),
        _ => Ok(None),
    }
}

/// Whether the split backward serves this shape (what a forward keeps its intermediates for).
pub(crate) fn split_backward_fits(
    dev: &CudaDevice,
    sh: &GdpShape,
    cfg: &KernelConfig,
) -> Result<bool> {
    Ok(split_plan(dev, sh, cfg)?.is_some())
}

/// Whether the gradient kernel with `kp`, `vp` tiles stores dv and dk through shared memory
/// (`_tiles`): K = V = 128 tiles at n >= 2, where it measured faster (slower at n = 1). Only
/// that kernel has persistent blocks (`_tiles_pipe`).
pub(super) fn grads_tiles(kp: usize, vp: usize, n: usize) -> bool {
    kp == 128 && vp == 128 && n >= 2
}

/// Value tiles of the fused one-kernel paths (`fused_fwd`, `fused_bwd`), widest first.
pub(super) const FUSED_TILES: [usize; 4] = [64, 32, 16, 8];

/// A fused kernel's value tile and grid `(rows, ceil(width / bv))` for `rows` (sequence or
/// entry, head) pairs over `width` value columns, `smem(bv)` bytes of shared memory per block:
/// `forced` (the [`TileConfig`] field `what`) when set, else the widest tile that fits in
/// `max_smem` and still gives at least `sms / 2` blocks, else the narrowest fitting tile of at
/// least 16 columns. Each block recomputes the V-independent WY factors, so narrower tiles cost
/// more work in all: V is split further only while the grid is under half a wave.
pub(super) fn fused_tile(
    width: usize,
    rows: usize,
    smem: impl Fn(usize) -> usize,
    max_smem: usize,
    sms: usize,
    forced: Option<usize>,
    what: &str,
) -> Result<(usize, (u32, u32))> {
    let cap = width.next_power_of_two().clamp(8, 64);
    let fits = |bv: usize| smem(bv) <= max_smem;
    let blocks = |bv: usize| rows * width.div_ceil(bv);
    let bv =
        match forced {
            Some(bv) => {
                if !FUSED_TILES.contains(&bv) || !fits(bv) {
                    candle_core::bail!(
                    "gdp cuda: KernelConfig::{what} = {bv} must be one of {FUSED_TILES:?} and fit \
                     in {max_smem} bytes of shared memory (needs {})",
                    if FUSED_TILES.contains(&bv) { smem(bv) } else { 0 }
                );
                }
                bv
            }
            None => {
                let fitting: Vec<usize> = FUSED_TILES
                    .iter()
                    .copied()
                    .filter(|&bv| bv <= cap && fits(bv))
                    .collect();
                let Some(&narrowest) = fitting.last() else {
                    candle_core::bail!(
                    "gdp cuda: {what}: this K needs {} bytes of shared memory even with 8 value \
                     columns per block, the limit is {max_smem} (the device's, or \
                     KernelConfig::shared_memory_limit)",
                    smem(8)
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
    Ok((bv, (gx as u32, gy as u32)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An H100's opt-in shared memory per block and multiprocessors.
    const H100: (usize, usize) = (227 * 1024, 132);

    fn forward_tile(batch: usize, heads: usize, n: usize, forced: &TileConfig) -> Option<usize> {
        let sh = GdpShape::new(batch, 4096, heads, 128, 128, n, None);
        let plan = forward_scan_plan(&sh, H100.0, H100.1, forced).unwrap();
        plan.map(|p| p.bv)
    }

    #[test]
    fn forward_scan_takes_32_columns_where_their_blocks_run_at_once() {
        let auto = TileConfig::default();
        // B·H 16: 64 blocks of 32 columns (scan_plan's own pick).
        assert_eq!(forward_tile(1, 16, 2, &auto), Some(32));
        // B·H 32: 128 blocks of 32 columns fit the 132 multiprocessors; 64 columns gave 64.
        for n in 1..=4 {
            assert_eq!(forward_tile(2, 16, n, &auto), Some(32));
        }
        // B·H 64: 256 blocks of 32 columns would run in two waves.
        assert_eq!(forward_tile(4, 16, 3, &auto), Some(64));
        // A forced tile stays.
        let forced = TileConfig {
            forward_scan: Some(64),
            ..auto
        };
        assert_eq!(forward_tile(2, 16, 2, &forced), Some(64));
    }
}
