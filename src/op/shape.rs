//! Problem geometry, computed once per call: sizes, packed-sequence spans, the interleaved
//! sub-token layout and the 64-row chunking that every kernel shares.

use crate::error::GdpError;

/// Rows per chunk of the chunked (WY) algorithm, in interleaved sub-tokens (as in FLA).
pub const CHUNK: usize = 64;

/// One sequence of the batch: tokens `[start, start + len)` of batch row `batch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqSpan {
    /// Batch row holding the sequence (always 0 for packed input).
    pub batch: usize,
    /// First token of the sequence within its batch row.
    pub start: usize,
    /// Number of tokens.
    pub len: usize,
}

/// Sizes of one Gated DeltaProduct call.
///
/// Inputs are `q [B, T, H, K]`, `k [B, T·n, H, K]`, `v [B, T·n, H, V]`, `g [B, T, H]`,
/// `beta [B, T·n, H]`; states are `[N, H, K, V]` with `N = B` for dense input or the number of
/// packed sequences.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GdpShape {
    /// Batch size `B` (1 for packed input).
    pub batch: usize,
    /// Tokens per batch row `T`.
    pub tokens: usize,
    /// Heads `H`.
    pub heads: usize,
    /// Key / query head dimension `K`.
    pub dk: usize,
    /// Value head dimension `V`.
    pub dv: usize,
    /// Householder sub-steps per token `n`.
    pub n: usize,
    /// The sequences, in state order (`N` of them).
    pub seqs: Vec<SeqSpan>,
}

impl GdpShape {
    /// Geometry of a dense batch (every row is one sequence) or, with `cu_seqlens`, of `B = 1`
    /// packed sequences. `cu_seqlens` must already be validated by [`validate_cu_seqlens`].
    pub fn new(
        batch: usize,
        tokens: usize,
        heads: usize,
        dk: usize,
        dv: usize,
        n: usize,
        cu_seqlens: Option<&[usize]>,
    ) -> Self {
        let seqs = match cu_seqlens {
            Some(cu) => cu
                .windows(2)
                .map(|w| SeqSpan {
                    batch: 0,
                    start: w[0],
                    len: w[1] - w[0],
                })
                .collect(),
            None => (0..batch)
                .map(|b| SeqSpan {
                    batch: b,
                    start: 0,
                    len: tokens,
                })
                .collect(),
        };
        Self {
            batch,
            tokens,
            heads,
            dk,
            dv,
            n,
            seqs,
        }
    }

    /// Checks that the geometry is self-consistent, as every kernel that writes through it
    /// assumes: each sequence lies inside its batch row (`batch < B`, `start + len <= T`), no
    /// two sequences of a row overlap, and every buffer size fits in `usize`. [`GdpShape::new`]
    /// builds shapes that pass; a hand-built one may not.
    pub fn check(&self) -> Result<(), GdpError> {
        let bad = |reason: String| GdpError::Option {
            name: "shape".into(),
            reason,
        };
        let overflow = || bad(format!("{self:?}: a buffer size overflows usize"));
        let th = self
            .batch
            .checked_mul(self.tokens)
            .and_then(|x| x.checked_mul(self.heads))
            .ok_or_else(overflow)?;
        let kv = self.dk.checked_mul(self.dv).ok_or_else(overflow)?;
        let n1 = self.n.checked_add(1).ok_or_else(overflow)?;
        let states = self
            .seqs
            .len()
            .checked_mul(self.heads)
            .and_then(|x| x.checked_mul(kv))
            .ok_or_else(overflow)?;
        // The largest buffer is the backward's `[dqk | dv | dg | dbeta | dh0]`; `[o | ht]` and
        // every offset into either are smaller.
        let (m, a) = (usize::checked_mul, usize::checked_add);
        let qk = m(th, n1).and_then(|x| m(x, self.dk));
        let v = m(th, self.n).and_then(|x| m(x, self.dv));
        let o = m(th, self.dv);
        let gates = m(th, n1);
        [qk, v, o, gates]
            .into_iter()
            .try_fold(states, |acc, x| x.and_then(|x| a(acc, x)))
            .ok_or_else(overflow)?;
        for (i, sp) in self.seqs.iter().enumerate() {
            let end = sp.start.checked_add(sp.len);
            if sp.batch >= self.batch || end.is_none_or(|e| e > self.tokens) {
                return Err(bad(format!(
                    "sequence {i} {sp:?} lies outside the batch [B = {}, T = {}]",
                    self.batch, self.tokens
                )));
            }
        }
        let mut order: Vec<&SeqSpan> = self.seqs.iter().collect();
        order.sort_by_key(|sp| (sp.batch, sp.start, sp.len));
        for w in order.windows(2) {
            if w[0].batch == w[1].batch && w[0].start + w[0].len > w[1].start {
                return Err(bad(format!("sequences {:?} and {:?} overlap", w[0], w[1])));
            }
        }
        Ok(())
    }

