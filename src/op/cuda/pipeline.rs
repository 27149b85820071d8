//! The bf16 forward's WY kernel and state scan running at the same time; the same for the
//! backward's WY kernel and its state-gradient scan (the same [`Pipeline`], with the chunks
//! taken from the sequences' ends), and for that scan and the backward's gradient kernel
//! (`backward.rs`, `grads.rs`: the scan counts its chunks done in the same groups).
//!
//! The WY kernel is parallel over every (chunk, head); the scan is sequential over the chunks
//! with one block per (sequence, head, value tile). Where the scan has blocks for at most half
//! the multiprocessors (B1 T32768 H16: 64 blocks on 132), running the two one after the other
//! leaves the scan waiting for the whole WY kernel and most of the GPU idle while the scan
//! runs. Here the scan starts at once on a high-priority side stream, the WY kernel takes the
//! (chunk, head) pairs in time-major order on the device's stream and counts each chunk as
//! ready once its factors are written (one counter per group of 8 chunks of a sequence and
//! head), and each scan block waits for a chunk's group before it copies the chunk's operands
//! (`gdpc_signal_ready` / `gdpc_wait_ready` in `cuda/gdp_fwd_chunked.cuh`). The results are
//! bit-identical to the two kernels one after the other.
//!
//! The WY kernel never waits, so the scan's waits end as long as WY blocks can run: the scan's
//! blocks, all resident while they wait, must leave multiprocessors to them. The scan may have
//! blocks for fewer than half the multiprocessors, and overlapped forwards of one GPU run one at
//! a time in a process: several at once, from threads sharing a device or context
//! parallelism's ranks sharing a GPU (each rank its own stream), could fill every
//! multiprocessor with waiting scan blocks. A forward queued on the stream of the previous
//! overlapped forward overlaps too (stream order starts its scan after the previous one's join,
//! as in a model's consecutive layers); one on another stream while that one still runs takes
//! the two kernels one after the other.
//! Two processes doing this on one GPU still leave multiprocessors free; a block that waits
//! 10 s traps (an error rather than a hang). The half also keeps the overlap useful: a scan that
//! holds nearly every multiprocessor leaves the WY kernel it waits for a few, and the forward
//! many times slower. An earlier design cut the chunks into segments launched one after the
//! other, each segment's WY factors computed beside the previous scan; its relaunches cost more
//! than they hid (`docs/perf-log.md`).

use super::device::smem_and_sms;
use super::fwd_scan::{run_scan, Beside, ScanDest, ScanInputs};
use super::inputs::ChunkTable;
use super::plan::ScanPlan;
use super::side::SideStream;
use super::wy::{ready_counters, Signal, WyFactors};
use crate::op::config::KernelConfig;
use crate::op::shape::GdpShape;
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaSlice};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::Result;
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// A WY kernel beside a scan that waits for its chunks: the WY kernel's chunk order on the
/// device and the number of readiness counters.
///
/// The forward takes the chunks time-major (every sequence's chunk 0, then every chunk 1, ...)
/// for its state scan ([`wy_then_scan`]). The backward runs two scans after the WY kernel, the
/// forward scan's rerun (chunk states) and the state-gradient scan, each with a block per
/// (sequence, head, value tile); where each has blocks for fewer than half the multiprocessors
/// (B1 T32768 H16: 64 each), the state-gradient scan, the longer of the two, starts at once on
/// the side stream beside a WY kernel that takes the chunks from the sequences' ends (the scan
/// runs backwards in time), and the rerun follows the WY kernel on the device's stream. Results
/// are bit-identical to the launches one after the other.
///
/// Where the scan has blocks for half the multiprocessors or more (a context-parallel rank's
/// widened forward scan, the op in segments), the two run one after the other. Running the WY
/// kernel on the multiprocessors that the waiting scan blocks hold, one WY block beside each
/// where the two fit, saved little where each call found the GPU idle, and made the forward
/// several times slower with calls queued back to back (`docs/cuda.md`, "Segments").
pub(super) struct Pipeline {
    order: CudaSlice<i32>,
    counters: usize,
    /// The scan on a side stream ([`KernelConfig::side_streams`]), else on the device's.
    side_streams: bool,
}

