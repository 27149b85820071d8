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

use std::ffi::CStr;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::cudarc::nccl::{safe::Id, sys};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};

use super::rendezvous::{DistEnv, Rendezvous, RendezvousAddr};
use super::{host_f32, Collective, Communicator, DEFAULT_TIMEOUT};
use crate::error::{GdpError, Result};

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
    /// The peer check's buffers: this rank's header and every rank's.
    header_send: Option<CudaSlice<f32>>,
    header_recv: Option<CudaSlice<f32>>,
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

fn nccl_error_string(r: sys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static C string for any value.
    let p = unsafe { sys::ncclGetErrorString(r) };
    if p.is_null() {
        return format!("{r:?}");
    }
    // SAFETY: non-null, NUL-terminated, static.
    let s = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
    format!("{s} ({r:?})")
}

fn nccl_last_error(comm: sys::ncclComm_t) -> String {
    // SAFETY: ncclGetLastError accepts any communicator handle (or null) and returns a C string.
    let p = unsafe { sys::ncclGetLastError(comm) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null, NUL-terminated.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn describe(r: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
    let last = nccl_last_error(comm);
    if last.is_empty() {
        nccl_error_string(r)
    } else {
        format!("{}: {last}", nccl_error_string(r))
    }
}

/// `NCCL_VERSION(major, minor, patch)` of nccl.h.
fn nccl_version(major: i32, minor: i32, patch: i32) -> i32 {
    if major <= 2 && minor <= 8 {
        major * 1000 + minor * 100 + patch
    } else {
        major * 10000 + minor * 100 + patch
    }
}

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`. The struct is the NCCL 2.30 layout of the
/// bindings; `version` claims the older of 2.30 and the loaded library, whose own layout is a
/// prefix of it (NCCL only appends fields, and reads `min(size, its own size)` bytes).
fn nonblocking_config() -> sys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    let mut loaded = 0;
    // SAFETY: writes one int.
    let _ = unsafe { sys::ncclGetVersion(&mut loaded) };
    let bindings = nccl_version(2, 30, 0);
    let version = if loaded > 0 {
        loaded.min(bindings)
    } else {
        bindings
    };
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: version as u32,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// Short sleeps that grow: the first polls spin, later ones sleep up to 1 ms.
struct Backoff(u32);

impl Backoff {
    fn wait(&mut self) {
        self.0 += 1;
        if self.0 < 64 {
            std::hint::spin_loop();
            std::thread::yield_now();
        } else {
            let us = (self.0 - 63).min(1000) as u64;
            std::thread::sleep(Duration::from_micros(us.max(20)));
        }
    }
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
                header_send: None,
                header_recv: None,
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

    /// The error of a failed group, from this rank's point of view.
    fn failed_err(&self, what: &str) -> candle_core::Error {
        let f = self.rendezvous.failure().unwrap_or_default();
        let mine = format!("rank {}: ", self.rank);
        match f.strip_prefix(&mine) {
            Some(reason) => comm_err(format!("{mine}{what}: {reason}")),
            None => comm_err(format!("{mine}{what}: group failed, {f}")),
        }
    }

    /// Aborts the NCCL communicator (once) and records and relays `reason`.
    fn fail(&self, inner: &mut Inner, what: &str, reason: &str) -> candle_core::Error {
        self.rendezvous.abort(&format!("{what}: {reason}"));
        abort_comm(inner);
        self.failed_err(what)
    }

    /// Enqueues one collective with `enqueue(comm, stream)` and waits for it; see the
    /// module docs of `cp::comm::nccl`.
    fn run(
        &self,
        inner: &mut Inner,
        op: Collective,
        issue: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
    ) -> Result<Duration> {
        inner.seq += 1;
        let what = format!("{op} #{}", inner.seq);
        if self.rendezvous.is_failed() || inner.comm.is_null() {
            abort_comm(inner);
            return Err(self.failed_err(&what));
        }
        let ctx = self.stream.context();
        ctx.bind_to_thread()
            .map_err(|e| self.fail(inner, &what, &format!("binding the CUDA context: {e:?}")))?;
        let t0 = Instant::now();
        let deadline = t0 + self.timeout;
        // NCCL's stream starts after everything this thread queued on Candle's stream.
        self.stream
            .record_event(None)
            .and_then(|ev| self.nccl_stream.wait(&ev))
            .map_err(|e| self.fail(inner, &what, &format!("ordering the streams: {e:?}")))?;
        let r = issue(
            inner.comm,
            self.nccl_stream.cu_stream() as sys::cudaStream_t,
        );
        if !matches!(
            r,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        ) {
            let reason = format!("NCCL error: {}", describe(r, inner.comm));
            return Err(self.fail(inner, &what, &reason));
        }
        let mut event = None;
        let mut backoff = Backoff(0);
        loop {
            if self.rendezvous.is_failed() {
                abort_comm(inner);
                return Err(self.failed_err(&what));
            }
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator (checked non-null above; only `fail` nulls it).
            let q = unsafe { sys::ncclCommGetAsyncError(inner.comm, &mut state) };
            if q != sys::ncclResult_t::ncclSuccess {
                state = q;
            }
            match state {
                sys::ncclResult_t::ncclSuccess => {}
                sys::ncclResult_t::ncclInProgress => {}
                err => {
                    let reason = format!("NCCL error: {}", describe(err, inner.comm));
                    return Err(self.fail(inner, &what, &reason));
                }
            }
            // Only once NCCL has finished enqueueing may other work go on its stream.
            if state == sys::ncclResult_t::ncclSuccess && event.is_none() {
                event = Some(self.nccl_stream.record_event(None).map_err(|e| {
                    self.fail(inner, &what, &format!("recording a CUDA event: {e:?}"))
                })?);
            }
            if let Some(ev) = &event {
                match ev.try_is_complete() {
                    Ok(true) => break,
                    Ok(false) => {}
                    Err(e) => {
                        let reason = format!("CUDA error while waiting: {e:?}");
                        return Err(self.fail(inner, &what, &reason));
                    }
                }
            }
            if Instant::now() >= deadline {
                let reason = format!(
                    "timed out after {:?} waiting for the other ranks of {} (a rank is slow, \
                     hung, or issued a different collective)",
                    self.timeout, self.world_size
                );
                return Err(self.fail(inner, &what, &reason));
            }
            backoff.wait();
        }
        Ok(t0.elapsed())
    }

    /// Runs `op` (of `n` floats from this rank) after [`Self::check_peers`], and counts it.
    fn checked_run(
        &self,
        inner: &mut Inner,
        op: Collective,
        n: usize,
        issue: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
    ) -> Result<()> {
        let checked = self.check_peers(inner, op, n)?;
        let waited = self.run(inner, op, issue)?;
        inner.stats.collectives += 1;
        inner.stats.wait += checked + waited;
        inner.stats.bytes += 4 * n as u64;
        Ok(())
    }

    /// Before each collective every rank all-gathers `[tag, number, kind, length]`; a rank that
    /// is about to run another collective, or the same one on a different number of values,
    /// fails the group here instead of handing NCCL buffers of different sizes (which it cannot
    /// detect). Returns the time spent.
    fn check_peers(&self, inner: &mut Inner, op: Collective, n: usize) -> Result<Duration> {
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

    /// Scratch buffers of at least `send` and `recv` floats.
    fn scratch(&self, inner: &mut Inner, send: usize, recv: usize) -> Result<()> {
        if inner.send.as_ref().is_none_or(|b| b.len() < send) {
            inner.send = Some(self.device.alloc_zeros::<f32>(send.max(1))?);
        }
        if inner.recv.as_ref().is_none_or(|b| b.len() < recv) {
            inner.recv = Some(self.device.alloc_zeros::<f32>(recv.max(1))?);
        }
        Ok(())
    }

    /// A host collective through the scratch buffers: `local` in, `world · len` (gather) or
    /// `len` (reduce) floats out.
    fn host_collective(&self, op: Collective, local: &[f32]) -> Result<Vec<f32>> {
        let n = local.len();
        let out_len = match op {
            Collective::AllGather => n * self.world_size,
            _ => n,
        };
        let mut inner = self.lock();
        self.scratch(&mut inner, n, out_len)?;
        let inner = &mut *inner;
        let mut send = inner.send.take().expect("scratch");
        let mut recv = inner.recv.take().expect("scratch");
        let res = (|| -> Result<Vec<f32>> {
            if n > 0 {
                self.stream
                    .memcpy_htod(local, &mut send.slice_mut(0..n))
                    .map_err(|e| {
                        comm_err(format!(
                            "rank {}: {op}: copy to the device: {e:?}",
                            self.rank
                        ))
                    })?;
            }
            {
                let stream = &self.nccl_stream;
                let (src, _s) = send.device_ptr(stream);
                let (dst, _d) = recv.device_ptr_mut(stream);
                self.checked_run(inner, op, n, |comm, st| unsafe {
                    enqueue(op, src, dst, n, comm, st)
                })?;
            }
            if out_len == 0 {
                return Ok(vec![]);
            }
            self.stream
                .clone_dtoh(&recv.slice(0..out_len))
                .map_err(|e| comm_err(format!("rank {}: {op}: copy to the host: {e:?}", self.rank)))
        })();
        inner.send = Some(send);
        inner.recv = Some(recv);
        res
    }

    /// A tensor collective on the device, for contiguous-able f32 tensors on this
    /// communicator's device; `None` when the tensor lives elsewhere.
    fn device_collective(&self, op: Collective, local: &Tensor) -> Result<Option<Tensor>> {
        match local.device() {
            Device::Cuda(d) if d.same_device(&self.device) => {}
            _ => return Ok(None),
        }
        if local.dtype() != DType::F32 {
            return Err(GdpError::DType {
                name: format!("{op}_tensor"),
                expected: "f32 (CP summaries cross the wire in f32)",
                got: local.dtype(),
            }
            .into());
        }
        let local = local.contiguous()?;
        let n = local.elem_count();
        let mut dims = local.dims().to_vec();
        if let Collective::AllGather = op {
            dims.insert(0, self.world_size);
        }
        if n == 0 {
            // Nothing to move, but the peers must agree that there is nothing.
            self.check_peers(&mut self.lock(), op, 0)?;
            return Ok(Some(Tensor::zeros(dims, DType::F32, local.device())?));
        }
        let out_len = n * if let Collective::AllGather = op {
            self.world_size
        } else {
            1
        };
        let mut out = self.device.alloc_zeros::<f32>(out_len)?;
        {
            let (storage, layout) = local.storage_and_layout();
            let Storage::Cuda(cs) = &*storage else {
                return Ok(None);
            };
            let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
                comm_err(format!("rank {}: {op}: non-contiguous tensor", self.rank))
            })?;
            let src = cs.as_cuda_slice::<f32>()?.slice(start..end);
            let mut inner = self.lock();
            let stream = &self.nccl_stream;
            let (sp, _s) = src.device_ptr(stream);
            let (dp, _d) = out.device_ptr_mut(stream);
            self.checked_run(&mut inner, op, n, |comm, st| unsafe {
                enqueue(op, sp, dp, n, comm, st)
            })?;
        }
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(out, self.device.clone()));
        let t = Tensor::from_storage(storage, out_len, BackpropOp::none(), false);
        Ok(Some(t.reshape(dims)?))
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

/// Enqueues `op` on raw device pointers (`n` floats in; `world · n` out for a gather).
///
/// # Safety
/// `src` and `dst` must be device buffers of the communicator's device large enough for `op`.
unsafe fn enqueue(
    op: Collective,
    src: u64,
    dst: u64,
    n: usize,
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
) -> sys::ncclResult_t {
    let f32t = sys::ncclDataType_t::ncclFloat32;
    match op {
        Collective::AllGather => sys::ncclAllGather(src as _, dst as _, n, f32t, comm, stream),
        Collective::AllReduceSum | Collective::Barrier => sys::ncclAllReduce(
            src as _,
            dst as _,
            n,
            f32t,
            sys::ncclRedOp_t::ncclSum,
            comm,
            stream,
        ),
    }
}

/// Creates the non-blocking communicator and waits for its setup; the error is the reason.
fn init_comm(
    stream: &Arc<CudaStream>,
    rank: usize,
    world_size: usize,
    id: Id,
    timeout: Duration,
    rdv: &Rendezvous,
) -> std::result::Result<sys::ncclComm_t, String> {
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| format!("binding the CUDA context: {e:?}"))?;
    let deadline = Instant::now() + timeout;
    let mut config = nonblocking_config();
    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
    let id = sys::ncclUniqueId {
        internal: *id.internal(),
    };
    // SAFETY: valid out-pointer and config; the id came from ncclGetUniqueId on rank 0.
    let r = unsafe {
        sys::ncclCommInitRankConfig(&mut comm, world_size as i32, id, rank as i32, &mut config)
    };
    let give_up = |comm: sys::ncclComm_t, reason: String| {
        if !comm.is_null() {
            // SAFETY: the communicator is not used afterwards.
            unsafe { sys::ncclCommAbort(comm) };
        }
        Err(reason)
    };
    if !matches!(
        r,
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
    ) {
        return give_up(
            comm,
            format!("ncclCommInitRankConfig: {}", describe(r, comm)),
        );
    }
    let mut backoff = Backoff(0);
    loop {
        let mut state = sys::ncclResult_t::ncclInProgress;
        if !comm.is_null() {
            // SAFETY: a communicator under construction may be polled.
            let q = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
            if q != sys::ncclResult_t::ncclSuccess {
                state = q;
            }
        }
        match state {
            sys::ncclResult_t::ncclSuccess => return Ok(comm),
            sys::ncclResult_t::ncclInProgress => {}
            err => return give_up(comm, format!("NCCL error: {}", describe(err, comm))),
        }
        if let Some(f) = rdv.failure() {
            return give_up(comm, format!("group failed, {f}"));
        }
        if Instant::now() >= deadline {
            return give_up(
                comm,
                format!("timed out after {timeout:?} waiting for the other {world_size} ranks"),
            );
        }
        backoff.wait();
    }
}

/// `ncclCommAbort` once; later calls are no-ops.
fn abort_comm(inner: &mut Inner) {
    if !inner.comm.is_null() {
        // SAFETY: a live communicator, never used again (nulled below).
        unsafe { sys::ncclCommAbort(inner.comm) };
        inner.comm = std::ptr::null_mut();
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
