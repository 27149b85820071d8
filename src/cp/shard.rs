//! Sharding of the time axis over the context-parallel (CP) group, and the per-rank metadata of
//! packed sequences.
//!
//! A [`ShardPlan`] cuts `T` tokens into `cp_size` contiguous shards whose sizes differ by at most
//! one token (the first `T % cp_size` ranks hold one more). Unlike Megatron, `T % cp_size == 0` is
//! not required; every rank must hold at least one token.
//!
//! For packed input (`cu_seqlens`), [`packed_rank_meta`] computes what rank `r` needs, as
//! Megatron's `build_packed_sequence_cp_metadata` does (`megatron_cp.md` §5.1):
//!
//! * `local_cu_seqlens`: 0, every local offset where a new sequence starts, the local length;
//! * `preceding_rank_start`: the rank that owns the first token of the first local sequence, so
//!   the forward fold runs over ranks `[preceding_rank_start, r)`;
//! * `following_rank_stop`: one past the rank that owns the last token of the last local sequence,
//!   so the backward fold runs over ranks `[r + 1, following_rank_stop)`.
//!
//! Empty sequences (repeated offsets in `cu_seqlens`) own no token, so they never appear among the
//! local sequences: `local_cu_seqlens` is strictly increasing, starts at 0 and ends at the local
//! length, and every local sequence has at least one token.

use std::ops::Range;

use crate::error::{GdpError, Result};

fn option_err(name: &str, reason: String) -> candle_core::Error {
    GdpError::Option {
        name: name.to_string(),
        reason,
    }
    .into()
}

/// Contiguous, near-equal shards of a sequence of `total_tokens` tokens over `cp_size` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardPlan {
    total_tokens: usize,
    cp_size: usize,
}

impl ShardPlan {
    /// Plans `cp_size` shards of `total_tokens` tokens; sizes differ by at most one, the first
    /// `total_tokens % cp_size` ranks get one more. Fails if `cp_size` is 0 or exceeds the tokens.
    pub fn new(total_tokens: usize, cp_size: usize) -> Result<Self> {
        if cp_size == 0 {
            return Err(option_err(
                "cp_size",
                "cp_size must be at least 1 (one rank per shard)".into(),
            ));
        }
        if cp_size > total_tokens {
            return Err(option_err(
                "cp_size",
                format!(
                    "cp_size {cp_size} exceeds the {total_tokens} tokens of the sequence; \
                     every rank needs at least one token"
                ),
            ));
        }
        Ok(Self {
            total_tokens,
            cp_size,
        })
    }

    /// Number of ranks (shards).
    pub fn cp_size(&self) -> usize {
        self.cp_size
    }

    /// Number of tokens of the whole (global) sequence.
    pub fn total_tokens(&self) -> usize {
        self.total_tokens
    }

    /// Smallest shard length; ranks `< total_tokens % cp_size` hold one more token.
    fn base(&self) -> usize {
        self.total_tokens / self.cp_size
    }

    fn extra(&self) -> usize {
        self.total_tokens % self.cp_size
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.cp_size {
            return Err(option_err(
                "rank",
                format!(
                    "rank {rank} is outside the CP group of size {}",
                    self.cp_size
                ),
            ));
        }
        Ok(())
    }

    /// Global token range `[start, end)` owned by `rank`.
    pub fn range(&self, rank: usize) -> Result<Range<usize>> {
        self.check_rank(rank)?;
        let start = rank * self.base() + rank.min(self.extra());
        let len = self.base() + usize::from(rank < self.extra());
        Ok(start..start + len)
    }

    /// Number of tokens owned by `rank`.
    pub fn len(&self, rank: usize) -> Result<usize> {
        Ok(self.range(rank)?.len())
    }

    /// The rank that owns global token `token`.
    pub fn rank_of_token(&self, token: usize) -> Result<usize> {
        if token >= self.total_tokens {
            return Err(option_err(
                "token",
                format!(
                    "token {token} is outside the sequence of {} tokens",
                    self.total_tokens
                ),
            ));
        }
        let (base, extra) = (self.base(), self.extra());
        let long = extra * (base + 1);
        Ok(if token < long {
            token / (base + 1)
        } else {
            extra + (token - long) / base
        })
    }

    /// Every rank's global token range, in rank order.
    pub fn ranges(&self) -> Vec<Range<usize>> {
        (0..self.cp_size)
            .filter_map(|r| self.range(r).ok())
            .collect()
    }
}

