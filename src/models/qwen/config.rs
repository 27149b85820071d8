//! [`QwenConfig`]: the text configuration of Qwen's Gated DeltaNet hybrids as Hugging Face
//! `config.json` files write it (transformers' `Qwen3_5TextConfig`, `Qwen3_5MoeTextConfig`,
//! `Qwen3NextConfig`), with transformers' defaults for missing keys.
//!
//! A vision-language checkpoint (`model_type` `qwen3_5` or `qwen3_5_moe`) nests the text
//! configuration under `text_config`; [`QwenConfig::from_json`] takes either form. RoPE settings
//! come from `rope_parameters` (transformers 5) or the top-level `rope_theta` and
//! `partial_rotary_factor` of older files.

use crate::error::GdpError;
use candle_core::Result;
use serde_json::Value;

/// Which checkpoint layout the weights follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QwenArch {
    /// Qwen3.5 and Qwen3.5-MoE: flat `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Qwen3_5,
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, interleaved per key-head group.
    Qwen3Next,
}

/// The token mixer of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// A Gated DeltaNet layer (`linear_attn`).
    Linear,
    /// Softmax attention with an output gate (`self_attn`).
    Full,
}

/// The feed-forward part of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpKind {
    /// SwiGLU of this width.
    Dense(usize),
    /// A sparse mixture of experts with a gated shared expert.
    Moe,
}

/// Hyper-parameters of a Qwen Gated DeltaNet hybrid, with the names of its `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct QwenConfig {
    /// The checkpoint's projection layout.
    pub arch: QwenArch,
    /// `model_type` of the text configuration (`qwen3_5_text`, `qwen3_5_moe_text`,
    /// `qwen3_next`).
    pub model_type: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width `D`.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads of the attention layers.
    pub num_attention_heads: usize,
    /// Key/value heads of the attention layers.
    pub num_key_value_heads: usize,
    /// Head dimension of the attention layers.
    pub head_dim: usize,
    /// Key heads `Hk` of the GDN layers.
    pub linear_num_key_heads: usize,
    /// Value heads `Hv` of the GDN layers (a multiple of `Hk`).
    pub linear_num_value_heads: usize,
    /// Key head dimension `dk` of the GDN layers.
    pub linear_key_head_dim: usize,
    /// Value head dimension `dv` of the GDN layers.
    pub linear_value_head_dim: usize,
    /// Short-convolution width `W`.
    pub linear_conv_kernel_dim: usize,
    /// The token mixer of each layer.
    pub layer_types: Vec<LayerKind>,
    /// Epsilon of every RMSNorm (the GDN layers' L2 norm uses a fixed 1e-6).
    pub rms_norm_eps: f64,
    /// The LM head is the token embedding matrix.
    pub tie_word_embeddings: bool,
    /// The attention projections have biases.
    pub attention_bias: bool,
    /// Dense MLP width (Qwen3.5 dense; Qwen3-Next's `mlp_only_layers`).
    pub intermediate_size: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// Fraction of `head_dim` that is rotated.
    pub partial_rotary_factor: f64,
    /// Routed experts (0: no mixture of experts).
    pub num_experts: usize,
    /// Experts per token (top-k).
    pub num_experts_per_tok: usize,
    /// Width of each routed expert's SwiGLU.
    pub moe_intermediate_size: usize,
    /// Width of the shared expert's SwiGLU.
    pub shared_expert_intermediate_size: usize,
    /// Every `decoder_sparse_step`-th layer is sparse (Qwen3-Next).
    pub decoder_sparse_step: usize,
    /// Layers with a dense MLP despite the above (Qwen3-Next).
    pub mlp_only_layers: Vec<usize>,
    /// Renormalise the top-k router probabilities.
    pub norm_topk_prob: bool,
}