impl Pipeline {
    /// The pipeline of a WY kernel taking the chunks of `table` in `order` beside a scan planned
    /// as `plan`, or `None` where `cfg` does not want it ([`KernelConfig::overlap`]) or it is
    /// not safe and useful: the scan's blocks must fill fewer than half of the device's
    /// multiprocessors.
    pub fn plan(
        dev: &CudaDevice,
        sh: &GdpShape,
        table: &ChunkTable,
        plan: &ScanPlan,
        order: Vec<usize>,
        cfg: &KernelConfig,
    ) -> Result<Option<Self>> {
        if !cfg.overlap || table.chunks == 0 {
            return Ok(None);
        }
        let sms = smem_and_sms(dev, None)?.1;
        if 2 * sh.scan_blocks(sh.dv, plan.bv) >= sms {
            return Ok(None);
        }
        Ok(Some(Self {
            order: chunk_order(dev, order, table)?,
            counters: ready_counters(table, sh),
            side_streams: cfg.side_streams,
        }))
    }

    /// Zeroed readiness counters for one overlapped launch, for [`Pipeline::start`]: the
    /// caller holds them, so that they outlive the run's side stream.
    pub fn zeroed_counters(&self, dev: &CudaDevice) -> Result<CudaSlice<i32>> {
        dev.alloc_zeros::<i32>(self.counters)
    }

    /// Starts the overlap with the counters `ready` ([`Pipeline::zeroed_counters`]):
    /// [`OverlapRun::start`] with this pipeline's streams.
    pub fn start<'b>(
        &self,
        dev: &CudaDevice,
        ready: &'b CudaSlice<i32>,
    ) -> Result<Option<OverlapRun<'b>>> {
        if ready.len() < self.counters {
            candle_core::bail!(
                "gdp cuda: {} readiness counters for a pipeline of {}",
                ready.len(),
                self.counters
            );
        }
        OverlapRun::start(dev, ready, self.side_streams)
    }

    /// The chunk order on the device (table ids): the WY kernel's, and the gradient kernel's
    /// beside the state-gradient scan (`grads.rs`).
    pub fn order(&self) -> &CudaSlice<i32> {
        &self.order
    }

    /// The number of readiness counters (per group of chunks and head).
    pub fn counters(&self) -> usize {
        self.counters
    }

    /// What the WY kernel is told: this order, `run`'s counters, and whether it keeps to two
    /// blocks per multiprocessor ([`Signal::two_per_sm`]).
    pub fn signal<'a>(&'a self, run: &OverlapRun<'a>, two_per_sm: bool) -> Signal<'a> {
        Signal {
            order: &self.order,
            ready: run.ready,
            two_per_sm,
        }
    }
}

/// Computes `wy` (allocated for `table`) and runs the scan `plan` over the value columns of
/// `sh` into `dest` (more than `wy.dv` for a context-parallel rank's widened scan, the WY
/// kernel computing U at its own width): side by side with `pipeline` where there is one and
/// this GPU's previous overlapped forward was queued on the same stream (stream order keeps the
/// two apart: the next one's scan starts after the previous one's join) or has finished; else
/// one after the other on the device's stream.
pub(super) fn wy_then_scan(
    pipeline: Option<&Pipeline>,
    src: &ScanInputs,
    wy: &WyFactors,
    sh: &GdpShape,
    scale: f32,
    plan: &ScanPlan,
    dest: ScanDest,
) -> Result<()> {
    let (dev, inp, table) = (&src.inp.dev, src.inp, src.table);
    // Side by side: the WY kernel is queued first, so that on one stream (side streams off) the
    // scan finds every chunk ready.
    let counters;
    let overlap = match pipeline {
        Some(p) => {
            counters = p.zeroed_counters(dev)?;
            p.start(dev, &counters)?.map(|run| (p, run))
        }
        None => None,
    };
    let widened;
    let wy_sh = if wy.dv == sh.dv {
        sh
    } else {
        widened = GdpShape {
            dv: wy.dv,
            ..sh.clone()
        };
        &widened
    };
    wy.launch(
        dev,
        inp,
        table,
        wy_sh,
        scale,
        overlap.as_ref().map(|(p, run)| p.signal(run, true)),
    )?;
    let beside = overlap.as_ref().map(|(_, run)| Beside {
        on: run.side.on(),
        ready: run.ready,
    });
    run_scan(src, wy, sh, plan, dest, beside)?;
    match overlap {
        Some((_, run)) => run.finish(),
        None => Ok(()),
    }
}

