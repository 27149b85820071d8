//! The peer check before each collective: every rank all-gathers a small header naming the
//! collective it is about to run, and a mismatch fails the group instead of reaching NCCL.

use std::time::Duration;

use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};

use super::collective::enqueue;
use super::{comm_err, Inner, NcclComm};
use crate::cp::comm::Collective;
use crate::error::Result;

impl NcclComm {
    /// Before each collective every rank all-gathers `[tag, number, kind, length]`; a rank that
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
        let words = HEADER_WORDS * self.world_size;
        if inner.header_send.is_none() {
            inner.header_send = Some(self.device.alloc_zeros::<f32>(HEADER_WORDS)?);
        }
        if inner.header_recv.is_none() {
            inner.header_recv = Some(self.device.alloc_zeros::<f32>(words)?);
        }
        let (Some(mut send), Some(mut recv)) = (inner.header_send.take(), inner.header_recv.take())
        else {
            return Err(comm_err(format!(
                "rank {}: {what}: no header buffers",
                self.rank
            )));
        };
        let res = (|| -> Result<Duration> {
            let bits = header.map(f32::from_bits);
            self.stream.memcpy_htod(&bits, &mut send).map_err(|e| {
                comm_err(format!(
                    "rank {}: {what}: copy to the device: {e:?}",
                    self.rank
                ))
            })?;
            let waited = {
                let stream = &self.nccl_stream;
                let (src, _s) = send.device_ptr(stream);
                let (dst, _d) = recv.device_ptr_mut(stream);
                self.run(inner, Collective::AllGather, |comm, st| unsafe {
                    enqueue(Collective::AllGather, src, dst, HEADER_WORDS, comm, st)
                })?
            };
            let all = self.stream.clone_dtoh(&recv).map_err(|e| {
                comm_err(format!(
                    "rank {}: {what}: copy to the host: {e:?}",
                    self.rank
                ))
            })?;
            for (r, theirs) in all.chunks(HEADER_WORDS).enumerate() {
                let theirs: Vec<u32> = theirs.iter().map(|x| x.to_bits()).collect();
                if theirs[..] != header[..] {
                    let called = match (theirs[0] == PEER_TAG, from_wire_code(theirs[2])) {
                        (true, Some(c)) => format!("{c} #{} with {} values", theirs[1], theirs[3]),
                        _ => format!("something else (header {theirs:?})"),
                    };
                    let reason = format!(
                        "collective mismatch: rank {} called {op} #{number} with {n} values, \
                         rank {r} called {called}",
                        self.rank
                    );
                    return Err(self.fail(inner, &what, &reason));
                }
            }
            Ok(waited)
        })();
        inner.header_send = Some(send);
        inner.header_recv = Some(recv);
        res
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
