//! The FLA-compatible model (`candle_gdp::nn`): cache consistency (prefill vs decode, split
//! prefill), FLA weight names through safetensors, gradients to every parameter, the short
//! convolution's halo, and bad inputs.

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use candle_gdp::nn::{Cache, GatedDeltaProduct, GdpConfig, GdpForCausalLM, LayerCache, ShortConv};
use candle_nn::{VarBuilder, VarMap};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Overwrites every variable with seeded values of a sensible scale for its role.
fn seed_vars(varmap: &VarMap, seed: u64) -> Result<()> {
    let data = varmap.data().lock().map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut rng = StdRng::seed_from_u64(seed);
    for name in names {
        let var = &data[name];
        let dims = var.dims().to_vec();
        let numel: usize = dims.iter().product();
        let mut u = |lo: f32, hi: f32| -> Vec<f32> {
            (0..numel).map(|_| rng.random_range(lo..hi)).collect()
        };
        let vals = if name.ends_with("norm.weight") {
            u(0.8, 1.2)
        } else if name.ends_with("A_log") {
            u(0.0, 16f32.ln())
        } else if name.ends_with("dt_bias") {
            u(-4.0, -1.0)
        } else if name.ends_with("conv1d.weight") {
            let b = 3f32.sqrt() / (dims[2] as f32).sqrt();
            u(-b, b)
        } else if name.ends_with("bias") {
            u(-0.3, 0.3)
        } else if name.contains("embeddings") {
            u(-1.7, 1.7)
        } else {
            let b = 3f32.sqrt() / (dims[1] as f32).sqrt();
            u(-b, b)
        };
        var.set(&Tensor::from_vec(vals, dims, &Device::Cpu)?)?;
    }
    Ok(())
}

fn build(cfg: &GdpConfig, seed: u64) -> Result<(VarMap, GdpForCausalLM)> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = GdpForCausalLM::new(cfg, vb)?;
    seed_vars(&varmap, seed)?;
    Ok((varmap, model))
}

fn ids(b: usize, t: usize, vocab: usize, seed: u64) -> Result<Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let v: Vec<u32> = (0..b * t)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect();
    Ok(Tensor::from_vec(v, (b, t), &Device::Cpu)?)
}

/// `max |a - b| / max |b|`.
fn rel_err(a: &Tensor, b: &Tensor) -> Result<f32> {
    let d = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let m = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    Ok(d / m.max(f32::MIN_POSITIVE))
}

fn variants() -> Vec<(&'static str, GdpConfig)> {
    let with = |edit: fn(&mut GdpConfig)| {
        let mut c = GdpConfig::tiny();
        edit(&mut c);
        c
    };
    vec![
        ("tiny n=2", GdpConfig::tiny()),
        (
            "gva Hv=2H n=3",
            with(|c| (c.num_v_heads, c.num_householder) = (Some(4), 3)),
        ),
        (
            "no conv, no gates, n=1, tied",
            with(|c| {
                (c.use_short_conv, c.use_output_gate, c.use_forget_gate) = (false, false, false);
                (c.allow_neg_eigval, c.num_householder, c.tie_word_embeddings) = (false, 1, true);
            }),
        ),
        (
            "conv bias, W=2, expand_v=1.5",
            with(|c| (c.conv_bias, c.conv_size, c.expand_v) = (true, 2, 1.5)),
        ),
    ]
}

/// (a) A chunked prefill of a prefix followed by one-token decode steps reproduces the logits
/// of one prefill of the whole sequence (T = 70 crosses the op's 64-token chunk).
#[test]
fn prefill_then_decode_matches_full_prefill() -> Result<()> {
    for (name, cfg) in variants() {
        let (_vm, model) = build(&cfg, 1)?;
        let (b, t, prefix) = (2, 70, 9);
        let x = ids(b, t, cfg.vocab_size, 2)?;
        let full = model.forward(&x, None)?;
        let mut cache = Cache::new(&cfg, b, DType::F32, &Device::Cpu)?;
        let mut parts = vec![model.forward(&x.narrow(1, 0, prefix)?, Some(&mut cache))?];
        for i in prefix..t {
            parts.push(model.forward(&x.narrow(1, i, 1)?, Some(&mut cache))?);
        }
        let inc = Tensor::cat(&parts, 1)?;
        let err = rel_err(&inc, &full)?;
        println!("{name}: prefill+decode vs prefill rel err {err:.2e}");
        assert!(err < 1e-5, "{name}: rel err {err}");
        assert_eq!(cache.seen_tokens(), t);
    }
    Ok(())
}

