//! NCCL transport (feature `nccl`): one process per GPU, collectives on the GPU, through
//! cudarc's NCCL bindings as re-exported by candle-core.
//!
//! Setup ([`NcclComm::from_dist_env`]): the launcher's environment gives rank, world size and GPU
//! ([`DistEnv`]); the [`Rendezvous`] broadcasts rank 0's NCCL unique id over TCP and stays open
//! as the health channel; every rank then creates its NCCL communicator in **non-blocking** mode
//! (`ncclCommInitRankConfig` with `blocking = 0`), so that no NCCL call can block the host
//! thread for good.
//!
//! Streams: a Candle CUDA device works on CUDA's *per-thread* default stream
//! (`CU_STREAM_PER_THREAD`), a handle that means a different stream in every thread. NCCL's
//! non-blocking mode enqueues from a background thread, where that handle would name another
//! stream, unordered with Candle's work. So the communicator runs NCCL on a stream of its own in
//! the device's context, made to wait (through an event) for the work the calling thread has
//! queued on Candle's stream, and the calling thread waits for the collective to complete before
//! it returns; the result is then visible to anything Candle queues afterwards.
//!
//! Every collective is enqueued, then polled to completion (an event query with short sleeps).
//! While it waits, a rank watches NCCL's asynchronous error state, the group's health channel
//! (an abort or the death of any rank) and its deadline; on any of them it calls
//! `ncclCommAbort`, tells the other ranks, and returns [`GdpError::Comm`] naming the rank, the
//! collective and the reason. After that the communicator is failed for good.
//!
//! Peer checks: NCCL cannot tell when ranks call different collectives or pass different
//! lengths (it hangs or reads out of bounds), so every collective is preceded by a fixed-size
//! all-gather of `[tag, number, kind, length]`, and a rank whose peers announce something else
//! fails the group, naming both sides. That costs one small collective per collective.
//!
//! The host slice methods ([`Communicator::all_gather`] ...) go through device scratch
//! buffers; the tensor methods keep CUDA tensors of the communicator's device on the device
//! (other tensors go through the host).
//!
//! This module holds [`NcclComm`], its setup and its [`Communicator`] methods; `setup` the calls
//! into NCCL that create, configure and abort the raw communicator; `collective` how one
//! collective runs (enqueued, polled, failed); `peers` the peer check before each collective.

mod collective;
mod peers;
mod setup;

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream};
use candle_core::cuda_backend::cudarc::nccl::{safe::Id, sys};
use candle_core::{CudaDevice, Device, Tensor};

use super::rendezvous::{DistEnv, Rendezvous, RendezvousAddr};
use super::{host_f32, Collective, Communicator, DEFAULT_TIMEOUT};
use crate::error::{GdpError, Result};
use setup::{abort_comm, init_comm, nccl_error_string};

/// Time spent in collectives, for benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CommStats {
    /// Collectives run (each all-gather, all-reduce, barrier).
    pub collectives: u64,
    /// Wall time from enqueueing to completion, summed (includes waiting for slower ranks).
    pub wait: Duration,
    /// Bytes this rank contributed.
    pub bytes: u64,
}

/// The raw NCCL communicator and the scratch buffers, behind [`NcclComm`]'s mutex.
struct Inner {
    /// Null once aborted.
    comm: sys::ncclComm_t,
    send: Option<CudaSlice<f32>>,
    recv: Option<CudaSlice<f32>>,
    /// NCCL calls issued so far, peer checks included (numbers them in messages).
    seq: u64,
    stats: CommStats,
}

// SAFETY: an NCCL communicator may be used from any thread, but not from two threads at once.
// `Inner` is only ever reached through `NcclComm::inner`'s `Mutex`, which serialises every NCCL
// call on it; the CUDA buffers belong to the communicator's device and are used on its stream.
unsafe impl Send for Inner {}

/// A context-parallel communicator over NCCL: one process per GPU. See the
/// module docs of `cp::comm::nccl`.
///
/// Thread safety: NCCL communicators are not thread-safe. `NcclComm` keeps the raw
/// communicator in a `Mutex`, so the handle can be shared (`Send + Sync`, e.g. in an
/// `Arc<dyn Communicator>`) and collectives from several threads are serialised; like every
/// communicator, all ranks must still issue the same collectives in the same order.
pub struct NcclComm {
    rank: usize,
    world_size: usize,
    device: CudaDevice,
    /// Candle's stream (the calling thread's per-thread default stream).
    stream: Arc<CudaStream>,
    /// NCCL's own stream (see the module docs).
    nccl_stream: Arc<CudaStream>,
    timeout: Duration,
    rendezvous: Rendezvous,
    inner: Mutex<Inner>,
}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device)
            .field("timeout", &self.timeout)
            .finish()
    }
}

fn comm_err(msg: String) -> candle_core::Error {
    GdpError::Comm(msg).into()
}

fn not_cuda(got: &str) -> candle_core::Error {
    GdpError::Unsupported(format!(
        "NcclComm needs a CUDA device (one GPU per process, e.g. cuda:LOCAL_RANK), got {got}"
    ))
    .into()
}

impl NcclComm {
    /// Rank, world size and rendezvous from the launcher's environment `env`
    /// (`DistEnv::from_vars(std::env::vars_os())` under `gdp launch` or torchrun), with
    /// `timeout` for the rendezvous, the NCCL setup and every collective ([`DEFAULT_TIMEOUT`]
    /// is the usual one). `device` should be `cuda:LOCAL_RANK` ([`NcclComm::local_device`]).
    pub fn from_dist_env(device: &Device, env: &DistEnv, timeout: Duration) -> Result<Self> {
        Self::new_with_timeout(device, env.rank, env.world_size, &env.master, timeout)
    }

