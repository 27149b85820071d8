//! A whole-problem context-parallel call ([`Problem`]): the full inputs checked and planned,
//! one rank's shard run through the per-rank entry point, the ranks' results exchanged between
//! processes, and gathered into the whole problem's outputs and gradients.

use super::{cp_gated_delta_product, Cotangents, CpGrads, CpOutput, CpRank};
use crate::cp::comm::Communicator;
use crate::cp::protocol::Composition;
use crate::cp::shard::{dense_rank_meta, packed_rank_meta, ShardPlan};
use crate::error::GdpError;
use crate::op::shape::GdpShape;
use crate::op::{validate_fla, GdpOptions};
use candle_core::{DType, Device, Result, Tensor, Var};
use std::ops::Range;
use std::sync::Arc;

/// What one rank returns to the gatherer: local outputs and gradients, on the rank's device
/// (its work finished), or on the CPU when they came through [`Problem::exchange`].
pub(super) struct RankOut {
    o: Tensor,
    ht: Tensor,
    grads: Option<Vec<Tensor>>,
    dh0: Option<Tensor>,
}

impl RankOut {
    /// `[o, ht, dq, dk, dv, dg, dbeta, dh0]`, the present ones.
    fn tensors(&self) -> Vec<Tensor> {
        let mut ts = vec![self.o.clone(), self.ht.clone()];
        ts.extend(self.grads.iter().flatten().cloned());
        ts.extend(self.dh0.iter().cloned());
        ts
    }

    fn from_tensors(ts: Vec<Tensor>, grads: bool, dh0: bool) -> Self {
        let mut it = ts.into_iter();
        let (o, ht) = (it.next().expect("o"), it.next().expect("ht"));
        let grads = grads.then(|| it.by_ref().take(5).collect());
        let dh0 = if dh0 { it.next() } else { None };
        Self { o, ht, grads, dh0 }
    }
}

/// A whole-problem context-parallel call: the full inputs, checked, and the shard plan.
pub(super) struct Problem<'a> {
    q: &'a Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
    g: &'a Tensor,
    beta: &'a Tensor,
    opts: &'a GdpOptions<'a>,
    cotangents: Option<Cotangents<'a>>,
    sh: GdpShape,
    plan: ShardPlan,
    cu: Option<Vec<usize>>,
}

