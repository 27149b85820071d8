"""Golden test data for the Qwen3.5 / Qwen3-Next loaders, from Hugging Face transformers.

Builds two tiny random hybrid models (3 Gated DeltaNet layers + 1 gated full-attention layer) in
float32 on the CPU, through transformers' pure-PyTorch path (no flash-linear-attention, no
causal-conv1d, no `kernels`), and writes one directory per model:

  <out>/qwen3_5_tiny/     Qwen3.5 (dense MLP), laid out like a REAL Qwen3.5 release:
      config.json           the vision-language wrapper (model_type "qwen3_5"), the text model's
                            config nested under "text_config" (model_type "qwen3_5_text"); a tiny
                            vision_config that no weight here matches.
      model.safetensors     text weights under "model.language_model.", "lm_head.weight", and two
                            dummies ("model.visual.dummy.weight", "mtp.dummy.weight") that a
                            text-only loader must skip.
      golden.safetensors
  <out>/qwen3_next_tiny/  Qwen3-Next (sparse MoE + shared expert in every layer), written by
                          `save_pretrained(max_shard_size="200KB")`, i.e. SHARDED:
      config.json, generation_config.json, model.safetensors.index.json,
      model-0000i-of-0000n.safetensors, golden.safetensors

golden.safetensors (float32 unless said otherwise; batch 1, batch dim dropped):
  prompt_ids     int64 [T]            T = 80 random ids (> 64: crosses the 64-token chunk boundary)
  prefill_logits [T, vocab]           one uncached forward over the prompt
  decode_ids     int64 [N]            N = 4 greedy tokens produced with the cache
  decode_logits  [N, vocab]           decode_logits[i] is the row whose argmax is decode_ids[i]:
                                        i = 0: the last row of the cached prefill of the prompt
                                               (== prefill_logits[T-1] up to rounding);
                                        i >= 1: the output of the cached single-token step that fed
                                               decode_ids[i-1] (position T+i-1).
                                      decode_ids[N-1] is never fed back.
  full_logits    [T+N-1, vocab]       one uncached forward over prompt ++ decode_ids[:N-1];
                                      full_logits[T-1+i] must equal decode_logits[i].
The file's metadata (one key, "golden_info", a JSON string) repeats this convention and records the
measured max abs differences, greedy top-2 margins, cache layout and kernel call counts.

Weights are re-randomised after construction with a fixed seed (HF's init makes the GDN state
forget everything at each step and zeroes the (1 + w) norm weights, which would test little):
  Linear / Embedding weights (and the fused MoE expert tensors)  ~ N(0, 0.08)
  (1 + w) RMSNorm weights (input_layernorm, post_attention_layernorm, final norm, q_norm, k_norm)
                                                                 ~ N(0, 0.1)
  linear_attn.norm.weight (gated RMSNorm, weight applied plainly) ~ 1 + N(0, 0.1)
  linear_attn.A_log ~ log U(0.05, 0.8);  linear_attn.dt_bias ~ N(0, 0.3)
  linear_attn.conv1d.weight ~ N(0, 0.3); mlp.gate.weight (router) ~ N(0, 0.3);
  mlp.shared_expert_gate.weight ~ N(0, 0.3)

Usage (from the repository root; needs torch and transformers 5.x, CPU only, no network):

    HF_HUB_OFFLINE=1 python scripts/qwen_golden.py [--out tests/data]

Produced with torch 2.15.0 and transformers 5.23.0.
"""

import argparse
import json
import logging
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import transformers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402

T_PROMPT = 80  # > 64, the chunk size of torch_chunk_gated_delta_rule
N_DECODE = 4
SEED_WEIGHTS = {"qwen3_5": 1234, "qwen3_next": 5678, "qwen3_5_moe": 4321}
# Prompt seeds picked (among 40..59) so that every greedy step wins by a clear logit margin
# (>= 0.17), so an implementation that agrees to ~1e-5 reproduces decode_ids exactly.
SEED_PROMPT = {"qwen3_5": 52, "qwen3_next": 46, "qwen3_5_moe": 52}

# The tiny hybrid shared by both models. r = Hv / Hk = 2 (grouped value heads), dk != dv.
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    intermediate_size=96,
    tie_word_embeddings=False,
    max_position_embeddings=512,
    hidden_act="silu",
)

