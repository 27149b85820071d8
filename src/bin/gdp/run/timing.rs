//! How `--repeat` times a call: the median of host-clock runs, or the mean of CUDA event
//! pairs (`--timing events`).

use super::args::TimingArg;
use crate::error::CliError;
use candle_core::Device;
use std::time::Instant;

/// [`bench()`] or, with [`TimingArg::Events`], [`bench_events`].
pub(super) fn bench_with<T>(
    timing: TimingArg,
    device: &Device,
    repeat: usize,
    f: impl Fn() -> Result<T, CliError>,
) -> Result<(T, f64), CliError> {
    match timing {
        TimingArg::Host => bench(device, repeat, f),
        TimingArg::Events => bench_events(device, repeat, f),
    }
}

/// Mean GPU time of `repeat` calls after one warm-up, measured as `triton.testing.do_bench`
/// measures (and averages, its default): an event pair on the device's stream around each
/// call, the calls queued back to back (one synchronisation at the end), 256 MiB of device
/// memory cleared before each call so that no input stays in L2. Returns the warm-up's result
/// too.
#[cfg(feature = "cuda")]
fn bench_events<T>(
    device: &Device,
    repeat: usize,
    f: impl Fn() -> Result<T, CliError>,
) -> Result<(T, f64), CliError> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
    let lib = |e: candle_core::Error| CliError::from_lib(&e);
    let drv = |e: candle_core::cuda_backend::cudarc::driver::DriverError| {
        CliError::new(format!("--timing events: {e}"))
    };
    let cuda = device.as_cuda_device().map_err(|_| {
        CliError::new("--timing events needs a CUDA device (use --timing host on the CPU)")
    })?;
    let stream = cuda.cuda_stream();
    let mut flush = stream.alloc_zeros::<u8>(256 << 20).map_err(drv)?;
    let (first, _) = timed(std::slice::from_ref(device), &f)?;
    let mut marks = Vec::with_capacity(repeat);
    for _ in 0..repeat {
        stream.memset_zeros(&mut flush).map_err(drv)?;
        let start = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)?;
        drop(f()?);
        let end = stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)?;
        marks.push((start, end));
    }
    device.synchronize().map_err(lib)?;
    let ms = marks
        .iter()
        .map(|(a, b)| a.elapsed_ms(b).map(f64::from).map_err(drv))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((first, ms.iter().sum::<f64>() / ms.len() as f64))
}

/// Without CUDA there is no event timing.
#[cfg(not(feature = "cuda"))]
fn bench_events<T>(
    _: &Device,
    _: usize,
    _: impl Fn() -> Result<T, CliError>,
) -> Result<(T, f64), CliError> {
    Err(CliError::new(
        "--timing events needs a CUDA build and device (use --timing host)",
    ))
}

/// One call, timed to completion on every device, in milliseconds.
fn timed<T>(devices: &[Device], f: impl Fn() -> Result<T, CliError>) -> Result<(T, f64), CliError> {
    let t0 = Instant::now();
    let r = f()?;
    for device in devices {
        device.synchronize().map_err(|e| CliError::from_lib(&e))?;
    }
    Ok((r, t0.elapsed().as_secs_f64() * 1e3))
}

/// Median of the runs of `f` after one warm-up; returns the warm-up's result too.
pub fn bench<T>(
    device: &Device,
    repeat: usize,
    f: impl Fn() -> Result<T, CliError>,
) -> Result<(T, f64), CliError> {
    bench_on(std::slice::from_ref(device), repeat, f)
}

/// [`bench()`], synchronising every device of `devices` after each call.
pub(super) fn bench_on<T>(
    devices: &[Device],
    repeat: usize,
    f: impl Fn() -> Result<T, CliError>,
) -> Result<(T, f64), CliError> {
    let (first, _) = timed(devices, &f)?;
    let mut ms = Vec::with_capacity(repeat);
    for _ in 0..repeat {
        ms.push(timed(devices, &f)?.1);
    }
    Ok((first, median(&mut ms)))
}

pub fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    let m = xs.len() / 2;
    if xs.len() % 2 == 1 {
        xs[m]
    } else {
        0.5 * (xs[m - 1] + xs[m])
    }
}
