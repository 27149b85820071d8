"""Side-by-side GPU benchmark: candle-gdp's CUDA op (through `gdp run --repeat`) against
flash-linear-attention's `chunk_gated_delta_product` on the same inputs, in the same run.

    python3 scripts/bench_vs_fla.py --gdp ./gdp [--reps 20] [--shapes all|small|long|I,J,...]
                                    [--timing events|host] [--variant "NAME --flag ..."]...
                                    [--qwen | --few-heads] [--no-fla]

`--qwen` times the GDN layers of Qwen3.5-9B and -27B instead (n = 1, 16 key heads, 32 or 48
value heads): gdp on q, k with 16 heads (grouped value heads), FLA's `chunk_gated_delta_rule`
on q, k repeated to the value heads inside the timed call, as a model on FLA runs it.
`--few-heads` times the shapes where the sequential scan is alone on the GPU (B·H <= 16,
T 32K-256K, n = 1, 2, 4). `--no-fla` times gdp alone (its variants side by side, FLA's
columns empty), e.g. to compare `--segments` settings in little device time.

Needs a CUDA build of `gdp` (`cargo build --release --features cuda --bin gdp`) and the
flash-linear-attention + fla-core wheels on PYTHONPATH. For each shape it writes q k v g beta do
to a safetensors file, times FLA (triton.testing.do_bench: its default mean; forward, and forward+backward
through torch autograd), runs `gdp run --device cuda:0 --dtype bf16 --repeat N` on the same
file with `--timing events` (timed the way do_bench times FLA: CUDA events around each call,
calls back to back, L2 cleared before each; `--timing host`: host-clocked calls, synchronised
one at a time), checks that both outputs agree, and prints the ratio FLA time / gdp time (> 1 means gdp
is faster), with the largest relative RMS difference of the gradients (dq dk dv dg dbeta)
from FLA's. Each `--variant` adds a row per shape: gdp run again on the same inputs with
those `gdp run` flags added (e.g. `--variant "chunked --fwd-kernels chunked"`,
`--variant "host --timing host"`, `--variant "explicit --backward explicit"`: the op's own
backward without Candle's gradient accumulation, `gated_delta_product_vjp`;
`--variant "nothing --save nothing"` / `"all --save all"`: the forward keeping none / all of its
intermediates for the backward instead of the default WY factors, `save_intermediates`);
`GDP_BIN=PATH` in a variant runs another `gdp` binary (e.g. an earlier build).

FLA's Triton kernels are autotuned on their first call, keyed by H, K, V and the chunk size but
not by B, T or n: in one process every later shape would run the configurations tuned for the
first. So each shape's FLA timing starts from empty autotune caches (in memory, and
FLA_CACHE_RESULTS=0 for Triton's on-disk results): FLA is tuned for the shape it is timed on,
as in a training run at that shape. `--shared-tuning` keeps the caches across shapes (the
behaviour of this script before 2026-12-02, whose B1 T32768 FLA times ran B4's configurations).
"""
import argparse
import gc
import os
import re
import subprocess
import tempfile
import warnings

os.environ.setdefault("FLA_CACHE_RESULTS", "0")  # before fla is imported (read at import)

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import fla.ops.common.chunk_o as chunk_o
from fla.ops.gated_delta_product import chunk_gated_delta_product
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from triton.runtime.autotuner import Autotuner
from triton.testing import do_bench

# FLA refuses its backward on Hopper with Triton 3.4-3.7.0 (issue #640); fla_gdp.md §10 found
# the results equal to the float64 oracle with the guard bypassed. Outputs are checked below.
chunk_o.TRITON_ABOVE_3_7_1 = True

SHAPES = [(4, 4096, 16, 128, 1), (4, 4096, 16, 128, 2), (4, 4096, 16, 128, 3), (1, 32768, 16, 128, 2)]
# `--few-heads`: where the sequential scan is alone on the GPU (B·H <= 16, T 32K-256K, n = 1, 2,
# 4): long-context training at one sequence per GPU, prefill of one long prompt. The op splits
# the first five (eight segments or four) and the last three (three or two) by default.
FEW_HEADS_SHAPES = [(1, 32768, 8, 128, 1), (1, 65536, 8, 128, 1), (1, 65536, 8, 128, 2),
                    (1, 131072, 4, 128, 1), (1, 262144, 4, 128, 2), (2, 32768, 8, 128, 2),
                    (1, 32768, 16, 128, 4), (1, 65536, 16, 128, 1), (1, 65536, 10, 128, 1),
                    (1, 32768, 12, 128, 1), (1, 32768, 14, 128, 2)]
