//! Qwen3.5, Qwen3.5-MoE and Qwen3-Next against transformers: tiny random checkpoints in
//! `tests/data` (written by `scripts/qwen_golden.py` with transformers' pure-PyTorch path, float32
//! on the CPU) load as a user's download would (the nested vision-language layout for Qwen3.5, a
//! sharded index for Qwen3-Next), and their prefill logits, cached greedy decode and
//! prefill-of-everything logits match the recorded ones at f32 tolerance.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_gdp::models::qwen::{load_dir, QwenCache, QwenHybrid};
use common::rel_rms;
use std::collections::HashMap;
use std::path::PathBuf;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn golden(name: &str) -> Result<HashMap<String, Tensor>> {
    Ok(candle_core::safetensors::load(
        data(name).join("golden.safetensors"),
        &Device::Cpu,
    )?)
}

fn ids(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_dtype(DType::U32)?.unsqueeze(0)?)
}

/// Feeds `tokens` one at a time through `model` from `cache`: each step's logits, `[N, vocab]`
/// f32 on the CPU.
fn step_through(model: &QwenHybrid, cache: &mut QwenCache, tokens: &[i64]) -> Result<Tensor> {
    let mut rows = vec![];
    for &id in tokens {
        let step = Tensor::new(&[[id as u32]], model.device())?;
        let logits = model.forward(&step, Some(&mut *cache))?;
        rows.push(logits.squeeze(0)?.squeeze(0)?.to_device(&Device::Cpu)?);
    }
    Ok(Tensor::stack(&rows, 0)?)
}

/// Prefill logits of the prompt, without a cache.
fn check_prefill(model: &QwenHybrid, g: &HashMap<String, Tensor>, what: &str) -> Result<()> {
    let logits = model.forward(&ids(&g["prompt_ids"])?, None)?.squeeze(0)?;
    let e = rel_rms(&logits, &g["prefill_logits"])?;
    println!("{what}: prefill logits relative RMS {e:.2e}");
    assert!(e <= 1e-5, "{what}: prefill logits relative RMS {e:.2e}");
    Ok(())
}

/// The tiny checkpoints: Qwen3.5 (vision-language layout), Qwen3-Next (sharded) and Qwen3.5-MoE
/// (text model, one file).
const MODELS: [&str; 3] = ["qwen3_5_tiny", "qwen3_next_tiny", "qwen3_5_moe_tiny"];

#[test]
fn prefill_matches_transformers() -> Result<()> {
    for name in MODELS {
        let model = load_dir(data(name), DType::F32, &Device::Cpu)?;
        check_prefill(&model, &golden(name)?, name)?;
    }
    Ok(())
}

/// Cached prefill of the prompt, then greedy decode one token at a time: the same tokens and
/// logits as transformers' cached decode, and as one uncached prefill of everything.
fn check_decode(model: &QwenHybrid, g: &HashMap<String, Tensor>, what: &str) -> Result<()> {
    let want_ids: Vec<i64> = g["decode_ids"].to_vec1()?;
    let mut cache = model.empty_cache(1)?;
    let prefill = model.forward(&ids(&g["prompt_ids"])?, Some(&mut cache))?;
    let t = prefill.dim(1)?;
    // Every decoded token but the last is fed back; row i chose token i.
    let fed = &want_ids[..want_ids.len() - 1];
    let decoded = Tensor::cat(
        &[
            &prefill.squeeze(0)?.narrow(0, t - 1, 1)?,
            &step_through(model, &mut cache, fed)?,
        ],
        0,
    )?;
    for (i, &id) in want_ids.iter().enumerate() {
        let got: u32 = decoded.get(i)?.argmax(0)?.to_scalar()?;
        assert_eq!(got as i64, id, "{what}: greedy token {i}");
    }
    let e = rel_rms(&decoded, &g["decode_logits"])?;
    println!("{what}: decode logits relative RMS {e:.2e}");
    assert!(e <= 1e-5, "{what}: decode logits relative RMS {e:.2e}");
    // One prefill of prompt ++ decoded tokens (but the last) equals the cached steps.
    let prompt: Vec<i64> = g["prompt_ids"].to_vec1()?;
    let all: Vec<u32> = prompt
        .iter()
        .chain(&want_ids[..want_ids.len() - 1])
        .map(|&x| x as u32)
        .collect();
    let n = all.len();
    let full = model
        .forward(&Tensor::from_vec(all, (1, n), &Device::Cpu)?, None)?
        .squeeze(0)?;
    let e = rel_rms(&full, &g["full_logits"])?;
    assert!(e <= 1e-5, "{what}: full logits relative RMS {e:.2e}");
    let tail = full.narrow(0, t - 1, want_ids.len())?;
    let e = rel_rms(&decoded, &tail)?;
    println!("{what}: cached decode vs one prefill relative RMS {e:.2e}");
    assert!(
        e <= 1e-5,
        "{what}: cached decode vs prefill relative RMS {e:.2e}"
    );
    Ok(())
}

