//! Shared by the `finetune` and `generate` examples: the byte-level corpus, the checkpoint
//! directory (`model.safetensors` + `config.json`), seeded initialisation, chunked prefill,
//! top-p sampling and streaming UTF-8 output. Each example includes it with
//! `#[path = "../common/mod.rs"] mod common;`, so not every item is used by every example.
#![allow(dead_code)]

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, IndexOp, Tensor, Var, D};
use candle_gdp::nn::{Cache, GdpConfig, GdpForCausalLM};
use candle_nn::{VarBuilder, VarMap};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The bundled public-domain text (see `examples/data/README.md`).
pub const DEFAULT_DATA: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/examples/data/devils_dictionary.txt"
);
/// File names inside a checkpoint directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";
pub const CONFIG_FILE: &str = "config.json";

/// Byte-level tokenisation: one token per byte, vocabulary 256, no special tokens.
pub const BYTE_VOCAB: usize = 256;

/// A text as bytes, split into a training part and a held-out tail.
pub struct ByteCorpus {
    pub train: Vec<u8>,
    pub valid: Vec<u8>,
}

impl ByteCorpus {
    /// Reads `path` and keeps the last `valid_frac` of it for validation.
    pub fn load(path: &Path, valid_frac: f64) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let n_valid = (bytes.len() as f64 * valid_frac) as usize;
        let split = bytes.len() - n_valid;
        Ok(Self {
            train: bytes[..split].to_vec(),
            valid: bytes[split..].to_vec(),
        })
    }
}

/// `batch` random contiguous windows of `seq_len + 1` bytes from `data`: inputs are the first
/// `seq_len` bytes of each window, targets the last `seq_len` (next-byte prediction). Both
/// `[batch, seq_len]` u32.
pub fn sample_windows(
    data: &[u8],
    batch: usize,
    seq_len: usize,
    rng: &mut StdRng,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    if data.len() < seq_len + 1 {
        bail!(
            "text of {} bytes is too short for --seq-len {seq_len}",
            data.len()
        );
    }
    let (mut xs, mut ys) = (Vec::with_capacity(batch * seq_len), Vec::new());
    for _ in 0..batch {
        let start = rng.random_range(0..=data.len() - seq_len - 1);
        let w = &data[start..start + seq_len + 1];
        xs.extend(w[..seq_len].iter().map(|&b| b as u32));
        ys.extend(w[1..].iter().map(|&b| b as u32));
    }
    Ok((
        Tensor::from_vec(xs, (batch, seq_len), device)?,
        Tensor::from_vec(ys, (batch, seq_len), device)?,
    ))
}

/// Redraws every variable from `seed` (Candle's CPU RNG cannot be seeded), with the same
/// distributions as the library's fresh initialisers: linear weights and embeddings
/// `N(0, initializer_range)`, norm weights 1, `A_log ~ U(0, ln 16)`,
/// `dt_bias ~ U(softplus⁻¹(0.001), softplus⁻¹(0.1))`, short convolutions `U(±1/√W)`.
pub fn seed_vars(varmap: &VarMap, cfg: &GdpConfig, seed: u64) -> Result<()> {
    let data = varmap.data().lock().map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut rng = StdRng::seed_from_u64(seed);
    let std = cfg.initializer_range as f32;
    for name in names {
        let var = &data[name];
        let dims = var.dims().to_vec();
        let numel: usize = dims.iter().product();
        let mut uniform = |lo: f32, hi: f32| -> Vec<f32> {
            (0..numel).map(|_| rng.random_range(lo..hi)).collect()
        };
        let vals: Vec<f32> = if name.ends_with("norm.weight") {
            vec![1.0; numel]
        } else if name.ends_with("A_log") {
            uniform(0.0, 16f32.ln())
        } else if name.ends_with("dt_bias") {
            uniform(-6.907_255, -2.252_168)
        } else if name.contains("conv1d") {
            let b = (*dims.last().unwrap_or(&1) as f32).powf(-0.5);
            uniform(-b, b)
        } else {
            // Box-Muller.
            (0..numel)
                .map(|_| {
                    let (u1, u2) = (1.0 - rng.random::<f32>(), rng.random::<f32>());
                    std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
                })
                .collect()
        };
        var.set(&Tensor::from_vec(vals, dims, var.device())?.to_dtype(var.dtype())?)?;
    }
    Ok(())
}

/// The variables in name order (`VarMap::all_vars` follows a `HashMap`, whose order changes
/// from run to run and with it the float sums over parameters, e.g. the gradient norm).
pub fn sorted_vars(varmap: &VarMap) -> Result<Vec<Var>> {
    let data = varmap.data().lock().map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut named: Vec<(&String, &Var)> = data.iter().collect();
    named.sort_by(|a, b| a.0.cmp(b.0));
    Ok(named.into_iter().map(|(_, v)| v.clone()).collect())
}

/// Writes `dir/model.safetensors` (FLA parameter names) and `dir/config.json`.
pub fn save_checkpoint(dir: &Path, varmap: &VarMap, cfg: &GdpConfig) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let weights = dir.join(WEIGHTS_FILE);
    varmap.save(&weights)?;
    std::fs::write(dir.join(CONFIG_FILE), serde_json::to_string_pretty(cfg)?)?;
    Ok(weights)
}

