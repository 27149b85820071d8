//! [`GdpConfig`]: flash-linear-attention's `GatedDeltaProductConfig`, key for key.
//!
//! A `config.json` written by FLA
//! (`fla/models/gated_deltaproduct/configuration_gated_deltaproduct.py`) deserialises as is; keys
//! this crate does not use (`fuse_*`, `use_l2warp`, `model_type`, ...) are ignored. Missing keys
//! take FLA's *config* defaults, which differ from the *layer* defaults in
//! `fla/layers/gated_deltaproduct.py` (the config has `use_forget_gate = false`,
//! `allow_neg_eigval = false`, `num_householder = 1`; the layer has `true, true, 2`).

use crate::error::GdpError;
use candle_core::Result;
use serde::{Deserialize, Serialize};

/// Model hyper-parameters with FLA's key names and defaults.
///
/// Sizes that FLA derives inside its modules are methods here: [`GdpConfig::head_k_dim`],
/// [`GdpConfig::head_v_dim`], [`GdpConfig::key_dim`], [`GdpConfig::value_dim`],
/// [`GdpConfig::num_v_heads`], [`GdpConfig::intermediate_size`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GdpConfig {
    /// `"chunk"` or `"fused_recurrent"`; both compute the same function (FLA switches to the
    /// recurrent kernel for short inputs anyway). Kept for round-tripping.
    pub attn_mode: String,
    /// Short-convolution kernel width `W`.
    pub conv_size: usize,
    /// Key head dimension `K` (FLA: `head_k_dim = head_dim`).
    pub head_dim: usize,
    /// Number of query/key heads `H`.
    pub num_heads: usize,
    /// Model width `D`.
    pub hidden_size: usize,
    /// Value head dimension as a multiple of `head_dim`: `V = int(head_dim · expand_v)`.
    pub expand_v: f64,
    /// Gate the output norm with `silu(g_proj(x))` (`FusedRMSNormGated`); plain `RMSNorm` when
    /// `false`. Older FLA configs call this `use_gate`.
    #[serde(alias = "use_gate")]
    pub use_output_gate: bool,
    /// Depthwise causal short convolution + SiLU on q, k, v; plain SiLU when `false`.
    pub use_short_conv: bool,
    /// Unused by the recurrent model; kept for round-tripping.
    pub max_position_embeddings: usize,
    /// MLP width ratio used when `intermediate_size` is absent (FLA treats `None` as 4).
    pub hidden_ratio: Option<f64>,
    /// MLP width; derived from `hidden_ratio` when absent (see [`GdpConfig::intermediate_size`]).
    pub intermediate_size: Option<usize>,
    /// MLP activation; FLA's `GatedMLP` only supports `"swish"` (`"silu"` accepted here too).
    pub hidden_act: String,
    /// Number of blocks.
    pub num_hidden_layers: usize,
    /// Epsilon of every RMSNorm (block norms, final norm, output norm).
    pub norm_eps: f64,
    /// Hybrid softmax-attention layers (`{"layers": [...], "num_heads": ...}`); not supported
    /// here: a config that names layers is rejected by [`GdpConfig::validate`].
    pub attn: Option<serde_json::Value>,
    /// Kept for round-tripping.
    pub use_cache: bool,
    /// Padding token id (the embedding row is an ordinary row at inference).
    pub pad_token_id: Option<u32>,
    /// Beginning-of-sequence token id.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token id.
    pub eos_token_id: Option<u32>,
    /// Share `lm_head.weight` with `model.embeddings.weight`.
    pub tie_word_embeddings: bool,
    /// Standard deviation of FLA's normal initialiser; used for fresh weights here.
    pub initializer_range: f64,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Data-dependent forget gate `g = -exp(A_log) · softplus(a_proj(x) + dt_bias)`; `g = 0`
    /// (no decay) and no `a_proj`, `A_log`, `dt_bias` weights when `false`.
    pub use_forget_gate: bool,
    /// `beta = 2 · sigmoid(b_proj(x))` instead of `sigmoid(b_proj(x))`, so that the Householder
    /// factors may have eigenvalue down to -1.
    pub allow_neg_eigval: bool,
    /// Householder sub-steps per token `n`.
    pub num_householder: usize,
    /// Extension (FLA's layer argument, absent from its config, where it is always `num_heads`):
    /// value heads for grouped value attention; `q`, `k` are repeated `num_v_heads / num_heads`
    /// times per head.
    pub num_v_heads: Option<usize>,
    /// Extension (FLA's layer argument `conv_bias`, `false` in every FLA model): the short
    /// convolutions carry a bias `*_conv1d.bias`.
    pub conv_bias: bool,
    /// Block attention residuals (FLA 0.6's `attnres_block_size`); not supported here: a
    /// config that sets it is rejected by [`GdpConfig::validate`].
    pub attnres_block_size: Option<usize>,
}

impl Default for GdpConfig {
    /// FLA's `GatedDeltaProductConfig()` defaults.
    fn default() -> Self {
        Self {
            attn_mode: "chunk".into(),
            conv_size: 4,
            head_dim: 256,
            num_heads: 6,
            hidden_size: 2048,
            expand_v: 2.0,
            use_output_gate: true,
            use_short_conv: true,
            max_position_embeddings: 2048,
            hidden_ratio: Some(4.0),
            intermediate_size: None,
            hidden_act: "swish".into(),
            num_hidden_layers: 21,
            norm_eps: 1e-6,
            attn: None,
            use_cache: true,
            pad_token_id: None,
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            tie_word_embeddings: false,
            initializer_range: 0.02,
            vocab_size: 32000,
            use_forget_gate: false,
            allow_neg_eigval: false,
            num_householder: 1,
            num_v_heads: None,
            conv_bias: false,
            attnres_block_size: None,
        }
    }
}

