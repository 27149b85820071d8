// Tensor-core block products for the GDP kernels: `block_mma` computes
//   out[m][n] = sum_k a(m, k) b(k, n)   (m < M, n < N, k < KD)
// with warp-level `mma.sync` (f32 accumulators), reading its operands through accessors that
// return f32 values, like the FFMA `block_mm` it replaces.
//
// Precision. The MMA operand type follows the input dtype T (`MmaFor<T>`):
//   bf16 inputs      -> bf16 m16n8k16;  a bf16 input operand is exact in it.
//   f16, f32 inputs  -> tf32 m16n8k8;   an f16 input is exact in tf32 (11 significant bits and
//                                       f32's exponent range), an f32 input is not.
// An operand that is not exact in the MMA type (an f32 intermediate such as the state, the
// inverse (I + A)^-1 or Delta, or an f32 input) is split into hi + lo MMA values and the product
// is hi*hi + hi*lo + lo*hi (the lo*lo term is below f32 rounding for tf32, and ~2^-16 relative
// for bf16). So the products keep f32 accuracy (3xTF32 for f32 inputs; no plain TF32 anywhere,
// fla_gdp.md §8) while exact input operands cost one MMA.
//
// Work split: tiles of (16 WM) x (8 WN) outputs go round-robin to the warps of threads
// [tid - lane, ...) of the calling range; `nthr` and the range's first thread must be
// multiples of 32 (every lane of a warp takes part in each mma).
//
// `GDP_EMU` swaps the inline PTX for the CPU emulation of cuda/emu (kernel tests without a GPU).

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// Triangular structure that a block product may exploit.
enum Tri {
  kFull = 0,         // no structure
  kStrictLowerOut,   // only out[m][n] with n < m is wanted (tiles on/above the diagonal skipped)
  kLowerA,           // a(m, k) = 0 for k > m (the k loop stops at the tile's last row)
};

struct MmaBf16 {
  static constexpr int KS = 16;  // k per mma
  static constexpr int NA = 4;   // 32-bit A registers
  static constexpr int NB = 2;   // 32-bit B registers

  __device__ static __forceinline__ uint32_t pack(float x0, float x1) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(x0, x1);  // x0 in the low half
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  // hi = bf16(x), lo = bf16(x - hi), for a pair.
  __device__ static __forceinline__ void split(float x0, float x1, uint32_t& hi, uint32_t& lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    const float2 hf = __bfloat1622float2(h);
    hi = *reinterpret_cast<const uint32_t*>(&h);
    lo = pack(x0 - hf.x, x1 - hf.y);
  }
  // Fragment element (row, col) of A (16 x 16) for register r, half h (lane = 4 g + t).
  __device__ static __forceinline__ void a_pos(int lane, int r, int h, int& row, int& col) {
    const int g = lane >> 2, t = lane & 3;
    row = g + ((r & 1) ? 8 : 0);
    col = 2 * t + h + ((r & 2) ? 8 : 0);
  }
  // Fragment element (k, n) of B (16 x 8) for register r, half h.
  __device__ static __forceinline__ void b_pos(int lane, int r, int h, int& k, int& n) {
    const int g = lane >> 2, t = lane & 3;
    k = 2 * t + h + (r ? 8 : 0);
    n = g;
  }
  __device__ static __forceinline__ void mma(float* c, const uint32_t* a, const uint32_t* b) {
#ifdef GDP_EMU
    gdp_emu_mma_bf16(c, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
  }
  // Loads the A fragment at (m0, k0) (hi and, with SPLIT, lo).
  template <bool SPLIT, typename FA>
  __device__ static __forceinline__ void load_a(int lane, int m0, int k0, int M, int KD, FA a,
                                                uint32_t* hi, uint32_t* lo) {
#pragma unroll
    for (int r = 0; r < NA; ++r) {
      float x[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int row, col;
        a_pos(lane, r, h, row, col);
        row += m0;
        col += k0;
        x[h] = (row < M && col < KD) ? a(row, col) : 0.f;
      }
      if (SPLIT)
        split(x[0], x[1], hi[r], lo[r]);
      else
        hi[r] = pack(x[0], x[1]);
    }
  }
  template <bool SPLIT, typename FB>
  __device__ static __forceinline__ void load_b(int lane, int k0, int n0, int KD, int N, FB b,
                                                uint32_t* hi, uint32_t* lo) {
#pragma unroll
    for (int r = 0; r < NB; ++r) {
      float x[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int k, n;
        b_pos(lane, r, h, k, n);
        k += k0;
        n += n0;
        x[h] = (k < KD && n < N) ? b(k, n) : 0.f;
      }
      if (SPLIT)
        split(x[0], x[1], hi[r], lo[r]);
      else
        hi[r] = pack(x[0], x[1]);
    }
  }
};

struct MmaTf32 {
  static constexpr int KS = 8;
  static constexpr int NA = 4;
  static constexpr int NB = 2;

