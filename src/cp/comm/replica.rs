//! [`ReplicaComm`]: one rank of a group played alone, for timing a rank on one device.

use std::sync::OnceLock;

use candle_core::Tensor;

use super::Communicator;
use crate::error::{GdpError, Result};

/// Plays rank `rank` of a group of `world_size` ranks without any peer: every collective is
/// answered from this rank's own contribution, as if every peer had sent the same buffer
/// (`all_gather` returns `world_size` copies of `local`, `all_reduce_sum` multiplies by
/// `world_size`).
///
/// The values a rank then folds are not those of a real group, but the work is: the summaries,
/// the exchange's copies, the fold over the causal slice and the local op run exactly as on a
/// real rank. `gdp cp-bench` uses it to time one rank against the plain op on the same shard,
/// on one device.
#[derive(Debug)]
pub struct ReplicaComm {
    rank: usize,
    world_size: usize,
    failed: OnceLock<String>,
}

impl ReplicaComm {
    /// Rank `rank` of a group of `world_size`; errors unless `rank < world_size`.
    pub fn new(rank: usize, world_size: usize) -> Result<Self> {
        if rank >= world_size {
            return Err(GdpError::Option {
                name: "rank".into(),
                reason: format!(
                    "needs rank < world_size, got rank {rank}, world size {world_size}"
                ),
            }
            .into());
        }
        Ok(Self {
            rank,
            world_size,
            failed: OnceLock::new(),
        })
    }

    fn check(&self) -> Result<()> {
        match self.failed.get() {
            Some(reason) => Err(GdpError::Comm(format!("group aborted: {reason}")).into()),
            None => Ok(()),
        }
    }
}

impl Communicator for ReplicaComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        self.check()?;
        Ok(local.repeat(self.world_size))
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        self.check()?;
        let w = self.world_size as f32;
        buf.iter_mut().for_each(|x| *x *= w);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.check()
    }

    fn abort(&self, reason: &str) {
        let _ = self.failed.set(reason.to_string());
    }

    /// `world_size` copies of `local`, stacked on its device (no host round trip, as on a
    /// device transport).
    fn all_gather_tensor(&self, local: &Tensor) -> Result<Tensor> {
        self.check()?;
        let copies = vec![local; self.world_size];
        Tensor::stack(&copies, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicates_the_local_contribution() {
        let c = ReplicaComm::new(2, 4).unwrap();
        assert_eq!((c.rank(), c.world_size()), (2, 4));
        assert_eq!(c.all_gather(&[1.0, 2.0]).unwrap(), [1.0, 2.0].repeat(4));
        let mut b = [0.5, -1.0];
        c.all_reduce_sum(&mut b).unwrap();
        assert_eq!(b, [2.0, -4.0]);
        c.abort("stop");
        let e = c.barrier().unwrap_err().to_string();
        assert!(e.contains("stop"), "{e}");
        let e = ReplicaComm::new(4, 4).unwrap_err().to_string();
        assert!(e.contains("rank 4") && e.contains("world size 4"), "{e}");
    }
}
