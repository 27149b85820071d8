//! Context parallelism over NCCL, one process per GPU (feature `nccl`, needs GPUs): the cases
//! of `tests/cp.rs` (dense and packed, empty sequences, sequences spanning ranks, n = 1..3,
//! with and without an initial state) give the single-GPU op's outputs, final states and every
//! gradient on every rank; the collectives (host and device), an abort, a timeout, and faults
//! on one rank (collectives of another length or kind, bad input, disagreeing problems) that
//! must fail every rank within 2 s.
//!
//! The test `cp_over_nccl_equals_single_gpu` starts this binary once per world size (1, 2, 4, 8,
//! or `GDP_NCCL_WORLDS=1,2`) through `gdp launch`; each worker (the ignored
//! `nccl_worker` test, started with `--ignored --exact nccl_worker` and `GDP_NCCL_TEST_WORKER`
//! set; run any other way it fails) opens `cuda:LOCAL_RANK`, computes the reference with the
//! single-device op on its own GPU and compares. The parent reads every rank's standard output
//! and requires libtest's "1 passed" in each. World sizes above the number of visible GPUs are
//! skipped with a printed `SKIPPED` line. Both tests are ignored by default (CI only compiles
//! this, without a GPU). On a GPU machine:
//! `cargo test --release --features nccl --test nccl -- --ignored --exact
//! cp_over_nccl_equals_single_gpu --nocapture` (a bare `--ignored` also runs the worker on its
//! own, which fails by design).
#![cfg(feature = "nccl")]

mod common;
#[path = "common/workers.rs"]
mod workers;

use anyhow::{bail, ensure, Context as _, Result};
use candle_core::{DType, Device, Tensor};
use candle_gdp::cp::comm::DistEnv;
use candle_gdp::cp::{
    distributed_gated_delta_product, Communicator, Composition, NcclComm, DEFAULT_TIMEOUT,
};
use candle_gdp::{Cotangents, GdpOptions};
use common::{cp_pairs, inputs, rel_rms, run_op_on, Case, Inputs};
use std::sync::Arc;
use std::time::{Duration, Instant};
use workers::{launch_workers, ONE_PASSED};

const WORKER: &str = "GDP_NCCL_TEST_WORKER";

fn gpu_count() -> usize {
    candle_core::cuda_backend::cudarc::driver::CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .unwrap_or(0)
}

