//! Decode caches: per layer, the short-convolution histories and the recurrent state, as FLA's
//! `Cache` holds them (`conv_state = (q, k, v)`, `recurrent_state`).

use super::config::GdpConfig;
use candle_core::{DType, Device, Result, Tensor};

/// What one [`super::GatedDeltaProduct`] layer carries from one call to the next.
#[derive(Debug, Clone)]
pub struct LayerCache {
    /// History of `q_conv1d`, `[B, key_dim, W]` (FLA's conv-cache layout: column `W - 1` is the
    /// latest input). `None` when the config has no short convolution.
    pub conv_q: Option<Tensor>,
    /// History of `k_conv1d`, `[B, n · key_dim, W]`.
    pub conv_k: Option<Tensor>,
    /// History of `v_conv1d`, `[B, n · value_dim, W]`.
    pub conv_v: Option<Tensor>,
    /// Recurrent state `S`, `[B, num_v_heads, K, V]`, always f32.
    pub recurrent: Tensor,
    /// Tokens consumed so far.
    pub seen_tokens: usize,
}

impl LayerCache {
    /// An empty cache (zero histories, zero state) for `batch` sequences; conv histories in
    /// `dtype` (the model's), the state in f32.
    pub fn new(cfg: &GdpConfig, batch: usize, dtype: DType, device: &Device) -> Result<Self> {
        cfg.validate()?;
        let n = cfg.num_householder();
        let w = cfg.conv_size;
        let conv = |c: usize| -> Result<Option<Tensor>> {
            if cfg.use_short_conv {
                Ok(Some(Tensor::zeros((batch, c, w), dtype, device)?))
            } else {
                Ok(None)
            }
        };
        Ok(Self {
            conv_q: conv(cfg.key_dim())?,
            conv_k: conv(n * cfg.key_dim())?,
            conv_v: conv(n * cfg.value_dim())?,
            recurrent: Tensor::zeros(
                (batch, cfg.state_heads(), cfg.head_k_dim(), cfg.head_v_dim()),
                DType::F32,
                device,
            )?,
            seen_tokens: 0,
        })
    }

    /// Batch size `B` the cache was made for.
    pub fn batch(&self) -> usize {
        self.recurrent.dims().first().copied().unwrap_or(0)
    }
}

/// The caches of a whole [`super::GdpForCausalLM`], one per block.
#[derive(Debug, Clone)]
pub struct Cache {
    /// One cache per block, in order.
    pub layers: Vec<LayerCache>,
}

impl Cache {
    /// Empty caches for every block (see [`LayerCache::new`]).
    pub fn new(cfg: &GdpConfig, batch: usize, dtype: DType, device: &Device) -> Result<Self> {
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| LayerCache::new(cfg, batch, dtype, device))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { layers })
    }

    /// Tokens consumed so far (0 for a fresh cache).
    pub fn seen_tokens(&self) -> usize {
        self.layers.first().map_or(0, |l| l.seen_tokens)
    }
}
