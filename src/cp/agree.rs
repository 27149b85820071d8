//! The ranks' agreement on the problem before their first summary: every rank all-gathers a
//! fixed-size record of what its summaries depend on (heads, `K`, `V`, `n`, dtype, dense or
//! packed, rows, scale, composition) and compares it with rank 0's. Ranks that disagree would
//! exchange summaries of different sizes or meanings; instead every rank fails with the same
//! error, which names the first field that differs and the ranks (and, as with any error of a
//! rank's op, the group is aborted).
//!
//! The record has the same length on every rank whatever the problem, so this collective itself
//! cannot mismatch.

use super::comm::Communicator;
use super::protocol::Composition;
use crate::error::{GdpError, Result};
use crate::op::shape::GdpShape;
use candle_core::DType;

/// Marks an agreement record (f32 bits of an ASCII tag).
const MAGIC: u32 = u32::from_le_bytes(*b"gdp1");

/// One field of a [`ProblemRecord`]: its name, its value and how a person reads the value.
#[derive(Debug, Clone, Copy)]
struct Field {
    name: &'static str,
    value: u32,
    shown: fn(u32) -> String,
}

impl Field {
    fn count(name: &'static str, x: usize) -> Self {
        Self {
            name,
            value: u32::try_from(x).unwrap_or(u32::MAX),
            shown: |x| x.to_string(),
        }
    }
}

/// What a rank's summaries depend on, one `u32` per field.
#[derive(Debug, Clone)]
pub(crate) struct ProblemRecord {
    fields: [Field; 10],
}

impl ProblemRecord {
    /// The record of a rank's call in a group of `world` ranks: its geometry `sh`, input dtype,
    /// `scale` and composition. `B` counts for dense batches only (every row continues across
    /// ranks); a packed rank holds its own number of sequences.
    pub(crate) fn new(
        world: usize,
        sh: &GdpShape,
        dtype: DType,
        packed: bool,
        scale: f32,
        composition: Composition,
    ) -> Self {
        let layout = if packed {
            1
        } else {
            u32::try_from(sh.batch).unwrap_or(u32::MAX >> 1) << 1
        };
        Self {
            fields: [
                Field {
                    name: "record tag",
                    value: MAGIC,
                    shown: |x| format!("{x:#x}"),
                },
                Field::count("world size", world),
                Field::count("heads H", sh.heads),
                Field::count("key dim K", sh.dk),
                Field::count("value dim V", sh.dv),
                Field::count("num_householder n", sh.n),
                Field {
                    name: "dtype",
                    value: dtype_code(dtype),
                    shown: dtype_name,
                },
                Field {
                    name: "layout (0 dense, 1 packed) and dense batch B",
                    value: layout,
                    shown: |x| match x {
                        1 => "packed".into(),
                        x => format!("dense B = {}", x >> 1),
                    },
                },
                Field {
                    name: "scale (f32 bits)",
                    value: scale.to_bits(),
                    shown: |x| f32::from_bits(x).to_string(),
                },
                Field {
                    name: "composition",
                    value: composition as u32,
                    shown: |x| match x {
                        x if x == Composition::Fold as u32 => "fold".into(),
                        _ => "scan".into(),
                    },
                },
            ],
        }
    }

    fn encode(&self) -> Vec<f32> {
        self.fields
            .iter()
            .map(|f| f32::from_bits(f.value))
            .collect()
    }
}

/// A small stable code per dtype (part of the record).
fn dtype_code(dtype: DType) -> u32 {
    match dtype {
        DType::F32 => 1,
        DType::BF16 => 2,
        DType::F16 => 3,
        DType::F64 => 4,
        _ => 255,
    }
}

/// The dtype of a [`dtype_code`].
fn dtype_name(code: u32) -> String {
    match code {
        1 => "f32".into(),
        2 => "bf16".into(),
        3 => "f16".into(),
        4 => "f64".into(),
        _ => format!("dtype #{code}"),
    }
}

/// All-gathers `record` over `comm` and checks that every rank sent rank 0's: on a mismatch
/// every rank returns the same [`GdpError::Comm`], naming the field, the ranks and their values
/// (the caller's abort-on-error then fails the group). A group of one agrees with itself
/// without a collective.
pub(crate) fn agree(comm: &dyn Communicator, record: ProblemRecord) -> Result<()> {
    let world = comm.world_size();
    if world == 1 {
        return Ok(());
    }
    let mine = record.encode();
    let width = mine.len();
    let all = comm.all_gather(&mine)?;
    if all.len() != width * world {
        return Err(GdpError::Comm(format!(
            "rank {}: the problem agreement gathered {} values, expected {} ({width} per rank)",
            comm.rank(),
            all.len(),
            width * world
        ))
        .into());
    }
    let first = &all[..width];
    for (r, theirs) in all.chunks(width).enumerate().skip(1) {
        let differs = first
            .iter()
            .zip(theirs)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        if let Some(i) = differs {
            let Field { name, shown, .. } = record.fields[i];
            return Err(GdpError::Comm(format!(
                "the ranks disagree on the problem before the first summary: {name} is {} on \
                 rank 0 but {} on rank {r} (every rank must call the op with the same heads, \
                 head dims, num_householder, dtype, layout, scale and composition)",
                shown(first[i].to_bits()),
                shown(theirs[i].to_bits())
            ))
            .into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cp::comm::{run_ranks, DEFAULT_TIMEOUT};

    fn shape(dk: usize, batch: usize) -> GdpShape {
        GdpShape::new(batch, 10, 2, dk, 3, 2, None)
    }

    #[test]
    fn equal_records_agree() {
        let res = run_ranks(3, DEFAULT_TIMEOUT, |comm| {
            let r = ProblemRecord::new(3, &shape(4, 2), DType::F32, false, 0.5, Composition::Fold);
            agree(comm, r)
        });
        res.unwrap();
    }

    #[test]
    fn a_mismatch_fails_every_rank_naming_the_field() {
        for (field, odd) in [
            ("key dim K", (shape(8, 2), DType::F32, 0.5f32)),
            ("dtype", (shape(4, 2), DType::BF16, 0.5)),
            ("dense batch B", (shape(4, 1), DType::F32, 0.5)),
            ("scale", (shape(4, 2), DType::F32, 0.25)),
        ] {
            let errs = std::sync::Mutex::new(Vec::new());
            let _ = run_ranks(3, DEFAULT_TIMEOUT, |comm| {
                let (sh, dt, scale) = if comm.rank() == 2 {
                    odd.clone()
                } else {
                    (shape(4, 2), DType::F32, 0.5)
                };
                let r = ProblemRecord::new(3, &sh, dt, false, scale, Composition::Fold);
                let e = agree(comm, r).unwrap_err().to_string();
                errs.lock().unwrap().push(e);
                Ok(())
            });
            let errs = errs.into_inner().unwrap();
            assert_eq!(errs.len(), 3);
            for e in &errs {
                assert!(e.contains(field) && e.contains("rank 2"), "{field}: {e}");
            }
        }
    }
}
