#!/usr/bin/env bash
# Builds what a GPU session runs and packs it small enough to send: `gdp` and the test binaries
# of tests/gpu.rs, tests/gpu_fast_paths.rs, tests/gpu_sweep.rs and tests/qwen.rs, for one
# architecture (sm_90 by default: about 13 MB each once stripped and xz-compressed, against 21
# MB for the default fat binary), into OUT_DIR as NAME.xz. Run from the repository root with nvcc on PATH (on a machine
# without CUDA: `source ../shared/tools/cuda-env.sh` first):
#
#   scripts/pack_gpu_bins.sh OUT_DIR [COMPUTE_CAP]
#
# scripts/gpu_check.sh unpacks and runs them on the GPU machine.
set -euo pipefail
out=${1:?usage: scripts/pack_gpu_bins.sh OUT_DIR [COMPUTE_CAP]}
export GDP_CUDA_COMPUTE_CAP=${2:-90}
mkdir -p "$out"
target=${CARGO_TARGET_DIR:-target}
cargo build --release --features cuda,cli --bin gdp
# The test binaries' paths, from cargo's own report of what it built.
tests=$(cargo test --release --features cuda,cli --no-run --message-format=json \
  --test gpu --test gpu_fast_paths --test gpu_sweep --test qwen |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"] + "=" + m["executable"])
')
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for pair in "gdp=$target/release/gdp" $tests; do
  name=${pair%%=*}
  strip -o "$tmp/$name" "${pair#*=}"
  # Written under another name first: a file sent while this loop still runs is then missing,
  # not a truncated archive.
  xz -T0 -6 -c "$tmp/$name" > "$out/$name.xz.part"
  mv "$out/$name.xz.part" "$out/$name.xz"
  echo "$out/$name.xz: $(du -h "$out/$name.xz" | cut -f1)"
done