/// Loads a checkpoint directory written by [`save_checkpoint`] (or by FLA, for a model that
/// fits the byte vocabulary).
pub fn load_checkpoint(dir: &Path, device: &Device) -> Result<(GdpConfig, GdpForCausalLM)> {
    let cfg_path = dir.join(CONFIG_FILE);
    let json = std::fs::read_to_string(&cfg_path)
        .with_context(|| format!("reading {}", cfg_path.display()))?;
    let cfg = GdpConfig::from_json(&json)?;
    let weights = dir.join(WEIGHTS_FILE);
    let tensors = candle_core::safetensors::load(&weights, device)
        .with_context(|| format!("reading {}", weights.display()))?;
    let vb = VarBuilder::from_tensors(tensors, DType::F32, device);
    let model = GdpForCausalLM::new(&cfg, vb)?;
    Ok((cfg, model))
}

/// Feeds `ids` through the model in chunks of `chunk` tokens, continuing `cache`; returns the
/// logits of the last position, `[vocab]` f32.
pub fn prefill(
    model: &GdpForCausalLM,
    cache: &mut Cache,
    ids: &[u32],
    chunk: usize,
    device: &Device,
) -> Result<Tensor> {
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    let mut last = None;
    for piece in ids.chunks(chunk.max(1)) {
        let x = Tensor::new(piece, device)?.unsqueeze(0)?;
        let logits = model.forward(&x, Some(cache))?;
        last = Some(logits.i((0, piece.len() - 1))?);
    }
    Ok(last.context("no logits")?.to_dtype(DType::F32)?)
}

/// One decode step: `token` continues `cache`; returns the next logits, `[vocab]` f32.
pub fn decode_step(
    model: &GdpForCausalLM,
    cache: &mut Cache,
    token: u32,
    device: &Device,
) -> Result<Tensor> {
    let x = Tensor::new(&[[token]], device)?;
    Ok(model
        .forward(&x, Some(cache))?
        .i((0, 0))?
        .to_dtype(DType::F32)?)
}

/// Temperature + nucleus (top-p) sampling; temperature 0 is greedy.
pub struct Sampler {
    rng: StdRng,
    temperature: f64,
    top_p: f64,
}

impl Sampler {
    pub fn new(seed: u64, temperature: f64, top_p: f64) -> Result<Self> {
        if !(temperature >= 0.0 && temperature.is_finite()) {
            bail!("--temperature must be finite and >= 0, got {temperature}");
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            bail!("--top-p must be in (0, 1], got {top_p}");
        }
        Ok(Self {
            rng: StdRng::seed_from_u64(seed),
            temperature,
            top_p,
        })
    }

    /// Draws a token from `logits [vocab]`: softmax at the temperature, keep the most likely
    /// tokens until their mass reaches `top_p`, renormalise, draw.
    pub fn sample(&mut self, logits: &Tensor) -> Result<u32> {
        if self.temperature == 0.0 {
            return Ok(logits.argmax(D::Minus1)?.to_scalar::<u32>()?);
        }
        let probs = candle_nn::ops::softmax_last_dim(&(logits / self.temperature)?)?;
        let probs: Vec<f32> = probs.to_vec1()?;
        let mut order: Vec<usize> = (0..probs.len()).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        let mut kept = 0.0f32;
        let mut n_kept = 0;
        for &i in &order {
            kept += probs[i];
            n_kept += 1;
            if kept as f64 >= self.top_p {
                break;
            }
        }
        let mut r = self.rng.random::<f32>() * kept;
        for &i in &order[..n_kept] {
            r -= probs[i];
            if r <= 0.0 {
                return Ok(i as u32);
            }
        }
        Ok(order[n_kept - 1] as u32)
    }
}

/// Writes a byte stream to stdout as it comes, holding back an incomplete UTF-8 sequence and
/// replacing invalid bytes with U+FFFD.
#[derive(Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    pub fn push(&mut self, byte: u8) -> Result<()> {
        self.pending.push(byte);
        let text = match std::str::from_utf8(&self.pending) {
            Ok(s) => s.to_string(),
            // Incomplete sequence: wait for more bytes (at most 4).
            Err(e) if e.error_len().is_none() && self.pending.len() < 4 => return Ok(()),
            Err(_) => String::from_utf8_lossy(&self.pending).into_owned(),
        };
        self.pending.clear();
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())?;
        out.flush()?;
        Ok(())
    }

    /// Flushes what is left (an incomplete sequence becomes U+FFFD).
    pub fn finish(&mut self) -> Result<()> {
        if !self.pending.is_empty() {
            print!("{}", String::from_utf8_lossy(&self.pending));
            self.pending.clear();
        }
        println!();
        Ok(())
    }
}

/// Uses `threads` rayon threads and tells Candle's matmul the same through `RAYON_NUM_THREADS`;
/// `None` keeps the defaults (`RAYON_NUM_THREADS` if set, else Candle's choice, its physical core
/// count) but still sets the variable: without it Candle 0.11.1 recomputes its thread count on
/// every matmul (`candle_core::utils::get_num_threads`, which parses `/proc/cpuinfo` on Linux),
/// which made the generate example's decoding 3.5x slower on a 2-core machine.
pub fn set_threads(threads: Option<usize>) -> Result<()> {
    let n = match threads {
        Some(n) => n,
        None => candle_core::utils::get_num_threads(),
    };
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    if threads.is_some() {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(())
}
