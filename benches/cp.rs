//! Context parallelism on CPU ranks: (1) the cost of the CP path at cp = 1 over the plain op;
//! (2) per-rank time of prepare / communicate / apply at cp = 4, forward and backward
//! (B1 T32768 H4 K=V=64 n=2, f32); (3) end-to-end fwd+bwd through `ContextParallel` for
//! cp = 1, 2, 4 against the plain op measured in the same run.
//!
//! Run: `cargo bench --bench cp` (`-- --quick` for fewer repetitions). On a machine with fewer
//! cores than ranks the ranks share cores, so (3) measures overhead, not speed-up.

use candle_core::{Device, Tensor, Var};
use candle_gdp::cp::protocol::{backward_summary, fold_backward, fold_forward, forward_summary};
use candle_gdp::cp::summary::{Backward, Forward, Gathered};
use candle_gdp::cp::{
    cp_gated_delta_product, dense_rank_meta, run_ranks, Communicator, CpRank, ShardPlan,
    SingleComm, DEFAULT_TIMEOUT,
};
use candle_gdp::op::cpu::{self, chunk::Dims, PackedInputs};
use candle_gdp::op::shape::GdpShape;
use candle_gdp::{gated_delta_product, ContextParallel, Cotangents, GdpOptions};
use std::sync::Arc;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn time_ms(
    reps: usize,
    mut f: impl FnMut() -> candle_core::Result<()>,
) -> candle_core::Result<f64> {
    f()?;
    let mut t = vec![];
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    Ok(median(t))
}

fn inputs(t: usize, h: usize, d: usize, n: usize) -> candle_core::Result<Vec<Tensor>> {
    let dev = Device::Cpu;
    let unit = |x: Tensor| -> candle_core::Result<Tensor> {
        let nrm = x.sqr()?.sum_keepdim(3)?.sqrt()?;
        x.broadcast_div(&nrm)
    };
    Ok(vec![
        unit(Tensor::randn(0f32, 1.0, (1, t, h, d), &dev)?)?,
        unit(Tensor::randn(0f32, 1.0, (1, t * n, h, d), &dev)?)?,
        Tensor::randn(0f32, 1.0, (1, t * n, h, d), &dev)?,
        (Tensor::rand(0f32, 1.0, (1, t, h), &dev)? * -0.5)?,
        Tensor::rand(0f32, 1.0, (1, t * n, h), &dev)?,
    ])
}

fn fwd_bwd(x: &[Tensor], dout: &Tensor) -> candle_core::Result<()> {
    let v: Vec<Var> = x
        .iter()
        .map(Var::from_tensor)
        .collect::<candle_core::Result<_>>()?;
    let (o, _) = gated_delta_product(&v[0], &v[1], &v[2], &v[3], &v[4], &GdpOptions::default())?;
    (o * dout)?.sum_all()?.backward().map(|_| ())
}

