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

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchArgs};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDevice, DeviceId, WrapErr};
use candle_core::Result;
use std::collections::HashMap;
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
    /// Argument builder of one launch on the device's stream.
    pub fn builder(&self) -> LaunchArgs<'_> {
        self.stream.launch_builder(&self.func)
    }

    /// Argument builder of one launch on `stream`, a stream of the device's context (see
    /// `side::SideStream`).
    pub fn builder_on<'a>(&'a self, stream: &'a Arc<CudaStream>) -> LaunchArgs<'a> {
        stream.launch_builder(&self.func)
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
