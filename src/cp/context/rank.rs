//! The per-rank entry points: the op on one rank's shard, inside the rank's own thread or
//! process, with its communicator and metadata ([`CpRank`]).

use crate::cp::agree::{agree, ProblemRecord};
use crate::cp::comm::Communicator;
use crate::cp::driver::CpLink;
use crate::cp::protocol::Composition;
use crate::cp::shard::RankMeta;
use crate::error::GdpError;
use crate::op::shape::GdpShape;
use crate::op::{apply, effective_scale, validate_fla, validate_packed, GdpOptions, QueryKeys};
use candle_core::{Result, Tensor};
use std::sync::Arc;

/// One rank of a context-parallel group: its communicator and its packed-sequence metadata.
#[derive(Clone)]
pub struct CpRank {
    /// The group's communicator, as seen by this rank.
    pub comm: Arc<dyn Communicator>,
    /// Local `cu_seqlens` and causal slices (see [`crate::cp::shard`]).
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
        ProblemRecord::new(
            rank.comm.world_size(),
            &sh,
            dtype,
            packed,
            scale,
            rank.composition,
        ),
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