impl<'a> Problem<'a> {
    /// Checks the inputs `[q, k, v, g, beta]` (as [`crate::gated_delta_product`] takes them)
    /// and plans their shards over `cp_size` ranks.
    pub(super) fn new(
        [q, k, v, g, beta]: [&'a Tensor; 5],
        opts: &'a GdpOptions<'a>,
        cotangents: Option<Cotangents<'a>>,
        cp_size: usize,
    ) -> Result<Self> {
        let sh = validate_fla(q, k, v, g, beta, opts)?;
        let plan = ShardPlan::new(sh.tokens, cp_size)?;
        let cu = opts.cu_seqlens.map(<[usize]>::to_vec);
        Ok(Self {
            q,
            k,
            v,
            g,
            beta,
            opts,
            cotangents,
            sh,
            plan,
            cu,
        })
    }

    /// One rank's part: its shard on `dev`, the op (forward and, with cotangents, backward)
    /// through `comm`; local outputs and gradients on `dev`.
    pub(super) fn run_rank(
        &self,
        comm: Arc<dyn Communicator>,
        dev: &Device,
        composition: Composition,
    ) -> Result<RankOut> {
        let composition = &composition;
        let Problem {
            q,
            k,
            v,
            g,
            beta,
            opts,
            cotangents,
            sh,
            plan,
            cu,
        } = self;
        let n = sh.n;
        let r = comm.rank();
        let range = plan.range(r)?;
        let (meta, ids) = match &cu {
            Some(cu) => (packed_rank_meta(cu, plan, r)?, local_seq_ids(cu, &range)),
            None => (dense_rank_meta(plan, r)?, (0..sh.batch).collect()),
        };
        let packed = cu.is_some();
        let continues_out = meta.following_rank_stop > r + 1;
        let shard = |x: &Tensor, per_token: usize| -> Result<Tensor> {
            x.narrow(1, range.start * per_token, range.len() * per_token)?
                .to_device(dev)
        };
        let var = |t: Tensor| Var::from_tensor(&t);
        let (qv, kv, vv) = (var(shard(q, 1)?)?, var(shard(k, n)?)?, var(shard(v, n)?)?);
        let (gv, bv) = (var(shard(g, 1)?)?, var(shard(beta, n)?)?);
        let h0 = match opts.initial_state {
            Some(h0) => Some(var(rows(h0, &ids)?.to_device(dev)?)?),
            None => None,
        };
        let local_opts = GdpOptions {
            num_householder: Some(n),
            scale: opts.scale,
            initial_state: h0.as_ref().map(|v| v.as_tensor()),
            output_final_state: true,
            cu_seqlens: packed.then_some(meta.local_cu_seqlens.as_slice()),
            // The rank's forward keeps its intermediates (of the folded initial states) for its
            // backward when asked to, as the plain op does.
            save_intermediates: opts.save_intermediates,
            kernels: opts.kernels,
        };
        let rank = CpRank {
            comm,
            meta: meta.clone(),
            composition: *composition,
        };
        let (o, ht) = cp_gated_delta_product(&qv, &kv, &vv, &gv, &bv, &local_opts, &rank)?;
        let Some(ht) = ht else {
            candle_core::bail!(
                "context parallelism, rank {r}: the local op returned no final state although \
                 `output_final_state` was set"
            );
        };
        let (grads, dh0) = match cotangents {
            None => (None, None),
            Some(ct) => {
                let dout = shard(ct.dout, 1)?;
                let dht = match ct.dht {
                    None => None,
                    Some(dht) => {
                        // Only sequences that end on this rank see the final-state cotangent.
                        let mut local = rows(dht, &ids)?.to_dtype(DType::F32)?;
                        let last = ids.len() - 1;
                        if continues_out {
                            let keep: Vec<usize> =
                                if packed { (0..last).collect() } else { vec![] };
                            local = zero_except(&local, &keep)?;
                        }
                        Some(local.to_device(dev)?)
                    }
                };
                let mut pairs = vec![(&o, &dout)];
                if let Some(dht) = &dht {
                    pairs.push((&ht, dht));
                }
                let gs = crate::autograd::backward_with(&pairs)?;
                let get = |v: &Var| -> Result<Tensor> {
                    match gs.get(v.as_tensor()) {
                        Some(g) => Ok(g.clone()),
                        None => v.as_tensor().zeros_like(),
                    }
                };
                let grads = vec![get(&qv)?, get(&kv)?, get(&vv)?, get(&gv)?, get(&bv)?];
                let dh0 = match &h0 {
                    Some(h) => Some(get(h)?),
                    None => None,
                };
                (Some(grads), dh0)
            }
        };
        // The gatherer copies these on another thread and stream.
        dev.synchronize()?;
        Ok(RankOut { o, ht, grads, dh0 })
    }

    /// Shapes of rank `r`'s [`RankOut`] tensors, in [`RankOut::tensors`] order.
    fn rank_dims(&self, r: usize, grads: bool, dh0: bool) -> Result<Vec<Vec<usize>>> {
        let range = self.plan.range(r)?;
        let sh = &self.sh;
        let (b, t, h, dk, dv, n) = (sh.batch, range.len(), sh.heads, sh.dk, sh.dv, sh.n);
        let ns = match &self.cu {
            Some(cu) => local_seq_ids(cu, &range).len(),
            None => b,
        };
        let mut dims = vec![vec![b, t, h, dv], vec![ns, h, dk, dv]];
        if grads {
            let hk = self.q.dim(2)?;
            dims.extend([
                vec![b, t, hk, dk],
                vec![b, t * n, hk, dk],
                vec![b, t * n, h, dv],
                vec![b, t, h],
                vec![b, t * n, h],
            ]);
            if dh0 {
                dims.push(vec![ns, h, dk, dv]);
            }
        }
        Ok(dims)
    }

    /// Every rank's [`RankOut`], from one all-gather of the f32-flattened, zero-padded local
    /// results (each rank computes every rank's shapes from the plan, so no sizes are sent).
    pub(super) fn exchange(&self, comm: &dyn Communicator, mine: RankOut) -> Result<Vec<RankOut>> {
        let world = comm.world_size();
        let (grads, dh0) = (mine.grads.is_some(), mine.dh0.is_some());
        let mine_t = mine.tensors();
        let dtypes: Vec<DType> = mine_t.iter().map(|t| t.dtype()).collect();
        let dims = (0..world)
            .map(|r| self.rank_dims(r, grads, dh0))
            .collect::<Result<Vec<_>>>()?;
        let lens: Vec<usize> = dims
            .iter()
            .map(|d| d.iter().map(|s| s.iter().product::<usize>()).sum())
            .collect();
        let width = lens.iter().copied().max().unwrap_or(0);
        let mut local = Vec::with_capacity(width);
        for t in &mine_t {
            local.extend(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
        if local.len() != lens[comm.rank()] {
            let e = GdpError::Comm(format!(
                "rank {}: local results have {} values, the plan expects {}",
                comm.rank(),
                local.len(),
                lens[comm.rank()]
            ));
            comm.abort(&e.to_string());
            return Err(e.into());
        }
        local.resize(width, 0.0);
        let all = comm.all_gather(&local)?;
        let mut outs = Vec::with_capacity(world);
        for (r, shapes) in dims.iter().enumerate() {
            let mut at = r * width;
            let mut ts = Vec::with_capacity(shapes.len());
            for (shape, &dt) in shapes.iter().zip(&dtypes) {
                let len: usize = shape.iter().product();
                let data = all[at..at + len].to_vec();
                at += len;
                ts.push(Tensor::from_vec(data, shape.as_slice(), &Device::Cpu)?.to_dtype(dt)?);
            }
            outs.push(RankOut::from_tensors(ts, grads, dh0));
        }
        Ok(outs)
    }

    /// Concatenates the ranks' outputs along time and places every sequence's final state
    /// (from the rank where it ends) and initial-state gradient (from the rank where it starts).
    pub(super) fn gather(&self, outs: Vec<RankOut>) -> Result<CpOutput> {
        let (q, opts, cotangents, plan) = (self.q, self.opts, self.cotangents, &self.plan);
        let cu = self.cu.as_deref();
        let dev = q.device();
        // Every piece goes to `q`'s device first (device to device where both are GPUs).
        let cat = |xs: Vec<&Tensor>| -> Result<Tensor> {
            let xs = xs
                .into_iter()
                .map(|x| x.to_device(dev))
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&xs, 1)
        };
        let o = cat(outs.iter().map(|r| &r.o).collect())?;
        let last = outs.len() - 1;
        // Per global sequence: (rank, local index) where it starts and where it ends.
        let (starts, ends): (Vec<_>, Vec<_>) = match cu {
            None => {
                let b = outs[0].o.dim(0)?;
                (
                    (0..b).map(|i| Some((0, i))).collect(),
                    (0..b).map(|i| Some((last, i))).collect(),
                )
            }
            Some(cu) => {
                let locals: Vec<Vec<usize>> =
                    plan.ranges().iter().map(|r| local_seq_ids(cu, r)).collect();
                let find = |j: usize, first: bool| -> Option<(usize, usize)> {
                    let mut it = locals
                        .iter()
                        .enumerate()
                        .filter_map(|(r, ids)| ids.iter().position(|&x| x == j).map(|i| (r, i)));
                    if first {
                        it.next()
                    } else {
                        it.next_back()
                    }
                };
                (0..cu.len() - 1)
                    .map(|j| (find(j, true), find(j, false)))
                    .unzip()
            }
        };
        let pick = |src: &dyn Fn(usize) -> Option<Tensor>,
                    at: &[Option<(usize, usize)>],
                    empty: &dyn Fn(usize) -> Result<Tensor>|
         -> Result<Tensor> {
            let rows: Vec<Tensor> = at
                .iter()
                .enumerate()
                .map(|(j, loc)| match loc {
                    Some((r, i)) => src(*r).expect("present").narrow(0, *i, 1)?.to_device(dev),
                    None => empty(j),
                })
                .collect::<Result<_>>()?;
            Tensor::cat(&rows, 0)
        };
        let h0_row = |j: usize| -> Result<Tensor> {
            match opts.initial_state {
                Some(h0) => h0.narrow(0, j, 1)?.to_dtype(DType::F32)?.to_device(dev),
                None => {
                    let (_, h, k, v) = outs[0].ht.dims4()?;
                    Tensor::zeros((1, h, k, v), DType::F32, dev)
                }
            }
        };
        let final_state = if opts.output_final_state {
            Some(pick(&|r| Some(outs[r].ht.clone()), &ends, &h0_row)?)
        } else {
            None
        };
        let grads = match (cotangents, outs[0].grads.is_some()) {
            (Some(ct), true) => {
                let g = |i: usize| {
                    cat(outs
                        .iter()
                        .map(|r| &r.grads.as_ref().expect("grads")[i])
                        .collect())
                };
                let dh0 = match opts.initial_state {
                    None => None,
                    Some(h0) => {
                        // An empty sequence passes its state through: dh0 = dht.
                        let dht_row = |j: usize| -> Result<Tensor> {
                            match ct.dht {
                                Some(d) => d.narrow(0, j, 1)?.to_dtype(h0.dtype())?.to_device(dev),
                                None => h0.narrow(0, j, 1)?.zeros_like()?.to_device(dev),
                            }
                        };
                        Some(pick(&|r| outs[r].dh0.clone(), &starts, &dht_row)?)
                    }
                };
                Some(CpGrads {
                    dq: g(0)?,
                    dk: g(1)?,
                    dv: g(2)?,
                    dg: g(3)?,
                    dbeta: g(4)?,
                    dh0,
                })
            }
            _ => None,
        };
        Ok(CpOutput {
            o,
            final_state,
            grads,
        })
    }
}

/// Global ids of the non-empty sequences that overlap the token range, in order.
fn local_seq_ids(cu: &[usize], range: &Range<usize>) -> Vec<usize> {
    (0..cu.len() - 1)
        .filter(|&j| cu[j] < cu[j + 1] && cu[j] < range.end && cu[j + 1] > range.start)
        .collect()
}

/// Rows `ids` of a `[N, ...]` tensor (a copy).
fn rows(x: &Tensor, ids: &[usize]) -> Result<Tensor> {
    let idx = Tensor::new(
        ids.iter().map(|&i| i as u32).collect::<Vec<_>>(),
        x.device(),
    )?;
    x.index_select(&idx, 0)
}

/// `x` with every row except `keep` set to zero.
fn zero_except(x: &Tensor, keep: &[usize]) -> Result<Tensor> {
    let n = x.dim(0)?;
    let mask: Vec<f32> = (0..n)
        .map(|i| if keep.contains(&i) { 1.0 } else { 0.0 })
        .collect();
    let mut shape = vec![n];
    shape.extend(std::iter::repeat_n(1, x.rank() - 1));
    x.broadcast_mul(&Tensor::from_vec(mask, shape, x.device())?.to_dtype(x.dtype())?)
}
