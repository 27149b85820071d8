//! Chains of segment summaries folded on the device in one launch (`gdp_fold_chains`,
//! `cuda/cp_fix.cuh`): the forward's `S_{j+1} = ΔS_j + M_j S_j` over each sequence's segments
//! and the backward's `e_j = γ_{j+1} + Mᵀ_{j+1} e_{j+1}` (the op in segments). One block per
//! (chain, head, 32 value columns) walks its chain; f32 products in a fixed order.

use super::device::{grid_dim, to_i32, GRID_X, GRID_YZ};
use super::module::load_kernel;
use crate::op::kernel_params::FoldParams;
use crate::op::segments::FoldChains;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig};
use candle_core::cuda_backend::CudaDevice;
use candle_core::Result;

/// Value columns per block, threads per block and the largest K (`GDP_FOLD_*`).
const COLS: usize = 32;
const THREADS: u32 = 256;
const MAX_K: usize = 256;
/// Key columns of `x̃` staged per pass (`GDP_FOLD_M`).
const M: usize = 16;

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

/// Folds the summaries `t` (f32 `[segments, H, K, V + K]`) along `chains` from the start states
/// `s0` (f32 `[chains, H, K, V]`; `None`: none) into `out_rows` state rows, and with
/// `want_finals` the chains' final states.
pub(super) fn fold_chains(
    dev: &CudaDevice,
    t: &CudaView<f32>,
    s0: Option<&CudaView<f32>>,
    chains: &FoldChains,
    dims: FoldDims,
    out_rows: usize,
    want_finals: bool,
) -> Result<FoldOut> {
    let FoldDims { heads, dk, dv } = dims;
    let per_state = heads * dk * dv;
    let n = chains.chains();
    if dk > MAX_K {
        candle_core::bail!("gdp cuda: the fold of segment states takes K <= {MAX_K}, got {dk}");
    }
    let steps = chains.steps.len();
    if chains.rows.len() != steps
        || chains.chain_at.last().copied() != Some(to_i32(steps, "steps")?)
    {
        candle_core::bail!("gdp cuda: a fold of {steps} steps with inconsistent chains");
    }
    let segments = chains
        .steps
        .iter()
        .map(|&id| (if id < 0 { -1 - id } else { id }) as usize + 1)
        .max()
        .unwrap_or(0);
    if t.len() < segments * heads * dk * (dv + dk) {
        candle_core::bail!(
            "gdp cuda: {segments} segment summaries in {} elements (H {heads}, K {dk}, V {dv})",
            t.len()
        );
    }
    if chains
        .rows
        .iter()
        .any(|&r| r >= 0 && r as usize >= out_rows)
    {
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
    let steps_dev = dev.clone_htod(&chains.steps)?;
    let chain_at = dev.clone_htod(&chains.chain_at)?;
    let rows = dev.clone_htod(&chains.rows)?;
    let func = load_kernel(dev, "gdp_fold_chains")?;
    let mut args = func.args();
    let params = FoldParams {
        t: args.read(t),
        s0: args.read_opt(s0),
        steps: args.read(&steps_dev),
        chain_at: args.read(&chain_at),
        rows: args.read(&rows),
        out: args.write(&mut states),
        fin: match finals.as_mut() {
            Some(f) => args.write(f),
            None => 0,
        },
        heads: to_i32(heads, "heads")?,
        dk: to_i32(dk, "K")?,
        dv: to_i32(dv, "V")?,
    };
    let cfg = LaunchConfig {
        grid_dim: (
            grid_dim(n, "fold chains", GRID_X)?,
            grid_dim(heads, "heads", GRID_YZ)?,
            grid_dim(dv.div_ceil(COLS), "value tiles", GRID_YZ)?,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: (dk * (COLS + M) * 4) as u32,
    };
    // SAFETY: `gdp_fold_chains` takes `GdpFoldParams`. It reads the summaries of the segment
    // ids in `steps` (every one below `segments`, checked against `t`), the start state of each
    // chain (checked against `s0`), and writes state rows below `out_rows` (checked) of
    // `states` and a final state per chain of `finals`, both allocated for that. Its shared
    // memory, `K (32 + 16)` floats, is at most 48 KB (K <= 256, checked).
    unsafe { args.launch(cfg, &params) }?;
    Ok(FoldOut { states, finals })
}
