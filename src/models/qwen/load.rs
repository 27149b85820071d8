//! Reading a Hugging Face checkpoint directory: `config.json`, and the weights of
//! `model.safetensors` or of the shards that `model.safetensors.index.json` lists.
//! Vision-language checkpoints keep the text weights under `model.language_model.`; the
//! vision tower (`model.visual.*`) and the multi-token-prediction head (`mtp.*`) are never read.

use super::config::QwenConfig;
use super::model::QwenHybrid;
use crate::error::GdpError;
use candle_core::{DType, Device, Result};
use candle_nn::VarBuilder;
use std::path::{Path, PathBuf};

/// The safetensors files of the checkpoint in `dir`: the shards named by
/// `model.safetensors.index.json` (each once, in order), else `model.safetensors`.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index)?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| GdpError::Option {
                name: index.display().to_string(),
                reason: format!("is not valid JSON: {e}"),
            })?;
        let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
            return Err(GdpError::Option {
                name: index.display().to_string(),
                reason: "has no `weight_map` object".into(),
            }
            .into());
        };
        let mut files: Vec<String> = map
            .values()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
        files.sort();
        files.dedup();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(GdpError::Option {
        name: dir.display().to_string(),
        reason: "holds neither model.safetensors nor model.safetensors.index.json".into(),
    }
    .into())
}

/// Loads the model in `dir` (a Hugging Face checkpoint of Qwen3.5, Qwen3.5-MoE or Qwen3-Next)
/// with its weights in `dtype` on `device`.
pub fn load_dir(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<QwenHybrid> {
    let dir = dir.as_ref();
    let config = dir.join("config.json");
    let text = std::fs::read_to_string(&config).map_err(|e| GdpError::Option {
        name: config.display().to_string(),
        reason: format!("cannot be read: {e}"),
    })?;
    let cfg = QwenConfig::from_json(&text)?;
    let files = weight_files(dir)?;
    // SAFETY: the files are memory-mapped read-only; they must not change while the model
    // loads (candle's safetensors loading has the same contract).
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device)? };
    let text_prefix = if vb.contains_tensor("model.language_model.embed_tokens.weight") {
        "model.language_model"
    } else {
        "model"
    };
    QwenHybrid::new(&cfg, vb, text_prefix)
}