    /// Number of sequences `N` (rows of the initial and final state).
    pub fn num_seqs(&self) -> usize {
        self.seqs.len()
    }

    /// Elements of `q` / `o`-style token tensors: `B·T·H`.
    pub fn token_heads(&self) -> usize {
        self.batch * self.tokens * self.heads
    }

    /// Elements of the packed `[q | k_0 .. k_{n-1}]` tensor `[B, T, n+1, H, K]`.
    pub fn qk_len(&self) -> usize {
        self.token_heads() * (self.n + 1) * self.dk
    }

    /// Elements of `v [B, T·n, H, V]`.
    pub fn v_len(&self) -> usize {
        self.token_heads() * self.n * self.dv
    }

    /// Elements of `o [B, T, H, V]`.
    pub fn o_len(&self) -> usize {
        self.token_heads() * self.dv
    }

    /// Elements of a state tensor `[N, H, K, V]`.
    pub fn state_len(&self) -> usize {
        self.num_seqs() * self.heads * self.dk * self.dv
    }

    /// Thread blocks of a chunked scan over `columns` value columns in tiles of `tile`: one per
    /// (sequence, head, tile).
    pub(crate) fn scan_blocks(&self, columns: usize, tile: usize) -> usize {
        self.num_seqs() * self.heads * columns.div_ceil(tile)
    }

    /// Whether such a scan has blocks for about half of `sms` multiprocessors (at least 9/20 of
    /// them). The CUDA forward scans take the widest tile that does, since a scan's chunk step
    /// is latency-bound and fewer, wider blocks stage each chunk fewer times; `Segments::Auto`
    /// reads from it where the unsplit scan falls back to its narrowest tile.
    pub(crate) fn scan_fills_half(&self, columns: usize, tile: usize, sms: usize) -> bool {
        20 * self.scan_blocks(columns, tile) >= 9 * sms
    }

    /// Elements of the f32 gate buffer `[g (B·T·H) | beta (B·T·n·H) | h0 (N·H·K·V)?]`.
    pub fn aux_len(&self, has_h0: bool) -> usize {
        self.token_heads() * (1 + self.n) + if has_h0 { self.state_len() } else { 0 }
    }

    /// [`CHUNK`]-row chunks of each sequence's `len · n` interleaved rows.
    pub fn chunks_per_seq(&self) -> Vec<usize> {
        self.seqs
            .iter()
            .map(|s| (s.len * self.n).div_ceil(CHUNK))
            .collect()
    }

    /// Every chunk once, numbered sequence by sequence (chunk `i` of sequence `s` is the
    /// chunks of sequences `0..s` plus `i`, as the CUDA kernels' chunk table numbers them),
    /// listed time-major: chunk 0 of every sequence, then chunk 1 of every sequence that has
    /// one, and so on (the order in which a scan over all sequences at once needs them).
    pub fn chunks_time_major(&self) -> Vec<usize> {
        let per_seq = self.chunks_per_seq();
        let mut first = Vec::with_capacity(per_seq.len());
        let mut next = 0;
        for &c in &per_seq {
            first.push(next);
            next += c;
        }
        let most = per_seq.iter().copied().max().unwrap_or(0);
        let mut order = Vec::with_capacity(next);
        for i in 0..most {
            for (&c, &f) in per_seq.iter().zip(&first) {
                if i < c {
                    order.push(f + i);
                }
            }
        }
        order
    }

    /// The chunks' ids as in [`GdpShape::chunks_time_major`], from the sequences' ends: every
    /// sequence's last chunk, then every second-to-last, and so on (the order in which the
    /// state-gradient scan, running backwards in time, needs the WY factors).
    pub fn chunks_from_the_end(&self) -> Vec<usize> {
        let per_seq = self.chunks_per_seq();
        let mut end = Vec::with_capacity(per_seq.len());
        let mut next = 0;
        for &c in &per_seq {
            next += c;
            end.push(next);
        }
        let most = per_seq.iter().copied().max().unwrap_or(0);
        let mut order = Vec::with_capacity(next);
        for i in 0..most {
            for (&c, &e) in per_seq.iter().zip(&end) {
                if i < c {
                    order.push(e - 1 - i);
                }
            }
        }
        order
    }
}

