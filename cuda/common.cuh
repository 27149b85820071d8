// Helpers that several stages of cuda/gdp.cu use: the chunk length (every stage), the block size
// of the fused forward and backward, exact conversions to f32 (the fused kernels and the decode
// step), and the staging of K rows into shared memory (fused_fwd.cuh and gdp_bwd.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define GDP_CHUNK 64
#define GDP_THREADS 256

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

// Padding of the K rows held in shared memory, so that rows start in different banks.
template <typename T> struct KPad { static constexpr int value = 1; };
template <> struct KPad<__nv_bfloat16> { static constexpr int value = 2; };
template <> struct KPad<__half> { static constexpr int value = 2; };

// Copies `rows` rows of K elements from global memory (row r starts at src + row_off(r)) to
// shared memory (row stride kstr). With `vec`, 16-byte loads (K a multiple of 16 / sizeof(T) and
// src 16-byte aligned); U loads are in flight per thread before their stores.
template <typename T, typename RowOff>
__device__ __forceinline__ void load_rows(T* __restrict__ dst, int kstr, const T* __restrict__ src,
                                          RowOff row_off, int rows, int K, bool vec, int tid,
                                          int nthr) {
  constexpr int U = 4;
  if (vec) {
    constexpr int EV = 16 / sizeof(T);
    const int vpr = K / EV;
    const int total = rows * vpr;
    for (int base = tid; base < total; base += U * nthr) {
      uint4 tmp[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = base + u * nthr;
        if (idx < total) {
          const int r = idx / vpr, cv = idx - r * vpr;
          tmp[u] = __ldg(reinterpret_cast<const uint4*>(src + row_off(r) + (int64_t)cv * EV));
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = base + u * nthr;
        if (idx < total) {
          const int r = idx / vpr, cv = idx - r * vpr;
          // 4-byte aligned: kstr is odd only for 4-byte T, even for 2-byte T.
          uint32_t* d = reinterpret_cast<uint32_t*>(dst + r * kstr + cv * EV);
          d[0] = tmp[u].x;
          d[1] = tmp[u].y;
          d[2] = tmp[u].z;
          d[3] = tmp[u].w;
        }
      }
    }
  } else {
    const int total = rows * K;
    for (int base = tid; base < total; base += 2 * U * nthr) {
      T tmp[2 * U];
#pragma unroll
      for (int u = 0; u < 2 * U; ++u) {
        const int idx = base + u * nthr;
        if (idx < total) {
          const int r = idx / K, d = idx - r * K;
          tmp[u] = src[row_off(r) + d];
        }
      }
#pragma unroll
      for (int u = 0; u < 2 * U; ++u) {
        const int idx = base + u * nthr;
        if (idx < total) {
          const int r = idx / K, d = idx - r * K;
          dst[r * kstr + d] = tmp[u];
        }
      }
    }
  }
}
