//! [`ContextParallel`]: one long sequence (or packed batch) sharded along time over several
//! Candle devices, one rank thread each, exact because ranks exchange affine state summaries.
//!
//! Two levels of API:
//! * per rank, inside the rank's own thread: [`cp_gated_delta_product`] on the rank's shard with
//!   a [`CpRank`] (communicator + metadata); `loss.backward()` on every rank then gives that
//!   rank's exact gradients;
//! * whole problem: [`ContextParallel::gated_delta_product`] shards full-sequence tensors, runs
//!   all ranks, and returns the gathered outputs, final states and gradients.
//!
//! This module holds the whole-problem API; `rank` the per-rank entry points, `problem` the
//! sharding of a whole problem, one rank's part of it, and the gathering of the results.

mod problem;
mod rank;

pub use rank::{cp_gated_delta_product, cp_gated_delta_product_packed, CpRank};

use super::comm::{run_ranks, Communicator, DEFAULT_TIMEOUT};
use super::protocol::Composition;
use crate::error::GdpError;
use crate::op::GdpOptions;
use candle_core::{Device, Result, Tensor};
use problem::Problem;
use std::sync::Arc;
use std::time::Duration;

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
    #[expect(
        clippy::too_many_arguments,
        reason = "the op's own positional inputs (q, k, v, g, beta, opts), as in the single-device op and FLA"
    )]
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
        let p = Problem::new([q, k, v, g, beta], opts, cotangents, self.cp_size())?;
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
#[expect(
    clippy::too_many_arguments,
    reason = "the op's own positional inputs (q, k, v, g, beta, opts), as in the single-device op and FLA"
)]
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
    let p = Problem::new([q, k, v, g, beta], opts, cotangents, comm.world_size())
        .map_err(abort_on_err)?;
    let mine = p
        .run_rank(comm.clone(), device, composition)
        .map_err(abort_on_err)?;
    let outs = p.exchange(&*comm, mine)?;
    p.gather(outs)
}
