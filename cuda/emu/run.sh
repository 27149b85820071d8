#!/bin/sh
# Builds and runs the CPU emulation test of the CUDA kernels (no GPU, no CUDA toolkit needed):
#   sh cuda/emu/run.sh [rev] [bf16]   (rev: reversed thread ids, to shake out ordering
#   assumptions; bf16: only the bf16 forwards)
set -e
cd "$(dirname "$0")"
out="${TMPDIR:-/tmp}/gdp-emu-kernels"
${CXX:-g++} -std=c++20 -O2 -DGDP_EMU -Wno-unknown-pragmas -Wno-unused-result -I inc -I .. \
  -include emu.h kernels.cpp -o "$out" -lpthread
exec "$out" "$@"
