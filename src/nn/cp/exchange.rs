//! The [`CpContext`] of a rank and its tagged collectives: the differentiable short-convolution
//! halo exchange and the collective shard check (ordering rules: see [`super`]).

use crate::cp::{Communicator, RankMeta};
use crate::error::GdpError;
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Marks a tagged collective's header.
const MAGIC: f32 = 6_911.0;
/// Header entries are integers below 2^24, exact in f32.
const WRAP: u64 = 1 << 24;

/// One rank's handle for the context-parallel model: the communicator of the CP group (rank
/// order = time order) and the sequence number of its tagged collectives.
pub struct CpContext {
    comm: Arc<dyn Communicator>,
    seq: AtomicU64,
}

impl std::fmt::Debug for CpContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpContext")
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .field("seq", &self.seq.load(Ordering::Relaxed))
            .finish()
    }
}

impl CpContext {
    /// A context for `comm`'s rank, e.g. from [`crate::cp::ContextParallel::run`]. Create one per
    /// rank and reuse it: its sequence numbers must advance in step on all ranks.
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self {
            comm,
            seq: AtomicU64::new(0),
        }
    }

    /// The group's communicator.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// The dense-batch metadata of a shard of `len` tokens: forward fold over `[0, r)`,
    /// backward fold over `(r, world)`.
    pub fn rank_meta(&self, len: usize) -> RankMeta {
        RankMeta {
            local_cu_seqlens: vec![0, len],
            preceding_rank_start: 0,
            following_rank_stop: self.comm.world_size(),
        }
    }

    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed) % WRAP
    }
}

/// What a tagged collective is for (part of its header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Shapes = 0,
    HaloForward = 1,
    HaloBackward = 2,
}

/// All-gathers `data` with a `[MAGIC, seq, kind, len]` header and checks that every rank sent
/// the same header; returns the ranks' payloads in rank order. On a mismatch the group aborts.
fn tagged_all_gather(
    comm: &dyn Communicator,
    seq: u64,
    kind: Kind,
    data: &[f32],
) -> Result<Vec<Vec<f32>>> {
    let header = [
        MAGIC,
        seq as f32,
        kind as u8 as f32,
        (data.len() as u64 % WRAP) as f32,
    ];
    let mut buf = header.to_vec();
    buf.extend_from_slice(data);
    let all = comm.all_gather(&buf)?;
    let per = buf.len();
    if all.len() != per * comm.world_size() {
        return Err(GdpError::Comm(format!("all_gather returned {} values", all.len())).into());
    }
    let parts: Vec<&[f32]> = all.chunks(per).collect();
    if let Some((r, p)) = parts.iter().enumerate().find(|(_, p)| p[..4] != header) {
        let reason = format!(
            "rank {}: collective order mismatch: sent [magic, seq, kind, len] = {header:?}, \
             rank {r} sent {:?} (every rank must run the same CP graph, see nn::cp)",
            comm.rank(),
            &p[..4]
        );
        comm.abort(&reason);
        return Err(GdpError::Comm(reason).into());
    }
    Ok(parts.into_iter().map(|p| p[4..].to_vec()).collect())
}

/// The differentiable halo exchange on a tail `[B, W-1, C]` (f32): forward returns rank
/// `r - 1`'s tail (zeros on rank 0); backward returns rank `r + 1`'s halo gradient (zeros on
/// the last rank) as the tail's gradient.
struct HaloExchange {
    comm: Arc<dyn Communicator>,
    seq: u64,
}

impl HaloExchange {
    /// Gathers `data` and returns the buffer of the rank `r - 1` (forward) or `r + 1`.
    fn shift(&self, data: &[f32], kind: Kind) -> Result<Vec<f32>> {
        let (r, world) = (self.comm.rank(), self.comm.world_size());
        let from = match kind {
            Kind::HaloForward => r.checked_sub(1),
            _ => Some(r + 1).filter(|&s| s < world),
        };
        if world == 1 {
            return Ok(vec![0.0; data.len()]);
        }
        let mut parts = tagged_all_gather(self.comm.as_ref(), self.seq, kind, data)?;
        Ok(match from {
            Some(s) => std::mem::take(&mut parts[s]),
            None => vec![0.0; data.len()],
        })
    }
}

impl CustomOp1 for HaloExchange {
    fn name(&self) -> &'static str {
        "cp-halo-exchange"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg("cp halo: tail must be contiguous".into()))?;
        let out = self.shift(&s.as_slice::<f32>()?[a..b], Kind::HaloForward)?;
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let g = grad.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let out = self.shift(&g, Kind::HaloBackward)?;
        Ok(Some(Tensor::from_vec(out, grad.shape(), grad.device())?))
    }
}

/// Differentiable halo exchange: `tail [B, W-1, C]` (this rank's last `W - 1` conv inputs)
/// `->` the previous rank's tail `[B, W-1, C]` (zeros on rank 0), in `tail`'s dtype. Its
/// gradient is the next rank's halo gradient. A collective: every rank must call it (see the
/// module docs). The exchange itself runs on a host copy of the tail.
pub fn halo_exchange(tail: &Tensor, ctx: &CpContext) -> Result<Tensor> {
    let op = HaloExchange {
        comm: ctx.comm.clone(),
        seq: ctx.next_seq(),
    };
    // The wire is host f32 anyway (see `Communicator`): run the op on a host copy, so it works
    // for tails on any device (both moves are differentiable).
    tail.to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .contiguous()?
        .apply_op1(op)?
        .to_device(tail.device())?
        .to_dtype(tail.dtype())
}

/// Collectively checks the shards (same `B` on every rank, `T_r >= W - 1` with short
/// convolutions); returns every rank's shard length, in rank order. Every rank gets the same
/// verdict.
pub(crate) fn check_shards(
    ctx: &CpContext,
    b: usize,
    t: usize,
    w: usize,
    conv: bool,
) -> Result<Vec<usize>> {
    let parts = tagged_all_gather(
        ctx.comm.as_ref(),
        ctx.next_seq(),
        Kind::Shapes,
        &[b as f32, t as f32],
    )?;
    let need = if conv { w.saturating_sub(1).max(1) } else { 1 };
    for (r, p) in parts.iter().enumerate() {
        let (rb, rt) = (p[0] as usize, p[1] as usize);
        if rb != b {
            return Err(GdpError::Option {
                name: "input_ids".into(),
                reason: format!(
                    "rank {r} has batch {rb}, rank {} batch {b}",
                    ctx.comm.rank()
                ),
            }
            .into());
        }
        if rt < need {
            return Err(GdpError::Option {
                name: "input_ids".into(),
                reason: format!(
                    "rank {r} holds a shard of {rt} tokens, but the short convolution (width \
                     {w}) needs at least {need} per rank: use fewer ranks or a longer sequence"
                ),
            }
            .into());
        }
    }
    Ok(parts.iter().map(|p| p[1] as usize).collect())
}
