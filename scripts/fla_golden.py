"""Golden test data from flash-linear-attention itself, for `tests/fla_compat.rs`.

Builds a tiny random FLA `GatedDeltaProductForCausalLM`, saves its weights (f32, FLA parameter
names), its config, input ids and the logits FLA computes, into one safetensors file. Run on a
machine with a CUDA GPU (FLA's kernels are Triton):

    pip install flash-linear-attention==0.6.0 fla-core==0.6.0
    python3 scripts/fla_golden.py tests/data/fla_gdp_tiny.safetensors

Two forward passes are recorded:
  * `logits_f32`  [1, 48, vocab]: f32 model in eval mode; FLA's layer takes its
    `fused_recurrent` path for q_len <= 64 (f32 throughout);
  * `logits_bf16` [1, 160, vocab]: the same weights in bf16; FLA's `chunk` path.
"""
import json
import sys

import torch
from safetensors.torch import save_file

import fla
from fla.models import GatedDeltaProductConfig, GatedDeltaProductForCausalLM


def main(path):
    torch.manual_seed(0)
    cfg = GatedDeltaProductConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=2,
        head_dim=16,
        expand_v=2.0,
        num_householder=2,
        use_forget_gate=True,
        allow_neg_eigval=True,
        use_output_gate=True,
        use_short_conv=True,
        conv_size=4,
        hidden_ratio=2,
        vocab_size=96,
        norm_eps=1e-6,
        tie_word_embeddings=False,
        fuse_cross_entropy=False,
    )
    model = GatedDeltaProductForCausalLM(cfg).cuda().float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Move every parameter off its initial value so that a misplaced one shows.
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("A_log") or name.endswith("dt_bias"):
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / max(1, p.shape[-1]) ** 0.5) * 2)
    weights = {k: v.detach().float().contiguous().cpu() for k, v in model.state_dict().items()}
    ids_short = torch.randint(0, cfg.vocab_size, (1, 48), device="cuda")
    ids_long = torch.randint(0, cfg.vocab_size, (1, 160), device="cuda")
    with torch.no_grad():
        logits_f32 = model(ids_short).logits.float()
        logits_bf16 = model.to(torch.bfloat16)(ids_long).logits.float()
    out = dict(weights)
    out["input_ids_f32"] = ids_short.cpu().to(torch.int64)
    out["logits_f32"] = logits_f32.cpu().contiguous()
    out["input_ids_bf16"] = ids_long.cpu().to(torch.int64)
    out["logits_bf16"] = logits_bf16.cpu().contiguous()
    meta = {
        "config": json.dumps(cfg.to_dict(), default=str),
        "fla_version": getattr(fla, "__version__", "?"),
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(0),
    }
    save_file(out, path, metadata=meta)
    print("saved", path, "params:", len(weights))
    for k, v in weights.items():
        print(f"  {k:55s} {tuple(v.shape)}")
    print("logits_f32", tuple(logits_f32.shape), float(logits_f32.std()))
    print("logits_bf16", tuple(logits_bf16.shape), float(logits_bf16.std()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fla_gdp_tiny.safetensors")
