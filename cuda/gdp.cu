// Gated DeltaProduct: every CUDA kernel of the crate in one translation unit. build.rs compiles
// this file into one fat binary; the CPU emulator (cuda/emu) and the kernel benchmark
// (cuda/bench) include it. The headers, in dependency order:
//   params.cuh           the kernels' parameter lists (X-macros; src/op/kernel_params.rs mirrors)
//   inverse.cuh          the triangular inverse (I + A)^-1 of a chunk, f32
//   mma.cuh              block_mma: matrix products on tensor cores (bf16, split tf32)
//   common.cuh           helpers several stages use: GDP_CHUNK, GDP_THREADS, to_f, KPad, load_rows
//   fused_fwd.cuh        gdp_fwd_{f32,bf16,f16}: the one-kernel forward (any dtype)
//   gdp_bwd.cuh          gdp_bwd_{f32,bf16,f16}: the one-kernel backward and the two CP summaries
//   gdp_fwd_chunked.cuh  the bf16 forward in two launches: gdp_fwd_wy_bf16 (the WY factors),
//                        gdp_fwd_scan_bf16_* and gdp_fwd_states_bf16_* (the state scan);
//                        ldmatrix loads from ldsm.cuh
//   gdp_bwd_chunked.cuh  the split bf16 backward: gdp_bwd_dh_bf16_* (the state-gradient scan),
//                        gdp_bwd_grads_bf16_* (every gradient), gdp_f32_to_bf16
//   copy.cuh             gdp_copy_rows: strided row copies (the op's q/k packing);
//                        gdp_sum_groups_{bf16,f32}: dq, dk summed over grouped value heads
//   cp_fix.cuh           gdp_cp_fix_{bf16,f32}, gdp_cp_widen_states: context parallelism's
//                        correction of a widened scan; gdp_fold_chains: the segments' folds
//   step.cuh             gdp_step_{f32,bf16,f16}_k*: the fused decode step

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "params.cuh"
#include "inverse.cuh"
#include "mma.cuh"
#include "common.cuh"

#include "fused_fwd.cuh"
#include "gdp_bwd.cuh"
#include "gdp_fwd_chunked.cuh"
#include "gdp_bwd_chunked.cuh"
#include "copy.cuh"
#include "cp_fix.cuh"
#include "step.cuh"
