//! The causal language model, FLA's `GatedDeltaProductForCausalLM`
//! (`fla/models/gated_deltaproduct/modeling_gated_deltaproduct.py`): embeddings, pre-norm blocks
//! (`x + attn(attn_norm x)`, then `x + mlp(mlp_norm x)`), final norm, `lm_head`.

use super::cache::Cache;
use super::config::GdpConfig;
use super::layer::{linear, GatedDeltaProduct};
use super::norm::RmsNorm;
use crate::error::GdpError;
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Embedding, Init, Linear, VarBuilder};

/// FLA's `GatedMLP` (SwiGLU): `down_proj(silu(gate_proj x) · up_proj x)`, all bias-free:
/// `gate_proj.weight [I, D]`, `up_proj.weight [I, D]`, `down_proj.weight [D, I]`.
#[derive(Debug, Clone)]
pub struct GatedMlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl GatedMlp {
    /// Loads the three projections from `vb` (e.g. `vb.pp("model.layers.0.mlp")`).
    pub fn new(cfg: &GdpConfig, vb: VarBuilder) -> Result<Self> {
        let (d, i) = (cfg.hidden_size, cfg.intermediate_size());
        Ok(Self {
            gate_proj: linear(d, i, cfg, vb.pp("gate_proj"))?,
            up_proj: linear(d, i, cfg, vb.pp("up_proj"))?,
            down_proj: linear(i, d, cfg, vb.pp("down_proj"))?,
        })
    }
}

impl Module for GatedMlp {
    /// `x [..., D] -> [..., D]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = (self.gate_proj.forward(x)?.silu()? * self.up_proj.forward(x)?)?;
        self.down_proj.forward(&h)
    }
}

/// One block: `attn_norm`, `attn` (a [`GatedDeltaProduct`]), `mlp_norm`, `mlp`.
#[derive(Debug, Clone)]
pub struct GdpBlock {
    attn_norm: RmsNorm,
    attn: GatedDeltaProduct,
    mlp_norm: RmsNorm,
    mlp: GatedMlp,
}

impl GdpBlock {
    /// Loads block `layer_idx` from `vb` (e.g. `vb.pp("model.layers.0")`).
    pub fn new(cfg: &GdpConfig, layer_idx: usize, vb: VarBuilder) -> Result<Self> {
        let (d, eps) = (cfg.hidden_size, cfg.norm_eps);
        Ok(Self {
            attn_norm: RmsNorm::new(d, eps, vb.pp("attn_norm"))?,
            attn: GatedDeltaProduct::new(cfg, layer_idx, vb.pp("attn"))?,
            mlp_norm: RmsNorm::new(d, eps, vb.pp("mlp_norm"))?,
            mlp: GatedMlp::new(cfg, vb.pp("mlp"))?,
        })
    }

    /// `x [B, T, D] -> [B, T, D]`; see [`GatedDeltaProduct::forward`] for the cache.
    pub fn forward(&self, x: &Tensor, cache: Option<&mut super::LayerCache>) -> Result<Tensor> {
        let x = (x + self.attn.forward(&self.attn_norm.forward(x)?, cache)?)?;
        &x + self.mlp.forward(&self.mlp_norm.forward(&x)?)?
    }

    /// The block with the token mixer replaced by `mix(attn, attn_norm x)` (e.g. the
    /// context-parallel mixer of `super::cp`): `x [B, T, D] -> [B, T, D]`.
    pub(super) fn forward_with<F>(&self, x: &Tensor, mix: F) -> Result<Tensor>
    where
        F: FnOnce(&GatedDeltaProduct, &Tensor) -> Result<Tensor>,
    {
        let x = (x + mix(&self.attn, &self.attn_norm.forward(x)?)?)?;
        &x + self.mlp.forward(&self.mlp_norm.forward(&x)?)?
    }
}

/// The causal LM with FLA's parameter names: `model.embeddings.weight [vocab, D]`,
/// `model.layers.{i}.{attn_norm, attn, mlp_norm, mlp}.*`, `model.norm.weight [D]` and
/// `lm_head.weight [vocab, D]` (absent, and taken from the embeddings, when
/// `tie_word_embeddings`).
#[derive(Debug, Clone)]
pub struct GdpForCausalLM {
    embeddings: Embedding,
    layers: Vec<GdpBlock>,
    norm: RmsNorm,
    lm_head: Linear,
    cfg: GdpConfig,
}