/// (a') The decode step with untracked weights (loaded as plain tensors, as for inference) is
/// the fused one pass over the state; with `Var`s it is the differentiable tensor-op step. Both
/// give the same logits, and the untracked model's prefill + decode reproduces its full prefill.
#[test]
fn fused_decode_of_untracked_weights_matches_tracked_decode() -> Result<()> {
    for (name, cfg) in variants() {
        let (varmap, tracked) = build(&cfg, 3)?;
        let tensors = {
            let data = varmap.data().lock().map_err(|e| anyhow::anyhow!("{e}"))?;
            data.iter()
                .map(|(k, v)| (k.clone(), v.as_tensor().detach()))
                .collect::<std::collections::HashMap<_, _>>()
        };
        let plain = GdpForCausalLM::new(
            &cfg,
            VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu),
        )?;
        let (b, t, prefix) = (2, 20, 7);
        let x = ids(b, t, cfg.vocab_size, 4)?;
        let decode = |model: &GdpForCausalLM| -> Result<Tensor> {
            let mut cache = Cache::new(&cfg, b, DType::F32, &Device::Cpu)?;
            let mut parts = vec![model.forward(&x.narrow(1, 0, prefix)?, Some(&mut cache))?];
            for i in prefix..t {
                parts.push(model.forward(&x.narrow(1, i, 1)?, Some(&mut cache))?);
            }
            Ok(Tensor::cat(&parts, 1)?)
        };
        let (fused, unfused) = (decode(&plain)?, decode(&tracked)?);
        assert!(!fused.track_op() && unfused.track_op(), "{name}: tracking");
        let err = rel_err(&fused, &unfused)?;
        let full = rel_err(&fused, &plain.forward(&x, None)?)?;
        println!("{name}: fused vs tensor-op decode {err:.2e}, vs full prefill {full:.2e}");
        assert!(
            err < 1e-5,
            "{name}: fused vs tensor-op decode rel err {err}"
        );
        assert!(
            full < 1e-5,
            "{name}: fused decode vs full prefill rel err {full}"
        );
    }
    Ok(())
}

/// (b) Prefill in two chunks through the cache equals one prefill, in logits and in the caches
/// left behind (including a second chunk shorter than the conv width).
#[test]
fn split_prefill_equals_one_prefill() -> Result<()> {
    for (name, cfg) in variants() {
        let (_vm, model) = build(&cfg, 3)?;
        let (b, t) = (2, 75);
        let x = ids(b, t, cfg.vocab_size, 4)?;
        let mut one = Cache::new(&cfg, b, DType::F32, &Device::Cpu)?;
        let full = model.forward(&x, Some(&mut one))?;
        for split in [40, 73] {
            let mut two = Cache::new(&cfg, b, DType::F32, &Device::Cpu)?;
            let a = model.forward(&x.narrow(1, 0, split)?, Some(&mut two))?;
            let c = model.forward(&x.narrow(1, split, t - split)?, Some(&mut two))?;
            let err = rel_err(&Tensor::cat(&[a, c], 1)?, &full)?;
            println!("{name}: split at {split}: logits rel err {err:.2e}");
            assert!(err < 1e-5, "{name} split {split}: rel err {err}");
            for (l1, l2) in one.layers.iter().zip(&two.layers) {
                assert!(rel_err(&l2.recurrent, &l1.recurrent)? < 1e-5);
                for (s1, s2) in [
                    (&l1.conv_q, &l2.conv_q),
                    (&l1.conv_k, &l2.conv_k),
                    (&l1.conv_v, &l2.conv_v),
                ] {
                    if let (Some(s1), Some(s2)) = (s1, s2) {
                        assert!(rel_err(s2, s1)? < 1e-6);
                    }
                }
            }
            assert_eq!(two.seen_tokens(), t);
        }
    }
    Ok(())
}

