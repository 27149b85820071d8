//! How a long sequence is cut into segments that the chunked bf16 forward scans side by side
//! (`KernelConfig::segments`, `op::cuda` runs them): how many per sequence, and where each
//! segment starts. Device-independent, so that its rules are tested without a GPU.

use crate::op::config::{KernelConfig, Segments};
use crate::op::shape::{GdpShape, SeqSpan};
use candle_core::Result;
use std::ops::Range;

/// Segment boundaries fall on multiples of this many tokens from a sequence's start, so that
/// a segment's 64-row chunks (`64 / n` tokens each) are those of the unsplit sequence, and the
/// WY factors computed over the segments serve the unsplit backward.
const ALIGN: usize = 64;
/// `Segments::Auto`: segments of at least this many tokens (shorter ones save less chain than
/// the widened columns, the fold and the correction cost).
const MIN_AUTO_TOKENS: usize = 2048;
/// `Segments::Auto`: at most this many segments per sequence.
const MAX_AUTO_SEGMENTS: usize = 16;
/// `Segments::Auto`: from this many segments per sequence on, a split is taken wherever one
/// wave of the widened scan holds them. Fewer are taken only with [`MIN_FEW_SEGMENT_TOKENS`]
/// per segment, and two only where the unsplit scan would run its narrowest tile: each halves
/// or thirds the chains but doubles the scans' columns and adds the fold and the corrections
/// (`docs/cuda.md`, "Segments").
const MIN_AUTO_SEGMENTS: usize = 4;
/// `Segments::Auto`: segments of at least this many tokens where fewer than
/// [`MIN_AUTO_SEGMENTS`] are taken, within the lengths measured (`docs/cuda.md`, "Segments").
const MIN_FEW_SEGMENT_TOKENS: usize = 8192;
/// `Segments::Auto`: the widened scan's value tile assumed when counting its blocks.
const AUTO_TILE: usize = 64;
/// The unsplit forward scan's tile below its narrowest: where tiles of this many columns give
/// it too few blocks (`GdpShape::scan_fills_half`), it runs 16-column tiles that fill the GPU
/// and leave the WY kernel no multiprocessors beside it, and two segments pay.
const UNSPLIT_MID_TILE: usize = 32;

/// The segments `cfg.segments` asks for on `sms` multiprocessors: every sequence of `sh` cut
/// into segments of one length (a multiple of [`ALIGN`] tokens; the last of a sequence shorter),
/// in order, and the segments of each sequence; `None` where nothing is split.
pub(crate) fn plan(sh: &GdpShape, cfg: &KernelConfig, sms: usize) -> Result<Option<Split>> {
    let count = segment_count(sh, cfg, sms)?;
    let longest = sh.seqs.iter().map(|s| s.len).max().unwrap_or(0);
    if count < 2 || longest <= ALIGN {
        return Ok(None);
    }
    let cut = split(&sh.seqs, longest.div_ceil(count).next_multiple_of(ALIGN));
    Ok((cut.segments.len() > sh.num_seqs()).then_some(cut))
}

/// Sequences cut into segments ([`plan`]).
#[derive(Debug)]
pub(crate) struct Split {
    /// The segments, each sequence's in order.
    pub segments: Vec<SeqSpan>,
    /// Per sequence, the indices of its segments.
    pub owners: Vec<Range<usize>>,
}

/// Segments per sequence under `cfg.segments` for `sh` on `sms` multiprocessors (1: no split).
/// `Auto` takes as many as one wave of the widened scan's blocks holds, each segment at least
/// [`MIN_AUTO_TOKENS`] of the longest sequence, at most [`MAX_AUTO_SEGMENTS`]; below
/// [`MIN_AUTO_SEGMENTS`], three or two with [`MIN_FEW_SEGMENT_TOKENS`] each, two only where
/// the unsplit scan would run its narrowest tile ([`UNSPLIT_MID_TILE`]).
fn segment_count(sh: &GdpShape, cfg: &KernelConfig, sms: usize) -> Result<usize> {
    match cfg.segments {
        Segments::Off => Ok(1),
        Segments::Count(0) => candle_core::bail!(
            "gdp cuda: KernelConfig::segments = Count(0): give at least 1 (1 or Off: no split)"
        ),
        Segments::Count(p) => Ok(p),
        Segments::Auto => {
            let longest = sh.seqs.iter().map(|s| s.len).max().unwrap_or(0);
            let blocks = sh.scan_blocks(sh.dv + sh.dk, AUTO_TILE);
            let by_blocks = sms / blocks.max(1);
            let count = by_blocks
                .min(longest / MIN_AUTO_TOKENS)
                .min(MAX_AUTO_SEGMENTS);
            let few = count.min(longest / MIN_FEW_SEGMENT_TOKENS);
            let unsplit_narrow = !sh.scan_fills_half(sh.dv, UNSPLIT_MID_TILE, sms);
            Ok(match (count, few) {
                (c, _) if c >= MIN_AUTO_SEGMENTS => c,
                (_, 3) => 3,
                (_, 2) if unsplit_narrow => 2,
                _ => 1,
            })
        }
    }
}

