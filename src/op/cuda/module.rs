//! Loading the kernels: the fat binary of `cuda/gdp.cu`, loaded once per Candle device.
//!
//! `build.rs` compiles the kernels ahead of time into `$OUT_DIR/gdp.fatbin`: machine code for
//! sm_80, sm_89 and sm_90 plus compute_90 PTX by default, or the architectures that
//! `GDP_CUDA_COMPUTE_CAP` / `CUDA_COMPUTE_CAP` name (the PTX is that of the highest; the rules
//! are in `build.rs`). The driver runs the machine code of the GPU's architecture (sm_80 code
//! also runs on sm_86/sm_87) and JIT-compiles the PTX only on a GPU that has none, such as a
//! newer architecture.
//!
//! Candle's `get_or_load_custom_func` takes PTX text, which the driver JIT-compiles when a
//! process first loads it (ptxas needs about 50 s per architecture for these kernels on a 2-core
//! machine; the driver's JIT cache helps only where it persists), so the fat binary is loaded
//! through cudarc (`Ptx::from_binary`) instead.

use crate::op::kernel_params::KernelArgs;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig,
    SyncOnDrop,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDevice, DeviceId, WrapErr};
use candle_core::Result;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, OnceLock};

/// Fat binary of `cuda/gdp.cu` (`nvcc --fatbin`, see `build.rs`).
const GDP_FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/gdp.fatbin"));

/// What [`GDP_FATBIN`] holds, such as `sm_80 sm_89 sm_90 + compute_90 PTX` (set by `build.rs`).
const GDP_FATBIN_ARCHS: &str = env!("GDP_CUDA_ARCHS");

/// A kernel of the module and the device's stream it launches on.
pub(super) struct GdpFunc {
    func: CudaFunction,
    stream: Arc<CudaStream>,
}

impl GdpFunc {
    /// The arguments of one launch on the device's stream. Buffers are freed on that stream
    /// (Candle's allocations are stream-ordered), so a freed buffer is not reused before the
    /// kernel is done with it: they stay borrowed only until the launch is queued.
    pub fn args<'s, 'b: 's>(&'s self) -> Launch<'s, 'b> {
        Launch::new(self, &self.stream)
    }

    /// The arguments of one launch `on` a stream ([`On`]): on a side stream
    /// ([`super::side::SideStream::on`]) its buffers stay borrowed for `'b`, until that stream
    /// is joined into the device's.
    pub fn args_on<'s, 'b: 's>(&'s self, on: On<'s, 'b>) -> Launch<'s, 'b> {
        Launch::new(self, on.stream)
    }
}

/// A stream to launch on and the region `'b` for which the buffers of the kernels launched on
/// it stay borrowed: on a [`super::side::SideStream`], its life (invariant, so that a launch
/// cannot borrow its buffers for less); on the device's stream, any.
#[derive(Clone, Copy)]
pub(super) struct On<'s, 'b> {
    stream: &'s Arc<CudaStream>,
    buffers: PhantomData<fn(&'b ()) -> &'b ()>,
}

impl<'s, 'b> On<'s, 'b> {
    /// The device's own stream (`dev.cuda_stream()`), which buffers are freed on: there a
    /// launch needs its buffers only until it is queued, whatever `'b`.
    pub fn device(stream: &'s Arc<CudaStream>) -> Self {
        Self::side(stream)
    }

    /// For [`super::side::SideStream::on`]: its stream, whose launches borrow their buffers
    /// until the side stream is joined (`'b`).
    pub(super) fn side(stream: &'s Arc<CudaStream>) -> Self {
        Self {
            stream,
            buffers: PhantomData,
        }
    }
}

/// One launch of a kernel: the device addresses that go into its parameter struct
/// (`cuda/params.cuh`), each taken from a buffer borrowed for `'b` (on the device's stream, until
/// the launch is queued; on a side stream, until it is joined: [`On`]), with cudarc's
/// stream-ordering guard (the stream waits for the buffer's earlier writes, and the launch is
/// recorded as a read or a write of it), as cudarc's own argument builder does.
pub(super) struct Launch<'s, 'b> {
    func: &'s GdpFunc,
    stream: &'s Arc<CudaStream>,
    guards: Vec<SyncOnDrop<'s>>,
    buffers: PhantomData<fn(&'b ()) -> &'b ()>,
}

impl<'s, 'b: 's> Launch<'s, 'b> {
    fn new(func: &'s GdpFunc, stream: &'s Arc<CudaStream>) -> Self {
        Self {
            func,
            stream,
            guards: Vec::new(),
            buffers: PhantomData,
        }
    }