/// What one rank needs to know about the packed sequences around its shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankMeta {
    /// Offsets of the local sequences in the local shard: 0, every local offset where a new
    /// (non-empty) sequence starts, the local length. Strictly increasing.
    pub local_cu_seqlens: Vec<usize>,
    /// Rank owning the first token of the first local sequence; the forward fold reads the
    /// summaries of ranks `[preceding_rank_start, rank)`.
    pub preceding_rank_start: usize,
    /// One past the rank owning the last token of the last local sequence; the backward fold
    /// reads the summaries of ranks `[rank + 1, following_rank_stop)`.
    pub following_rank_stop: usize,
}

impl RankMeta {
    /// Ranks whose forward summaries `rank` folds: `[preceding_rank_start, rank)`.
    pub fn forward_slice(&self, rank: usize) -> Range<usize> {
        self.preceding_rank_start..rank.max(self.preceding_rank_start)
    }

    /// Ranks whose backward summaries `rank` folds: `[rank + 1, following_rank_stop)`.
    pub fn backward_slice(&self, rank: usize) -> Range<usize> {
        let start = rank.saturating_add(1);
        start..self.following_rank_stop.max(start)
    }

    /// Number of local sequences (at least one).
    pub fn num_local_seqs(&self) -> usize {
        self.local_cu_seqlens.len().saturating_sub(1)
    }
}

/// Checks that `cu_seqlens` starts at 0, is non-decreasing and ends at `total_tokens`.
pub fn check_cu_seqlens(cu_seqlens: &[usize], total_tokens: usize) -> Result<()> {
    let cu_err = |msg: String| -> candle_core::Error { GdpError::CuSeqlens(msg).into() };
    match (cu_seqlens.first(), cu_seqlens.last()) {
        (None, _) | (_, None) => {
            return Err(cu_err(format!(
                "is empty; expected offsets [0, ..., {total_tokens}]"
            )))
        }
        (Some(&first), _) if first != 0 => {
            return Err(cu_err(format!("must start at 0, got {first}")))
        }
        (_, Some(&last)) if last != total_tokens => {
            return Err(cu_err(format!(
                "must end at the {total_tokens} tokens of the sequence, got {last}"
            )))
        }
        _ => {}
    }
    if let Some(i) = cu_seqlens.windows(2).position(|w| w[1] < w[0]) {
        return Err(cu_err(format!(
            "must be non-decreasing, got cu_seqlens[{}] = {} after cu_seqlens[{i}] = {}",
            i + 1,
            cu_seqlens[i + 1],
            cu_seqlens[i]
        )));
    }
    Ok(())
}

/// Per-rank metadata of packed sequences given by global `cu_seqlens` (`megatron_cp.md` §5.1),
/// for the possibly uneven shards of `plan`. Empty sequences are skipped (see the module docs).
pub fn packed_rank_meta(
    global_cu_seqlens: &[usize],
    plan: &ShardPlan,
    rank: usize,
) -> Result<RankMeta> {
    check_cu_seqlens(global_cu_seqlens, plan.total_tokens())?;
    let shard = plan.range(rank)?;
    let mut local_cu_seqlens = vec![0];
    for &c in global_cu_seqlens {
        if c > shard.start && c < shard.end && local_cu_seqlens.last() != Some(&(c - shard.start)) {
            local_cu_seqlens.push(c - shard.start);
        }
    }
    local_cu_seqlens.push(shard.len());
    // The sequence holding token `t` is `[max{c <= t}, min{c > t})`; cu[0] = 0 <= t and
    // cu[last] = T > t, so both exist once `cu_seqlens` is valid.
    let first_start =
        global_cu_seqlens[global_cu_seqlens.partition_point(|&c| c <= shard.start) - 1];
    let last_end = global_cu_seqlens[global_cu_seqlens.partition_point(|&c| c < shard.end)];
    Ok(RankMeta {
        local_cu_seqlens,
        preceding_rank_start: plan.rank_of_token(first_start)?,
        following_rank_stop: plan.rank_of_token(last_end - 1)? + 1,
    })
}

/// Global `cu_seqlens` of per-token sequence ids (`seq_idx`, non-decreasing, one per token): 0,
/// every index where the id changes, the number of tokens. Ids may skip values (empty sequences).
pub fn cu_seqlens_from_seq_ids<I: Copy + Ord + std::fmt::Debug>(
    global_seq_idx: &[I],
) -> Result<Vec<usize>> {
    if let Some(i) = global_seq_idx.windows(2).position(|w| w[1] < w[0]) {
        return Err(option_err(
            "seq_idx",
            format!(
                "sequence ids must be non-decreasing, got seq_idx[{}] = {:?} after seq_idx[{i}] = {:?}",
                i + 1,
                global_seq_idx[i + 1],
                global_seq_idx[i]
            ),
        ));
    }
    let mut cu = vec![0];
    cu.extend((1..global_seq_idx.len()).filter(|&i| global_seq_idx[i] != global_seq_idx[i - 1]));
    cu.push(global_seq_idx.len());
    Ok(cu)
}