/// The world sizes to run: `GDP_NCCL_WORLDS` (comma-separated, each at least 1), or 1, 2, 4, 8.
/// An unparsable or empty list is an error, not a silently shorter run.
fn worlds() -> Result<Vec<usize>> {
    let Ok(s) = std::env::var("GDP_NCCL_WORLDS") else {
        return Ok(vec![1, 2, 4, 8]);
    };
    let worlds = s
        .split(',')
        .map(|w| match w.trim().parse::<usize>() {
            Ok(n) if n >= 1 => Ok(n),
            _ => bail!("GDP_NCCL_WORLDS={s:?}: `{w}` is not a world size (want e.g. `1,2`)"),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(worlds)
}

/// Ignored by default: it needs GPUs, and a test that cannot run must be reported as skipped,
/// not passed. Without this attribute a machine with no GPU (or fewer GPUs than every requested
/// world size) would run nothing and still count a pass. Run explicitly (see the module docs),
/// each world size above the visible GPU count prints `SKIPPED`, and if no world size at all
/// could run the test fails: it was asked for and checked nothing.
#[test]
#[ignore = "needs GPUs: run with --ignored"]
fn cp_over_nccl_equals_single_gpu() -> Result<()> {
    let gpus = gpu_count();
    let mut ran = vec![];
    let mut skipped = vec![];
    for world in worlds()? {
        if world > gpus {
            println!("SKIPPED world size {world}: needs {world} GPUs, {gpus} visible");
            skipped.push(world);
            continue;
        }
        let t0 = Instant::now();
        let dir =
            std::env::temp_dir().join(format!("gdp-nccl-test-{}-w{world}", std::process::id()));
        let (launched, outs) = launch_workers(world, "nccl_worker", (WORKER, "1"), &dir)?;
        let passed = launched.status.success();
        println!(
            "world size {world}: {} in {:.1} s",
            if passed { "passed" } else { "FAILED" },
            t0.elapsed().as_secs_f64()
        );
        for out in &outs {
            print!("{out}");
        }
        ensure!(
            passed,
            "world size {world}: {}",
            String::from_utf8_lossy(&launched.stderr).trim()
        );
        for (r, out) in outs.iter().enumerate() {
            ensure!(
                out.contains(ONE_PASSED),
                "world size {world}: rank {r} did not print `{ONE_PASSED}` (did the worker \
                 filter stop matching?)"
            );
        }
        ran.push(world);
    }
    ensure!(
        !ran.is_empty(),
        "SKIPPED every world size {skipped:?} ({gpus} GPUs visible): nothing was checked"
    );
    println!("ran world sizes {ran:?}, skipped {skipped:?} ({gpus} GPUs visible)");
    Ok(())
}

/// The worker: run only by `cp_over_nccl_equals_single_gpu`, which sets `WORKER`; run without
/// it (e.g. by a bare `--ignored`), it fails.
#[test]
#[ignore = "worker: started by cp_over_nccl_equals_single_gpu"]
fn nccl_worker() -> Result<()> {
    if std::env::var_os(WORKER).is_none() {
        bail!("{WORKER} is unset: nccl_worker is run only by cp_over_nccl_equals_single_gpu");
    }
    let env = DistEnv::from_vars(std::env::vars_os())?;
    let (r, w) = (env.rank, env.world_size);
    let dev = Device::new_cuda(env.local_rank)?;
    let comm = NcclComm::from_dist_env(&dev, &env, DEFAULT_TIMEOUT).context("NcclComm")?;
    let comm = Arc::new(comm);
    ensure!(comm.rank() == r && comm.world_size() == w);
    collectives(&comm, &dev).context("collectives")?;
    for c in cases() {
        cp_case(&comm, &dev, &c).with_context(|| format!("rank {r}: {}", c.name))?;
    }
    let stats = comm.stats();
    println!(
        "[rank {r}/{w}] {} collectives, {:.1} ms waiting, {} bytes sent",
        stats.collectives,
        stats.wait.as_secs_f64() * 1e3,
        stats.bytes
    );
    comm.barrier()?;
    drop(comm);
    failures(&env, &dev).context("failures")?;
    println!("[rank {r}/{w}] all checks passed");
    Ok(())
}

/// Host and device all-gather / all-reduce, strided and empty inputs.
fn collectives(comm: &NcclComm, dev: &Device) -> Result<()> {
    let (r, w) = (comm.rank(), comm.world_size());
    for len in [0usize, 1, 5, 1000] {
        let local: Vec<f32> = (0..len).map(|j| (1000 * r + j) as f32).collect();
        let got = comm.all_gather(&local)?;
        let want: Vec<f32> = (0..w)
            .flat_map(|q| (0..len).map(move |j| (1000 * q + j) as f32))
            .collect();
        ensure!(got == want, "all_gather len {len}");
        let mut buf = local.clone();
        comm.all_reduce_sum(&mut buf)?;
        let want: Vec<f32> = (0..len)
            .map(|j| (0..w).map(|q| (1000 * q + j) as f32).sum())
            .collect();
        ensure!(buf == want, "all_reduce_sum len {len}");
    }
    comm.barrier()?;
    // Device tensors stay on the device; a strided view is made contiguous first.
    let rf = r as f32;
    let t = Tensor::new(&[[rf, 10.0 + rf], [20.0 + rf, 30.0 + rf]], dev)?.t()?;
    let g = comm.all_gather_tensor(&t)?;
    ensure!(
        g.device().same_device(dev),
        "all_gather_tensor left the device"
    );
    ensure!(g.dims() == [w, 2, 2]);
    let want: Vec<f32> = (0..w)
        .flat_map(|q| {
            let q = q as f32;
            [q, 20.0 + q, 10.0 + q, 30.0 + q]
        })
        .collect();
    ensure!(
        g.flatten_all()?.to_vec1::<f32>()? == want,
        "all_gather_tensor"
    );
    let s = comm.all_reduce_sum_tensor(&t)?;
    ensure!(s.device().same_device(dev) && s.dims() == [2, 2]);
    let tot: f32 = (0..w).map(|q| q as f32).sum();
    let wf = w as f32;
    ensure!(
        s.to_vec2::<f32>()? == [[tot, 20.0 * wf + tot], [10.0 * wf + tot, 30.0 * wf + tot]],
        "all_reduce_sum_tensor"
    );
    // CPU tensors go through the host.
    let c = comm.all_reduce_sum_tensor(&Tensor::new(&[1.0f32, 2.0], &Device::Cpu)?)?;
    ensure!(c.device().is_cpu() && c.to_vec1::<f32>()? == [wf, 2.0 * wf]);
    let e = comm
        .all_gather_tensor(&Tensor::new(&[1u32], dev)?)
        .unwrap_err()
        .to_string();
    ensure!(e.contains("f32"), "{e}");
    Ok(())
}

fn cases() -> Vec<Case> {
    let cu = [0, 3, 3, 90, 95, 96, 160, 200];
    vec![
        Case::new("dense n1 h0", 2, 75, 2, 16, 12, 1).h0(),
        Case::new("dense n2", 1, 130, 2, 12, 16, 2),
        Case::new("dense n3 h0 strong", 2, 61, 1, 8, 10, 3)
            .h0()
            .strong_gates(),
        Case::new("dense n2 K128 V128 h0", 1, 600, 4, 128, 128, 2)
            .h0()
            .seed(11),
        Case::new("packed n2 h0", 1, 200, 2, 12, 8, 2)
            .packed(&cu)
            .h0(),
        Case::new("packed n1", 1, 200, 2, 8, 12, 1).packed(&cu),
        Case::new("packed n3 h0", 1, 200, 1, 10, 10, 3)
            .packed(&[0, 150, 151, 200])
            .h0(),
        Case::new("packed one seq", 1, 97, 2, 8, 8, 2)
            .packed(&[0, 97])
            .h0(),
    ]
}

/// The distributed op on this rank's GPU equals the single-device op on the same GPU.
fn cp_case(comm: &Arc<NcclComm>, dev: &Device, c: &Case) -> Result<()> {
    let (r, w) = (comm.rank(), comm.world_size());
    let x = inputs(c, DType::F32)?;
    let want = run_op_on(c, &x, DType::F32, dev)?;
    let Inputs {
        q,
        k,
        v,
        g,
        beta,
        h0,
        dout,
        dht,
    } = x.cast(DType::F32)?;
    let opts = GdpOptions {
        initial_state: h0.as_ref(),
        output_final_state: true,
        cu_seqlens: c.cu.as_deref(),
        ..Default::default()
    };
    let cm: Arc<dyn Communicator> = comm.clone();
    let got = distributed_gated_delta_product(
        cm,
        dev,
        &q,
        &k,
        &v,
        &g,
        &beta,
        &opts,
        Some(Cotangents {
            dout: &dout,
            dht: Some(&dht),
        }),
        Composition::Fold,
    )?;
    ensure!(
        got.grads.as_ref().is_some_and(|g| g.dh0.is_some()) == c.h0,
        "dh0 missing or unexpected"
    );
    let mut report = vec![];
    let mut worst = 0.0f64;
    for (name, a, b) in cp_pairs(got, &want)? {
        let a = a.to_dtype(DType::F32)?.to_device(&Device::Cpu)?;
        ensure!(
            a.dims() == b.dims(),
            "{name}: shape {:?} vs {:?}",
            a.dims(),
            b.dims()
        );
        let e = rel_rms(&a, &b)?;
        report.push(format!("{name} {e:.0e}"));
        worst = worst.max(e);
        ensure!(
            e.is_finite() && e <= 1e-5,
            "{} world {w}: {name} relative RMS {e:.2e} vs the single-GPU op",
            c.name
        );
    }
    println!(
        "[rank {r}/{w}] {:<22} worst {worst:.1e}: {}",
        c.name,
        report.join(" ")
    );
    Ok(())
}

/// An abort reaches the other ranks' pending collective; a collective that waits for a rank
/// that does not come times out, and that rank then fails at once. Each on a fresh group.
fn failures(env: &DistEnv, dev: &Device) -> Result<()> {
    let (r, w) = (env.rank, env.world_size);
    // A non-CUDA device is refused.
    let e = NcclComm::from_dist_env(&Device::Cpu, env, DEFAULT_TIMEOUT)
        .unwrap_err()
        .to_string();
    ensure!(e.contains("CUDA device"), "{e}");
    if w == 1 {
        let comm = NcclComm::from_dist_env(dev, env, DEFAULT_TIMEOUT)?;
        comm.abort("on purpose");
        let e = comm.all_gather(&[1.0]).unwrap_err().to_string();
        ensure!(e.contains("on purpose") && e.contains("rank 0"), "{e}");
        println!("[rank {r}/{w}] abort: {e}");
        return Ok(());
    }
    // Abort: rank 1 gives up while the others wait in an all-gather.
    let comm = NcclComm::from_dist_env(dev, env, DEFAULT_TIMEOUT)?;
    comm.barrier()?;
    let t0 = Instant::now();
    if r == 1 {
        std::thread::sleep(Duration::from_millis(500));
        comm.abort("rank 1 gives up on purpose");
        let e = comm.all_gather(&[1.0]).unwrap_err().to_string();
        ensure!(e.contains("gives up on purpose"), "{e}");
    } else {
        let e = comm.all_gather(&[1.0; 64]).unwrap_err().to_string();
        let took = t0.elapsed();
        println!("[rank {r}/{w}] abort seen after {took:?}: {e}");
        ensure!(
            e.contains("communicator") && e.contains("rank 1") && e.contains("on purpose"),
            "{e}"
        );
        ensure!(took < Duration::from_secs(10), "{took:?}");
    }
    drop(comm);
    // Timeout: rank 0 waits alone for 2 s; the others come late and fail at once.
    let comm = NcclComm::from_dist_env(dev, env, Duration::from_secs(2))?;
    comm.barrier()?;
    let t0 = Instant::now();
    if r == 0 {
        let e = comm.all_gather(&[1.0; 16]).unwrap_err().to_string();
        let took = t0.elapsed();
        println!("[rank {r}/{w}] timeout after {took:?}: {e}");
        ensure!(e.contains("rank 0") && e.contains("timed out"), "{e}");
        ensure!(
            took >= Duration::from_secs(2) && took < Duration::from_secs(10),
            "{took:?}"
        );
    } else {
        std::thread::sleep(Duration::from_secs(4));
        let e = comm.all_gather(&[1.0; 16]).unwrap_err().to_string();
        println!("[rank {r}/{w}] late rank: {e}");
        ensure!(
            e.contains("group failed, rank 0") && e.contains("timed out"),
            "{e}"
        );
        ensure!(t0.elapsed() < Duration::from_secs(6), "{:?}", t0.elapsed());
    }
    drop(comm);
    mismatches(env, dev)
}

/// Faults on rank 1, each on a fresh group with a 30 s timeout: every rank must fail within
/// 2 s, its error naming rank 1 or the mismatch. A collective of another length, a collective
/// of another kind (the peer checks of `NcclComm`); in the op, a `beta` of the wrong shape (an
/// error before any collective, which aborts the group) and another scale (the ranks' problem
/// agreement).
fn mismatches(env: &DistEnv, dev: &Device) -> Result<()> {
    use candle_gdp::cp::{cp_gated_delta_product, dense_rank_meta, CpRank, ShardPlan};
    let (r, w) = (env.rank, env.world_size);
    let faults: [(&str, &str); 4] = [
        ("length", "collective mismatch"),
        ("kind", "collective mismatch"),
        ("bad input", "rank 1"),
        ("scale", "scale"),
    ];
    for (fault, says) in faults {
        let comm = Arc::new(NcclComm::from_dist_env(dev, env, Duration::from_secs(30))?);
        comm.barrier()?;
        let t0 = Instant::now();
        let odd = r == 1;
        let res: Result<()> = match fault {
            "length" => comm
                .all_gather(&vec![1.0; if odd { 3 } else { 2 }])
                .map(|_| ())
                .map_err(Into::into),
            "kind" if odd => comm.all_reduce_sum(&mut [1.0; 2]).map_err(Into::into),
            "kind" => comm.all_gather(&[1.0; 2]).map(|_| ()).map_err(Into::into),
            _ => (|| -> Result<()> {
                let c = Case::new("fault", 1, 40, 2, 8, 8, 2);
                let x = inputs(&c, DType::F32)?.cast(DType::F32)?;
                let plan = ShardPlan::new(c.t, w)?;
                let span = plan.range(r)?;
                let cut = |t: &Tensor, per: usize, l: usize| -> candle_core::Result<Tensor> {
                    t.narrow(1, span.start * per, l * per)?.to_device(dev)
                };
                let l = span.len();
                let beta_len = if fault == "bad input" && odd {
                    l
                } else {
                    l * c.n
                };
                let rank = CpRank {
                    comm: comm.clone(),
                    meta: dense_rank_meta(&plan, r)?,
                    composition: Composition::Fold,
                };
                let opts = GdpOptions {
                    scale: (fault == "scale" && odd).then_some(0.5),
                    ..Default::default()
                };
                cp_gated_delta_product(
                    &cut(&x.q, 1, l)?,
                    &cut(&x.k, c.n, l)?,
                    &cut(&x.v, c.n, l)?,
                    &cut(&x.g, 1, l)?,
                    &x.beta
                        .narrow(1, span.start * c.n, beta_len)?
                        .to_device(dev)?,
                    &opts,
                    &rank,
                )?;
                Ok(())
            })(),
        };
        let took = t0.elapsed();
        let Err(e) = res else {
            bail!("rank {r}: the {fault} fault returned success");
        };
        let e = e.to_string();
        println!("[rank {r}/{w}] {fault} fault seen after {took:?}: {e}");
        ensure!(r == 1 || e.contains(says), "{fault}: {e}");
        ensure!(took < Duration::from_secs(2), "{fault}: {took:?}");
    }
    Ok(())
}
