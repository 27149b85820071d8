//! [`QwenHybrid`]: the decoder of Qwen3.5 (dense and MoE) and Qwen3-Next, with a decode cache.

use super::attention::{GatedAttention, KvCache};
use super::config::{LayerKind, MlpKind, QwenConfig};
use super::gdn::{GatedDeltaNet, GdnCache};
use super::layers::{OffsetRmsNorm, SwiGlu};
use super::moe::SparseMoe;
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::{Embedding, Linear, Module, VarBuilder};

/// A layer's token mixer.
#[derive(Debug, Clone)]
pub(super) enum Mixer {
    Linear(GatedDeltaNet),
    Full(GatedAttention),
}

/// A layer's feed-forward part.
#[derive(Debug, Clone)]
pub(super) enum Ffn {
    Dense(SwiGlu),
    Moe(SparseMoe),
}

/// One decoder layer: `x + mixer(norm(x))`, then `x + ffn(norm(x))`.
#[derive(Debug, Clone)]
pub(super) struct DecoderLayer {
    pub input_norm: OffsetRmsNorm,
    pub mixer: Mixer,
    pub post_norm: OffsetRmsNorm,
    pub ffn: Ffn,
}

impl Ffn {
    /// `x [B, T, D] -> [B, T, D]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Ffn::Dense(m) => m.forward(x),
            Ffn::Moe(m) => m.forward(x),
        }
    }
}

/// What one layer carries between calls.
#[derive(Debug, Clone)]
pub enum LayerCache {
    /// A Gated DeltaNet layer's convolution history and recurrent state.
    Linear(GdnCache),
    /// An attention layer's keys and values.
    Full(KvCache),
}

/// The decode cache of a whole model: one entry per layer, and the tokens seen.
#[derive(Debug, Clone)]
pub struct QwenCache {
    /// One entry per decoder layer, of its mixer's kind.
    pub layers: Vec<LayerCache>,
    /// Tokens consumed so far (the position of the next one).
    pub seen_tokens: usize,
}

/// A Qwen Gated DeltaNet hybrid for causal language modelling (`Qwen3_5ForCausalLM`,
/// `Qwen3_5MoeForCausalLM`, the text part of `Qwen3_5ForConditionalGeneration`,
/// `Qwen3NextForCausalLM`): token embeddings, the decoder layers, the final norm and the LM
/// head (the embeddings when tied).
#[derive(Debug, Clone)]
pub struct QwenHybrid {
    cfg: QwenConfig,
    embed: Embedding,
    layers: Vec<DecoderLayer>,
    norm: OffsetRmsNorm,
    lm_head: Linear,
    dtype: DType,
    device: Device,
}

/// Qwen3.5 and Qwen3.5-MoE ([`QwenHybrid`] in the flat projection layout).
pub type Qwen3_5 = QwenHybrid;
/// Qwen3-Next and Qwen3-Coder-Next ([`QwenHybrid`] in the grouped projection layout).
pub type Qwen3Next = QwenHybrid;