    /// Opens `cuda:LOCAL_RANK` of `env`, this process's GPU under `gdp launch` (or torchrun).
    pub fn local_device(env: &DistEnv) -> Result<Device> {
        Device::new_cuda(env.local_rank).map_err(|e| {
            comm_err(format!(
                "rank {}: cannot open cuda:{} (LOCAL_RANK): {e}",
                env.rank, env.local_rank
            ))
        })
    }

    /// Rank `rank` of a `world_size`-process group meeting at `rendezvous` (rank 0 listens
    /// there), on `device`'s stream, with [`DEFAULT_TIMEOUT`].
    pub fn new(
        device: &Device,
        rank: usize,
        world_size: usize,
        rendezvous: &RendezvousAddr,
    ) -> Result<Self> {
        Self::new_with_timeout(device, rank, world_size, rendezvous, DEFAULT_TIMEOUT)
    }

    /// [`NcclComm::new`] with an explicit timeout.
    pub fn new_with_timeout(
        device: &Device,
        rank: usize,
        world_size: usize,
        rendezvous: &RendezvousAddr,
        timeout: Duration,
    ) -> Result<Self> {
        let cuda = match device {
            Device::Cuda(d) => d.clone(),
            Device::Cpu => return Err(not_cuda("cpu")),
            Device::Metal(_) => return Err(not_cuda("metal")),
        };
        let stream = cuda.cuda_stream();
        let nccl_stream = stream.context().new_stream().map_err(|e| {
            comm_err(format!(
                "rank {rank}: cannot create NCCL's CUDA stream: {e:?}"
            ))
        })?;
        let rdv = Rendezvous::establish(rank, world_size, rendezvous, timeout, || {
            let id = Id::new().map_err(|e| {
                comm_err(format!(
                    "rank 0: ncclGetUniqueId failed: {}",
                    nccl_error_string(e.0)
                ))
            })?;
            Ok(id.internal().iter().map(|&c| c as u8).collect())
        })?;
        let bytes: [std::ffi::c_char; 128] = rdv
            .blob()
            .iter()
            .map(|&b| b as std::ffi::c_char)
            .collect::<Vec<_>>()
            .try_into()
            .map_err(|_| {
                comm_err(format!(
                    "rank {rank}: the NCCL id from rank 0 has {} bytes, expected 128",
                    rdv.blob().len()
                ))
            })?;
        let id = Id::uninit(bytes);
        let comm = match init_comm(&nccl_stream, rank, world_size, id, timeout, &rdv) {
            Ok(c) => c,
            Err(reason) => {
                rdv.abort(&reason);
                let reason = match rdv.failure() {
                    Some(f) if !f.starts_with(&format!("rank {rank}: ")) => {
                        format!("group failed, {f}")
                    }
                    _ => reason,
                };
                return Err(comm_err(format!(
                    "rank {rank}: NCCL communicator setup: {reason}"
                )));
            }
        };
        Ok(Self {
            rank,
            world_size,
            device: cuda,
            stream,
            nccl_stream,
            timeout,
            rendezvous: rdv,
            inner: Mutex::new(Inner {
                comm,
                send: None,
                recv: None,
                seq: 0,
                stats: CommStats::default(),
            }),
        })
    }

    /// The timeout of every collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The communicator's device, as a Candle [`Device`].
    pub fn device(&self) -> Device {
        Device::Cuda(self.device.clone())
    }

    /// Time spent in collectives so far.
    pub fn stats(&self) -> CommStats {
        self.lock().stats
    }

    /// Resets [`NcclComm::stats`].
    pub fn reset_stats(&self) {
        self.lock().stats = CommStats::default();
    }

    /// The group's first failure (`"rank R: reason"`), if any rank failed.
    pub fn failure(&self) -> Option<String> {
        self.rendezvous.failure()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        self.host_collective(Collective::AllGather, local)
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let sum = self.host_collective(Collective::AllReduceSum, buf)?;
        buf.copy_from_slice(&sum);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.host_collective(Collective::Barrier, &[0.0])
            .map(|_| ())
    }

    fn abort(&self, reason: &str) {
        self.rendezvous.abort(&format!("aborted: {reason}"));
        // A collective in flight holds the lock; it sees the failure and aborts NCCL itself.
        if let Ok(mut inner) = self.inner.try_lock() {
            abort_comm(&mut inner);
        }
    }

    fn all_gather_tensor(&self, local: &Tensor) -> Result<Tensor> {
        if let Some(t) = self.device_collective(Collective::AllGather, local)? {
            return Ok(t);
        }
        let data = host_f32(local, "all_gather_tensor")?;
        let gathered = self.all_gather(&data)?;
        let mut dims = vec![self.world_size];
        dims.extend_from_slice(local.dims());
        Tensor::from_vec(gathered, dims, local.device())
    }

    fn all_reduce_sum_tensor(&self, local: &Tensor) -> Result<Tensor> {
        if let Some(t) = self.device_collective(Collective::AllReduceSum, local)? {
            return Ok(t);
        }
        let mut data = host_f32(local, "all_reduce_sum_tensor")?;
        self.all_reduce_sum(&mut data)?;
        Tensor::from_vec(data, local.dims(), local.device())
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Every collective has completed (or failed and aborted) before it returned, so nothing
        // is in flight: abort frees the communicator without the collective handshake of
        // ncclCommFinalize/Destroy, which would hang if a peer is gone. The rendezvous then says
        // goodbye to the peers.
        let failed = self.rendezvous.is_failed();
        let inner = self.inner.get_mut().unwrap_or_else(|p| p.into_inner());
        if !failed && !inner.comm.is_null() {
            let _ = self.device.synchronize();
        }
        abort_comm(inner);
    }
}
