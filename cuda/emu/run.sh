#!/bin/sh
# Builds and runs the CPU emulation test of the CUDA kernels (no GPU, no CUDA toolkit needed):
#   sh cuda/emu/run.sh [rev] [bf16|step|f32dg|cp|seg] [bwd]   (rev: reversed thread ids, to shake
#   out ordering assumptions; bf16: the decode step, context parallelism's kernels and the bf16
#   kernels only; step: the decode step only; bf16 bwd: the decode step and the split bf16
#   backward only; f32dg: the f32 backward at K = 256 with strong gates four times, whose gate
#   gradient must not depend on thread timing; cp: context parallelism's kernels only; seg: the
#   forward and the backward in segments; seg bwd: the backward in segments only)
set -e
cd "$(dirname "$0")"
out="${TMPDIR:-/tmp}/gdp-emu-kernels"
# -fno-strict-aliasing: the kernels read bf16 rows as 32-bit pairs and 16-byte vectors through
# reinterpret_cast, as CUDA code does; at -O2 g++ may assume such reads alias nothing.
# -fsanitize=alignment: emu.h gives the vector types CUDA's alignment, so a pair or vector access
# that would fault on a GPU ("misaligned address") stops the run here, naming the line.
${CXX:-g++} -std=c++20 -O2 -fno-strict-aliasing -fsanitize=alignment -fno-sanitize-recover=alignment \
  -DGDP_EMU -Wno-unknown-pragmas -Wno-unused-result -I inc -I .. \
  -include emu.h kernels.cpp -o "$out" -lpthread
exec "$out" "$@"
