//! NCCL's setup and teardown below [`NcclComm`](super::NcclComm): error strings, the library
//! version, the non-blocking config, creating the raw communicator (polled to completion) and
//! aborting it, and the backoff of every poll.

use std::ffi::CStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::cuda_backend::cudarc::nccl::{safe::Id, sys};

use super::Inner;
use crate::cp::comm::Rendezvous;

pub(super) fn nccl_error_string(r: sys::ncclResult_t) -> String {
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

pub(super) fn describe(r: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
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
pub(super) struct Backoff(pub(super) u32);

impl Backoff {
    pub(super) fn wait(&mut self) {
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

/// Creates the non-blocking communicator and waits for its setup; the error is the reason.
pub(super) fn init_comm(
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
pub(super) fn abort_comm(inner: &mut Inner) {
    if !inner.comm.is_null() {
        // SAFETY: a live communicator, never used again (nulled below).
        unsafe { sys::ncclCommAbort(inner.comm) };
        inner.comm = std::ptr::null_mut();
    }
}