# Qwen3.5 keeps RoPE settings in `rope_parameters`. The M-RoPE keys are written with the values real
# Qwen3.5 releases carry (transformers' defaults). With text-only positions (the same position on the
# t, h and w axes) M-RoPE is plain partial RoPE.
QWEN3_5_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}
# transformers 5.x also keeps Qwen3-Next's rope_theta / partial_rotary_factor in `rope_parameters`
# (released Qwen3-Next config.json files have them at the top level; transformers converts).
QWEN3_NEXT_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}

QWEN3_NEXT_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
)

# A small vision tower config for the Qwen3.5 wrapper, so that transformers can build
# Qwen3_5ForConditionalGeneration from this config.json cheaply. No weights match it.
TINY_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=64,  # = text hidden_size
    num_position_embeddings=64,
)


# --------------------------------------------------------------------------------------------------
# Kernel path checks
# --------------------------------------------------------------------------------------------------

KERNEL_FUNCS = [
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
]


def _closure_impl(fn):
    """The implementation a `use_kernel_func_from_hub_with_fallback` wrapper dispatches to."""
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        if name == "implementation":
            return cell.cell_contents
    return None


def check_torch_fallbacks(module):
    """Asserts every GDN / conv entry point of `module` resolves to transformers' own torch code,
    and installs call counters so the caller can confirm each ran."""
    counts = {}
    for fname in KERNEL_FUNCS:
        wrapped = getattr(module, fname)
        impl = _closure_impl(wrapped)
        assert impl is not None and impl.__module__ == module.__name__, (
            f"{module.__name__}.{fname} dispatches to {impl!r}, not the pure-PyTorch fallback"
        )
        counts[fname] = 0

        def counting(*args, __f=wrapped, __n=fname, **kwargs):
            counts[__n] += 1
            return __f(*args, **kwargs)

        setattr(module, fname, counting)
    return counts