  __device__ static __forceinline__ uint32_t cvt(float x) {
#ifdef GDP_EMU
    return gdp_emu_cvt_tf32(x);
#else
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
#endif
  }
  __device__ static __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
    hi = cvt(x);
    lo = cvt(x - __uint_as_float(hi));
  }
  __device__ static __forceinline__ void mma(float* c, const uint32_t* a, const uint32_t* b) {
#ifdef GDP_EMU
    gdp_emu_mma_tf32(c, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
  }
  template <bool SPLIT, typename FA>
  __device__ static __forceinline__ void load_a(int lane, int m0, int k0, int M, int KD, FA a,
                                                uint32_t* hi, uint32_t* lo) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < NA; ++r) {
      const int row = m0 + g + ((r & 1) ? 8 : 0);
      const int col = k0 + t + ((r & 2) ? 4 : 0);
      const float x = (row < M && col < KD) ? a(row, col) : 0.f;
      if (SPLIT)
        split(x, hi[r], lo[r]);
      else
        hi[r] = cvt(x);
    }
  }
  template <bool SPLIT, typename FB>
  __device__ static __forceinline__ void load_b(int lane, int k0, int n0, int KD, int N, FB b,
                                                uint32_t* hi, uint32_t* lo) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < NB; ++r) {
      const int k = k0 + t + (r ? 4 : 0);
      const int n = n0 + g;
      const float x = (k < KD && n < N) ? b(k, n) : 0.f;
      if (SPLIT)
        split(x, hi[r], lo[r]);
      else
        hi[r] = cvt(x);
    }
  }
};

// The MMA type for input dtype T, and whether an input operand must be split in it.
template <typename T> struct MmaFor;
template <> struct MmaFor<float> {
  using type = MmaTf32;
  static constexpr bool split_inputs = true;
};
template <> struct MmaFor<__half> {
  using type = MmaTf32;
  static constexpr bool split_inputs = false;
};
template <> struct MmaFor<__nv_bfloat16> {
  using type = MmaBf16;
  static constexpr bool split_inputs = false;
};

// Accumulates the product of one (16 WM) x (8 WN) tile over k in [0, kd) into acc.
template <typename P, bool SA, bool SB, int WM, int WN, typename FA, typename FB>
__device__ __forceinline__ void mma_tile(float (&acc)[WM][WN][4], int lane, int m0, int n0, int M,
                                         int N, int kd, FA a, FB b) {
  for (int k0 = 0; k0 < kd; k0 += P::KS) {
    uint32_t ahi[WM][P::NA], alo[WM][P::NA], bhi[WN][P::NB], blo[WN][P::NB];
#pragma unroll
    for (int i = 0; i < WM; ++i) P::template load_a<SA>(lane, m0 + 16 * i, k0, M, kd, a, ahi[i], alo[i]);
#pragma unroll
    for (int j = 0; j < WN; ++j) P::template load_b<SB>(lane, k0, n0 + 8 * j, kd, N, b, bhi[j], blo[j]);
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
      for (int j = 0; j < WN; ++j) {
        // Small terms first.
        if (SA) P::mma(acc[i][j], alo[i], bhi[j]);
        if (SB) P::mma(acc[i][j], ahi[i], blo[j]);
        P::mma(acc[i][j], ahi[i], bhi[j]);
      }
  }
}

