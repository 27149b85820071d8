//! A second stream beside a Candle device's stream, for kernels that run at the same time as
//! the device stream's: the backward's forward rerun beside its state-gradient scan, and the
//! forward's scan beside its WY kernel (`pipeline.rs`).
//!
//! The stream is created through the driver and wrapped as borrowed, so cudarc's context does
//! not switch to its multi-stream mode (which would make every later launch of every Candle op
//! on the device record events for its buffers). Ordering is explicit: the side stream starts
//! after the work queued so far on the device's stream ([`SideStream::fork`]), and the device's
//! stream waits for all of it before the side stream goes ([`SideStream::join`], also on drop,
//! so that no buffer is freed on the device's stream while a side kernel may still use it).
//! The buffers of the kernels launched on the side stream ([`SideStream::on`]) stay borrowed
//! until it is joined or dropped: its lifetime parameter `'b` is the region of those borrows,
//! so a buffer that a side kernel may still use cannot be dropped (freed on the device's
//! stream) before the join.
//! With [`KernelConfig::side_streams`](crate::op::KernelConfig::side_streams) off, the side work
//! goes on the device's stream instead (same results, one kernel at a time: for measurements and
//! debugging).

use super::module::On;
use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaEvent, CudaStream};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::Result;
use std::marker::PhantomData;
use std::sync::Arc;

/// A non-blocking stream of the device's context, joined back into the device's stream when
/// it goes; the buffers of its kernels stay borrowed for `'b` (invariant) until then.
pub(super) struct SideStream<'b> {
    main: Arc<CudaStream>,
    side: Arc<CudaStream>,
    /// The driver's stream behind `side`; `None` when `side` is the device's stream.
    raw: Option<sys::CUstream>,
    joined: bool,
    buffers: PhantomData<fn(&'b ()) -> &'b ()>,
}

impl<'b> SideStream<'b> {
    /// A new stream that starts after the work queued so far on `dev`'s stream; the device's
    /// stream itself where `separate` is false.
    pub fn fork(dev: &CudaDevice, separate: bool) -> Result<Self> {
        Self::fork_with(dev, separate, false)
    }

    /// [`SideStream::fork`] with the context's greatest stream priority: where both streams
    /// have blocks waiting for multiprocessors, the side stream's go first.
    pub fn fork_urgent(dev: &CudaDevice, separate: bool) -> Result<Self> {
        Self::fork_with(dev, separate, true)
    }

    fn fork_with(dev: &CudaDevice, separate: bool, urgent: bool) -> Result<Self> {
        let main = dev.cuda_stream();
        if !separate {
            return Ok(Self {
                side: main.clone(),
                main,
                raw: None,
                joined: false,
                buffers: PhantomData,
            });
        }
        let ctx = main.context().clone();
        ctx.bind_to_thread().w()?;
        let kind = result::stream::StreamKind::NonBlocking;
        let raw = if urgent {
            let (_least, greatest) = result::stream::get_priority_range().w()?;
            result::stream::create_with_priority(kind, greatest).w()?
        } else {
            result::stream::create(kind).w()?
        };
        // SAFETY: `raw` is a stream of this context, created above; it lives until `Drop`
        // destroys it, after every wrapper clone below is gone (they stay inside `self`).
        let side = unsafe { ctx.wrap_borrowed_stream(raw) };
        let this = Self {
            main,
            side,
            raw: Some(raw),
            joined: false,
            buffers: PhantomData,
        };
        this.side.join(&this.main).w()?;
        Ok(this)
    }

    /// The side stream, to launch on ([`super::module::GdpFunc::args_on`]): the launch's
    /// buffers stay borrowed for `'b`.
    pub fn on(&self) -> On<'_, 'b> {
        On::side(&self.side)
    }

    /// Records an event on the side stream, after the work queued on it so far.
    pub fn record_event(&self) -> Result<CudaEvent> {
        self.side.record_event(None).w()
    }

    /// Makes the device's stream wait for everything queued on the side stream.
    pub fn join(mut self) -> Result<()> {
        self.main.join(&self.side).w()?;
        self.joined = true;
        Ok(())
    }
}

impl Drop for SideStream<'_> {
    fn drop(&mut self) {
        let Some(raw) = self.raw else {
            return;
        };
        if !self.joined {
            // An error path: order the device's stream after the side stream all the same (or
            // wait for it), so that buffers freed on the device's stream are no longer read.
            if self.main.join(&self.side).is_err() {
                let _ = self.side.synchronize();
            }
        }
        // SAFETY: the stream was created by `fork` and is destroyed once; work still queued on
        // it completes first (cuStreamDestroy returns at once and releases it afterwards).
        let _ = unsafe { result::stream::destroy(raw) };
    }
}
