//! Context parallelism's row correction (`gdp_cp_fix_*`, `cuda/cp_fix.cuh`): a scan run on
//! widened value columns from `[S0 | I_K]` writes rows `[y0 | ỹ]`, and once the state `S` that
//! belongs on top of `S0` is known the true rows are `y = y0 + ỹ S`. This turns the summary's
//! widened scan into the rank's own output, with no second pass over the chunks.

use super::device::{allow_smem, grid_dim, to_i32, GRID_YZ};
use super::module::load_kernel;
use crate::op::kernel_params::FixParams;
use crate::op::row_fix::FixRows;
use candle_core::cuda_backend::cudarc::driver::{CudaView, CudaViewMut, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::Result;
use half::bf16;

/// Rows of one warp's tile, and warps per block.
const ROWS: usize = 16;
const WARPS: usize = 8;
const COLS: usize = 128;
const THREADS: u32 = 32 * WARPS as u32;

/// Output element types of the correction.
pub(crate) trait FixOut: DeviceRepr {
    const KERNEL: &'static str;
}

impl FixOut for bf16 {
    const KERNEL: &'static str = "gdp_cp_fix_bf16";
}

impl FixOut for f32 {
    const KERNEL: &'static str = "gdp_cp_fix_f32";
}

/// Shared memory of `gdp_cp_fix_*`: `S`'s 128 columns as bf16 pairs, `K` padded to 32.
fn smem_bytes(dk: usize) -> usize {
    let kp = dk.next_multiple_of(32);
    (kp / 2) * (COLS + 8) * 4
}

/// The heads and the widths of a correction: rows of `V + K` corrected into rows of `V`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FixDims {
    pub heads: usize,
    pub dk: usize,
    pub dv: usize,
}

/// `y[row, :V] = x[row, :V] + x[row, V:V+K] · s[seq, h]` over the rows of `rows`: `x` rows of
/// width `V + K` (bf16), `y` of width `V`, `s` f32 `[seqs, H, K, V]`; with `s = None` a plain
/// copy of the first `V` columns.
fn fix_rows<T: FixOut>(
    dev: &CudaDevice,
    (x, y): (&CudaView<bf16>, &mut CudaViewMut<T>),
    s: Option<&CudaView<f32>>,
    FixDims { heads, dk, dv }: FixDims,
    rows: FixRows,
) -> Result<()> {
    let per_seq = rows.outer_per_seq * rows.inner;
    if per_seq == 0 || rows.seqs * heads == 0 || dv == 0 {
        return Ok(());
    }
    if rows.seqs * heads > 65_535 {
        candle_core::bail!(
            "gdp cuda: cp correction over {} sequences x {heads} heads exceeds the grid",
            rows.seqs
        );
    }
    let end_row = (rows.outer0 + rows.seqs * rows.outer_per_seq) * heads * rows.inner;
    if end_row * (dv + dk) > x.len() || end_row * dv > y.len() {
        candle_core::bail!(
            "gdp cuda: cp correction out of bounds ({rows:?}, H {heads}, K {dk}, V {dv}; x {} \
             and y {} elements)",
            x.len(),
            y.len()
        );
    }
    if let Some(s) = s {
        if s.len() < rows.seqs * heads * dk * dv {
            candle_core::bail!("gdp cuda: cp correction state of {} elements", s.len());
        }
    }
    let func = load_kernel(dev, T::KERNEL)?;
    let smem = smem_bytes(dk);
    allow_smem(&func, smem)?;
    let mut args = func.args();
    let params = FixParams {
        x: args.read(x),
        y: args.write(y),
        s: args.read_opt(s),
        outer0: rows.outer0 as i64,
        heads: to_i32(heads, "heads")?,
        dk: to_i32(dk, "K")?,
        dv: to_i32(dv, "V")?,
        outer_per_seq: to_i32(rows.outer_per_seq, "rows per sequence")?,
        inner: to_i32(rows.inner, "inner rows")?,
    };
    // One wave: as many blocks as the multiprocessors hold at once (two at K = 128, bound by
    // registers), each walking several row tiles of its (sequence, head), so that S is loaded
    // and converted once per block and no block waits for a second wave.
    let sms = super::device::smem_and_sms(dev, None)?.1;
    let per_sm = func
        .occupancy_max_active_blocks_per_multiprocessor(THREADS, smem, None)
        .w()?
        .max(1) as usize;
    let others = rows.seqs * heads * dv.div_ceil(COLS);
    let groups = per_seq
        .div_ceil(ROWS * WARPS)
        .min(per_sm * sms / others)
        .max(1);
    let cfg = LaunchConfig {
        grid_dim: (
            to_i32(groups, "row tiles")? as u32,
            grid_dim(dv.div_ceil(COLS), "value tiles", GRID_YZ)?,
            to_i32(rows.seqs * heads, "sequences x heads")? as u32,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    // SAFETY: `gdp_cp_fix_*` takes `GdpFixParams`; every row it reads or writes lies below
    // `end_row`, checked against `x` and `y` above, and `s` holds a state per (sequence, head).
    unsafe { args.launch(cfg, &params) }?;
    Ok(())
}

/// `y = x[.., :V] + x[.., V:] · s` over every launch of
/// [`plan_rows`](crate::op::row_fix::plan_rows) (`s` f32 `[rows, H, K, V]`, read from each launch's
/// state row on; the copies need none).
pub(crate) fn fix_planned<T: FixOut>(
    dev: &CudaDevice,
    (x, y): (&CudaView<bf16>, &mut CudaViewMut<T>),
    s: Option<&CudaView<f32>>,
    dims: FixDims,
    plan: &[(FixRows, Option<usize>)],
) -> Result<()> {
    let per_state = dims.heads * dims.dk * dims.dv;
    for &(rows, state) in plan {
        let st = match (state, s) {
            (Some(i), Some(s)) if s.len() >= (i + rows.seqs) * per_state => {
                Some(s.slice(i * per_state..))
            }
            (Some(i), _) => candle_core::bail!(
                "gdp cuda: cp correction wants state rows {i}..{} of {} elements",
                i + rows.seqs,
                s.map_or(0, |s| s.len())
            ),
            (None, _) => None,
        };
        fix_rows(dev, (x, &mut *y), st.as_ref(), dims, rows)?;
    }
    Ok(())
}
