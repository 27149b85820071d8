//! The sparse mixture of experts of Qwen3-Next and Qwen3.5-MoE (`mlp`): a softmax router over
//! `E` experts (f32), the top-k of each token, renormalised (`norm_topk_prob`), SwiGLU experts,
//! and a shared expert scaled by `sigmoid(shared_expert_gate(x))`.
//!
//! Experts load from per-expert tensors (`experts.{e}.gate_proj.weight`, `up_proj`,
//! `down_proj`, as the released checkpoints store them) or from the fused ones transformers 5
//! writes (`experts.gate_up_proj [E, 2I, D]`, gate rows first, and `experts.down_proj
//! [E, D, I]`).

use super::config::QwenConfig;
use super::layers::SwiGlu;
use candle_core::{DType, Result, Tensor};
use candle_nn::{Linear, Module, VarBuilder};

/// One sparse MoE block.
#[derive(Debug, Clone)]
pub struct SparseMoe {
    /// `[E, D]`, f32.
    router: Tensor,
    experts: Vec<SwiGlu>,
    shared: SwiGlu,
    /// `[1, D]`.
    shared_gate: Linear,
    top_k: usize,
    renormalise: bool,
}

impl SparseMoe {
    /// Loads the block from `vb` (`…layers.{i}.mlp`).
    pub fn new(cfg: &QwenConfig, vb: VarBuilder) -> Result<Self> {
        let (e, d, i) = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size);
        let ev = vb.pp("experts");
        let experts = if ev.contains_tensor("gate_up_proj") {
            let gate_up = ev.get((e, 2 * i, d), "gate_up_proj")?;
            let down = ev.get((e, d, i), "down_proj")?;
            (0..e)
                .map(|x| Ok(SwiGlu::from_weights(gate_up.get(x)?, down.get(x)?)))
                .collect::<Result<Vec<_>>>()?
        } else {
            (0..e)
                .map(|x| SwiGlu::new(d, i, ev.pp(x)))
                .collect::<Result<Vec<_>>>()?
        };
        Ok(Self {
            router: vb.get((e, d), "gate.weight")?.to_dtype(DType::F32)?,
            experts,
            shared: SwiGlu::new(
                d,
                cfg.shared_expert_intermediate_size,
                vb.pp("shared_expert"),
            )?,
            shared_gate: Linear::new(vb.get((1, d), "shared_expert_gate.weight")?, None),
            top_k: cfg.num_experts_per_tok,
            renormalise: cfg.norm_topk_prob,
        })
    }

    /// `x [B, T, D] -> [B, T, D]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let xs = x.reshape((b * t, d))?;
        let logits = xs.to_dtype(DType::F32)?.matmul(&self.router.t()?)?;
        let probs = candle_nn::ops::softmax_last_dim(&logits)?.to_vec2::<f32>()?;
        // Per expert: the tokens routed to it and their weights.
        let mut routed: Vec<(Vec<u32>, Vec<f32>)> = vec![(vec![], vec![]); self.experts.len()];
        for (tok, p) in probs.iter().enumerate() {
            let mut order: Vec<usize> = (0..p.len()).collect();
            // Highest probability first; ties to the lower expert index, as torch.topk. Only the
            // top k are sorted (hundreds of experts, a handful chosen).
            let first = |a: &usize, b: &usize| p[*b].total_cmp(&p[*a]).then(a.cmp(b));
            order.select_nth_unstable_by(self.top_k - 1, first);
            order[..self.top_k].sort_by(first);
            let top = &order[..self.top_k];
            let sum: f32 = top.iter().map(|&e| p[e]).sum();
            for &e in top {
                let w = if self.renormalise { p[e] / sum } else { p[e] };
                routed[e].0.push(tok as u32);
                routed[e].1.push(w);
            }
        }
        let mut out = xs.zeros_like()?;
        for (expert, (tokens, weights)) in self.experts.iter().zip(routed) {
            if tokens.is_empty() {
                continue;
            }
            let n = tokens.len();
            let idx = Tensor::from_vec(tokens, n, xs.device())?;
            let w = Tensor::from_vec(weights, (n, 1), xs.device())?.to_dtype(xs.dtype())?;
            let y = expert
                .forward(&xs.index_select(&idx, 0)?)?
                .broadcast_mul(&w)?;
            out = out.index_add(&idx, &y, 0)?;
        }
        let gate = candle_nn::ops::sigmoid(&self.shared_gate.forward(&xs)?)?;
        let shared = self.shared.forward(&xs)?.broadcast_mul(&gate)?;
        (out + shared)?.reshape((b, t, d))
    }
}