    /// The address of a buffer the kernel reads.
    pub fn read<T, S: DevicePtr<T>>(&mut self, s: &'b S) -> u64 {
        let (ptr, guard) = s.device_ptr(self.stream);
        self.guards.push(guard);
        ptr
    }

    /// The address of element `at` of a buffer the kernel reads (an error past its end).
    pub fn read_at<T>(&mut self, s: &'b CudaSlice<T>, at: usize) -> Result<u64> {
        if at > s.len() {
            candle_core::bail!("gdp cuda: element {at} of a {}-element buffer", s.len());
        }
        Ok(self.read(s) + (at * std::mem::size_of::<T>()) as u64)
    }

    /// The address of a buffer the kernel writes.
    pub fn write<T, S: DevicePtrMut<T>>(&mut self, s: &'b mut S) -> u64 {
        let (ptr, guard) = s.device_ptr_mut(self.stream);
        self.guards.push(guard);
        ptr
    }

    /// The address of an optional buffer the kernel reads, 0 (null) for none.
    pub fn read_opt<T, S: DevicePtr<T>>(&mut self, s: Option<&'b S>) -> u64 {
        s.map_or(0, |s| self.read(s))
    }

    /// The address of a buffer outside cudarc's event tracking, which the kernel reads or
    /// writes while a kernel on the other stream uses it too. cudarc's tracking is active where
    /// the context has several streams (context parallelism's ranks' devices) and keeps one
    /// pair of events per buffer: the WY factors and counters are written by the WY kernel
    /// while a scan beside it reads them on another stream (`pipeline.rs`), and the
    /// state-gradient scan writes dS and dDelta while the gradient kernel reads them, which
    /// those events would serialise. Every use of these buffers is ordered by the streams it is
    /// queued on instead (one stream, or the fork and join of `side.rs`) and by the kernels'
    /// readiness counters; the buffer stays borrowed (shared, as kernels on both streams use
    /// it) for `'b`, like the others.
    pub fn untracked<T>(&mut self, s: &'b CudaSlice<T>) -> u64 {
        // The guard records a read on the device's stream at once, after the work queued there
        // so far: it orders nothing that the streams do not order already.
        let (ptr, _record_now) = s.device_ptr(&self.func.stream);
        ptr
    }

    /// [`Launch::untracked`] for an optional buffer, 0 (null) for none.
    pub fn untracked_opt<T>(&mut self, s: Option<&'b CudaSlice<T>>) -> u64 {
        s.map_or(0, |s| self.untracked(s))
    }

    /// Queues the kernel with `params` (pushed field by field, in the kernel's parameter
    /// order), then records the launch on every buffer's guard.
    ///
    /// # Safety
    /// `params` must be the kernel's parameter list (`cuda/params.cuh`), every address in it
    /// taken from this `Launch` (or null where the kernel allows it) and large enough for what
    /// the kernel reads and writes at `cfg`'s grid.
    pub unsafe fn launch(self, cfg: LaunchConfig, params: &impl KernelArgs) -> Result<()> {
        let mut args = self.stream.launch_builder(&self.func.func);
        params.push(&mut args);
        // SAFETY: the caller's contract.
        unsafe { args.launch(cfg) }.w()?;
        drop(self.guards);
        Ok(())
    }
}

impl std::ops::Deref for GdpFunc {
    type Target = CudaFunction;

    fn deref(&self) -> &CudaFunction {
        &self.func
    }
}

/// The module of every Candle device that has used it.
fn modules() -> &'static Mutex<HashMap<DeviceId, Arc<CudaModule>>> {
    static MODULES: OnceLock<Mutex<HashMap<DeviceId, Arc<CudaModule>>>> = OnceLock::new();
    MODULES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Kernel `name` of `cuda/gdp.cu` on `dev` (the module is loaded on first use).
pub(super) fn load_kernel(dev: &CudaDevice, name: &str) -> Result<GdpFunc> {
    let stream = dev.cuda_stream();
    let module = {
        let mut map = modules()
            .lock()
            .map_err(|_| candle_core::Error::Msg("gdp cuda: module cache poisoned".into()))?;
        match map.get(&dev.id()) {
            Some(m) => m.clone(),
            None => {
                let m = stream
                    .context()
                    .load_module(Ptx::from_binary(GDP_FATBIN.to_vec()))
                    .w()
                    .map_err(|e| {
                        e.context(format!(
                            "gdp cuda: cannot load the kernels, built for {GDP_FATBIN_ARCHS} \
                             (to add this GPU's architecture, see GDP_CUDA_COMPUTE_CAP in build.rs)"
                        ))
                    })?;
                map.insert(dev.id(), m.clone());
                m
            }
        }
    };
    let func = module.load_function(name).w()?;
    Ok(GdpFunc { func, stream })
}
