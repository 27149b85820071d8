//! Context parallelism on CPU ranks with threads to spare: a rank then runs a continuing
//! sequence's value columns and its transition columns as two tasks side by side (the global
//! rayon pool is sized here, before anything else uses it, so this file holds one test). The
//! results equal the single-device op's as in `tests/cp.rs`.

mod common;

use anyhow::Result;
use common::{cp_check_cpu, Case};

#[test]
fn split_columns_equal_single_device() -> Result<()> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(64)
        .build_global()
        .expect("the global pool is sized once, before any other use in this binary");
    cp_check_cpu(
        &Case::new("dense n2 h0 split", 2, 130, 3, 24, 16, 2).h0(),
        &[2, 3, 4],
    )?;
    cp_check_cpu(
        &Case::new("packed n3 strong split", 1, 200, 2, 16, 20, 3)
            .packed(&[0, 3, 90, 91, 200])
            .strong_gates()
            .h0(),
        &[2, 4],
    )?;
    Ok(())
}
