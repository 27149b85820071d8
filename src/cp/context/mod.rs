//! [`ContextParallel`]: one long sequence (or packed batch) sharded along time over several
//! Candle devices, one rank thread each, exact because ranks exchange affine state summaries.
//!
//! Two levels of API:
//! * per rank, inside the rank's own thread: [`cp_gated_delta_product`] on the rank's shard with
//!   a [`CpRank`] (communicator + metadata); `loss.backward()` on every rank then gives that
//!   rank's exact gradients;
//! * whole problem: [`ContextParallel::gated_delta_product`] shards full-sequence tensors, runs
//!   all ranks, and returns the gathered outputs, final states and gradients.

use super::agree::{agree, ProblemRecord};
use super::comm::{run_ranks, Communicator, DEFAULT_TIMEOUT};
use super::driver::CpLink;
use super::protocol::Composition;
use super::shard::{dense_rank_meta, packed_rank_meta, RankMeta, ShardPlan};
use crate::error::GdpError;
use crate::op::shape::GdpShape;
use crate::op::{apply, effective_scale, validate_fla, validate_packed, GdpOptions, QueryKeys};
use candle_core::{DType, Device, Result, Tensor, Var};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// One rank of a context-parallel group: its communicator and its packed-sequence metadata.
#[derive(Clone)]
pub struct CpRank {
    /// The group's communicator, as seen by this rank.
    pub comm: Arc<dyn Communicator>,
    /// Local `cu_seqlens` and causal slices (see [`super::shard`]).
    pub meta: RankMeta,
    /// How the gathered summaries are composed (the sequential fold by default).
    pub composition: Composition,
}

/// Gated DeltaProduct on one rank's shard. Inputs are the rank's contiguous slice of the
/// global tensors (`q [B, T_r, H, K]`, `k [B, T_r·n, H, K]`, ...); with packed sequences,
/// `opts.cu_seqlens` must be `rank.meta.local_cu_seqlens`.
///
/// The initial state of a sequence that continues from an earlier rank is the fold of the
/// preceding ranks' summaries (its row of `opts.initial_state` is ignored and gets a zero
/// gradient); the final-state gradient of a sequence that continues on a later rank receives
/// the fold of the following ranks' summaries in the backward. Every rank of the group must
/// call this the same number of times, in the same order.
pub fn cp_gated_delta_product(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    opts: &GdpOptions,
    rank: &CpRank,
) -> Result<(Tensor, Option<Tensor>)> {
    aborting_on_error(rank, || {
        let sh = validate_fla(q, k, v, g, beta, opts)?;
        apply_on_rank(QueryKeys::Split(q, k), v, g, beta, sh, opts, rank)
    })
}

/// [`cp_gated_delta_product`] on the packed query/key layout `qk [B, T_r, n+1, H, K]` of
/// [`crate::gated_delta_product_packed`] (slot 0 holds `q_t`, slot `1 + j` holds `k_{t·n+j}`),
/// so a model's fused `[q | k]` projection needs no copy. `v [B, T_r·n, H, V]`, `g [B, T_r, H]`,
/// `beta [B, T_r·n, H]`; returns `o [B, T_r, H, V]` and, when requested, the final states.
pub fn cp_gated_delta_product_packed(
    qk: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    opts: &GdpOptions,
    rank: &CpRank,
) -> Result<(Tensor, Option<Tensor>)> {
    aborting_on_error(rank, || {
        let sh = validate_packed(qk, v, g, beta, opts)?;
        apply_on_rank(QueryKeys::Packed(qk), v, g, beta, sh, opts, rank)
    })
}

/// Runs a rank's forward; any error aborts the group first, so that the peers fail within a
/// moment instead of waiting out the timeout in their next collective (the backward's errors
/// abort the group from inside the op, see [`CpLink`]).
fn aborting_on_error<T>(rank: &CpRank, f: impl FnOnce() -> Result<T>) -> Result<T> {
    f().inspect_err(|e| rank.comm.abort(&e.to_string()))
}

/// Checks the rank's offsets and applies the op with this rank's link to its group.
fn apply_on_rank(
    qk: QueryKeys,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    sh: GdpShape,
    opts: &GdpOptions,
    rank: &CpRank,
) -> Result<(Tensor, Option<Tensor>)> {
    if let Some(cu) = opts.cu_seqlens {
        if cu != rank.meta.local_cu_seqlens.as_slice() {
            return Err(GdpError::CuSeqlens(format!(
                "on a CP rank it must equal the rank's local offsets {:?}, got {cu:?}",
                rank.meta.local_cu_seqlens
            ))
            .into());
        }
    }
    let dtype = match qk {
        QueryKeys::Packed(qk) => qk.dtype(),
        QueryKeys::Split(q, _) => q.dtype(),
    };
    let packed = opts.cu_seqlens.is_some();
    let scale = effective_scale(opts, sh.dk);
    agree(
        &*rank.comm,
        ProblemRecord::new(&sh, dtype, packed, scale, rank.composition),
    )?;
    let link = CpLink::new(
        rank.comm.clone(),
        rank.meta.preceding_rank_start,
        rank.meta.following_rank_stop,
        packed,
        rank.composition,
    )?;
    apply(qk, v, g, beta, sh, opts, Some(Arc::new(link)))
}

/// Cotangents of a [`ContextParallel::gated_delta_product`] call: the loss is
/// `Σ dout·o + Σ dht·final_state`.
#[derive(Debug, Clone, Copy)]
pub struct Cotangents<'a> {
    /// `[B, T, H, V]`
    pub dout: &'a Tensor,
    /// `[N, H, K, V]`, optional.
    pub dht: Option<&'a Tensor>,
}