class _LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def rerandomise(model, seed):
    """Replaces every parameter with a seeded draw (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(p, std, mean=0.0):
        p.copy_(torch.randn(p.shape, generator=gen) * std + mean)

    unity_norms = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")
    for name, p in model.named_parameters():  # deterministic order
        leaf = name.split(".")
        if name.endswith("linear_attn.A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.05, 0.8, generator=gen).log())
        elif name.endswith("linear_attn.dt_bias"):
            normal(p, 0.3)
        elif name.endswith("linear_attn.conv1d.weight"):
            normal(p, 0.3)
        elif name.endswith("linear_attn.norm.weight"):
            normal(p, 0.1, mean=1.0)
        elif any(n in leaf for n in unity_norms) or name == "model.norm.weight":
            normal(p, 0.1)
        elif name.endswith("mlp.gate.weight") or name.endswith("mlp.shared_expert_gate.weight"):
            normal(p, 0.3)
        elif name.endswith("weight") or name.endswith("experts.gate_up_proj") or name.endswith(
            "experts.down_proj"
        ):
            normal(p, 0.08)
        else:
            raise RuntimeError(f"no re-randomisation rule for {name} {tuple(p.shape)}")


# --------------------------------------------------------------------------------------------------
# Golden logits
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def gdn_input(model, prompt, layer_idx):
    """(the GDN module of layer `layer_idx`, its input over `prompt` in an uncached forward)."""
    attn = model.model.layers[layer_idx].linear_attn
    captured = {}

    def hook(_mod, args, kwargs):
        captured["x"] = kwargs.get("hidden_states", args[0] if args else None)

    h = attn.register_forward_pre_hook(hook, with_kwargs=True)
    model(prompt, use_cache=False)
    h.remove()
    return attn, captured["x"]


@torch.no_grad()
def gate_stats(model, prompt, layer_idx=0):
    """exp(g) over the prompt for GDN layer `layer_idx`: g = -exp(A_log) * softplus(a + dt_bias)."""
    attn, x = gdn_input(model, prompt, layer_idx)
    if hasattr(attn, "in_proj_a"):  # Qwen3.5
        a = attn.in_proj_a(x)
    else:  # Qwen3-Next: a comes out of the grouped in_proj_ba
        _, _, _, _, _, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(x), attn.in_proj_ba(x))
    g = -attn.A_log.float().exp() * F.softplus(a.float() + attn.dt_bias)
    decay = g.exp()
    return {
        "layer": layer_idx,
        "min": decay.min().item(),
        "mean": decay.mean().item(),
        "max": decay.max().item(),
        "per_head_mean": [round(v, 4) for v in decay.mean(dim=(0, 1)).tolist()],
    }


@torch.no_grad()
def cache_layout(model, prompt, cache, layer_idx=0):
    """Shapes of GDN layer `layer_idx`'s cached states after the prefill, and a check that the conv
    state holds the pre-conv [q|k|v] channels of the last W tokens (oldest first)."""
    conv = cache.layers[layer_idx].conv_states[0]
    rec = cache.layers[layer_idx].recurrent_states[0]
    attn, x = gdn_input(model, prompt, layer_idx)
    if hasattr(attn, "in_proj_qkv"):
        qkv = attn.in_proj_qkv(x)
    else:
        q, k, v, _, _, _ = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(x), attn.in_proj_ba(x))
        qkv = torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (q, k, v)], dim=-1)
    W = conv.shape[-1]
    expect = qkv[0, -W:].transpose(0, 1)
    return {
        "conv_state_shape": list(conv.shape),
        "recurrent_state_shape": list(rec.shape),
        "recurrent_state_dtype": str(rec.dtype),
        "conv_state_is_last_W_preconv_inputs": (conv[0] - expect).abs().max().item() == 0.0,
    }


@torch.no_grad()
def check_text_mrope(model):
    """Qwen3.5's interleaved M-RoPE with text-only positions (t = h = w) is plain partial RoPE.
    Returns the max abs difference of cos/sin against rotate-half RoPE over the first
    head_dim * partial_rotary_factor dims."""
    rot = model.model.rotary_emb
    T = 100
    pos = torch.arange(T)[None, None].expand(3, 1, T)
    x = torch.zeros(1, T, 1)
    cos, sin = rot(x, pos)
    cfg = model.config
    dim = int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"])
    inv = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
    ang = torch.arange(T).float()[:, None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    assert cos.shape[-1] == dim, cos.shape
    return max((cos[0] - ang.cos()).abs().max().item(), (sin[0] - ang.sin()).abs().max().item())


@torch.no_grad()
def golden(model, prompt):
    """Prefill, cached greedy decode, and the one-shot prefill of prompt + decoded tokens."""
    prefill = model(prompt, use_cache=False).logits[0]

    out = model(prompt, use_cache=True)
    cache = out.past_key_values
    layout = cache_layout(model, prompt, cache)
    row = out.logits[0, -1]
    decode_ids, decode_logits, margins = [], [], []
    for i in range(N_DECODE):
        decode_logits.append(row)
        top2 = torch.topk(row, 2).values
        margins.append((top2[0] - top2[1]).item())
        tok = int(row.argmax())
        decode_ids.append(tok)
        if i + 1 < N_DECODE:
            out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            row = out.logits[0, -1]
    decode_ids = torch.tensor(decode_ids, dtype=torch.int64)
    decode_logits = torch.stack(decode_logits)

    full_in = torch.cat([prompt[0], decode_ids[: N_DECODE - 1]])[None]
    full = model(full_in, use_cache=False).logits[0]

    T = prompt.shape[1]
    diff_decode = (full[T - 1 :] - decode_logits).abs().max().item()
    diff_prefill = (full[:T] - prefill).abs().max().item()
    diff_first = (decode_logits[0] - prefill[T - 1]).abs().max().item()
    tensors = {
        "prompt_ids": prompt[0].to(torch.int64).contiguous(),
        "prefill_logits": prefill.float().contiguous(),
        "decode_ids": decode_ids.contiguous(),
        "decode_logits": decode_logits.float().contiguous(),
        "full_logits": full.float().contiguous(),
    }
    checks = {
        "max_abs_diff_decode_vs_full": diff_decode,
        "max_abs_diff_prefill_vs_full_prefix": diff_prefill,
        "max_abs_diff_decode0_vs_prefill_last": diff_first,
        "greedy_top2_margins": margins,
        "logits_abs_max": prefill.abs().max().item(),
        "logits_std": prefill.std().item(),
        "cache_layout": layout,
    }
    return tensors, checks


def write_golden(path, tensors, checks):
    # One metadata key only: safetensors writes its metadata map in hash order, so with several
    # keys the file's bytes would change from run to run.
    info = {
        "convention": (
            "decode_logits[i] is the logits row whose argmax is decode_ids[i]; row 0 is the last row "
            "of the cached prefill; row i>=1 is the cached one-token step that fed decode_ids[i-1]. "
            "full_logits = uncached forward over prompt_ids ++ decode_ids[:N-1]; "
            "full_logits[T-1+i] == decode_logits[i]."
        ),
        "checks": checks,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    save_file(tensors, path, metadata={"golden_info": json.dumps(info, sort_keys=True)})


def make_prompt(key, vocab):
    gen = torch.Generator().manual_seed(SEED_PROMPT[key])
    return torch.randint(0, vocab, (1, T_PROMPT), generator=gen, dtype=torch.int64)


def prepare(model):
    model = model.float().eval()
    model.set_attn_implementation("eager")
    return model


# --------------------------------------------------------------------------------------------------
# The two models
# --------------------------------------------------------------------------------------------------


def record(key, model, module):
    """Re-randomises `model`'s weights and records its golden logits on `key`'s prompt, checking
    that the GDN and conv entry points of `module` ran transformers' own torch code."""
    rerandomise(model, SEED_WEIGHTS[key])
    counts = check_torch_fallbacks(module)
    prompt = make_prompt(key, model.config.vocab_size)
    stats = gate_stats(model, prompt)
    tensors, checks = golden(model, prompt)
    checks["kernel_calls"] = dict(counts)
    assert all(v > 0 for v in counts.values()), counts
    return tensors, checks, stats


