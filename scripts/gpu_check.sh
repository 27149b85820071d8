#!/usr/bin/env bash
# The GPU checks of a session, from the repository root on a machine with an NVIDIA GPU, nvcc
# and PyTorch (+ the flash-linear-attention and fla-core wheels on PYTHONPATH for the last step):
#
#   scripts/gpu_check.sh BIN_DIR [OUT_DIR]
#
# BIN_DIR holds `gpu`, `gpu_fast_paths` (the test binaries of
# `cargo test --release --features cuda --no-run --test gpu --test gpu_fast_paths`) and `gdp`
# (`cargo build --release --features cuda --bin gdp`), and optionally `kbench.o` (the kernel
# timing harness compiled elsewhere: `nvcc -O3 -std=c++17 -arch=sm_90 -Icuda -c
# cuda/bench/kernels.cu -o kbench.o`; otherwise it is compiled here). Runs, each with a time
# limit, logging to OUT_DIR (default $OUT or /tmp/gpu_check): the GPU tests (tests/gpu.rs, then
# tests/gpu_fast_paths.rs with its ignored timing), the kernel-only timings, the few-heads
# shapes with `--segments` off and auto (gdp alone), and the
# side-by-side benchmark against FLA with the no-pool-retention and per-value-tile-backward
# variants (scripts/bench_vs_fla.py).
set -u
bin=${1:?usage: scripts/gpu_check.sh BIN_DIR [OUT_DIR]}
out=${2:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
summary() { grep -E "test result|FAILED|panicked|^Error|decode step" "$1" | head -20; }

echo "== tests/gpu.rs"
timeout 300 "$bin/gpu" --test-threads 1 > "$out/gpu.log" 2>&1
summary "$out/gpu.log"
echo "== tests/gpu_fast_paths.rs (with the decode timing)"
timeout 300 "$bin/gpu_fast_paths" --test-threads 1 --include-ignored > "$out/fast.log" 2>&1
summary "$out/fast.log"
echo "== kernel-only timings"
if [ -f "$bin/kbench.o" ]; then
  nvcc -arch=sm_90 "$bin/kbench.o" -o "$out/kbench"
else
  nvcc -O3 -std=c++17 -arch=sm_90 -Icuda cuda/bench/kernels.cu -o "$out/kbench"
fi && timeout 120 "$out/kbench" 2>&1 | tee "$out/kbench.log"
echo "== few heads: segments off and auto (gdp alone, forward and backward)"
timeout 300 python3 -u scripts/bench_vs_fla.py --gdp "$bin/gdp" --reps 5 --few-heads --no-fla \
  --variant "auto --segments auto" --variant "explicit --backward explicit" \
  --variant "auto-explicit --segments auto --backward explicit" \
  --variant "auto-pair --segments auto --backward explicit --states-tile 128 --dh-tile 64" \
  2>&1 | tee "$out/segments.log"
echo "== against FLA"
timeout 600 python3 -u scripts/bench_vs_fla.py --gdp "$bin/gdp" --reps 5 \
  --variant "noretain --no-retain-pool" --variant "tilebwd --bwd-kernels fused" 2>&1 |
  tee "$out/bench.log"