/// Gradients gathered from all ranks, each with its input's shape and dtype: the plain op's
/// [`crate::GdpGrads`].
pub type CpGrads = crate::op::GdpGrads;

/// Result of [`ContextParallel::gated_delta_product`], on the device of `q`.
#[derive(Debug, Clone)]
pub struct CpOutput {
    /// `[B, T, H, V]` in `q`'s dtype.
    pub o: Tensor,
    /// `[N, H, K, V]` f32, when requested.
    pub final_state: Option<Tensor>,
    /// When cotangents were given.
    pub grads: Option<CpGrads>,
}

/// A context-parallel group over Candle devices, one rank per device.
#[derive(Debug, Clone)]
pub struct ContextParallel {
    devices: Vec<Device>,
    timeout: Duration,
    composition: Composition,
}

/// What one rank returns to the gatherer: local outputs and gradients, on the rank's device
/// (its work finished), or on the CPU when they came through [`Problem::exchange`].
struct RankOut {
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

impl ContextParallel {
    /// A group with one rank per device (rank order = time order). Each rank's inputs are
    /// moved to its device. Every `Device::new_cuda(i)` call makes a distinct Candle device
    /// (own stream), so several ranks can share one GPU by calling it once per rank; keep using
    /// the same handle for a rank's tensors.
    pub fn new(devices: Vec<Device>) -> Result<Self> {
        if devices.is_empty() {
            return Err(GdpError::Option {
                name: "cp_size".into(),
                reason: "needs at least one device (rank)".into(),
            }
            .into());
        }
        Ok(Self {
            devices,
            timeout: DEFAULT_TIMEOUT,
            composition: Composition::Fold,
        })
    }

    /// `cp_size` ranks on the CPU.
    pub fn cpu(cp_size: usize) -> Result<Self> {
        Self::new(vec![Device::Cpu; cp_size])
    }

    /// How long a collective waits for its peers before every rank fails.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How ranks compose the gathered summaries: the sequential fold (default, cheapest when
    /// every rank composes its whole prefix itself, as here) or the log-depth Hillis–Steele scan
    /// (see [`super::protocol::scan_forward`]). Both give the same result up to rounding.
    pub fn with_composition(mut self, composition: Composition) -> Self {
        self.composition = composition;
        self
    }

    /// Number of ranks.
    pub fn cp_size(&self) -> usize {
        self.devices.len()
    }

    /// The ranks' devices.
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// Runs `f(rank, device)` on one thread per rank with an in-process communicator; the
    /// per-rank entry point for models. If a rank fails, every rank returns within the timeout
    /// and the root-cause error is returned.
    pub fn run<T: Send>(
        &self,
        f: impl Fn(Arc<dyn Communicator>, &Device) -> Result<T> + Sync,
    ) -> Result<Vec<T>> {
        run_ranks(self.cp_size(), self.timeout, |comm| {
            let comm: Arc<dyn Communicator> = Arc::new(comm.clone());
            f(comm.clone(), &self.devices[comm.rank()])
        })
    }

    /// Shards full-sequence inputs along time (shards differ by at most one token), runs the
    /// op on every rank, and gathers `o`, the final states and, with `cotangents`, all
    /// gradients. Arguments as in [`crate::gated_delta_product`]. Equal to the single-device op.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_product(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        opts: &GdpOptions,
        cotangents: Option<Cotangents>,
    ) -> Result<CpOutput> {
        let p = Problem::new(q, k, v, g, beta, opts, cotangents, self.cp_size())?;
        let outs = self.run(|comm, dev| p.run_rank(comm, dev, self.composition))?;
        p.gather(outs)
    }
}

/// The whole-problem call of [`ContextParallel::gated_delta_product`] for a multi-process
/// group: every process holds the full inputs (on the CPU, say, read from the same file), runs
/// its own rank's shard on `device` through `comm` (e.g. an `NcclComm` on `cuda:LOCAL_RANK`),
/// and gets back the gathered outputs, final states and gradients (on `q`'s device), equal to
/// the single-device op. The ranks' results are exchanged with one all-gather over `comm`,
/// through the host. A rank that fails aborts the group, so its peers fail instead of waiting.
#[allow(clippy::too_many_arguments)]
pub fn distributed_gated_delta_product(
    comm: Arc<dyn Communicator>,
    device: &Device,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    opts: &GdpOptions,
    cotangents: Option<Cotangents>,
    composition: Composition,
) -> Result<CpOutput> {
    let abort_on_err = |e: candle_core::Error| {
        comm.abort(&e.to_string());
        e
    };
    let p = Problem::new(q, k, v, g, beta, opts, cotangents, comm.world_size())
        .map_err(abort_on_err)?;
    let mine = p
        .run_rank(comm.clone(), device, composition)
        .map_err(abort_on_err)?;
    let outs = p.exchange(&*comm, mine)?;
    p.gather(outs)
}

/// A whole-problem context-parallel call: the full inputs, checked, and the shard plan.
struct Problem<'a> {
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
    #[allow(clippy::too_many_arguments)]
    fn new(
        q: &'a Tensor,
        k: &'a Tensor,
        v: &'a Tensor,
        g: &'a Tensor,
        beta: &'a Tensor,
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
    fn run_rank(
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
            dims.extend([
                vec![b, t, h, dk],
                vec![b, t * n, h, dk],
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
    fn exchange(&self, comm: &dyn Communicator, mine: RankOut) -> Result<Vec<RankOut>> {
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
    fn gather(&self, outs: Vec<RankOut>) -> Result<CpOutput> {
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