#[test]
fn decode_matches_transformers() -> Result<()> {
    for name in MODELS {
        let model = load_dir(data(name), DType::F32, &Device::Cpu)?;
        check_decode(&model, &golden(name)?, name)?;
    }
    Ok(())
}

/// The fused expert tensors that transformers 5 keeps in memory (`experts.gate_up_proj
/// [E, 2I, D]`, `experts.down_proj [E, D, I]`, in one unsharded file) load to the same model
/// as the per-expert ones of the released checkpoints.
#[test]
fn fused_expert_tensors_load_the_same_model() -> Result<()> {
    let src = data("qwen3_next_tiny");
    let dir = std::env::temp_dir().join(format!("gdp-qwen-fused-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(src.join("config.json"), dir.join("config.json"))?;
    let mut all = HashMap::new();
    for f in candle_gdp::models::qwen::load::weight_files(&src)? {
        all.extend(candle_core::safetensors::load(f, &Device::Cpu)?);
    }
    let experts = 4;
    let mut fused = HashMap::new();
    for (name, t) in &all {
        let Some((layer, rest)) = name.split_once(".mlp.experts.") else {
            fused.insert(name.clone(), t.clone());
            continue;
        };
        if rest.starts_with("0.gate_proj") {
            let get =
                |e: usize, w: &str| all[&format!("{layer}.mlp.experts.{e}.{w}.weight")].clone();
            let gate_up: Vec<Tensor> = (0..experts)
                .map(|e| Tensor::cat(&[get(e, "gate_proj"), get(e, "up_proj")], 0))
                .collect::<candle_core::Result<_>>()?;
            let down: Vec<Tensor> = (0..experts).map(|e| get(e, "down_proj")).collect();
            fused.insert(
                format!("{layer}.mlp.experts.gate_up_proj"),
                Tensor::stack(&gate_up, 0)?,
            );
            fused.insert(
                format!("{layer}.mlp.experts.down_proj"),
                Tensor::stack(&down, 0)?,
            );
        }
    }
    candle_core::safetensors::save(&fused, dir.join("model.safetensors"))?;
    let g = golden("qwen3_next_tiny")?;
    let prompt = ids(&g["prompt_ids"])?;
    let per_expert = load_dir(&src, DType::F32, &Device::Cpu)?.forward(&prompt, None)?;
    let from_fused = load_dir(&dir, DType::F32, &Device::Cpu)?.forward(&prompt, None)?;
    std::fs::remove_dir_all(&dir)?;
    assert_eq!(
        rel_rms(&from_fused, &per_expert)?,
        0.0,
        "fused and per-expert tensors give different logits"
    );
    Ok(())
}

/// Loading fails with a message that names what is wrong: a missing directory, a config of
/// another model, a missing tensor.
#[test]
fn bad_checkpoints_name_the_problem() -> Result<()> {
    let missing = load_dir(data("no_such_model"), DType::F32, &Device::Cpu).unwrap_err();
    assert!(missing.to_string().contains("config.json"), "{missing}");
    let dir = std::env::temp_dir().join(format!("gdp-qwen-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("config.json"), r#"{"model_type": "llama"}"#)?;
    let other = load_dir(&dir, DType::F32, &Device::Cpu).unwrap_err();
    assert!(other.to_string().contains("model_type"), "{other}");
    // The Qwen3-Next config with no weights next to it.
    std::fs::copy(
        data("qwen3_next_tiny").join("config.json"),
        dir.join("config.json"),
    )?;
    let none = load_dir(&dir, DType::F32, &Device::Cpu).unwrap_err();
    assert!(none.to_string().contains("model.safetensors"), "{none}");
    // Weights of the other architecture: the first tensor it needs is named.
    std::fs::copy(
        data("qwen3_5_tiny").join("model.safetensors"),
        dir.join("model.safetensors"),
    )?;
    let wrong = load_dir(&dir, DType::F32, &Device::Cpu).unwrap_err();
    std::fs::remove_dir_all(&dir)?;
    assert!(wrong.to_string().contains("in_proj_qkvz"), "{wrong}");
    Ok(())
}

/// A context-parallel prefill over 2 and 3 CPU ranks: the same logits as one device, and a
/// decode cache from which the greedy decode continues exactly as after a one-device prefill.
#[test]
fn context_parallel_prefill_matches_one_device() -> Result<()> {
    use candle_gdp::models::qwen::prefill_context_parallel;
    use candle_gdp::ContextParallel;
    for name in MODELS {
        let model = load_dir(data(name), DType::F32, &Device::Cpu)?;
        let g = golden(name)?;
        let prompt = ids(&g["prompt_ids"])?;
        let want = model.forward(&prompt, None)?;
        let decode_ids: Vec<i64> = g["decode_ids"].to_vec1()?;
        for ranks in [2, 3] {
            let out = prefill_context_parallel(&model, &ContextParallel::cpu(ranks)?, &prompt)?;
            let e = rel_rms(&out.logits, &want)?;
            println!("{name} cp={ranks}: prefill logits vs one device {e:.1e}");
            assert!(e <= 1e-5, "{name} cp={ranks}: prefill logits {e:.2e}");
            let mut cache = out.cache;
            let fed = &decode_ids[..decode_ids.len() - 1];
            let got = step_through(&model, &mut cache, fed)?;
            let want_rows = g["decode_logits"].narrow(0, 1, fed.len())?;
            let e = rel_rms(&got, &want_rows)?;
            assert!(
                e <= 1e-5,
                "{name} cp={ranks}: decode after CP prefill {e:.2e}"
            );
        }
    }
    Ok(())
}

/// bf16 and f16 weights and activations on the CPU stay as close to transformers' float32
/// logits as transformers itself does in that dtype. Its own errors (relative RMS of its prefill
/// logits against its float32 ones, measured with transformers 5.23 on the CPU): Qwen3.5 bf16
/// 3.82e-2, f16 4.68e-3; Qwen3-Next bf16 4.74e-2, f16 3.12e-2. Ours may be at most 1.25x those.
#[test]
fn half_precision_prefill_is_as_close_as_transformers() -> Result<()> {
    let cases = [
        ("qwen3_5_tiny", DType::BF16, 3.82e-2),
        ("qwen3_5_tiny", DType::F16, 4.68e-3),
        ("qwen3_next_tiny", DType::BF16, 4.74e-2),
        ("qwen3_next_tiny", DType::F16, 3.12e-2),
    ];
    for (name, dtype, theirs) in cases {
        let g = golden(name)?;
        let model = load_dir(data(name), dtype, &Device::Cpu)?;
        let logits = model.forward(&ids(&g["prompt_ids"])?, None)?.squeeze(0)?;
        assert_eq!(logits.dtype(), DType::F32, "{name} {dtype:?}: logits dtype");
        let e = rel_rms(&logits, &g["prefill_logits"])?;
        println!(
            "{name} {dtype:?}: prefill logits relative RMS {e:.2e} (transformers {theirs:.2e})"
        );
        assert!(
            e <= 1.25 * theirs,
            "{name} {dtype:?}: prefill logits relative RMS {e:.2e}, transformers' {theirs:.2e}"
        );
    }
    Ok(())
}

/// On CUDA: f32 matches transformers as on the CPU (prefill and cached decode), bf16 as closely
/// as on the CPU, and a context-parallel prefill over two ranks on the GPU gives the same cache.
#[cfg(feature = "cuda")]
#[test]
fn cuda_matches_transformers() -> Result<()> {
    use candle_gdp::models::qwen::prefill_context_parallel;
    let dev = Device::new_cuda(0)?;
    for name in MODELS {
        let g = golden(name)?;
        let model = load_dir(data(name), DType::F32, &dev)?;
        let prompt = ids(&g["prompt_ids"])?.to_device(&dev)?;
        let logits = model
            .forward(&prompt, None)?
            .squeeze(0)?
            .to_device(&Device::Cpu)?;
        let e = rel_rms(&logits, &g["prefill_logits"])?;
        println!("{name} cuda f32: prefill logits relative RMS {e:.2e}");
        assert!(e <= 1e-5, "{name} cuda f32: prefill {e:.2e}");
        let cp = candle_gdp::ContextParallel::new(vec![dev.clone(), dev.clone()])?;
        let out = prefill_context_parallel(&model, &cp, &prompt)?;
        let e = rel_rms(&out.logits.squeeze(0)?.to_device(&Device::Cpu)?, &logits)?;
        assert!(e <= 1e-5, "{name} cuda cp=2: prefill vs one rank {e:.2e}");
        let mut cache = out.cache;
        let decode_ids: Vec<i64> = g["decode_ids"].to_vec1()?;
        let fed = &decode_ids[..decode_ids.len() - 1];
        let got = step_through(&model, &mut cache, fed)?;
        let e = rel_rms(&got, &g["decode_logits"].narrow(0, 1, fed.len())?)?;
        assert!(
            e <= 1e-5,
            "{name} cuda f32: decode after CP prefill {e:.2e}"
        );
        let bf16 = load_dir(data(name), DType::BF16, &dev)?;
        let l = bf16
            .forward(&prompt, None)?
            .squeeze(0)?
            .to_device(&Device::Cpu)?;
        let e = rel_rms(&l, &g["prefill_logits"])?;
        println!("{name} cuda bf16: prefill logits relative RMS {e:.2e}");
        assert!(
            e <= 6e-2,
            "{name} cuda bf16: prefill {e:.2e} (transformers' own bf16: <= 4.7e-2)"
        );
    }
    Ok(())
}
