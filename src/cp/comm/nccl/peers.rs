//! The peer check before each collective: every rank all-gathers a small header naming the
//! collective it is about to run, and a mismatch fails the group instead of reaching NCCL.

use std::time::Duration;

use super::{comm_err, Inner, NcclComm};
use crate::cp::comm::Collective;
use crate::error::Result;

impl NcclComm {
    /// Before each collective every rank all-gathers `[tag, number, kind, length]` (through the
    /// scratch buffers, before the collective's own data goes in); a rank that
    /// is about to run another collective, or the same one on a different number of values,
    /// fails the group here instead of handing NCCL buffers of different sizes (which it cannot
    /// detect). Returns the time spent.
    pub(super) fn check_peers(
        &self,
        inner: &mut Inner,
        op: Collective,
        n: usize,
    ) -> Result<Duration> {
        let number = inner.seq + 2;
        let what = format!("{op} #{number}");
        let len = u32::try_from(n).map_err(|_| {
            comm_err(format!(
                "rank {}: {what}: {n} values do not fit one collective (at most {})",
                self.rank,
                u32::MAX
            ))
        })?;
        let header = [PEER_TAG, number as u32, wire_code(op), len];
        let bits = header.map(f32::from_bits);
        let words = HEADER_WORDS * self.world_size;
        let (all, waited) = self.transfer(inner, Collective::AllGather, &bits, words)?;
        for (r, theirs) in all.chunks(HEADER_WORDS).enumerate() {
            let theirs: Vec<u32> = theirs.iter().map(|x| x.to_bits()).collect();
            if theirs[..] != header[..] {
                let called = match (theirs[0] == PEER_TAG, from_wire_code(theirs[2])) {
                    (true, Some(c)) => format!("{c} #{} with {} values", theirs[1], theirs[3]),
                    _ => format!("something else (header {theirs:?})"),
                };
                let reason = format!(
                    "collective mismatch: rank {} called {op} #{number} with {n} values, rank \
                     {r} called {called}",
                    self.rank
                );
                return Err(self.fail(inner, &what, &reason));
            }
        }
        Ok(waited)
    }
}

/// Marks a peer-check header (the bits of an ASCII tag).
const PEER_TAG: u32 = u32::from_le_bytes(*b"gdpc");
/// Words of a peer-check header: tag, collective number, kind, length.
const HEADER_WORDS: usize = 4;

/// A collective's code in peer-check headers.
fn wire_code(op: Collective) -> u32 {
    match op {
        Collective::AllGather => 1,
        Collective::AllReduceSum => 2,
        Collective::Barrier => 3,
    }
}

/// The collective of a [`wire_code`], if any.
fn from_wire_code(code: u32) -> Option<Collective> {
    [
        Collective::AllGather,
        Collective::AllReduceSum,
        Collective::Barrier,
    ]
    .into_iter()
    .find(|&c| wire_code(c) == code)
}