/// Each sequence of `seqs` split into consecutive segments of `len` tokens (the last shorter;
/// an empty sequence stays one empty segment), in order, and the segments of each sequence.
fn split(seqs: &[SeqSpan], len: usize) -> Split {
    let mut segments = Vec::new();
    let mut owners = Vec::with_capacity(seqs.len());
    for s in seqs {
        let first = segments.len();
        let mut at = 0;
        loop {
            let l = len.min(s.len - at);
            segments.push(SeqSpan {
                batch: s.batch,
                start: s.start + at,
                len: l,
            });
            at += l;
            if at >= s.len {
                break;
            }
        }
        owners.push(first..segments.len());
    }
    Split { segments, owners }
}

/// Per segment of a [`Split`]'s `owners` (`segments` in all), its row among the end-state
/// gradients that the backward in segments folds: every segment but a sequence's last (whose
/// scan starts from the sequence's own final-state gradient), numbered in order.
pub(crate) fn end_grad_rows(owners: &[Range<usize>], segments: usize) -> Vec<Option<usize>> {
    let mut rows = vec![None; segments];
    let mut next = 0;
    for seg in owners {
        let last = seg.end.saturating_sub(1).max(seg.start);
        for row in &mut rows[seg.start..last] {
            *row = Some(next);
            next += 1;
        }
    }
    rows
}

/// Chains of segment summaries folded in one launch (`gdp_fold_chains` in `cuda/cp_fix.cuh`):
/// each chain's steps in fold order, and where the state before each step goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FoldChains {
    /// Segment ids in fold order, the chains one after the other; `-1 - id` passes the state
    /// on unchanged (an empty segment).
    pub steps: Vec<i32>,
    /// Per chain, the index of its first step in `steps`; one more entry, `steps.len()`.
    pub chain_at: Vec<i32>,
    /// Per step, the output row that receives the state before it (`-1`: none).
    pub rows: Vec<i32>,
}

/// The forward's fold over each sequence's segments (`owners`) in order, `S_{j+1} = ΔS_j +
/// M_j S_j` (`segments`' lengths: an empty segment passes the state on): every segment's
/// incoming state to its own row.
pub(crate) fn forward_chains(owners: &[Range<usize>], segments: &[SeqSpan]) -> Result<FoldChains> {
    let mut chains = FoldChains::with_capacity(owners.len(), segments.len());
    for seq in owners {
        for j in seq.clone() {
            let id = to_i32(j)?;
            let empty = segments.get(j).is_none_or(|s| s.len == 0);
            chains.steps.push(if empty { -1 - id } else { id });
            chains.rows.push(id);
        }
        chains.end_chain()?;
    }
    Ok(chains)
}

/// The backward's fold from each sequence's last segment back, `e_j = γ_{j+1} + Mᵀ_{j+1}
/// e_{j+1}`: the end-state gradient of every segment but a sequence's last to its row of
/// [`end_grad_rows`].
pub(crate) fn backward_chains(owners: &[Range<usize>], segments: usize) -> Result<FoldChains> {
    let rows = end_grad_rows(owners, segments);
    let mut chains = FoldChains::with_capacity(owners.len(), segments);
    for seq in owners {
        for j in seq.clone().rev() {
            chains.steps.push(to_i32(j)?);
            chains.rows.push(match rows[j] {
                Some(row) => to_i32(row)?,
                None => -1,
            });
        }
        chains.end_chain()?;
    }
    Ok(chains)
}