fn main() -> candle_core::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let reps = if quick { 3 } else { 7 };
    let (h, d, n) = (4, 64, 2);

    // (1) + (3): end to end.
    let t = 8192;
    let x = inputs(t, h, d, n)?;
    let dout = Tensor::randn(0f32, 1.0, (1, t, h, d), &Device::Cpu)?;
    // The CP op itself at cp = 1 (one rank, no collective): the per-rank entry point. Timed in
    // alternation with the plain op so that machine drift cancels.
    let rank = CpRank {
        comm: Arc::new(SingleComm::new()),
        meta: dense_rank_meta(&ShardPlan::new(t, 1)?, 0)?,
        composition: Default::default(),
    };
    let cp1_step = || -> candle_core::Result<()> {
        let v: Vec<Var> = x
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<_>>()?;
        let opts = GdpOptions::default();
        let (o, _) = cp_gated_delta_product(&v[0], &v[1], &v[2], &v[3], &v[4], &opts, &rank)?;
        (o * &dout)?.sum_all()?.backward().map(|_| ())
    };
    let (mut tp, mut tc) = (vec![], vec![]);
    fwd_bwd(&x, &dout)?;
    cp1_step()?;
    for _ in 0..reps.max(5) {
        let t0 = Instant::now();
        fwd_bwd(&x, &dout)?;
        let t1 = Instant::now();
        cp1_step()?;
        tp.push((t1 - t0).as_secs_f64() * 1e3);
        tc.push(t1.elapsed().as_secs_f64() * 1e3);
    }
    let (plain, cp1) = (median(tp), median(tc));
    println!(
        "end to end, fwd+bwd, B1 T{t} H{h} K=V={d} n={n} f32 (threads: {})",
        rayon::current_num_threads()
    );
    println!("  plain op                       {plain:8.1} ms");
    println!(
        "  cp_gated_delta_product cp=1    {cp1:8.1} ms   ({:+.1}% vs plain)",
        100.0 * (cp1 / plain - 1.0)
    );
    for r in [1, 2, 4] {
        let cp = ContextParallel::cpu(r)?;
        let ms = time_ms(reps, || {
            let ct = Cotangents {
                dout: &dout,
                dht: None,
            };
            cp.gated_delta_product(
                &x[0],
                &x[1],
                &x[2],
                &x[3],
                &x[4],
                &GdpOptions::default(),
                Some(ct),
            )
            .map(|_| ())
        })?;
        println!(
            "  ContextParallel cp={r}            {ms:8.1} ms   ({:+.1}% vs plain)",
            100.0 * (ms / plain - 1.0)
        );
    }

    // (2): phases per rank at cp = 4, T = 32768.
    let (t, cp) = (32768, 4);
    let x = inputs(t, h, d, n)?;
    let local = t / cp;
    let dims = Dims {
        dk: d,
        dv: d,
        n,
        scale: (d as f32).powf(-0.5),
    };
    let kv = d * d;
    println!("phases per rank, cp={cp}, B1 T{t} (T/rank {local}) H{h} K=V={d} n={n} f32 (median of {reps})");
    println!(
        "  {:>4} {:>13} {:>13} {:>13} {:>13} {:>13} {:>13}",
        "rank", "fwd prepare", "fwd comm", "fwd apply", "bwd prepare", "bwd comm", "bwd apply"
    );
    let rows = run_ranks(cp, DEFAULT_TIMEOUT, |comm| {
        let r = comm.rank();
        let shard: Vec<Tensor> = x
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let per = if i == 1 || i == 2 || i == 4 { n } else { 1 };
                t.narrow(1, r * local * per, local * per)?.contiguous()
            })
            .collect::<candle_core::Result<_>>()?;
        let k5 = shard[1].reshape((1, local, n, h, d))?;
        let qk = Tensor::cat(&[&shard[0].unsqueeze(2)?, &k5], 2)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let vv = shard[2].flatten_all()?.to_vec1::<f32>()?;
        let aux = Tensor::cat(&[shard[3].flatten_all()?, shard[4].flatten_all()?], 0)?
            .to_vec1::<f32>()?;
        let sh = GdpShape::new(1, local, h, d, d, n, None);
        let px = PackedInputs {
            qk: &qk,
            v: &vv,
            aux: &aux,
            has_h0: false,
        };
        let grad = vec![0.5f32; sh.o_len() + sh.state_len()];
        let mut times = vec![vec![]; 6];
        for _ in 0..reps {
            let t0 = Instant::now();
            let local_sum: Vec<f32> = (0..h)
                .flat_map(|hd| {
                    forward_summary(&px.gather(&sh, &sh.seqs[0], hd), &dims, &vec![0.0; kv])
                        .into_rows()
                })
                .collect();
            let t1 = Instant::now();
            let all = comm.all_gather(&local_sum)?;
            let t2 = Instant::now();
            let gathered = Gathered::<Forward>::new(&all, cp, 1, h, (d, d))?;
            let mut h0 = vec![0.0f32; h * kv];
            for hd in 0..h {
                let s = fold_forward((0..r).map(|j| gathered.get(j, 0, hd)), d, d);
                h0[hd * kv..(hd + 1) * kv].copy_from_slice(&s);
            }
            cpu::forward(&px, &sh, dims.scale, Some(&h0))?;
            let t3 = Instant::now();
            let local_b: Vec<f32> = (0..h)
                .flat_map(|hd| {
                    backward_summary(
                        &px.gather(&sh, &sh.seqs[0], hd),
                        &dims,
                        &grad[..local * d],
                        &vec![0.0; kv],
                    )
                    .into_rows()
                })
                .collect();
            let t4 = Instant::now();
            let all = comm.all_gather(&local_b)?;
            let t5 = Instant::now();
            let gathered = Gathered::<Backward>::new(&all, cp, 1, h, (d, d))?;
            for hd in 0..h {
                let _ = fold_backward((r + 1..cp).map(|j| gathered.get(j, 0, hd)), d, d);
            }
            cpu::backward(&px, &sh, dims.scale, &grad, Some(&h0))?;
            let t6 = Instant::now();
            for (i, (a, b)) in [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6)]
                .iter()
                .enumerate()
            {
                times[i].push((*b - *a).as_secs_f64() * 1e3);
            }
        }
        Ok(times.into_iter().map(median).collect::<Vec<_>>())
    })?;
    for (r, t) in rows.iter().enumerate() {
        println!(
            "  {r:>4} {:>10.1} ms {:>10.1} ms {:>10.1} ms {:>10.1} ms {:>10.1} ms {:>10.1} ms",
            t[0], t[1], t[2], t[3], t[4], t[5]
        );
    }
    Ok(())
}