// Calls store(m, n, value) for every valid element of an accumulated tile.
template <int WM, int WN, typename FS>
__device__ __forceinline__ void mma_store(const float (&acc)[WM][WN][4], int lane, int m0, int n0,
                                          int M, int N, FS store) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < WM; ++i)
#pragma unroll
    for (int j = 0; j < WN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = m0 + 16 * i + g + (e >= 2 ? 8 : 0);
        const int n = n0 + 8 * j + 2 * t + (e & 1);
        if (m < M && n < N) store(m, n, acc[i][j][e]);
      }
}

// out = a b on tensor cores (see the file comment); `store(m, n, acc)` writes a result.
// SA / SB: split operand a / b into hi + lo (false only for operands exact in P's type).
template <typename P, bool SA, bool SB, int WM = 1, int WN = 4, int TRI = kFull, typename FA,
          typename FB, typename FS>
__device__ __forceinline__ void block_mma(int M, int N, int KD, int tid, int nthr, FA a, FB b,
                                          FS store) {
  if (M <= 0 || N <= 0) return;
  constexpr int TM = 16 * WM, TN = 8 * WN;
  const int lane = tid & 31, warp = tid >> 5, nwarps = nthr >> 5;
  const int tiles_n = (N + TN - 1) / TN;
  const int tiles = ((M + TM - 1) / TM) * tiles_n;
  for (int tile = warp; tile < tiles; tile += nwarps) {
    const int m0 = (tile / tiles_n) * TM;
    const int n0 = (tile % tiles_n) * TN;
    if (TRI == kStrictLowerOut && n0 >= m0 + TM - 1) continue;
    const int kd = TRI == kLowerA ? min(KD, m0 + TM) : KD;
    float acc[WM][WN][4] = {};
    mma_tile<P, SA, SB, WM, WN>(acc, lane, m0, n0, M, N, kd, a, b);
    mma_store<WM, WN>(acc, lane, m0, n0, M, N, store);
  }
}

// Like block_mma (kFull) with the inner dimension in two parts: acc1 sums k < KD1 through
// (a1, b1), acc2 sums k < KD2 through (a2, b2); `store(m, n, acc1, acc2)`.
template <typename P, bool SA1, bool SB1, bool SA2, bool SB2, int WM = 1, int WN = 4,
          typename FA1, typename FB1, typename FA2, typename FB2, typename FS>
__device__ __forceinline__ void block_mma_split(int M, int N, int KD1, int KD2, int tid, int nthr,
                                                FA1 a1, FB1 b1, FA2 a2, FB2 b2, FS store) {
  if (M <= 0 || N <= 0) return;
  constexpr int TM = 16 * WM, TN = 8 * WN;
  const int lane = tid & 31, warp = tid >> 5, nwarps = nthr >> 5;
  const int tiles_n = (N + TN - 1) / TN;
  const int tiles = ((M + TM - 1) / TM) * tiles_n;
  for (int tile = warp; tile < tiles; tile += nwarps) {
    const int m0 = (tile / tiles_n) * TM;
    const int n0 = (tile % tiles_n) * TN;
    float acc1[WM][WN][4] = {}, acc2[WM][WN][4] = {};
    mma_tile<P, SA1, SB1, WM, WN>(acc1, lane, m0, n0, M, N, KD1, a1, b1);
    mma_tile<P, SA2, SB2, WM, WN>(acc2, lane, m0, n0, M, N, KD2, a2, b2);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
      for (int j = 0; j < WN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int m = m0 + 16 * i + g + (e >= 2 ? 8 : 0);
          const int n = n0 + 8 * j + 2 * t + (e & 1);
          if (m < M && n < N) store(m, n, acc1[i][j][e], acc2[i][j][e]);
        }
  }
}