/// A WY kernel's chunk order (ids of `table`, every chunk once) on the device.
fn chunk_order(dev: &CudaDevice, order: Vec<usize>, table: &ChunkTable) -> Result<CudaSlice<i32>> {
    if order.len() != table.chunks {
        candle_core::bail!(
            "gdp cuda: the chunk order has {} chunks, the table {}",
            order.len(),
            table.chunks
        );
    }
    // The table holds at most i32::MAX chunks (`ChunkTable::new`).
    let order: Vec<i32> = order.into_iter().map(|c| c as i32).collect();
    dev.clone_htod(&order)
}

/// An overlapped launch in progress: zeroed readiness counters (borrowed, like every buffer of
/// the side stream's kernels, until the side stream is joined), a high-priority side stream
/// forked from the device's stream, and this GPU's registry of overlapped launches, locked
/// until the launch is recorded in it.
pub(super) struct OverlapRun<'b> {
    running: MutexGuard<'static, HashMap<usize, InFlight>>,
    ordinal: usize,
    stream: usize,
    pub side: SideStream<'b>,
    pub ready: &'b CudaSlice<i32>,
}

impl<'b> OverlapRun<'b> {
    /// Starts one with the zeroed readiness counters `ready` (the side stream forks after the work
    /// queued so far), or `None`, queuing nothing, where this GPU's previous overlapped launch was
    /// queued on another stream and may still be running: its waiting blocks and these could fill
    /// every multiprocessor. One queued on the same stream cannot overlap this one (stream order
    /// starts this one's side stream after the previous one's join).
    fn start(
        dev: &CudaDevice,
        ready: &'b CudaSlice<i32>,
        side_streams: bool,
    ) -> Result<Option<Self>> {
        let main = dev.cuda_stream();
        let ordinal = main.context().ordinal();
        let running = in_flight()
            .lock()
            .map_err(|_| candle_core::Error::Msg("gdp cuda: overlap registry poisoned".into()))?;
        main.context().bind_to_thread().w()?;
        let stream = main.cu_stream() as usize;
        let free = running
            .get(&ordinal)
            .is_none_or(|f| f.stream == stream || f.done.is_complete());
        if !free {
            return Ok(None);
        }
        let side = SideStream::fork_urgent(dev, side_streams)?;
        Ok(Some(Self {
            running,
            ordinal,
            stream,
            side,
            ready,
        }))
    }

    /// Records the side stream's completion in the registry and joins it into the device's
    /// stream (once everything that runs on the side stream is queued).
    pub fn finish(mut self) -> Result<()> {
        let done = self.side.record_event()?;
        let (stream, ordinal) = (self.stream, self.ordinal);
        self.running.insert(ordinal, InFlight { stream, done });
        self.side.join()
    }
}

/// The last overlapped launch (a forward's or a backward's) queued on a GPU: the
/// stream it was queued on (its raw handle) and the completion of its waiting scan.
struct InFlight {
    stream: usize,
    done: CudaEvent,
}

/// Per GPU (ordinal), the last overlapped launch queued in this process.
fn in_flight() -> &'static Mutex<HashMap<usize, InFlight>> {
    static IN_FLIGHT: OnceLock<Mutex<HashMap<usize, InFlight>>> = OnceLock::new();
    IN_FLIGHT.get_or_init(|| Mutex::new(HashMap::new()))
}
