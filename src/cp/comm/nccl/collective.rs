//! How one collective runs on the NCCL communicator: enqueued on NCCL's stream after Candle's
//! work, polled to completion while watching NCCL, the health channel and the deadline, and
//! failed for the whole group on any of them; the host and device collectives built on it.

use std::time::{Duration, Instant};

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle_core::cuda_backend::cudarc::nccl::sys;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Storage, Tensor};

use super::setup::{abort_comm, describe, Backoff};
use super::{comm_err, Inner, NcclComm};
use crate::cp::comm::Collective;
use crate::error::{GdpError, Result};

impl NcclComm {
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
    pub(super) fn fail(&self, inner: &mut Inner, what: &str, reason: &str) -> candle_core::Error {
        self.rendezvous.abort(&format!("{what}: {reason}"));
        abort_comm(inner);
        self.failed_err(what)
    }

    /// Enqueues one collective with `enqueue(comm, stream)` and waits for it; see the
    /// module docs of `cp::comm::nccl`.
    pub(super) fn run(
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

    /// Counts one collective of `n` floats from this rank that took `waited` (its peer check
    /// included).
    fn count(inner: &mut Inner, n: usize, waited: Duration) {
        inner.stats.collectives += 1;
        inner.stats.wait += waited;
        inner.stats.bytes += 4 * n as u64;
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

    /// `local` through the scratch buffers, one `op` without a peer check: `out_len` floats
    /// back, and the time the collective took.
    pub(super) fn transfer(
        &self,
        inner: &mut Inner,
        op: Collective,
        local: &[f32],
        out_len: usize,
    ) -> Result<(Vec<f32>, Duration)> {
        let n = local.len();
        self.scratch(inner, n, out_len)?;
        let mut send = inner.send.take().expect("scratch");
        let mut recv = inner.recv.take().expect("scratch");
        let res = (|| -> Result<(Vec<f32>, Duration)> {
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
            let waited = {
                let stream = &self.nccl_stream;
                let (src, _s) = send.device_ptr(stream);
                let (dst, _d) = recv.device_ptr_mut(stream);
                self.run(inner, op, |comm, st| unsafe {
                    enqueue(op, src, dst, n, comm, st)
                })?
            };
            if out_len == 0 {
                return Ok((vec![], waited));
            }
            let out = self
                .stream
                .clone_dtoh(&recv.slice(0..out_len))
                .map_err(|e| {
                    comm_err(format!("rank {}: {op}: copy to the host: {e:?}", self.rank))
                })?;
            Ok((out, waited))
        })();
        inner.send = Some(send);
        inner.recv = Some(recv);
        res
    }

    /// A host collective through the scratch buffers: `local` in, `world · len` (gather) or
    /// `len` (reduce) floats out.
    pub(super) fn host_collective(&self, op: Collective, local: &[f32]) -> Result<Vec<f32>> {
        let n = local.len();
        let out_len = match op {
            Collective::AllGather => n * self.world_size,
            _ => n,
        };
        let mut inner = self.lock();
        let checked = self.check_peers(&mut inner, op, n)?;
        let (out, waited) = self.transfer(&mut inner, op, local, out_len)?;
        Self::count(&mut inner, n, checked + waited);
        Ok(out)
    }

    /// A tensor collective on the device, for contiguous-able f32 tensors on this
    /// communicator's device; `None` when the tensor lives elsewhere.
    pub(super) fn device_collective(
        &self,
        op: Collective,
        local: &Tensor,
    ) -> Result<Option<Tensor>> {
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
            let checked = self.check_peers(&mut inner, op, n)?;
            let stream = &self.nccl_stream;
            let (sp, _s) = src.device_ptr(stream);
            let (dp, _d) = out.device_ptr_mut(stream);
            let waited = self.run(&mut inner, op, |comm, st| unsafe {
                enqueue(op, sp, dp, n, comm, st)
            })?;
            Self::count(&mut inner, n, checked + waited);
        }
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(out, self.device.clone()));
        let t = Tensor::from_storage(storage, out_len, BackpropOp::none(), false);
        Ok(Some(t.reshape(dims)?))
    }
}

/// Enqueues `op` on raw device pointers (`n` floats in; `world · n` out for a gather).
///
/// # Safety
/// `src` and `dst` must be device buffers of the communicator's device large enough for `op`.
pub(super) unsafe fn enqueue(
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
