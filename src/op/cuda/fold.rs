//! Chains of summaries folded on the device in one launch (`gdp_fold_chains`,
//! `cuda/cp_fix.cuh`): the forward's `S_{j+1} = ΔS_j + M_j S_j` over each sequence's segments
//! and the backward's `e_j = γ_{j+1} + Mᵀ_{j+1} e_{j+1}` (the op in segments), and a
//! context-parallel rank's fold of its peers' gathered summaries ([`fold_gathered`]). One block
//! per (chain, head, 16 value columns) walks its chain; f32 products in a fixed order.

use super::device::{grid_dim, to_i32, view, GRID_X, GRID_YZ};
use super::module::load_kernel;
use crate::op::kernel_params::FoldParams;
use crate::op::segments::FoldChains;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result, Storage, Tensor};

/// Value columns per block, threads per block and the largest K (`GDP_FOLD_*`).
const COLS: usize = 16;
const THREADS: u32 = 256;
const MAX_K: usize = 256;
/// The narrowest pass of `x̃`'s key columns (48 KB of shared memory at K = 256, the default).
const MIN_PASS: usize = 16;

/// Shared memory of `gdp_fold_chains` (`gdp_fold_smem_bytes`) with passes of `pass` key
/// columns: the state's tile `[K][16]` and a pass of `x̃`, `[K][pass + 4]`, f32.
fn smem_bytes(dk: usize, pass: usize) -> usize {
    dk * (COLS + pass + 4) * 4
}

/// The widest pass of `x̃`'s key columns (a power of two, all `K` where it fits) whose shared
/// memory fits `max_smem`: each pass waits for its copies once, so fewer passes wait less.
fn pass_cols(dk: usize, max_smem: usize) -> usize {
    let mut pass = dk.next_power_of_two();
    while pass > MIN_PASS && smem_bytes(dk, pass) > max_smem {
        pass /= 2;
    }
    pass
}
/// The heads and widths of a fold: summaries `[x⁰ | x̃]` of `K` rows and `V + K` columns per
/// head, states of `K` rows and `V` columns.
#[derive(Debug, Clone, Copy)]
pub(super) struct FoldDims {
    pub heads: usize,
    pub dk: usize,
    pub dv: usize,
}

/// What a fold writes: the states before the steps (f32 `[rows, H, K, V]`, zero where a chain
/// has none yet) and, when asked for, each chain's final state (f32 `[chains, H, K, V]`).
pub(super) struct FoldOut {
    pub states: CudaSlice<f32>,
    pub finals: Option<CudaSlice<f32>>,
}

/// [`FoldChains`] on the device. Uploaded where the op starts, beside the chunk table, before
/// the kernels whose summaries they fold: CUDA may make a copy from pageable host memory wait
/// for the work queued on the stream, and one after the scans would then hold the host until
/// they end.
pub(crate) struct DeviceChains {
    steps: CudaSlice<i32>,
    chain_at: CudaSlice<i32>,
    rows: CudaSlice<i32>,
    /// The number of chains.
    chains: usize,
    /// One more than the largest segment id a step reads.
    segments: usize,
    /// One more than the largest state row a step writes.
    rows_written: usize,
}

impl DeviceChains {
    /// Checks `chains` and copies it to `dev`.
    pub(crate) fn upload(dev: &CudaDevice, chains: &FoldChains) -> Result<Self> {
        let (segments, rows_written) = chains.extent()?;
        let upload = |x: &[i32]| dev.clone_htod(if x.is_empty() { &[0][..] } else { x });
        Ok(Self {
            steps: upload(&chains.steps)?,
            chain_at: upload(&chains.chain_at)?,
            rows: upload(&chains.rows)?,
            chains: chains.chains(),
            segments,
            rows_written,
        })
    }
}

