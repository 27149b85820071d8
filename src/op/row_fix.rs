//! Which rows a correction of a widened scan's output covers (`op::cuda::cp_fix` launches
//! them): a scan run on value columns widened by `K` writes rows `[y⁰ | ỹ]`, and the rows of
//! the sequences whose incoming state (or end-state gradient) `S` came later are corrected to
//! `y⁰ + ỹ S`, the others copied. Device-independent, so that the planning is tested without a
//! GPU.

use candle_core::Result;
use std::ops::Range;

/// Which rows a correction covers: `seqs` sequences of `outer_per_seq · inner` rows per head,
/// row `i` of sequence `s` at row `(outer · H + h) · inner + i % inner` of its buffer with
/// `outer = outer0 + s · outer_per_seq + i / inner` (`o [B·T, H, V]`: inner 1; chunk states
/// `[slots, H, K, V]`: inner K; dDelta `[slots, H, 64, V]`: inner 64).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FixRows {
    pub outer0: usize,
    pub outer_per_seq: usize,
    pub inner: usize,
    pub seqs: usize,
}

/// The launches that correct some sequences and copy the others, for rows grouped by sequence:
/// sequence `s` covers the outer indices `spans[s] = (first, count)` (in order, not
/// overlapping), `total` outer indices in all, `inner` rows each; `state_of[s]` is the row of
/// the states that corrects sequence `s` (`None`: a copy). Each launch comes with the state
/// row of its first sequence (`None`: a copy). Consecutive corrected sequences of equal counts
/// whose state rows follow each other share a launch (all of a dense batch, or a sequence's
/// segments of one length); the rows between them, before and after are copied.
pub(crate) fn plan_rows(
    spans: &[(usize, usize)],
    total: usize,
    state_of: &[Option<usize>],
    inner: usize,
) -> Result<Vec<(FixRows, Option<usize>)>> {
    if state_of.len() != spans.len() {
        candle_core::bail!(
            "gdp: {} state rows for {} sequences",
            state_of.len(),
            spans.len()
        );
    }
    let rows = |outer0: usize, outer_per_seq: usize, seqs: usize| FixRows {
        outer0,
        outer_per_seq,
        inner,
        seqs,
    };
    let mut out: Vec<(FixRows, Option<usize>)> = Vec::new();
    let mut at = 0;
    for (&(first, count), &state) in spans.iter().zip(state_of) {
        let Some(state) = state.filter(|_| count > 0) else {
            continue; // copied with the rows around it
        };
        if first < at || first + count > total {
            candle_core::bail!(
                "gdp: corrected rows {first}..{} out of order or past {total}",
                first + count
            );
        }
        if let Some((prev, Some(s0))) = out.last_mut() {
            let joins = first == at && prev.outer_per_seq == count && state == *s0 + prev.seqs;
            if joins {
                prev.seqs += 1;
                at = first + count;
                continue;
            }
        }
        if first > at {
            out.push((rows(at, first - at, 1), None));
        }
        out.push((rows(first, count, 1), Some(state)));
        at = first + count;
    }
    if total > at {
        out.push((rows(at, total - at, 1), None));
    }
    Ok(out)
}

/// `state_of` for [`plan_rows`] where the sequences `fixed` of `n` take state rows `0, 1, ..`.
pub(crate) fn states_of_range(n: usize, fixed: Range<usize>) -> Vec<Option<usize>> {
    (0..n)
        .map(|s| fixed.contains(&s).then(|| s - fixed.start))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(spans: &[(usize, usize)], total: usize, of: &[Option<usize>]) -> Vec<String> {
        let got = plan_rows(spans, total, of, 4).expect("a plan");
        assert!(got.iter().all(|(r, _)| r.inner == 4));
        got.iter()
            .map(|(r, s)| format!("{}+{}x{} {s:?}", r.outer0, r.outer_per_seq, r.seqs))
            .collect()
    }

    #[test]
    fn a_dense_batch_is_one_launch_and_the_rest_is_copied() {
        let spans = [(0, 10), (10, 10), (20, 10)];
        assert_eq!(plan(&spans, 30, &[None; 3]), ["0+30x1 None"]);
        let all = states_of_range(3, 0..3);
        assert_eq!(plan(&spans, 30, &all), ["0+10x3 Some(0)"]);
        let last = states_of_range(3, 1..3);
        assert_eq!(
            plan(&spans, 32, &last),
            ["0+10x1 None", "10+10x2 Some(0)", "30+2x1 None"]
        );
    }

    #[test]
    fn segments_share_a_launch_per_run_of_equal_lengths() {
        // Two sequences of segments 8, 8, 3 and 8, 2: each last segment copied.
        let spans = [(0, 8), (8, 8), (16, 3), (19, 8), (27, 2)];
        let of = [Some(0), Some(1), None, Some(2), None];
        assert_eq!(
            plan(&spans, 29, &of),
            [
                "0+8x2 Some(0)",
                "16+3x1 None",
                "19+8x1 Some(2)",
                "27+2x1 None"
            ]
        );
        // Equal lengths but state rows out of step: two launches; an empty segment skipped.
        let of = [Some(1), Some(0), None, None, Some(3)];
        let spans2 = [(0, 8), (8, 8), (16, 0), (16, 3), (19, 2)];
        assert_eq!(
            plan(&spans2, 21, &of),
            [
                "0+8x1 Some(1)",
                "8+8x1 Some(0)",
                "16+3x1 None",
                "19+2x1 Some(3)"
            ]
        );
    }

    #[test]
    fn rows_out_of_order_or_bounds_are_errors() {
        assert!(plan_rows(&[(4, 4), (0, 4)], 8, &[Some(0), Some(1)], 1).is_err());
        assert!(plan_rows(&[(0, 9)], 8, &[Some(0)], 1).is_err());
        assert!(plan_rows(&[(0, 4)], 8, &[], 1).is_err());
    }
}
