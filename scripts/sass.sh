#!/usr/bin/env bash
# The machine code (SASS) of the CUDA kernels, without a GPU: compiles cuda/gdp.cu to an sm_90
# cubin with the nvcc on PATH (`source ../shared/tools/cuda-env.sh` first) and disassembles it
# with nvdisasm, fetched once from PyPI (nvidia-cuda-nvdisasm) into the cache folder.
#
#   scripts/sass.sh [KERNEL]     # e.g. gdp_fwd_scan_bf16_32_128; none: every kernel
#
# Prints the chosen kernel's SASS to stdout and a summary to stderr: its instruction count and
# how many of them are tensor-core products, asynchronous copies, shared-memory loads and block
# barriers (static counts; the issued ones need ncu on a GPU). The full listing stays in
# $SASS_DIR (default /tmp/gdp-sass), compiled again when a source in cuda/ is newer.
set -euo pipefail
cd "$(dirname "$0")/.."
kernel=${1:-}
out=${SASS_DIR:-/tmp/gdp-sass}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/gdp-nvdisasm
mkdir -p "$out" "$cache"
command -v nvcc > /dev/null || { echo "sass.sh: no nvcc on PATH (source ../shared/tools/cuda-env.sh)" >&2; exit 2; }
nvdisasm=$(find "$cache" -name nvdisasm -type f 2> /dev/null | head -n 1)
if [ -z "$nvdisasm" ]; then
  python3 -m pip download -q --no-deps -d "$cache" nvidia-cuda-nvdisasm
  python3 -m zipfile -e "$cache"/nvidia_cuda_nvdisasm-*.whl "$cache/x"
  nvdisasm=$(find "$cache" -name nvdisasm -type f | head -n 1)
  chmod +x "$nvdisasm"
fi
# Compiled again only when a kernel source is newer than the listing.
if [ ! -s "$out/gdp.sass" ] || [ -n "$(find cuda -maxdepth 1 -name '*.cu*' -newer "$out/gdp.sass")" ]; then
  nvcc -arch=sm_90 -O3 -std=c++17 -I cuda --cubin -o "$out/gdp.cubin" cuda/gdp.cu
  "$nvdisasm" -c "$out/gdp.cubin" > "$out/gdp.sass"
fi
if [ -z "$kernel" ]; then
  cat "$out/gdp.sass"
  exit 0
fi
# One function's section: from its .text label to the next one.
awk -v name=".text.$kernel:" '$0 == name {on = 1; print; next} on && /^([ \t]*\.section|\.text\.|\/\/-)/ {exit} on' \
  "$out/gdp.sass" > "$out/$kernel.sass"
[ -s "$out/$kernel.sass" ] || { echo "sass.sh: no kernel $kernel in the cubin" >&2; exit 1; }
cat "$out/$kernel.sass"
# Instructions by opcode, leaving out the never-issued padding the compiler predicates on !PT.
count() { grep -E '^ +/\*[0-9a-f]+\*/ ' "$out/$kernel.sass" | grep -v '@!PT ' | grep -cE "$1" || true; }
echo "$kernel: $(count .) instructions, $(count ' HMMA') HMMA, $(count ' LDGSTS') LDGSTS," \
  "$(count ' LDSM') LDSM, $(count ' LDS[. ]') LDS, $(count ' BAR\.SYNC') BAR.SYNC" >&2