def build_qwen3_5(out_dir):
    key = "qwen3_5"
    text_cfg = Qwen3_5TextConfig(**COMMON, rope_parameters=dict(QWEN3_5_ROPE))
    torch.manual_seed(0)
    model = prepare(Qwen3_5ForCausalLM(text_cfg))
    tensors, checks, stats = record(key, model, modeling_qwen3_5)
    checks["text_mrope_vs_plain_rope_max_abs_diff"] = check_text_mrope(model)

    # Weights, laid out like a released Qwen3.5 checkpoint (text model under model.language_model.).
    state = {}
    for name, t in model.state_dict().items():
        assert name.startswith("model.") or name == "lm_head.weight", name
        new = "model.language_model." + name[len("model.") :] if name.startswith("model.") else name
        state[new] = t.detach().float().contiguous().clone()
    state["model.visual.dummy.weight"] = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    state["mtp.dummy.weight"] = torch.full((2, 2), -1.0)
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})

    # The vision-language wrapper config, with a fresh text config (no "architectures" inside).
    wrapper = Qwen3_5Config(
        text_config=Qwen3_5TextConfig(**COMMON, rope_parameters=dict(QWEN3_5_ROPE)).to_dict(),
        vision_config=dict(TINY_VISION),
        tie_word_embeddings=False,
    )
    wrapper.architectures = ["Qwen3_5ForConditionalGeneration"]
    wrapper.dtype = torch.float32
    wrapper.text_config.dtype = torch.float32
    wrapper.save_pretrained(out_dir)

    write_golden(os.path.join(out_dir, "golden.safetensors"), tensors, checks)
    return tensors, checks, stats


def build_qwen3_next(out_dir):
    key = "qwen3_next"
    cfg = Qwen3NextConfig(**COMMON, **QWEN3_NEXT_MOE, rope_parameters=dict(QWEN3_NEXT_ROPE))
    torch.manual_seed(0)
    model = prepare(Qwen3NextForCausalLM(cfg))
    model.set_experts_implementation("eager")
    tensors, checks, stats = record(key, model, modeling_qwen3_next)

    if os.path.isdir(out_dir):  # no stale shards from an earlier run
        for f in os.listdir(out_dir):
            if f.startswith("model") and (f.endswith(".safetensors") or f.endswith(".index.json")):
                os.remove(os.path.join(out_dir, f))
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="200KB")
    write_golden(os.path.join(out_dir, "golden.safetensors"), tensors, checks)
    return tensors, checks, stats