/// Context parallelism's fold of gathered summaries (`[ranks, F, H, K, V + K]`, read as
/// `ranks · F` segments): per fragment slot `f < F`, the ranks `order` (first applied first),
/// segment `r · F + f` each; no state rows, the chains' final states are the result.
pub(crate) fn rank_chains(order: &[usize], frags: usize) -> Result<FoldChains> {
    let mut chains = FoldChains::with_capacity(frags, frags * order.len());
    for f in 0..frags {
        for &r in order {
            chains.steps.push(to_i32(r * frags + f)?);
            chains.rows.push(-1);
        }
        chains.end_chain()?;
    }
    Ok(chains)
}

impl FoldChains {
    fn with_capacity(chains: usize, steps: usize) -> Self {
        let mut chain_at = Vec::with_capacity(chains + 1);
        chain_at.push(0);
        Self {
            steps: Vec::with_capacity(steps),
            chain_at,
            rows: Vec::with_capacity(steps),
        }
    }

    fn end_chain(&mut self) -> Result<()> {
        self.chain_at.push(to_i32(self.steps.len())?);
        Ok(())
    }

    /// The number of chains.
    pub fn chains(&self) -> usize {
        self.chain_at.len() - 1
    }

    /// What a fold along these chains reads and writes: one more than the largest segment id
    /// a step reads, and one more than the largest state row a step writes; an error where the
    /// chains are inconsistent (`chain_at` not from 0 to the steps' count in order, or `rows`
    /// not one per step).
    pub fn extent(&self) -> Result<(usize, usize)> {
        let steps = self.steps.len();
        let ordered = self.chain_at.first() == Some(&0)
            && self.chain_at.windows(2).all(|w| w[0] <= w[1])
            && self.chain_at.last().copied() == Some(to_i32(steps)?);
        if self.rows.len() != steps || !ordered {
            candle_core::bail!("gdp: a fold of {steps} steps with inconsistent chains");
        }
        let segments = self.steps.iter().map(|&id| id.max(-1 - id) as usize + 1);
        let rows = self
            .rows
            .iter()
            .filter(|&&r| r >= 0)
            .map(|&r| r as usize + 1);
        Ok((segments.max().unwrap_or(0), rows.max().unwrap_or(0)))
    }
}

