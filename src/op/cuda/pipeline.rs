//! The bf16 forward's WY kernel and state scan running at the same time.
//!
//! The WY kernel is parallel over every (chunk, head); the scan is sequential over the chunks
//! with one block per (sequence, head, value tile). Where the scan has blocks for at most half
//! the multiprocessors (B1 T32768 H16: 64 blocks on the H200's 132), running the two one after
//! the other leaves the scan waiting for the whole WY kernel (0.89 of 3.4 ms there,
//! `docs/perf.md` v15) and most of the GPU idle while the scan runs. Here the scan starts at
//! once on a high-priority side stream, the WY kernel takes the (chunk, head) pairs in
//! time-major order on the device's stream and counts each chunk as ready once its factors are
//! written (one counter per group of 8 chunks of a sequence and head), and each scan block waits
//! for a chunk's group before it copies the chunk's operands (`gdpc_signal_ready` /
//! `gdpc_wait_ready` in `cuda/gdp_fwd_chunked.cuh`). The results are bit-identical to the two
//! kernels one after the other.
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
//! 10 s traps (an error rather than a hang). The half also keeps the overlap useful: with the scan's
//! 128 blocks on 132 multiprocessors (B4 T4096 H16) the WY kernel ran on the 4 left and the
//! forward took 6.8 ms instead of 0.6. An earlier design (v15) cut the chunks into segments
//! launched one after the other, each segment's WY factors computed beside the previous scan:
//! the relaunches cost ~30 µs per segment.

use super::chunked::{
    ready_counters, run_scan, Beside, Bf16Inputs, ChunkTable, ScanDest, ScanPlan, Signal, WyFactors,
};
use super::side::SideStream;
use crate::op::shape::GdpShape;
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaSlice};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::Result;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// The WY kernel's chunk order (time-major: every sequence's chunk 0, then every chunk 1, ...),
/// on the device.
pub(super) struct Pipeline {
    order: CudaSlice<i32>,
}

impl Pipeline {
    /// The pipeline for a scan planned as `plan` over `table`, or `None` where it is not
    /// wanted (`GDP_CUDA_OVERLAP=0`) or not safe and useful: the scan's blocks must fill fewer
    /// than half of the `sms` multiprocessors.
    pub fn plan(
        dev: &CudaDevice,
        sh: &GdpShape,
        table: &ChunkTable,
        plan: &ScanPlan,
        sms: usize,
    ) -> Result<Option<Self>> {
        let wanted = match std::env::var("GDP_CUDA_OVERLAP") {
            Err(_) => true,
            Ok(v) => match v.trim() {
                "" | "auto" => true,
                "0" => false,
                other => candle_core::bail!(
                    "gdp cuda: GDP_CUDA_OVERLAP must be 0 or `auto`, got {other:?}"
                ),
            },
        };
        let blocks = sh.num_seqs() * sh.heads * sh.dv.div_ceil(plan.bv);
        if !wanted || table.chunks == 0 || 2 * blocks >= sms {
            return Ok(None);
        }
        // The table holds at most i32::MAX chunks (`ChunkTable::new`).
        let order: Vec<i32> = sh
            .chunks_time_major()
            .into_iter()
            .map(|c| c as i32)
            .collect();
        if order.len() != table.chunks {
            candle_core::bail!(
                "gdp cuda: the chunk order has {} chunks, the table {}",
                order.len(),
                table.chunks
            );
        }
        Ok(Some(Self {
            order: dev.clone_htod(&order)?,
        }))
    }
}

/// Computes `wy` (allocated for `table`) and runs the scan `plan` into `dest`: side by side
/// with `pipeline` where there is one and this GPU's previous overlapped forward was queued on
/// the same stream (stream order keeps the two apart: the next one's scan starts after the
/// previous one's join) or has finished; else one after the other on the device's stream.
#[allow(clippy::too_many_arguments)]
pub(super) fn wy_then_scan(
    pipeline: Option<&Pipeline>,
    dev: &CudaDevice,
    inp: &Bf16Inputs,
    table: &ChunkTable,
    wy: &mut WyFactors,
    sh: &GdpShape,
    scale: f32,
    has_h0: bool,
    h0_override: Option<&CudaSlice<f32>>,
    plan: &ScanPlan,
    dest: ScanDest,
) -> Result<()> {
    // Side by side: this GPU's registry of overlapped forwards (locked until this one is
    // recorded in it), zeroed readiness counters and the side stream. The side stream starts
    // after the counters are zeroed; the WY kernel is queued first, so that with
    // GDP_CUDA_STREAMS=1 (one stream) the scan finds every chunk ready.
    let overlap = match pipeline {
        Some(p) => {
            let main = dev.cuda_stream();
            let ordinal = main.context().ordinal();
            let running = in_flight().lock().map_err(|_| {
                candle_core::Error::Msg("gdp cuda: overlap registry poisoned".into())
            })?;
            main.context().bind_to_thread().w()?;
            let stream = main.cu_stream() as usize;
            let free = running
                .get(&ordinal)
                .is_none_or(|f| f.stream == stream || f.done.is_complete());
            if free {
                let ready = dev.alloc_zeros::<i32>(ready_counters(table, sh))?;
                let side = SideStream::fork_urgent(dev)?;
                Some((p, running, ordinal, stream, ready, side))
            } else {
                None
            }
        }
        None => None,
    };
    let signal = overlap.as_ref().map(|(p, _, _, _, ready, _)| Signal {
        order: &p.order,
        ready,
    });
    wy.launch(dev, inp, table, sh, scale, signal)?;
    let beside = overlap.as_ref().map(|(_, _, _, _, ready, side)| Beside {
        stream: side.stream(),
        ready,
    });
    run_scan(
        dev,
        inp,
        table,
        wy,
        sh,
        has_h0,
        h0_override,
        plan,
        dest,
        beside,
    )?;
    if let Some((_, mut running, ordinal, stream, _, side)) = overlap {
        let done = side.stream().record_event(None).w()?;
        running.insert(ordinal, InFlight { stream, done });
        side.join()?;
    }
    Ok(())
}

/// The last overlapped forward queued on a GPU: the stream it was queued on (its raw handle)
/// and the completion of its scan.
struct InFlight {
    stream: usize,
    done: CudaEvent,
}

/// Per GPU (ordinal), the last overlapped forward queued in this process.
fn in_flight() -> &'static Mutex<HashMap<usize, InFlight>> {
    static IN_FLIGHT: OnceLock<Mutex<HashMap<usize, InFlight>>> = OnceLock::new();
    IN_FLIGHT.get_or_init(|| Mutex::new(HashMap::new()))
}