/// Checks packed-sequence offsets: at least two entries, starting at 0, non-decreasing, ending
/// at `total_tokens`. Empty sequences (repeated offsets) are allowed, as in FLA.
pub fn validate_cu_seqlens(cu: &[usize], total_tokens: usize) -> Result<(), GdpError> {
    if cu.len() < 2 {
        return Err(GdpError::CuSeqlens(format!(
            "expected at least 2 offsets [0, .., T], got {cu:?}"
        )));
    }
    if cu[0] != 0 {
        return Err(GdpError::CuSeqlens(format!(
            "must start at 0, got {} (offsets {cu:?})",
            cu[0]
        )));
    }
    if let Some(i) = cu.windows(2).position(|w| w[1] < w[0]) {
        return Err(GdpError::CuSeqlens(format!(
            "must be non-decreasing, but entry {} ({}) < entry {} ({})",
            i + 1,
            cu[i + 1],
            i,
            cu[i]
        )));
    }
    let last = *cu.last().unwrap_or(&0);
    if last != total_tokens {
        return Err(GdpError::CuSeqlens(format!(
            "must end at the number of tokens T = {total_tokens}, got {last}"
        )));
    }
    Ok(())
}

/// The chunks of one sequence of `rows` interleaved sub-tokens: `[start, end)` ranges of at
/// most [`CHUNK`] rows, restarting at the sequence start.
pub fn chunks(rows: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..rows)
        .step_by(CHUNK)
        .map(move |s| s..(s + CHUNK).min(rows))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cu_seqlens_rules() {
        assert!(validate_cu_seqlens(&[0, 3, 3, 7], 7).is_ok());
        assert!(validate_cu_seqlens(&[0], 0).is_err());
        assert!(validate_cu_seqlens(&[1, 7], 7).is_err());
        assert!(validate_cu_seqlens(&[0, 5, 4, 7], 7).is_err());
        assert!(validate_cu_seqlens(&[0, 5, 6], 7).is_err());
    }

    #[test]
    fn chunking_restarts_and_covers() {
        let c: Vec<_> = chunks(130).collect();
        assert_eq!(c, vec![0..64, 64..128, 128..130]);
        assert_eq!(chunks(0).count(), 0);
    }

    #[test]
    fn packed_geometry() {
        let s = GdpShape::new(1, 10, 2, 4, 3, 2, Some(&[0, 4, 4, 10]));
        assert_eq!(s.num_seqs(), 3);
        assert_eq!(
            s.seqs[2],
            SeqSpan {
                batch: 0,
                start: 4,
                len: 6
            }
        );
        assert_eq!(s.aux_len(true), 10 * 2 * 3 + 3 * 2 * 4 * 3);
    }

    #[test]
    fn chunks_time_major_lists_each_chunk_once_in_time_order() {
        // n = 2: sequences of 100, 0, 20 and 40 tokens have 4, 0, 1 and 2 chunks, numbered
        // 0..4, -, 4 and 5..7.
        let s = GdpShape::new(1, 160, 2, 4, 3, 2, Some(&[0, 100, 100, 120, 160]));
        assert_eq!(s.chunks_per_seq(), vec![4, 0, 1, 2]);
        assert_eq!(s.chunks_time_major(), vec![0, 4, 5, 1, 6, 2, 3]);
        let dense = GdpShape::new(2, 64, 1, 4, 3, 1, None);
        assert_eq!(dense.chunks_time_major(), vec![0, 1]);
        let empty = GdpShape::new(1, 0, 1, 4, 3, 1, Some(&[0, 0]));
        assert!(empty.chunks_time_major().is_empty());
    }

    #[test]
    fn chunks_from_the_end_lists_each_chunk_once_from_the_sequences_ends() {
        // The sequences of the test above: chunks 0..4, -, 4 and 5..7.
        let s = GdpShape::new(1, 160, 2, 4, 3, 2, Some(&[0, 100, 100, 120, 160]));
        assert_eq!(s.chunks_from_the_end(), vec![3, 4, 6, 2, 5, 1, 0]);
        let dense = GdpShape::new(2, 64, 1, 4, 3, 1, None);
        assert_eq!(dense.chunks_from_the_end(), vec![0, 1]);
        let empty = GdpShape::new(1, 0, 1, 4, 3, 1, Some(&[0, 0]));
        assert!(empty.chunks_from_the_end().is_empty());
    }
}