fn to_i32(x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("gdp: {x} segments exceed i32")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(batch: usize, start: usize, len: usize) -> SeqSpan {
        SeqSpan { batch, start, len }
    }

    #[test]
    fn extent_names_what_a_fold_reads_and_writes() {
        let seqs = [span(0, 0, 300), span(0, 300, 0), span(0, 300, 64)];
        let Split { segments, owners } = split(&seqs, 128);
        let fwd = forward_chains(&owners, &segments).unwrap();
        assert_eq!(fwd.extent().unwrap(), (segments.len(), segments.len()));
        assert_eq!(rank_chains(&[3, 1], 2).unwrap().extent().unwrap(), (8, 0));
        let mut bad = rank_chains(&[0], 1).unwrap();
        bad.rows.push(0);
        assert!(bad.extent().is_err());
        bad.rows.pop();
        bad.chain_at = vec![1, 1];
        assert!(bad.extent().is_err());
    }

    #[test]
    fn rank_chains_fold_each_fragment_slot_over_the_ranks() {
        let c = rank_chains(&[3, 2], 2).unwrap();
        assert_eq!(c.steps, [6, 4, 7, 5]);
        assert_eq!(c.chain_at, [0, 2, 4]);
        assert_eq!(c.rows, [-1; 4]);
        let none = rank_chains(&[], 1).unwrap();
        assert_eq!((none.chains(), none.steps.len()), (1, 0));
    }

    #[test]
    fn segments_cover_each_sequence_in_order() {
        let seqs = [span(0, 0, 300), span(0, 300, 0), span(0, 300, 64)];
        let Split { segments, owners } = split(&seqs, 128);
        let want = [
            span(0, 0, 128),
            span(0, 128, 128),
            span(0, 256, 44),
            span(0, 300, 0),
            span(0, 300, 64),
        ];
        assert_eq!(segments, want);
        assert_eq!(owners, [0..3, 3..4, 4..5]);
    }

    #[test]
    fn every_segment_but_the_last_lacks_an_end_state_gradient() {
        let owners = [0..3, 3..4, 4..6];
        assert_eq!(
            end_grad_rows(&owners, 6),
            [Some(0), Some(1), None, None, Some(2), None]
        );
        assert_eq!(end_grad_rows(&[], 0), []);
    }

    #[test]
    fn fold_chains_follow_each_sequence_forward_and_back() -> Result<()> {
        let segments = [
            span(0, 0, 128),
            span(0, 128, 44),
            span(0, 172, 0),
            span(0, 172, 64),
        ];
        let owners = [0..2, 2..3, 3..4];
        let fwd = forward_chains(&owners, &segments)?;
        assert_eq!(
            fwd,
            FoldChains {
                steps: vec![0, 1, -3, 3],
                chain_at: vec![0, 2, 3, 4],
                rows: vec![0, 1, 2, 3],
            }
        );
        let bwd = backward_chains(&owners, segments.len())?;
        assert_eq!(
            bwd,
            FoldChains {
                steps: vec![1, 0, 2, 3],
                chain_at: vec![0, 2, 3, 4],
                rows: vec![-1, 0, -1, -1],
            }
        );
        assert_eq!(bwd.chains(), 3);
        Ok(())
    }

    #[test]
    fn forced_segments_are_aligned_and_short_sequences_stay_whole() -> Result<()> {
        let cfg = KernelConfig {
            segments: Segments::Count(3),
            ..Default::default()
        };
        // The longest sequence (300 tokens) in thirds, rounded up to 64: segments of 128.
        let sh = GdpShape::new(1, 400, 2, 16, 16, 2, Some(&[0, 300, 340, 400]));
        let Split { segments, owners } = plan(&sh, &cfg, 132)?.expect("a split");
        assert_eq!(
            segments.iter().map(|s| s.len).collect::<Vec<_>>(),
            [128, 128, 44, 40, 60]
        );
        assert_eq!(owners, [0..3, 3..4, 4..5]);
        // Nothing longer than one segment: no split.
        let short = GdpShape::new(2, 64, 2, 16, 16, 1, None);
        assert!(plan(&short, &cfg, 132)?.is_none());
        Ok(())
    }

    #[test]
    fn auto_splits_only_what_leaves_the_gpu_idle() -> Result<()> {
        let cfg = KernelConfig {
            segments: Segments::Auto,
            ..Default::default()
        };
        // B1 H8 K = V = 128 over 64K tokens on 132 multiprocessors: 32 blocks per segment.
        let few = GdpShape::new(1, 65_536, 8, 128, 128, 1, None);
        assert_eq!(segment_count(&few, &cfg, 132)?, 4);
        // B1 H4 over 128K tokens: 16 blocks per segment, 8 segments.
        let fewer = GdpShape::new(1, 131_072, 4, 128, 128, 2, None);
        assert_eq!(segment_count(&fewer, &cfg, 132)?, 8);
        // Short sequences: fewer than four segments of 2048 tokens or more.
        let short = GdpShape::new(1, 8000, 8, 128, 128, 1, None);
        assert_eq!(segment_count(&short, &cfg, 132)?, 1);
        // B·H 10: 40 blocks per segment, three in one wave, each over 8192 tokens.
        let three = GdpShape::new(1, 65_536, 10, 128, 128, 1, None);
        assert_eq!(segment_count(&three, &cfg, 132)?, 3);
        // Three would be shorter than 8192 tokens: two, where those are long enough.
        let three_short = GdpShape::new(1, 20_000, 10, 128, 128, 1, None);
        assert_eq!(segment_count(&three_short, &cfg, 132)?, 2);
        let two_short = GdpShape::new(1, 16_000, 10, 128, 128, 1, None);
        assert_eq!(segment_count(&two_short, &cfg, 132)?, 1);
        // B·H 12: two segments, since the unsplit scan has too few blocks of 32 columns (48)
        // and runs 16-column tiles.
        let two = GdpShape::new(1, 32_768, 12, 128, 128, 1, None);
        assert_eq!(segment_count(&two, &cfg, 132)?, 2);
        // B·H 16: the unsplit scan runs 64 blocks of 32 columns, the WY kernel beside them;
        // two segments would not pay.
        let sixteen = GdpShape::new(1, 65_536, 16, 128, 128, 1, None);
        assert_eq!(segment_count(&sixteen, &cfg, 132)?, 1);
        let b2 = GdpShape::new(2, 32_768, 8, 128, 128, 2, None);
        assert_eq!(segment_count(&b2, &cfg, 132)?, 1);
        // Many heads already fill the GPU.
        let many = GdpShape::new(4, 65_536, 16, 128, 128, 1, None);
        assert_eq!(segment_count(&many, &cfg, 132)?, 1);
        let forced = KernelConfig {
            segments: Segments::Count(0),
            ..cfg
        };
        assert!(segment_count(&few, &forced, 132).is_err());
        Ok(())
    }
}