impl GdpForCausalLM {
    /// Builds the model from `vb` (the checkpoint's root). Fresh embeddings and linear weights
    /// are `N(0, initializer_range)`, as FLA's `_init_weights`.
    pub fn new(cfg: &GdpConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let (d, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let vm = vb.pp("model");
        let emb_w = vm.pp("embeddings").get_with_hints(
            (vocab, d),
            "weight",
            Init::Randn {
                mean: 0.0,
                stdev: cfg.initializer_range,
            },
        )?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| GdpBlock::new(cfg, i, vm.pp(format!("layers.{i}"))))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(d, cfg.norm_eps, vm.pp("norm"))?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(emb_w.clone(), None)
        } else {
            linear(d, vocab, cfg, vb.pp("lm_head"))?
        };
        Ok(Self {
            embeddings: Embedding::new(emb_w, d),
            layers,
            norm,
            lm_head,
            cfg: cfg.clone(),
        })
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> &GdpConfig {
        &self.cfg
    }

    /// Final hidden states: `input_ids [B, T]` (u32 or i64) `-> [B, T, D]`, after `model.norm`.
    pub fn forward_hidden(&self, input_ids: &Tensor, cache: Option<&mut Cache>) -> Result<Tensor> {
        self.check_ids(input_ids)?;
        let mut x = self.embeddings.forward(input_ids)?;
        match cache {
            None => {
                for layer in &self.layers {
                    x = layer.forward(&x, None)?;
                }
            }
            Some(cache) => {
                if cache.layers.len() != self.layers.len() {
                    return Err(GdpError::Option {
                        name: "cache".into(),
                        reason: format!(
                            "has {} layer caches, the model {} layers",
                            cache.layers.len(),
                            self.layers.len()
                        ),
                    }
                    .into());
                }
                for (layer, lc) in self.layers.iter().zip(cache.layers.iter_mut()) {
                    x = layer.forward(&x, Some(lc))?;
                }
            }
        }
        self.norm.forward(&x)
    }

    /// Logits: `input_ids [B, T]` (u32 or i64) `-> [B, T, vocab]`. With a cache (see
    /// [`Cache::new`]) the call continues the cached sequences: prefill with `T > 1`, decode
    /// with `T == 1`, in any mix.
    pub fn forward(&self, input_ids: &Tensor, cache: Option<&mut Cache>) -> Result<Tensor> {
        self.lm_head
            .forward(&self.forward_hidden(input_ids, cache)?)
    }

    /// Checks `input_ids [B, T]` (non-empty, integer, inside the vocabulary); returns `(B, T)`.
    pub(super) fn check_ids(&self, input_ids: &Tensor) -> Result<(usize, usize)> {
        let (b, t) = input_ids.dims2().map_err(|_| GdpError::Rank {
            name: "input_ids".into(),
            expected: 2,
            layout: "[B, T]",
            got: input_ids.dims().to_vec(),
        })?;
        if b == 0 || t == 0 {
            return Err(GdpError::Empty {
                name: "input_ids".into(),
                got: input_ids.dims().to_vec(),
            }
            .into());
        }
        if !matches!(input_ids.dtype(), DType::U32 | DType::I64 | DType::U8) {
            return Err(GdpError::DType {
                name: "input_ids".into(),
                expected: "an integer dtype (u32, i64 or u8)",
                got: input_ids.dtype(),
            }
            .into());
        }
        let flat = input_ids.to_dtype(DType::I64)?.flatten_all()?;
        let (lo, hi) = (
            flat.min(0)?.to_scalar::<i64>()?,
            flat.max(0)?.to_scalar::<i64>()?,
        );
        if lo < 0 || hi as usize >= self.cfg.vocab_size {
            let id = if lo < 0 { lo } else { hi };
            return Err(GdpError::Option {
                name: "input_ids".into(),
                reason: format!(
                    "id {id} is outside the vocabulary 0..{}",
                    self.cfg.vocab_size
                ),
            }
            .into());
        }
        Ok((b, t))
    }

    /// The pieces of the model, for the context-parallel forward (`super::cp`): the embedding,
    /// the blocks, the final norm and the LM head.
    pub(super) fn parts(&self) -> (&Embedding, &[GdpBlock], &RmsNorm, &Linear) {
        (&self.embeddings, &self.layers, &self.norm, &self.lm_head)
    }
}