def build_qwen3_5_moe(out_dir):
    """Qwen3.5-MoE's text model (`Qwen3_5MoeForCausalLM`, a sparse MoE block in every layer),
    saved by transformers as one file: the flat GDN projections of Qwen3.5 with Qwen3-Next's
    experts."""
    key = "qwen3_5_moe"
    moe = {k: v for k, v in QWEN3_NEXT_MOE.items() if k not in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")}
    cfg = transformers.Qwen3_5MoeTextConfig(**COMMON, **moe, rope_parameters=dict(QWEN3_5_ROPE))
    torch.manual_seed(0)
    model = prepare(transformers.Qwen3_5MoeForCausalLM(cfg))
    model.set_experts_implementation("eager")
    tensors, checks, stats = record(key, model, modeling_qwen3_5_moe)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_golden(os.path.join(out_dir, "golden.safetensors"), tensors, checks)
    return tensors, checks, stats


# --------------------------------------------------------------------------------------------------
# Reload checks (transformers reading the directories back)
# --------------------------------------------------------------------------------------------------


def reload_check(out_dir, tensors, classes):
    """Loads `out_dir` with each class and compares prefill logits to the golden ones."""
    results = {}
    prompt = tensors["prompt_ids"][None]
    for cls in classes:
        label = cls.__name__
        try:
            m = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
            with torch.no_grad():
                logits = m(input_ids=prompt, use_cache=False).logits[0]
            results[label] = {
                "loaded_as": type(m).__name__,
                "max_abs_diff_prefill": (logits - tensors["prefill_logits"]).abs().max().item(),
            }
        except Exception as e:  # noqa: BLE001 - report, don't fail
            results[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return results


def describe(out_dir):
    """name -> shape of every tensor in the directory's checkpoint files (not golden)."""
    names = {}
    for f in sorted(os.listdir(out_dir)):
        if f.endswith(".safetensors") and f != "golden.safetensors":
            with safe_open(os.path.join(out_dir, f), "pt") as sf:
                for k in sf.keys():
                    names[k] = (tuple(sf.get_slice(k).get_shape()), f)
    return names


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/data", help="output directory (default: tests/data)")
    ap.add_argument("--no-reload-check", action="store_true", help="skip loading the results back")
    args = ap.parse_args()

    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)  # reproducible CPU reductions
    torch.use_deterministic_algorithms(True)

    cap = _LogCapture()
    logging.getLogger("transformers").addHandler(cap)

    q35_dir = os.path.join(args.out, "qwen3_5_tiny")
    qn_dir = os.path.join(args.out, "qwen3_next_tiny")
    qm_dir = os.path.join(args.out, "qwen3_5_moe_tiny")
    report = {}
    models = (
        ("qwen3_5", build_qwen3_5, q35_dir),
        ("qwen3_next", build_qwen3_next, qn_dir),
        ("qwen3_5_moe", build_qwen3_5_moe, qm_dir),
    )
    for key, build, d in models:
        tensors, checks, stats = build(d)
        report[key] = {"dir": d, "checks": checks, "exp_g": stats, "decode_ids": tensors["decode_ids"].tolist()}
        print(f"== {key}: {d}")
        print(f"   decode_ids {tensors['decode_ids'].tolist()}  top-2 margins {checks['greedy_top2_margins']}")
        print(f"   max |decode - full|            {checks['max_abs_diff_decode_vs_full']:.3e}")
        print(f"   max |prefill - full[:T]|       {checks['max_abs_diff_prefill_vs_full_prefix']:.3e}")
        print(f"   max |decode[0] - prefill[T-1]| {checks['max_abs_diff_decode0_vs_prefill_last']:.3e}")
        print(f"   logits |max| {checks['logits_abs_max']:.3f} std {checks['logits_std']:.3f}")
        print(f"   exp(g) layer {stats['layer']}: min {stats['min']:.4f} mean {stats['mean']:.4f} "
              f"max {stats['max']:.4f} per-head mean {stats['per_head_mean']}")
        print(f"   kernel entry points called: {checks['kernel_calls']}")
        print(f"   cache layout (layer 0): {checks['cache_layout']}")
        if "text_mrope_vs_plain_rope_max_abs_diff" in checks:
            print(f"   text-only M-RoPE vs plain partial RoPE: {checks['text_mrope_vs_plain_rope_max_abs_diff']:.3e}")

    fallback_logs = [m for m in cap.messages if "falling back" in m]
    print("== transformers fallback warnings:")
    for m in fallback_logs:
        print("   " + m)

    if not args.no_reload_check:
        from transformers import Qwen3_5ForConditionalGeneration

        for key, d, classes in (
            ("qwen3_5", q35_dir, [Qwen3_5ForConditionalGeneration, AutoModelForCausalLM, Qwen3_5ForCausalLM]),
            ("qwen3_next", qn_dir, [Qwen3NextForCausalLM, AutoModelForCausalLM]),
            ("qwen3_5_moe", qm_dir, [transformers.Qwen3_5MoeForCausalLM, AutoModelForCausalLM]),
        ):
            with safe_open(os.path.join(d, "golden.safetensors"), "pt") as sf:
                tensors = {k: sf.get_tensor(k) for k in sf.keys()}
            res = reload_check(d, tensors, classes)
            report[key]["reload"] = res
            print(f"== reload {key}: {json.dumps(res, indent=1)}")

    for key, _, d in models:
        print(f"== files in {d}:")
        for f in sorted(os.listdir(d)):
            print(f"   {os.path.getsize(os.path.join(d, f)):>9}  {f}")
        print(f"== tensors of {d}:")
        for k, (shape, f) in describe(d).items():
            print(f"   {k} {list(shape)}  [{f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