/// Folds the summaries `t` (f32 `[segments, H, K, V + K]`) along `chains` from the start states
/// `s0` (f32 `[chains, H, K, V]`; `None`: none) into `out_rows` state rows, and with
/// `want_finals` the chains' final states.
pub(super) fn fold_chains(
    dev: &CudaDevice,
    t: &CudaView<f32>,
    s0: Option<&CudaView<f32>>,
    chains: &DeviceChains,
    dims: FoldDims,
    out_rows: usize,
    want_finals: bool,
) -> Result<FoldOut> {
    let FoldDims { heads, dk, dv } = dims;
    let per_state = heads * dk * dv;
    let n = chains.chains;
    if dk > MAX_K {
        candle_core::bail!("gdp cuda: the fold of segment states takes K <= {MAX_K}, got {dk}");
    }
    let segments = chains.segments;
    if t.len() < segments * heads * dk * (dv + dk) {
        candle_core::bail!(
            "gdp cuda: {segments} segment summaries in {} elements (H {heads}, K {dk}, V {dv})",
            t.len()
        );
    }
    if chains.rows_written > out_rows {
        candle_core::bail!("gdp cuda: a fold writes past its {out_rows} state rows");
    }
    if let Some(s0) = s0 {
        if s0.len() < n * per_state {
            candle_core::bail!("gdp cuda: {n} start states in {} elements", s0.len());
        }
    }
    let mut states = dev.alloc_zeros::<f32>((out_rows * per_state).max(1))?;
    let mut finals = match want_finals {
        // SAFETY: the kernel writes every final state (zeros where a chain has none).
        true => Some(unsafe { dev.alloc::<f32>((n * per_state).max(1))? }),
        false => None,
    };
    if n == 0 || per_state == 0 {
        return Ok(FoldOut { states, finals });
    }
    let func = load_kernel(dev, "gdp_fold_chains")?;
    let (max_smem, _) = super::device::smem_and_sms(dev, None)?;
    let pass = pass_cols(dk, max_smem);
    let smem = smem_bytes(dk, pass);
    if smem > 48 * 1024 {
        super::device::allow_smem(&func, smem)?;
    }
    let mut args = func.args();
    let params = FoldParams {
        t: args.read(t),
        s0: args.read_opt(s0),
        steps: args.read(&chains.steps),
        chain_at: args.read(&chains.chain_at),
        rows: args.read(&chains.rows),
        out: args.write(&mut states),
        fin: match finals.as_mut() {
            Some(f) => args.write(f),
            None => 0,
        },
        heads: to_i32(heads, "heads")?,
        dk: to_i32(dk, "K")?,
        dv: to_i32(dv, "V")?,
        pass_cols: to_i32(pass, "pass")?,
    };
    let cfg = LaunchConfig {
        grid_dim: (
            grid_dim(n, "fold chains", GRID_X)?,
            grid_dim(heads, "heads", GRID_YZ)?,
            grid_dim(dv.div_ceil(COLS), "value tiles", GRID_YZ)?,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: `gdp_fold_chains` takes `GdpFoldParams`. It reads the summaries of the segment
    // ids in `steps` (every one below `segments`, checked against `t`), the start state of each
    // chain (checked against `s0`), and writes state rows below `out_rows` (checked) of
    // `states` and a final state per chain of `finals`, both allocated for that. Its shared
    // memory, `K (16 + pass + 4)` floats, fits the device (`pass_cols`; allowed above), and
    // `pass` is a power of two.
    unsafe { args.launch(cfg, &params) }?;
    Ok(FoldOut { states, finals })
}

/// A context-parallel rank's fold of the gathered summaries `all` (f32 `[ranks, F, H, K, V + K]`,
/// `[x⁰ | x̃]` per rank and fragment slot, on a CUDA device) along `chains` (uploaded
/// [`rank_chains`](crate::op::segments::rank_chains) of the ranks to fold, first applied
/// first), per fragment slot: `S ← x⁰ + x̃ S` from `S = 0`, in one launch. Returns the states
/// f32 `[F, H, K, V]` (zeros where no rank is folded): the forward's incoming states from
/// `[ΔS | M]`, the backward's final-state gradients from `[γ | Mᵀ]`.
pub(crate) fn fold_gathered(
    all: &Tensor,
    chains: &DeviceChains,
    dk: usize,
    dv: usize,
) -> Result<CudaSlice<f32>> {
    let (_, frags, heads, k, w) = all.dims5()?;
    if all.dtype() != DType::F32 || k != dk || w != dv + dk || chains.chains != frags {
        candle_core::bail!(
            "gdp cuda: gathered summaries of K = {dk}, V = {dv} must be f32 [R, {}, H, {dk}, {}], \
             got {:?} {:?}",
            chains.chains,
            dv + dk,
            all.dtype(),
            all.dims()
        );
    }
    let all = all.contiguous()?;
    let (st, layout) = all.storage_and_layout();
    let Storage::Cuda(c) = &*st else {
        candle_core::bail!("gdp cuda: the gathered summaries are not on a CUDA device");
    };
    let t = view::<f32>(c, layout, all.elem_count(), "summaries")?;
    let dims = FoldDims { heads, dk, dv };
    let out = fold_chains(c.device(), &t, None, chains, dims, 0, true)?;
    out.finals
        .ok_or_else(|| candle_core::Error::Msg("gdp cuda: the fold wrote no final states".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_take_every_key_column_where_shared_memory_allows() {
        // H100: 227 KB; sm_89: 99 KB; the default 48 KB.
        assert_eq!(pass_cols(128, 227 * 1024), 128);
        assert_eq!(pass_cols(256, 227 * 1024), 128);
        assert_eq!(pass_cols(256, 99 * 1024), 64);
        assert_eq!(pass_cols(256, 48 * 1024), 16);
        assert_eq!(pass_cols(13, 48 * 1024), 16);
        assert!(smem_bytes(256, MIN_PASS) <= 48 * 1024);
    }
}