/// The parameter names FLA's `GatedDeltaProductForCausalLM` has for `cfg`.
fn fla_names(cfg: &GdpConfig) -> Vec<String> {
    let mut v = vec![
        "model.embeddings.weight".to_string(),
        "model.norm.weight".into(),
    ];
    if !cfg.tie_word_embeddings {
        v.push("lm_head.weight".into());
    }
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let mut local = vec![
            "attn_norm.weight",
            "mlp_norm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "attn.q_proj.weight",
            "attn.k_proj.weight",
            "attn.v_proj.weight",
            "attn.b_proj.weight",
            "attn.o_norm.weight",
            "attn.o_proj.weight",
        ];
        if cfg.use_forget_gate {
            local.extend(["attn.a_proj.weight", "attn.A_log", "attn.dt_bias"]);
        }
        if cfg.use_short_conv {
            local.extend([
                "attn.q_conv1d.weight",
                "attn.k_conv1d.weight",
                "attn.v_conv1d.weight",
            ]);
        }
        if cfg.use_output_gate {
            local.push("attn.g_proj.weight");
        }
        v.extend(local.into_iter().map(|s| format!("{p}.{s}")));
    }
    v.sort();
    v
}

/// (c) Weights saved under FLA's names reload through `from_mmaped_safetensors` and give the
/// same logits; the name set is exactly FLA's, with FLA's shapes.
#[test]
fn loads_fla_names_from_safetensors() -> Result<()> {
    let cfg = GdpConfig::tiny();
    let (varmap, model) = build(&cfg, 5)?;
    let mut names: Vec<String> = varmap
        .data()
        .lock()
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .keys()
        .cloned()
        .collect();
    names.sort();
    println!("parameters ({}):\n  {}", names.len(), names.join("\n  "));
    assert_eq!(names, fla_names(&cfg));
    let dir = std::env::temp_dir().join(format!("candle-gdp-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("model.safetensors");
    varmap.save(&path)?;
    let loaded = candle_core::safetensors::load(&path, &Device::Cpu)?;
    let (n, kd, w) = (cfg.num_householder, cfg.key_dim(), cfg.conv_size);
    assert_eq!(
        loaded["model.layers.0.attn.k_conv1d.weight"].dims(),
        &[n * kd, 1, w]
    );
    assert_eq!(
        loaded["model.layers.1.attn.k_proj.weight"].dims(),
        &[n * kd, cfg.hidden_size]
    );
    assert_eq!(
        loaded["model.layers.0.attn.A_log"].dims(),
        &[cfg.num_v_heads()]
    );
    assert_eq!(
        loaded["model.layers.0.attn.o_norm.weight"].dims(),
        &[cfg.head_v_dim()]
    );
    // SAFETY: the file was written above and is not modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, &Device::Cpu)? };
    let reloaded = GdpForCausalLM::new(&cfg, vb)?;
    let x = ids(2, 13, cfg.vocab_size, 6)?;
    let diff = (model.forward(&x, None)? - reloaded.forward(&x, None)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    std::fs::remove_dir_all(&dir)?;
    assert_eq!(diff, 0.0);
    Ok(())
}

/// FLA `config.json` keys parse, including unused keys and the older `use_gate` synonym.
#[test]
fn parses_fla_config_json() -> Result<()> {
    let json = r#"{"model_type": "gated_deltaproduct", "attn_mode": "chunk", "conv_size": 4,
        "head_dim": 128, "num_heads": 6, "hidden_size": 1024, "expand_v": 2, "use_gate": false,
        "hidden_ratio": 4, "intermediate_size": null, "num_hidden_layers": 12, "norm_eps": 1e-6,
        "fuse_norm": true, "fuse_swiglu": true, "vocab_size": 32000, "use_forget_gate": true,
        "allow_neg_eigval": true, "num_householder": 2, "tie_word_embeddings": false}"#;
    let cfg = GdpConfig::from_json(json)?;
    assert!(!cfg.use_output_gate);
    assert_eq!(
        (cfg.head_v_dim(), cfg.key_dim(), cfg.value_dim()),
        (256, 768, 1536)
    );
    assert_eq!(cfg.intermediate_size(), 2816); // 256 · ceil(int(1024·4·2/3) / 256)
    let defaults = GdpConfig::from_json("{}")?;
    assert_eq!(defaults, GdpConfig::default());
    assert_eq!(
        (defaults.num_householder, defaults.use_forget_gate),
        (1, false)
    );
    Ok(())
}

/// (d) A cross-entropy loss reaches every parameter with a finite, non-zero gradient.
#[test]
fn gradients_reach_every_parameter() -> Result<()> {
    for (name, cfg) in variants() {
        let (varmap, model) = build(&cfg, 7)?;
        let (b, t) = (2, 12);
        let x = ids(b, t + 1, cfg.vocab_size, 8)?;
        let logits = model.forward(&x.narrow(1, 0, t)?, None)?;
        let target = x.narrow(1, 1, t)?.flatten_all()?;
        let loss =
            candle_nn::loss::cross_entropy(&logits.reshape((b * t, cfg.vocab_size))?, &target)?;
        let grads = loss.backward()?;
        let data = varmap.data().lock().map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut names: Vec<&String> = data.keys().collect();
        names.sort();
        for pname in names {
            let var: &Var = &data[pname];
            let g = grads
                .get(var.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("{name}: no gradient for {pname}"))?;
            assert_eq!(g.dims(), var.dims(), "{name}: {pname}");
            let v: Vec<f32> = g.flatten_all()?.to_vec1()?;
            assert!(
                v.iter().all(|x| x.is_finite()),
                "{name}: {pname} has non-finite grads"
            );
            assert!(
                v.iter().any(|&x| x != 0.0),
                "{name}: {pname} has an all-zero gradient"
            );
        }
    }
    Ok(())
}

/// The short convolution: shards with halos, chunked calls with a cache and single steps all
/// reproduce one pass over the whole sequence.
#[test]
fn short_conv_halo_cache_and_step_match_full() -> Result<()> {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let conv = ShortConv::new(6, 4, true, vb.pp("c"))?;
    seed_vars(&varmap, 9)?;
    let x = Tensor::randn(0f32, 1.0, (2, 11, 6), &Device::Cpu)?;
    let full = conv.forward(&x, None)?;
    let (mut start, mut halo, mut ys) = (0, None::<Tensor>, vec![]);
    for len in [5, 2, 4] {
        let (y, tail) = conv.forward_with_halo(&x.narrow(1, start, len)?, halo.as_ref())?;
        ys.push(y);
        halo = Some(tail);
        start += len;
    }
    assert!(rel_err(&Tensor::cat(&ys, 1)?, &full)? < 1e-6);
    let mut state = conv.zero_state(2, DType::F32, &Device::Cpu)?;
    let a = conv.forward(&x.narrow(1, 0, 7)?, Some(&mut state))?;
    let mut ys = vec![a];
    for i in 7..11 {
        let (y, s) = conv.step(&x.narrow(1, i, 1)?.squeeze(1)?, &state)?;
        ys.push(y.unsqueeze(1)?);
        state = s;
    }
    assert!(rel_err(&Tensor::cat(&ys, 1)?, &full)? < 1e-6);
    expect_err(
        "halo of the wrong shape",
        conv.forward_with_halo(&x, Some(&x)),
        "`halo`: expected shape [2, 3, 6]",
    );
    Ok(())
}

/// `r` is an error whose message contains `needle` (the argument or setting it names).
fn expect_err<T, E: std::fmt::Display>(what: &str, r: std::result::Result<T, E>, needle: &str) {
    match r {
        Ok(_) => panic!("{what}: expected an error naming `{needle}`, got Ok"),
        Err(e) => {
            let msg = e.to_string();
            println!("{what:<24} {msg}");
            assert!(msg.contains(needle), "{what}: `{needle}` not in: {msg}");
        }
    }
}

/// Bad inputs and configs are errors, not panics.
#[test]
fn bad_inputs_are_errors() -> Result<()> {
    let cfg = GdpConfig::tiny();
    let (_vm, model) = build(&cfg, 10)?;
    let dev = Device::Cpu;
    let zeros = |dims: &[usize], dt: DType| Tensor::zeros(dims, dt, &dev);
    let mut wrong_batch = Cache::new(&cfg, 3, DType::F32, &dev)?;
    let bad_calls = [
        (
            "id = vocab",
            model.forward(&Tensor::new(&[[1u32, 64]], &dev)?, None),
            "`input_ids`: id 64",
        ),
        (
            "empty sequence",
            model.forward(&zeros(&[2, 0], DType::U32)?, None),
            "`input_ids`: every dimension",
        ),
        (
            "rank-1 ids",
            model.forward(&zeros(&[3], DType::U32)?, None),
            "`input_ids`: expected a rank-2",
        ),
        (
            "negative id",
            model.forward(&Tensor::new(&[[-1i64, 2]], &dev)?, None),
            "`input_ids`: id -1",
        ),
        (
            "f32 ids",
            model.forward(&zeros(&[1, 3], DType::F32)?, None),
            "`input_ids`: expected an integer dtype",
        ),
        (
            "cache batch 3 vs 2",
            model.forward(&ids(2, 1, 64, 0)?, Some(&mut wrong_batch)),
            "`cache.recurrent`: expected shape [2,",
        ),
    ];
    for (what, r, needle) in bad_calls {
        expect_err(what, r, needle);
    }
    expect_err(
        "cache batch 3 vs 2, T 5",
        model.forward(&ids(2, 5, 64, 0)?, Some(&mut wrong_batch)),
        "`cache.recurrent`: expected shape [2,",
    );
    let vm = VarMap::new();
    let layer = GatedDeltaProduct::new(&cfg, 0, VarBuilder::from_varmap(&vm, DType::F32, &dev))?;
    expect_err(
        "hidden 31",
        layer.forward(&zeros(&[1, 4, 31], DType::F32)?, None),
        "`x`: expected shape [1, 4, 32]",
    );
    let mut no_conv = cfg.clone();
    no_conv.use_short_conv = false;
    let mut c = LayerCache::new(&no_conv, 1, DType::F32, &dev)?;
    expect_err(
        "cache without conv",
        layer.forward(&zeros(&[1, 4, 32], DType::F32)?, Some(&mut c)),
        "`cache`: has no conv states",
    );
    /// A config setting and an edit that makes it invalid.
    type Edit = (&'static str, fn(&mut GdpConfig));
    let edits: [Edit; 6] = [
        ("expand_v", |c| c.expand_v = 1.3),
        ("num_v_heads", |c| c.num_v_heads = Some(3)),
        ("num_householder", |c| c.num_householder = 0),
        ("hidden_act", |c| c.hidden_act = "gelu".into()),
        ("attn.layers", |c| {
            c.attn = Some(serde_json::json!({"layers": [1], "num_heads": 2}))
        }),
        ("attnres_block_size", |c| c.attnres_block_size = Some(2)),
    ];
    for (name, edit) in edits {
        let mut bad = cfg.clone();
        edit(&mut bad);
        let vm = VarMap::new();
        let needle = format!("`{name}`");
        expect_err(name, bad.validate(), &needle);
        expect_err(
            name,
            GdpForCausalLM::new(&bad, VarBuilder::from_varmap(&vm, DType::F32, &dev)),
            &needle,
        );
    }
    Ok(())
}