# `--qwen`: the GDN layers of Qwen3.5-9B (Hk 16 / Hv 32) and Qwen3.5-27B (Hk 16 / Hv 48), n = 1:
# (B, T, Hv, K = V, Hk).
QWEN_SHAPES = [(1, 4096, 32, 128, 16), (8, 4096, 32, 128, 16), (1, 32768, 32, 128, 16),
               (1, 4096, 48, 128, 16), (4, 8192, 48, 128, 16), (1, 32768, 48, 128, 16)]


def reset_autotuning():
    """Forgets every Triton autotuner's chosen configurations, so the next call tunes again."""
    with warnings.catch_warnings():  # isinstance on deprecated torch aliases warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, Autotuner):
                obj.cache.clear()


def inputs(B, T, H, D, n, Hk=None, seed=0):
    """Random bf16 inputs; `q`, `k` with `Hk` heads (default `H`: no grouping)."""
    Hk = Hk or H
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    q = F.normalize(r(B, T, Hk, D), dim=-1).bfloat16()
    k = F.normalize(r(B, T * n, Hk, D), dim=-1).bfloat16()
    v = r(B, T * n, H, D).bfloat16()
    gate = F.logsigmoid(r(B, T, H)).float()
    beta = torch.sigmoid(r(B, T * n, H)).bfloat16()
    do = r(B, T, H, D).bfloat16()
    return q, k, v, gate, beta, do


def fla_op(q, k, v, g, beta, n):
    """FLA's op: chunk_gated_delta_product; with fewer key heads than value heads (Qwen's
    grouped heads), chunk_gated_delta_rule on q and k repeated to the value heads first, inside
    the timed call, as a model on FLA runs it."""
    r = v.shape[2] // q.shape[2]
    if r == 1:
        return chunk_gated_delta_product(q, k, v, g, beta, num_householder=n)
    q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    return chunk_gated_delta_rule(q, k, v, g, beta)


def fla_times(q, k, v, g, beta, do, n):
    fwd = lambda: fla_op(q, k, v, g, beta, n)
    o = fwd()[0]
    t_fwd = do_bench(fwd, warmup=50, rep=300)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]

    def fwd_bwd():
        for x in leaves:
            x.grad = None
        out = fla_op(*leaves, n)[0]
        out.backward(do)

    t_fb = do_bench(fwd_bwd, warmup=50, rep=300)
    fwd_bwd()
    grads = {name: x.grad.float() for name, x in zip(("dq", "dk", "dv", "dg", "dbeta"), leaves)}
    return o.float(), t_fwd, t_fb, grads


