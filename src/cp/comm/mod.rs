//! Communicators for context parallelism: the collectives the CP driver needs on the CP group,
//! whose rank order is the sequence order (`megatron_cp.md` §5.2).
//!
//! The driver only ever talks to a `&dyn Communicator`. The slice methods work on host `f32`
//! buffers; the tensor methods have default implementations that copy the tensor to the host,
//! call the slice method and copy the result back to the tensor's device. That is what the
//! in-process [`ThreadComm`] transport does; a device transport (NCCL) can override the tensor
//! methods to keep the data on the device.
//!
//! Failure is shared: once any rank fails (it calls [`Communicator::abort`], a collective times
//! out, or the ranks disagree on the collective), every pending and later collective of the group
//! returns [`GdpError::Comm`] instead of waiting.
//!
//! Transports: [`ThreadComm`] (one thread per rank in one process), [`ReplicaComm`] (one rank
//! played alone, for timing) and, with the `nccl` feature,
//! `NcclComm` (one process per GPU, NCCL collectives on the device, set up through the
//! [`rendezvous`] and started by `gdp launch` or torchrun).

#[cfg(feature = "nccl")]
mod nccl;
pub mod rendezvous;
mod replica;
mod threads;

#[cfg(feature = "nccl")]
pub use nccl::{CommStats, NcclComm};
pub use rendezvous::{DistEnv, Rendezvous, RendezvousAddr};
pub use replica::ReplicaComm;
pub use threads::{run_ranks, ThreadComm, DEFAULT_TIMEOUT};

use std::sync::OnceLock;

use candle_core::{DType, Tensor};

use crate::error::{GdpError, Result};

/// Collectives over a context-parallel group of `world_size` ranks. Object-safe.
pub trait Communicator: Send + Sync {
    /// This rank's index in the group, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Concatenation of every rank's `local` buffer, in rank order. All buffers must have the
    /// same length, otherwise every rank gets an error.
    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>>;

    /// Replaces `buf` by the elementwise sum over the ranks (the same bits on every rank). All
    /// buffers must have the same length, otherwise every rank gets an error.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;

    /// Returns once every rank has called `barrier`.
    fn barrier(&self) -> Result<()>;

    /// Marks the group failed, so that peers error out instead of waiting. Idempotent; the first
    /// reason is kept.
    fn abort(&self, reason: &str);

    /// Gathers an `f32` tensor from every rank into `[world_size, *shape]` on `local`'s device.
    /// The default implementation copies through the host.
    fn all_gather_tensor(&self, local: &Tensor) -> Result<Tensor> {
        let data = host_f32(local, "all_gather_tensor")?;
        let gathered = self.all_gather(&data)?;
        let mut dims = vec![self.world_size()];
        dims.extend_from_slice(local.dims());
        Tensor::from_vec(gathered, dims, local.device())
    }

    /// Sums an `f32` tensor over the ranks; the result has `local`'s shape and device. The default
    /// implementation copies through the host.
    fn all_reduce_sum_tensor(&self, local: &Tensor) -> Result<Tensor> {
        let mut data = host_f32(local, "all_reduce_sum_tensor")?;
        self.all_reduce_sum(&mut data)?;
        Tensor::from_vec(data, local.dims(), local.device())
    }
}

/// The collectives of [`Communicator`], as the transports name them in errors and checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Collective {
    AllGather,
    AllReduceSum,
    Barrier,
}

impl std::fmt::Display for Collective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Collective::AllGather => "all_gather",
            Collective::AllReduceSum => "all_reduce_sum",
            Collective::Barrier => "barrier",
        })
    }
}

/// Host copy of an `f32` tensor (any layout), the wire format of the collectives.
pub(crate) fn host_f32(t: &Tensor, name: &str) -> Result<Vec<f32>> {
    if t.dtype() != DType::F32 {
        return Err(GdpError::DType {
            name: name.to_string(),
            expected: "f32 (CP summaries cross the wire in f32)",
            got: t.dtype(),
        }
        .into());
    }
    t.flatten_all()?.to_vec1::<f32>()
}

/// The group of one rank (`cp_size = 1`): every collective is the identity.
#[derive(Debug, Default)]
pub struct SingleComm {
    failed: OnceLock<String>,
}

impl SingleComm {
    /// A fresh, healthy group of one.
    pub fn new() -> Self {
        Self::default()
    }

    fn check(&self) -> Result<()> {
        match self.failed.get() {
            Some(reason) => Err(GdpError::Comm(format!("group aborted: {reason}")).into()),
            None => Ok(()),
        }
    }
}

impl Communicator for SingleComm {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }

    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        self.check()?;
        Ok(local.to_vec())
    }

    fn all_reduce_sum(&self, _buf: &mut [f32]) -> Result<()> {
        self.check()
    }

    fn barrier(&self) -> Result<()> {
        self.check()
    }

    fn abort(&self, reason: &str) {
        let _ = self.failed.set(reason.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn single_comm_is_identity_until_aborted() {
        let c = SingleComm::new();
        assert_eq!((c.rank(), c.world_size()), (0, 1));
        assert_eq!(c.all_gather(&[1.0, 2.0]).unwrap(), [1.0, 2.0]);
        let mut buf = [3.0];
        c.all_reduce_sum(&mut buf).unwrap();
        assert_eq!(buf, [3.0]);
        c.barrier().unwrap();
        c.abort("stop");
        let e = c.barrier().unwrap_err().to_string();
        assert!(e.contains("communicator") && e.contains("stop"), "{e}");
    }

    #[test]
    fn tensor_collectives() {
        let res = run_ranks(3, DEFAULT_TIMEOUT, |comm| {
            let r = comm.rank() as f32;
            let t = Tensor::new(&[[r, 10.0 + r]], &Device::Cpu)?.t()?; // [2, 1], strided
            let g = comm.all_gather_tensor(&t)?;
            let s = comm.all_reduce_sum_tensor(&t)?;
            Ok((
                g.dims().to_vec(),
                g.flatten_all()?.to_vec1::<f32>()?,
                s.to_vec2::<f32>()?,
            ))
        })
        .unwrap();
        for (dims, g, s) in res {
            assert_eq!(dims, [3, 2, 1]);
            assert_eq!(g, [0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
            assert_eq!(s, [[3.0], [33.0]]);
        }
        let e = SingleComm::new()
            .all_gather_tensor(&Tensor::new(&[1u32], &Device::Cpu).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("f32"), "{e}");
    }
}