/// [`packed_rank_meta`] from global per-token sequence ids, as Megatron takes them (`seq_idx`).
/// `global_seq_idx` must be non-decreasing and hold one id per token of `plan`.
pub fn packed_rank_meta_from_seq_ids<I: Copy + Ord + std::fmt::Debug>(
    global_seq_idx: &[I],
    plan: &ShardPlan,
    rank: usize,
) -> Result<RankMeta> {
    if global_seq_idx.len() != plan.total_tokens() {
        return Err(GdpError::Shape {
            name: "seq_idx".into(),
            expected: vec![plan.total_tokens()],
            layout: "[T_global] (one sequence id per token)",
            got: vec![global_seq_idx.len()],
        }
        .into());
    }
    packed_rank_meta(&cu_seqlens_from_seq_ids(global_seq_idx)?, plan, rank)
}

/// Metadata of dense (unpacked) input: one local sequence, forward fold over `[0, rank)`,
/// backward fold over `[rank + 1, cp_size)`.
pub fn dense_rank_meta(plan: &ShardPlan, rank: usize) -> Result<RankMeta> {
    Ok(RankMeta {
        local_cu_seqlens: vec![0, plan.len(rank)?],
        preceding_rank_start: 0,
        following_rank_stop: plan.cp_size(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cu_of(lens: &[usize]) -> Vec<usize> {
        let mut cu = vec![0];
        for l in lens {
            cu.push(cu.last().unwrap() + l);
        }
        cu
    }

    /// (local cu, start, stop) for every rank.
    fn table(cu: &[usize], plan: &ShardPlan) -> Vec<(Vec<usize>, usize, usize)> {
        (0..plan.cp_size())
            .map(|r| {
                let m = packed_rank_meta(cu, plan, r).unwrap();
                (
                    m.local_cu_seqlens,
                    m.preceding_rank_start,
                    m.following_rank_stop,
                )
            })
            .collect()
    }

    /// Token-by-token definition, for cross-checking.
    fn naive(cu: &[usize], plan: &ShardPlan, rank: usize) -> (Vec<usize>, usize, usize) {
        let seq = |t: usize| cu.partition_point(|&c| c <= t) - 1;
        let shard = plan.range(rank).unwrap();
        let mut local = vec![0];
        for t in shard.start + 1..shard.end {
            if seq(t) != seq(t - 1) {
                local.push(t - shard.start);
            }
        }
        local.push(shard.len());
        let first = (0..=shard.start)
            .find(|&t| seq(t) == seq(shard.start))
            .unwrap();
        let last = (shard.end - 1..plan.total_tokens())
            .rev()
            .find(|&t| seq(t) == seq(shard.end - 1))
            .unwrap();
        let r = |t| plan.rank_of_token(t).unwrap();
        (local, r(first), r(last) + 1)
    }

    #[test]
    fn megatron_table() {
        let plan = ShardPlan::new(16, 4).unwrap();
        let t = table(&cu_of(&[5, 4, 7]), &plan);
        let ends: Vec<_> = t.iter().map(|(_, s, e)| (*s, e - 1)).collect();
        assert_eq!(ends, [(0, 1), (0, 2), (1, 3), (2, 3)]);
        let locals: Vec<_> = t.into_iter().map(|(l, _, _)| l).collect();
        assert_eq!(
            locals,
            [vec![0, 4], vec![0, 1, 4], vec![0, 1, 4], vec![0, 4]]
        );
    }

    #[test]
    fn check_script_table() {
        let plan = ShardPlan::new(24, 4).unwrap();
        let cu = cu_of(&[5, 4, 9, 2, 4]);
        let want = vec![
            (vec![0, 5, 6], 0, 2),
            (vec![0, 3, 6], 0, 3),
            (vec![0, 6], 1, 3),
            (vec![0, 2, 6], 3, 4),
        ];
        assert_eq!(table(&cu, &plan), want);
        let ids: Vec<i64> = [5, 4, 9, 2, 4]
            .iter()
            .enumerate()
            .flat_map(|(s, &l)| std::iter::repeat_n(s as i64, l))
            .collect();
        for (r, w) in want.iter().enumerate() {
            let m = packed_rank_meta_from_seq_ids(&ids, &plan, r).unwrap();
            assert_eq!(
                (
                    m.local_cu_seqlens,
                    m.preceding_rank_start,
                    m.following_rank_stop
                ),
                *w
            );
        }
    }

    #[test]
    fn metadata_reuse_vector() {
        let plan = ShardPlan::new(8, 2).unwrap();
        let m = packed_rank_meta_from_seq_ids(&[0u32, 0, 0, 0, 0, 1, 1, 1], &plan, 1).unwrap();
        assert_eq!(m.local_cu_seqlens, [0, 1, 4]);
        assert_eq!((m.preceding_rank_start, m.following_rank_stop), (0, 2));
        assert_eq!(m.forward_slice(1), 0..1);
        assert_eq!(m.backward_slice(1), 2..2);
    }

    #[test]
    fn uneven_shards() {
        let plan = ShardPlan::new(10, 4).unwrap();
        assert_eq!(plan.ranges(), [0..3, 3..6, 6..8, 8..10]);
        let lens: Vec<_> = (0..4).map(|r| plan.len(r).unwrap()).collect();
        assert_eq!(lens, [3, 3, 2, 2]);
        let owners: Vec<_> = (0..10).map(|t| plan.rank_of_token(t).unwrap()).collect();
        assert_eq!(owners, [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]);
        assert_eq!(dense_rank_meta(&plan, 2).unwrap().local_cu_seqlens, [0, 2]);
        assert_eq!(dense_rank_meta(&plan, 2).unwrap().following_rank_stop, 4);
        // One sequence of 4 then one of 6: rank 1 holds token 3 of the first and 3 of the second.
        let t = table(&[0, 4, 10], &plan);
        assert_eq!(t[1], (vec![0, 1, 3], 0, 4));
        assert_eq!(t[2], (vec![0, 2], 1, 4));
    }

    #[test]
    fn empty_sequences_are_skipped() {
        // lengths [0, 3, 0, 0, 5, 0], one empty sequence exactly on the rank boundary 4.
        let plan = ShardPlan::new(8, 2).unwrap();
        let cu = [0, 0, 3, 3, 3, 8, 8];
        assert_eq!(
            table(&cu, &plan),
            [(vec![0, 3, 4], 0, 2), (vec![0, 4], 0, 2)]
        );
        let cu = [0, 4, 4, 8];
        assert_eq!(table(&cu, &plan), [(vec![0, 4], 0, 1), (vec![0, 4], 1, 2)]);
    }

    #[test]
    fn matches_token_by_token_definition() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % m) as usize
        };
        for _ in 0..300 {
            let lens: Vec<usize> = (0..1 + next(6)).map(|_| next(7)).collect();
            let total: usize = lens.iter().sum();
            if total == 0 {
                continue;
            }
            let plan = ShardPlan::new(total, 1 + next(total as u64)).unwrap();
            let cu = cu_of(&lens);
            for r in 0..plan.cp_size() {
                assert_eq!(
                    table(&cu, &plan)[r],
                    naive(&cu, &plan, r),
                    "{lens:?} {plan:?}"
                );
            }
        }
    }

    #[test]
    fn errors() {
        let msg = |e: candle_core::Error| e.to_string();
        assert!(msg(ShardPlan::new(5, 0).unwrap_err()).contains("cp_size"));
        let e = msg(ShardPlan::new(5, 9).unwrap_err());
        assert!(e.contains("cp_size 9 exceeds the 5 tokens"), "{e}");
        let plan = ShardPlan::new(8, 2).unwrap();
        assert!(msg(plan.range(2).unwrap_err()).contains("rank 2"));
        assert!(msg(plan.rank_of_token(8).unwrap_err()).contains("token 8"));
        for (cu, want) in [
            (&[][..], "empty"),
            (&[1, 8][..], "start at 0"),
            (&[0, 7][..], "end at the 8 tokens"),
            (&[0, 5, 3, 8][..], "non-decreasing"),
        ] {
            let e = msg(packed_rank_meta(cu, &plan, 0).unwrap_err());
            assert!(e.contains("cu_seqlens") && e.contains(want), "{e}");
        }
        let e =
            msg(packed_rank_meta_from_seq_ids(&[0, 1, 0, 1, 1, 1, 1, 1], &plan, 0).unwrap_err());
        assert!(e.contains("seq_idx") && e.contains("non-decreasing"), "{e}");
        let e = msg(packed_rank_meta_from_seq_ids(&[0u32; 7], &plan, 0).unwrap_err());
        assert!(e.contains("seq_idx"), "{e}");
    }
}