def gdp_times(gdp, path, out, reps, timing, env=None, extra=()):
    timing = [] if "--timing" in extra else ["--timing", timing]
    cmd = [gdp, "run", "--input", path, "--output", out, "--dtype", "bf16", "--device", "cuda:0",
           "--repeat", str(reps), *timing, *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if res.returncode != 0:
        return None, None, res.stderr.strip().splitlines()[-1] if res.stderr else f"exit {res.returncode}"
    get = lambda key: (float(m.group(1)) if (m := re.search(key + r"=([0-9.]+)", res.stdout)) else None)
    return get("fwd_ms"), get("fwd_bwd_ms"), None


def parse_variant(text, gdp):
    """`NAME VAR=VALUE ... --flag VALUE ...` -> (name, `gdp` binary, environment, extra `gdp run`
    arguments); `GDP_BIN=PATH` runs another `gdp` binary (e.g. an earlier build)."""
    name, *rest = text.split()
    env = dict(kv.split("=", 1) for kv in rest if "=" in kv and not kv.startswith("--"))
    extra = [x for x in rest if x.startswith("--") or "=" not in x]
    return name, env.pop("GDP_BIN", gdp), env, extra


def parse_shape(text, ap):
    """`B,T,H,n` or `B,T,H,n,Hk` (K = V = 128) -> a table row (B, T, H, D, n, Hk)."""
    try:
        B, T, H, n, *hk = (int(x) for x in text.split(","))
        if len(hk) > 1:
            raise ValueError
    except ValueError:
        ap.error(f"--shape: B,T,H,n[,Hk], got {text!r}")
    return B, T, H, 128, n, hk[0] if hk else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gdp", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="all",
                    help="all, small (the first shape), long (the last) or 1-based indices into SHAPES: 2,3")
    ap.add_argument("--shape", action="append", default=[],
                    help="B,T,H,n[,Hk] (K = V = 128) instead of a table's shapes; repeatable")
    ap.add_argument("--variant", action="append", default=[],
                    help='"NAME VAR=VALUE ... [--gdp-run-flag VALUE ...]"; GDP_BIN=PATH: another gdp binary')
    ap.add_argument("--timing", default="events", choices=["events", "host"],
                    help="gdp run's timing: events (as do_bench times FLA) or host")
    ap.add_argument("--qwen", action="store_true",
                    help="Qwen3.5 GDN shapes (n = 1, Hk = 16 key heads, Hv = 32 or 48 value heads): "
                         "FLA's chunk_gated_delta_rule on q, k repeated to Hv heads, gdp on Hk heads")
    ap.add_argument("--few-heads", action="store_true",
                    help="few heads and long sequences (B·H <= 16, T 32K-256K, n = 1, 2, 4)")
    ap.add_argument("--no-fla", action="store_true",
                    help="time gdp alone (its rows and variants; FLA columns left empty)")
    ap.add_argument("--shared-tuning", action="store_true",
                    help="keep FLA's autotuned configurations across shapes (tuned on the first)")
    args = ap.parse_args()
    table = [(B, T, H, D, n, None) for B, T, H, D, n in SHAPES]
    if args.qwen:
        table = [(B, T, Hv, D, 1, Hk) for B, T, Hv, D, Hk in QWEN_SHAPES]
    elif args.few_heads:
        table = [(B, T, H, D, n, None) for B, T, H, D, n in FEW_HEADS_SHAPES]
    named = {"all": table, "small": table[:1], "long": table[-1:]}
    if args.shape:
        shapes = [parse_shape(x, ap) for x in args.shape]
    elif args.shapes in named:
        shapes = named[args.shapes]
    else:
        picks = [int(i) if i.strip().isdigit() else 0 for i in args.shapes.split(",")]
        if not all(1 <= i <= len(table) for i in picks):
            ap.error(f"--shapes: all, small, long or indices 1..{len(table)}, got {args.shapes!r}")
        shapes = [table[i - 1] for i in picks]
    tuning = "tuned on the first shape" if args.shared_tuning else "tuned per shape"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, bf16, K=V=128, ms (FLA: do_bench mean, {tuning}; gdp: --timing {args.timing})")
    print(f"{'B,T,H,n[,Hk]':<16} {'FLA fwd':>9} {'gdp fwd':>9} {'ratio':>6} {'FLA f+b':>9} {'gdp f+b':>9} {'ratio':>6}  o rel RMS, worst grad")
    tmp = tempfile.mkdtemp()
    for B, T, H, D, n, Hk in shapes:
        q, k, v, g, beta, do = inputs(B, T, H, D, n, Hk)
        if not args.shared_tuning:
            reset_autotuning()
        if args.no_fla:
            o_fla, f_fwd, f_fb, g_fla = None, float("nan"), float("nan"), {}
        else:
            o_fla, f_fwd, f_fb, g_fla = fla_times(q, k, v, g, beta, do, n)
        path, out = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
        cpu = lambda x: x.detach().cpu().contiguous()
        save_file({"q": cpu(q), "k": cpu(k), "v": cpu(v), "g": cpu(g), "beta": cpu(beta), "do": cpu(do)}, path)
        variants = [("", args.gdp, {}, [])] + [parse_variant(v, args.gdp) for v in args.variant]
        for name, gdp, env, extra in variants:
            label = f"{B},{T},{H},{n}" + (f",{Hk}" if Hk else "") + (f" {name}" if name else "")
            g_fwd, g_fb, err = gdp_times(gdp, path, out, args.reps, args.timing, env, extra)
            if g_fwd is None:
                print(f"{label:<16} {f_fwd:9.3f} {'-':>9} {'-':>6} {f_fb:9.3f}  gdp failed: {err}")
                continue
            res = load_file(out)
            rel = lambda a, b: ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()
            e_o = rel(res["o"].cuda().float(), o_fla) if o_fla is not None else float("nan")
            e_g = [(rel(res[k].cuda().float(), g_fla[k]), k) for k in g_fla if k in res]
            worst = f", {max(e_g)[1]} {max(e_g)[0]:.1e}" if e_g else ""
            fb = f"{g_fb:9.3f} {f_fb / g_fb:6.2f}" if g_fb else f"{'-':>9} {'-':>6}"
            print(f"{label:<16} {f_fwd:9.3f} {g_fwd:9.3f} {f_fwd / g_fwd:6.2f} {f_fb:9.3f} {fb}  {e_o:.1e}{worst}", flush=True)


if __name__ == "__main__":
    main()