fn bad(name: &str, reason: String) -> candle_core::Error {
    GdpError::Option {
        name: name.into(),
        reason,
    }
    .into()
}

impl GdpConfig {
    /// A small model for tests and examples: `D = 32`, `H = 2`, `K = 8`, `V = 16`, `n = 2`,
    /// two blocks, vocabulary 64, forget gate and negative eigenvalues on.
    pub fn tiny() -> Self {
        Self {
            conv_size: 4,
            head_dim: 8,
            num_heads: 2,
            hidden_size: 32,
            expand_v: 2.0,
            intermediate_size: Some(64),
            num_hidden_layers: 2,
            vocab_size: 64,
            use_forget_gate: true,
            allow_neg_eigval: true,
            num_householder: 2,
            ..Self::default()
        }
    }

    /// Parses a FLA `config.json`.
    pub fn from_json(json: &str) -> Result<Self> {
        let cfg: Self = serde_json::from_str(json).map_err(candle_core::Error::wrap)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Key head dimension `K`.
    pub fn head_k_dim(&self) -> usize {
        self.head_dim
    }

    /// Value head dimension `V = int(head_dim · expand_v)` (truncated, as FLA's `int(...)`).
    pub fn head_v_dim(&self) -> usize {
        (self.head_dim as f64 * self.expand_v) as usize
    }

    /// Value heads: `num_v_heads`, or `num_heads` when absent.
    pub fn num_v_heads(&self) -> usize {
        self.num_v_heads.unwrap_or(self.num_heads)
    }

    /// Heads of the recurrence (and of the state): the value heads.
    pub fn state_heads(&self) -> usize {
        self.num_v_heads()
    }

    /// How many value heads share one query/key head (1 without grouped value attention).
    pub fn gva_groups(&self) -> usize {
        (self.num_v_heads() / self.num_heads.max(1)).max(1)
    }

    /// Width of `q_proj`: `num_heads · K`. `k_proj` is `n` times as wide.
    pub fn key_dim(&self) -> usize {
        self.num_heads * self.head_k_dim()
    }

    /// Width of `g_proj` and the input of `o_proj`: `num_v_heads · V`. `v_proj` is `n` times as
    /// wide.
    pub fn value_dim(&self) -> usize {
        self.num_v_heads() * self.head_v_dim()
    }

    /// Householder sub-steps per token `n`.
    pub fn num_householder(&self) -> usize {
        self.num_householder
    }

    /// MLP width: `intermediate_size`, or FLA's `GatedMLP` rule
    /// `256 · ceil(int(D · hidden_ratio · 2/3) / 256)` with `hidden_ratio` defaulting to 4.
    pub fn intermediate_size(&self) -> usize {
        match self.intermediate_size {
            Some(i) => i,
            None => {
                let ratio = self.hidden_ratio.unwrap_or(4.0);
                let raw = (self.hidden_size as f64 * ratio * 2.0 / 3.0) as usize;
                256 * raw.div_ceil(256)
            }
        }
    }

    /// Checks what FLA's constructors assert, plus what this port does not support.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("num_heads", self.num_heads),
            ("head_dim", self.head_dim),
            ("num_householder", self.num_householder),
            ("num_hidden_layers", self.num_hidden_layers),
            ("vocab_size", self.vocab_size),
            ("conv_size", self.conv_size),
            ("num_v_heads", self.num_v_heads()),
        ] {
            if v == 0 {
                return Err(bad(name, "must be at least 1".into()));
            }
        }
        let hv = self.head_dim as f64 * self.expand_v;
        if !hv.is_finite() || hv < 1.0 || (hv - self.head_v_dim() as f64).abs() > 1e-5 * hv {
            return Err(bad(
                "expand_v",
                format!(
                    "head_dim · expand_v = {} · {} must be a positive integer",
                    self.head_dim, self.expand_v
                ),
            ));
        }
        let nv = self.num_v_heads();
        if nv < self.num_heads || !nv.is_multiple_of(self.num_heads) {
            return Err(bad(
                "num_v_heads",
                format!(
                    "must be a multiple of num_heads = {}, got {nv}",
                    self.num_heads
                ),
            ));
        }
        if !matches!(self.hidden_act.as_str(), "swish" | "silu") {
            return Err(bad(
                "hidden_act",
                format!("only \"swish\" is supported, got {:?}", self.hidden_act),
            ));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps >= 0.0) {
            return Err(bad(
                "norm_eps",
                format!("must be finite and >= 0, got {}", self.norm_eps),
            ));
        }
        if self.intermediate_size() == 0 {
            return Err(bad("intermediate_size", "must be at least 1".into()));
        }
        if self.attnres_block_size.is_some() {
            return Err(GdpError::Unsupported(
                "block attention residuals (`attnres_block_size`)".into(),
            )
            .into());
        }
        if let Some(attn) = &self.attn {
            let has_layers = attn
                .get("layers")
                .and_then(|l| l.as_array())
                .is_some_and(|l| !l.is_empty());
            if has_layers {
                return Err(GdpError::Unsupported(
                    "hybrid softmax-attention layers (`attn.layers`)".into(),
                )
                .into());
            }
        }
        Ok(())
    }
}