impl QwenConfig {
    /// Parses a `config.json` (the text configuration, or a vision-language one with
    /// `text_config`), checks it and fills transformers' defaults.
    pub fn from_json(text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text)
            .map_err(|e| bad("config.json", format!("is not valid JSON: {e}")))?;
        let cfg = match root.get("text_config") {
            Some(t) if t.is_object() => t,
            _ => &root,
        };
        let outer = root.get("model_type").and_then(Value::as_str).unwrap_or("");
        let model_type = cfg
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or(outer)
            .to_string();
        let arch = match model_type.as_str() {
            "qwen3_next" => QwenArch::Qwen3Next,
            "qwen3_5" | "qwen3_5_text" | "qwen3_5_moe" | "qwen3_5_moe_text" => QwenArch::Qwen3_5,
            other => {
                return Err(bad(
                    "model_type",
                    format!(
                        "`{other}` is not a Qwen Gated DeltaNet hybrid (qwen3_5, qwen3_5_text, \
                         qwen3_5_moe, qwen3_5_moe_text, qwen3_next)"
                    ),
                ))
            }
        };
        let moe_default = model_type.starts_with("qwen3_5_moe") || arch == QwenArch::Qwen3Next;
        let r = Reader(cfg);
        let hidden_size = r.usize("hidden_size", None)?;
        let num_hidden_layers = r.usize("num_hidden_layers", None)?;
        let num_attention_heads = r.usize("num_attention_heads", Some(16))?;
        let head_dim = match r.opt_usize("head_dim")? {
            Some(d) => d,
            None => hidden_size / num_attention_heads.max(1),
        };
        let layer_types = match cfg.get("layer_types") {
            Some(Value::Array(list)) => list
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("linear_attention") => Ok(LayerKind::Linear),
                    Some("full_attention") => Ok(LayerKind::Full),
                    _ => Err(bad(
                        "layer_types",
                        format!(
                            "entry {i} is {v}, expected \"linear_attention\" or \"full_attention\""
                        ),
                    )),
                })
                .collect::<Result<Vec<_>>>()?,
            _ => {
                let every = r.usize("full_attention_interval", Some(4))?.max(1);
                (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % every == 0 {
                            LayerKind::Full
                        } else {
                            LayerKind::Linear
                        }
                    })
                    .collect()
            }
        };
        let rope = cfg.get("rope_parameters").filter(|v| v.is_object());
        let rope_f64 = |key: &str, default: f64| -> Result<f64> {
            let v = rope
                .and_then(|p| p.get(key))
                .or_else(|| cfg.get(key))
                .filter(|v| !v.is_null());
            match v {
                None => Ok(default),
                Some(v) => v
                    .as_f64()
                    .ok_or_else(|| bad(key, format!("expected a number, got {v}"))),
            }
        };
        let c = Self {
            arch,
            model_type,
            vocab_size: r.usize("vocab_size", None)?,
            hidden_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: r.usize("num_key_value_heads", Some(2))?,
            head_dim,
            linear_num_key_heads: r.usize("linear_num_key_heads", Some(16))?,
            linear_num_value_heads: r.usize("linear_num_value_heads", Some(32))?,
            linear_key_head_dim: r.usize("linear_key_head_dim", Some(128))?,
            linear_value_head_dim: r.usize("linear_value_head_dim", Some(128))?,
            linear_conv_kernel_dim: r.usize("linear_conv_kernel_dim", Some(4))?,
            layer_types,
            rms_norm_eps: r.f64("rms_norm_eps", 1e-6)?,
            // Vision-language checkpoints may set it on the wrapper only.
            tie_word_embeddings: r.bool(
                "tie_word_embeddings",
                Reader(&root).bool("tie_word_embeddings", false)?,
            )?,
            attention_bias: r.bool("attention_bias", false)?,
            intermediate_size: r.usize("intermediate_size", Some(0))?,
            rope_theta: rope_f64("rope_theta", 10_000.0)?,
            partial_rotary_factor: rope_f64("partial_rotary_factor", 0.25)?,
            num_experts: r.usize("num_experts", Some(if moe_default { 512 } else { 0 }))?,
            num_experts_per_tok: r.usize("num_experts_per_tok", Some(10))?,
            moe_intermediate_size: r.usize("moe_intermediate_size", Some(512))?,
            shared_expert_intermediate_size: r
                .usize("shared_expert_intermediate_size", Some(512))?,
            decoder_sparse_step: r.usize("decoder_sparse_step", Some(1))?,
            mlp_only_layers: match cfg.get("mlp_only_layers") {
                Some(Value::Array(l)) => l
                    .iter()
                    .map(|v| {
                        v.as_u64().map(|x| x as usize).ok_or_else(|| {
                            bad("mlp_only_layers", format!("entry {v} is not an index"))
                        })
                    })
                    .collect::<Result<Vec<_>>>()?,
                _ => vec![],
            },
            norm_topk_prob: r.bool("norm_topk_prob", true)?,
        };
        if let Some(act) = cfg.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" && act != "swish" {
                return Err(bad(
                    "hidden_act",
                    format!("`{act}` is not supported (silu only)"),
                ));
            }
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks the sizes: non-zero dimensions, `Hk` dividing `Hv`, attention heads a multiple
    /// of the key/value heads, one layer type per layer, an even rotary width.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(bad(name, "must be at least 1".into()));
            }
        }
        if !self
            .linear_num_value_heads
            .is_multiple_of(self.linear_num_key_heads)
        {
            return Err(bad(
                "linear_num_value_heads",
                format!(
                    "{} is not a multiple of linear_num_key_heads {}",
                    self.linear_num_value_heads, self.linear_num_key_heads
                ),
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(bad(
                "num_attention_heads",
                format!(
                    "{} is not a multiple of num_key_value_heads {}",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if self.layer_types.len() != self.num_hidden_layers {
            return Err(bad(
                "layer_types",
                format!(
                    "has {} entries for {} layers",
                    self.layer_types.len(),
                    self.num_hidden_layers
                ),
            ));
        }
        if !(0.0..=1.0).contains(&self.partial_rotary_factor)
            || !self.rotary_dim().is_multiple_of(2)
        {
            return Err(bad(
                "partial_rotary_factor",
                format!(
                    "{} of head_dim {} must give an even number of rotated dimensions",
                    self.partial_rotary_factor, self.head_dim
                ),
            ));
        }
        for l in 0..self.num_hidden_layers {
            let width = match self.mlp_kind(l) {
                MlpKind::Dense(w) => w,
                MlpKind::Moe => self.moe_intermediate_size.min(self.num_experts_per_tok),
            };
            if width == 0 {
                return Err(bad(
                    "intermediate_size",
                    format!("layer {l}: the MLP (or the experts, or top-k) has no width"),
                ));
            }
        }
        if self.num_experts > 0 && self.num_experts_per_tok > self.num_experts {
            return Err(bad(
                "num_experts_per_tok",
                format!(
                    "{} is more than num_experts {}",
                    self.num_experts_per_tok, self.num_experts
                ),
            ));
        }
        Ok(())
    }

    /// Rotated dimensions of each attention head: `head_dim · partial_rotary_factor`.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// Value heads per key head of the GDN layers, `r = Hv / Hk`.
    pub fn value_groups(&self) -> usize {
        self.linear_num_value_heads / self.linear_num_key_heads
    }

    /// Channels of the GDN layers' convolution, `C = 2·Hk·dk + Hv·dv` (`[q | k | v]`).
    pub fn conv_channels(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// The feed-forward part of layer `layer`: a mixture of experts where the model has experts
    /// (Qwen3-Next: every `decoder_sparse_step`-th layer outside `mlp_only_layers`), else SwiGLU.
    pub fn mlp_kind(&self, layer: usize) -> MlpKind {
        let sparse = self.num_experts > 0
            && !self.mlp_only_layers.contains(&layer)
            && (layer + 1).is_multiple_of(self.decoder_sparse_step.max(1));
        if sparse {
            MlpKind::Moe
        } else {
            MlpKind::Dense(self.intermediate_size)
        }
    }
}

fn bad(name: &str, reason: String) -> candle_core::Error {
    GdpError::Option {
        name: format!("config.json: {name}"),
        reason,
    }
    .into()
}

/// Typed reads of one JSON object's keys, with defaults.
struct Reader<'a>(&'a Value);

impl Reader<'_> {
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| bad(key, format!("expected a non-negative integer, got {v}"))),
        }
    }

    fn usize(&self, key: &str, default: Option<usize>) -> Result<usize> {
        match (self.opt_usize(key)?, default) {
            (Some(v), _) => Ok(v),
            (None, Some(d)) => Ok(d),
            (None, None) => Err(bad(key, "is missing".into())),
        }
    }

    fn f64(&self, key: &str, default: f64) -> Result<f64> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| bad(key, format!("expected a number, got {v}"))),
        }
    }

    fn bool(&self, key: &str, default: bool) -> Result<bool> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad(key, format!("expected true or false, got {v}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEXT: &str = r#"{"model_type": "qwen3_next", "vocab_size": 128, "hidden_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 24, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "intermediate_size": 96,
        "rope_theta": 10000, "partial_rotary_factor": 0.25}"#;

    #[test]
    fn qwen3_next_defaults_and_layer_pattern() -> Result<()> {
        let c = QwenConfig::from_json(NEXT)?;
        assert_eq!(c.arch, QwenArch::Qwen3Next);
        use LayerKind::{Full, Linear};
        assert_eq!(c.layer_types, [Linear, Linear, Linear, Full]);
        assert_eq!((c.rotary_dim(), c.value_groups()), (4, 2));
        assert_eq!(c.conv_channels(), 2 * 2 * 16 + 4 * 24);
        assert_eq!(c.mlp_kind(0), MlpKind::Moe);
        Ok(())
    }

    #[test]
    fn nested_text_config_and_rope_parameters() -> Result<()> {
        let text = r#"{"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text",
            "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 8, "linear_num_key_heads": 1,
            "linear_num_value_heads": 3, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
            "intermediate_size": 16, "layer_types": ["linear_attention", "full_attention"],
            "rope_parameters": {"rope_theta": 5e6, "partial_rotary_factor": 0.5,
                                "mrope_section": [1, 1, 0]}}}"#;
        let c = QwenConfig::from_json(text)?;
        assert_eq!(c.arch, QwenArch::Qwen3_5);
        assert_eq!((c.rope_theta, c.rotary_dim()), (5e6, 4));
        assert_eq!(c.mlp_kind(1), MlpKind::Dense(16));
        Ok(())
    }

    #[test]
    fn tied_embeddings_from_the_wrapper() -> Result<()> {
        let text = r#"{"model_type": "qwen3_5", "tie_word_embeddings": true,
            "text_config": {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "linear_num_key_heads": 1, "linear_num_value_heads": 1, "linear_key_head_dim": 4,
            "linear_value_head_dim": 4, "intermediate_size": 16}}"#;
        let c = QwenConfig::from_json(text)?;
        assert!(c.tie_word_embeddings);
        assert_eq!(c.model_type, "qwen3_5");
        Ok(())
    }

    #[test]
    fn bad_configs_name_the_key() {
        for (edit, key) in [
            (
                (
                    "\"linear_num_value_heads\": 4",
                    "\"linear_num_value_heads\": 3",
                ),
                "linear_num_value_heads",
            ),
            (
                (
                    "\"model_type\": \"qwen3_next\"",
                    "\"model_type\": \"llama\"",
                ),
                "model_type",
            ),
            (
                ("\"hidden_size\": 64", "\"hidden_size\": \"big\""),
                "hidden_size",
            ),
            (
                ("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 9"),
                "num_experts_per_tok",
            ),
        ] {
            let e = QwenConfig::from_json(&NEXT.replace(edit.0, edit.1))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
    }
}
