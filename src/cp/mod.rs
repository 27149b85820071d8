//! Context parallelism (CP): the time axis is sharded over a group of ranks, each rank summarises
//! its shard, the summaries are all-gathered and folded (`megatron_cp.md` §5).
//!
//! * [`shard`]: the shard plan and the per-rank metadata of packed sequences;
//! * `agree`: the ranks' check that they run the same problem, before the first summary;
//! * [`summary`]: the typed summaries `[ΔS | M]` (forward), `[γ | Mᵀ]` (backward);
//! * [`protocol`]: how a fragment's summaries are computed and composed (fold or scan);
//! * [`driver`]: a rank's pass (widened by the transition's columns) → all-gather → fold →
//!   correct, run inside the op's forward and backward (`docs/cp.md`);
//! * [`context`]: [`ContextParallel`] and the per-rank entry points;
//! * [`comm`]: the [`Communicator`] trait and its transports (in-process threads; NCCL across
//!   processes with the `nccl` feature), the multi-process rendezvous;
//! * [`mod@bench`]: one rank timed alone on one device against the plain op (`gdp cp-bench`).

mod agree;
pub mod bench;
pub mod comm;
pub mod context;
pub mod driver;
pub mod protocol;
pub mod shard;
pub mod summary;

pub use bench::{rank_alone, RankBenchConfig, RankBenchReport};
#[cfg(feature = "nccl")]
pub use comm::NcclComm;
pub use comm::{
    run_ranks, Communicator, DistEnv, ReplicaComm, SingleComm, ThreadComm, DEFAULT_TIMEOUT,
};
pub use context::{
    cp_gated_delta_product, cp_gated_delta_product_packed, distributed_gated_delta_product,
    ContextParallel, Cotangents, CpGrads, CpOutput, CpRank,
};
pub use protocol::Composition;
pub use shard::{
    dense_rank_meta, packed_rank_meta, packed_rank_meta_from_seq_ids, RankMeta, ShardPlan,
};
pub use summary::{BackwardSummary, ForwardSummary};