impl QwenHybrid {
    /// Builds the model from `vb`, whose root holds `lm_head.weight` and, under `text`, the
    /// decoder (`embed_tokens`, `layers.{i}`, `norm`): `text` is `model` or, for a
    /// vision-language checkpoint, `model.language_model`.
    pub fn new(cfg: &QwenConfig, vb: VarBuilder, text: &str) -> Result<Self> {
        cfg.validate()?;
        let tv = vb.pp(text);
        let d = cfg.hidden_size;
        let embed_w = tv.get((cfg.vocab_size, d), "embed_tokens.weight")?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let lv = tv.pp(format!("layers.{i}"));
                let mixer = match cfg.layer_types[i] {
                    LayerKind::Linear => {
                        Mixer::Linear(GatedDeltaNet::new(cfg, lv.pp("linear_attn"))?)
                    }
                    LayerKind::Full => Mixer::Full(GatedAttention::new(cfg, lv.pp("self_attn"))?),
                };
                let ffn = match cfg.mlp_kind(i) {
                    MlpKind::Dense(w) => Ffn::Dense(SwiGlu::new(d, w, lv.pp("mlp"))?),
                    MlpKind::Moe => Ffn::Moe(SparseMoe::new(cfg, lv.pp("mlp"))?),
                };
                Ok(DecoderLayer {
                    input_norm: OffsetRmsNorm::new(d, cfg.rms_norm_eps, lv.pp("input_layernorm"))?,
                    mixer,
                    post_norm: OffsetRmsNorm::new(
                        d,
                        cfg.rms_norm_eps,
                        lv.pp("post_attention_layernorm"),
                    )?,
                    ffn,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_w.clone()
        } else {
            vb.get((cfg.vocab_size, d), "lm_head.weight")?
        };
        Ok(Self {
            cfg: cfg.clone(),
            embed: Embedding::new(embed_w, d),
            layers,
            norm: OffsetRmsNorm::new(d, cfg.rms_norm_eps, tv.pp("norm"))?,
            lm_head: Linear::new(lm_head, None),
            dtype: vb.dtype(),
            device: vb.device().clone(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &QwenConfig {
        &self.cfg
    }

    /// The weights' dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The weights' device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// An empty cache for `batch` sequences.
    pub fn empty_cache(&self, batch: usize) -> Result<QwenCache> {
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Linear(g) => Ok(LayerCache::Linear(g.empty_cache(
                    batch,
                    self.dtype,
                    &self.device,
                )?)),
                Mixer::Full(_) => Ok(LayerCache::Full(KvCache::default())),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(QwenCache {
            layers,
            seen_tokens: 0,
        })
    }

    /// Logits `[B, T, vocab]` (f32) of `input_ids [B, T]` (u32). With `cache`, the tokens
    /// continue those it has seen (prefill, then one token at a time to decode), and it is
    /// updated; without, they are a whole sequence.
    pub fn forward(&self, input_ids: &Tensor, cache: Option<&mut QwenCache>) -> Result<Tensor> {
        let h = self.forward_hidden(input_ids, cache)?;
        self.lm_head.forward(&h)?.to_dtype(DType::F32)
    }

    /// The final hidden states `[B, T, D]` (after the final norm), as [`Self::forward`].
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        mut cache: Option<&mut QwenCache>,
    ) -> Result<Tensor> {
        let (_, t) = input_ids.dims2()?;
        if let Some(c) = cache.as_ref() {
            if c.layers.len() != self.layers.len() {
                candle_core::bail!(
                    "qwen: the cache has {} layers, the model {}",
                    c.layers.len(),
                    self.layers.len()
                );
            }
        }
        let mut x = self.embed.forward(input_ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let lc = cache.as_mut().map(|c| &mut c.layers[i]);
            let y = layer.input_norm.forward(&x)?;
            let y = match (&layer.mixer, lc) {
                (Mixer::Linear(g), None) => g.forward(&y, None)?,
                (Mixer::Linear(g), Some(LayerCache::Linear(c))) => g.forward(&y, Some(c))?,
                (Mixer::Full(a), None) => a.forward(&y, None)?,
                (Mixer::Full(a), Some(LayerCache::Full(c))) => a.forward(&y, Some(c))?,
                _ => candle_core::bail!("qwen: layer {i}'s cache is of the other kind"),
            };
            x = (x + y)?;
            let y = layer.post_norm.forward(&x)?;
            x = (&x + layer.ffn.forward(&y)?)?;
        }
        if let Some(c) = cache {
            c.seen_tokens += t;
        }
        self.norm.forward(&x)
    }

    /// The token embeddings of `input_ids [B, T]`: `[B, T, D]`.
    pub(super) fn embed_tokens(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.embed.forward(input_ids)
    }

    /// The decoder layers.
    pub(super) fn decoder_layers(&self) -> &[DecoderLayer] {
        &self.layers
    }

    /// Logits `[B, T, vocab]` (f32) of the last layer's output `x [B, T, D]`.
    pub(super) fn head(&self, x: &Tensor) -> Result<Tensor> {
        self.lm_head
            .forward(&self.norm.forward(x)?)?
            .to_dtype(DType::F32)
    }
}
