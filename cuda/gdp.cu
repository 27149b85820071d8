// Gated DeltaProduct: forward of the chunked (WY) algorithm on CUDA.
//
// Mirrors the CPU kernels of `src/op/cpu/{chunk,forward}.rs` (see `fla_gdp.md` §2): one block
// walks the interleaved 64-row chunks of one (sequence, head) for a slice of BV value columns,
// keeping its state slice S[K, BV] in shared memory, in f32. Inputs are the packed buffers of
// `src/op/custom.rs`:
//   qk  [B, T, n+1, H, K]   slot 0 = q_t, slot 1+j = k_{t*n+j}              (T = float/bf16/f16)
//   v   [B, T*n, H, V]
//   aux [g (B*T*H) | beta (B*T*n*H) | h0 (N*H*K*V) if has_h0]                 (f32)
//   seqs [N, 3] int: (batch row, first token, tokens) per sequence
//   out [o (B*T*H*V) | final state (N*H*K*V)]                                 (f32)
// Grid (N*H, ceil(V/BV)) (N*H on x, whose limit is 2^31-1), GDP_THREADS threads; dynamic shared memory as in `gdp_smem_bytes`
// (the Rust launcher in src/op/cuda/fused_fwd.rs computes the same layout).
//
// Per interleaved chunk of c <= 64 rows (gate g_t on row t*n, query on row t*n+n-1):
//   G = cumsum(gate), decay[i][j] = prod_{m=j+1..i} e^{gate_m} (j <= i, 0 above: pitfall P4),
//   A = strict_lower((beta_i k_i.k_j) decay),  Ainv = (I + A)^-1 (forward substitution, f32),
//   X = diag(beta) V - diag(beta e^G) (K S),   Delta = Ainv X      (= U - W S of the CPU code),
//   o_r = scale e^{G_i} q_r S + sum_j scale (q_r.k_j) decay[i][j] Delta_j   (query rows i),
//   S = e^{G_last} S + (decay[last][:] k)^T Delta.
// The matrix products run on tensor cores (block_mma, cuda/mma.cuh: bf16 or split tf32 operands
// with f32 accumulators); the triangular inverse and the scalar recurrences stay in f32 FFMA.
// Every offset into global memory is 64-bit.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "inverse.cuh"
#include "mma.cuh"

#define GDP_CHUNK 64
#define GDP_THREADS 256

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

// The 16 / sizeof(T) values of a 16-byte word, as f32 (exact conversions).
template <typename T> __device__ __forceinline__ void unpack16(uint4 w, float* out);
template <> __device__ __forceinline__ void unpack16<float>(uint4 w, float* out) {
  out[0] = __uint_as_float(w.x);
  out[1] = __uint_as_float(w.y);
  out[2] = __uint_as_float(w.z);
  out[3] = __uint_as_float(w.w);
}
__device__ __forceinline__ void unpack_bf16x2(uint32_t x, float* out) {
  out[0] = __uint_as_float(x << 16);
  out[1] = __uint_as_float(x & 0xffff0000u);
}
template <> __device__ __forceinline__ void unpack16<__nv_bfloat16>(uint4 w, float* out) {
  unpack_bf16x2(w.x, out);
  unpack_bf16x2(w.y, out + 2);
  unpack_bf16x2(w.z, out + 4);
  unpack_bf16x2(w.w, out + 6);
}
__device__ __forceinline__ void unpack_f16x2(uint32_t x, float* out) {
  out[0] = __half2float(__ushort_as_half((unsigned short)(x & 0xffffu)));
  out[1] = __half2float(__ushort_as_half((unsigned short)(x >> 16)));
}
template <> __device__ __forceinline__ void unpack16<__half>(uint4 w, float* out) {
  unpack_f16x2(w.x, out);
  unpack_f16x2(w.y, out + 2);
  unpack_f16x2(w.z, out + 4);
  unpack_f16x2(w.w, out + 6);
}

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

template <typename T>
__device__ void gdp_fwd(const T* __restrict__ qk, const T* __restrict__ vv,
                        const float* __restrict__ aux, const int* __restrict__ seqs,
                        const float* __restrict__ h0_override, int use_h0_override,
                        float* __restrict__ out, int B, int TT, int H, int K, int V, int n,
                        int has_h0, float scale, int BV) {
  constexpr int C = GDP_CHUNK;
  using MP = typename MmaFor<T>::type;          // tensor-core operand type
  constexpr bool SI = MmaFor<T>::split_inputs;  // whether input operands need hi + lo
  const int tid = threadIdx.x;
  const int nthr = blockDim.x;
  const int v0 = blockIdx.y * BV;
  const int bv = min(BV, V - v0);  // valid columns of this block
  const int sidx = blockIdx.x / H;
  const int head = blockIdx.x % H;
  const int seq_b = seqs[3 * sidx];
  const int seq_start = seqs[3 * sidx + 1];
  const int seq_len = seqs[3 * sidx + 2];
  const int KSTR = K + KPad<T>::value;
  constexpr int EV = 16 / sizeof(T);  // values per 16-byte load
  const bool vec_k = (K % EV == 0) && ((reinterpret_cast<uintptr_t>(qk) & 15) == 0);
  const bool vec_v = (V % EV == 0) && (BV % EV == 0) && ((reinterpret_cast<uintptr_t>(vv) & 15) == 0);

  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* S = reinterpret_cast<float*>(smem_raw);  // [K][BV]
  float* X = S + (size_t)K * BV;                   // [C][BV]: V tile, then X, then q S
  float* D = X + C * BV;                           // [C][BV]: Delta
  float* A = D + C * BV;                           // [C][C]: A, then P (query-key scores)
  float* Ai = A + C * C;                           // [C][C]: (I + A)^-1
  float* Dec = Ai + C * C;                         // [C][C]: decay
  float* Gs = Dec + C * C;                         // [C]: gate, then its cumsum
  float* Eg = Gs + C;                              // [C]: e^G
  float* Bt = Eg + C;                              // [C]: beta
  float* St = Bt + C;                              // [C]: e^{gate} per row
  T* Ks = reinterpret_cast<T*>(St + C);            // [C][KSTR]
  T* Qs = Ks + (size_t)C * KSTR;                   // [C][KSTR] (query rows only)

  const int64_t BTH = (int64_t)B * TT * H;
  const int64_t KV = (int64_t)K * V;
  const int64_t state_off = ((int64_t)sidx * H + head) * KV;
  const int64_t tok0 = (int64_t)seq_b * TT + seq_start;  // first token of the sequence

  // Initial state slice.
  {
    const float* h0 = nullptr;
    if (use_h0_override)
      h0 = h0_override + state_off;
    else if (has_h0)
      h0 = aux + BTH * (1 + n) + state_off;
    for (int idx = tid; idx < K * BV; idx += nthr) {
      const int r = idx / BV, col = idx % BV;
      S[idx] = (h0 != nullptr && col < bv) ? h0[(int64_t)r * V + v0 + col] : 0.f;
    }
  }
  __syncthreads();

  const int64_t L = (int64_t)seq_len * n;
  for (int64_t p0 = 0; p0 < L; p0 += C) {
    const int c = (int)min((int64_t)C, L - p0);
    // Query rows of the chunk: rows i with (p0 + i) % n == n - 1, i = first + r n.
    const int first = (int)(((int64_t)(n - 1) - p0 % n + n) % n);
    const int nq = first < c ? (c - 1 - first) / n + 1 : 0;

    // ---- L1: load keys, queries, the V tile, gates and betas.
    load_rows<T>(
        Ks, KSTR, qk,
        [&](int i) {
          const int64_t p = p0 + i;
          return ((tok0 + p / n) * (n + 1) + 1 + p % n) * H * K + (int64_t)head * K;
        },
        c, K, vec_k, tid, nthr);
    load_rows<T>(
        Qs, KSTR, qk,
        [&](int r) {
          const int64_t p = p0 + first + (int64_t)r * n;
          return ((tok0 + p / n) * (n + 1)) * H * K + (int64_t)head * K;
        },
        nq, K, vec_k, tid, nthr);
    if (vec_v) {
      // bv is a multiple of EV here (V, v0 and BV are).
      const int vpr = bv / EV;
      for (int idx = tid; idx < c * vpr; idx += nthr) {
        const int i = idx / vpr, cv = idx - i * vpr;
        const int64_t row = tok0 * n + p0 + i;
        const uint4 w = __ldg(reinterpret_cast<const uint4*>(vv + (row * H + head) * V + v0) + cv);
        unpack16<T>(w, X + i * BV + cv * EV);
      }
    } else {
      for (int idx = tid; idx < c * bv; idx += nthr) {
        const int i = idx / bv, col = idx % bv;
        const int64_t row = tok0 * n + p0 + i;
        X[i * BV + col] = to_f(vv[(row * H + head) * V + v0 + col]);
      }
    }
    for (int i = tid; i < c; i += nthr) {
      const int64_t p = p0 + i;
      const int64_t tok = tok0 + p / n;
      const float graw = (p % n == 0) ? aux[tok * H + head] : 0.f;
      Gs[i] = graw;
      St[i] = expf(graw);
      Bt[i] = aux[BTH + ((tok0 * n + p) * H + head)];
    }
    __syncthreads();

    // ---- L2: cumsum of the gate (one thread, in the CPU's order) and decay rows (one thread per
    // row, as running products of e^{gate}, like the CPU code).
    if (tid == 0) {
      float acc = 0.f;
#pragma unroll 8
      for (int i = 0; i < c; ++i) {
        acc += Gs[i];
        Gs[i] = acc;
      }
    }
    if (tid >= 64 && tid < 64 + c) {
      const int i = tid - 64;
      float* row = Dec + i * c;
      float d = 1.f;
      row[i] = 1.f;
      for (int j = i - 1; j >= 0; --j) {
        d = d * St[j + 1];
        row[j] = d;
      }
      for (int j = i + 1; j < c; ++j) row[j] = 0.f;
    }
    __syncthreads();

    for (int i = tid; i < c; i += nthr) Eg[i] = expf(Gs[i]);
    // ---- A = strict_lower((beta_i k_i.k_j) decay_ij).
    block_mma<MP, SI, SI, 1, 4, kStrictLowerOut>(
        c, c, K, tid, nthr, [&](int m, int k) { return to_f(Ks[m * KSTR + k]); },
        [&](int k, int nn) { return to_f(Ks[nn * KSTR + k]); },
        [&](int m, int nn, float acc) {
          A[m * c + nn] = nn < m ? (acc * Bt[m]) * Dec[m * c + nn] : 0.f;
        });
    __syncthreads();

    // ---- (I + A)^-1 (warps 0-1, named barrier 1) || X = beta V - beta e^G (K S) (warps 2-7).
    if (tid < 64) {
      tri_inverse(A, Ai, c, tid, 64, 1);
    } else {
      block_mma<MP, SI, true>(
          c, bv, K, tid - 64, nthr - 64, [&](int m, int k) { return to_f(Ks[m * KSTR + k]); },
          [&](int k, int nn) { return S[k * BV + nn]; },
          [&](int m, int nn, float acc) {
            const float b = Bt[m];
            X[m * BV + nn] = b * X[m * BV + nn] - (b * Eg[m]) * acc;
          });
    }
    __syncthreads();

    // ---- Delta = Ainv X.
    block_mma<MP, true, true, 1, 4, kLowerA>(
        c, bv, c, tid, nthr, [&](int m, int k) { return Ai[m * c + k]; },
        [&](int k, int nn) { return X[k * BV + nn]; },
        [&](int m, int nn, float acc) { D[m * BV + nn] = acc; });
    __syncthreads();

    // ---- Query rows: P = scale (q.k) decay (into A), q S (into X).
    if (nq > 0) {
      block_mma<MP, SI, SI>(
          nq, c, K, tid, nthr, [&](int r, int k) { return to_f(Qs[r * KSTR + k]); },
          [&](int k, int nn) { return to_f(Ks[nn * KSTR + k]); },
          [&](int r, int nn, float acc) {
            const int i = first + r * n;
            A[r * c + nn] = acc * (scale * Dec[i * c + nn]);
          });
      block_mma<MP, SI, true>(
          nq, bv, K, tid, nthr, [&](int r, int k) { return to_f(Qs[r * KSTR + k]); },
          [&](int k, int nn) { return S[k * BV + nn]; },
          [&](int r, int nn, float acc) { X[r * BV + nn] = acc; });
    }
    __syncthreads();

    // ---- o = scale e^G (q S) + P Delta;  S = e^{G_last} S + (decay_last k)^T Delta.
    if (nq > 0) {
      block_mma<MP, true, true>(
          nq, bv, c, tid, nthr, [&](int r, int k) { return A[r * c + k]; },
          [&](int k, int nn) { return D[k * BV + nn]; },
          [&](int r, int nn, float acc) {
            const int i = first + r * n;
            const int64_t tok = tok0 + (p0 + i) / n;
            out[(tok * H + head) * V + v0 + nn] = (scale * Eg[i]) * X[r * BV + nn] + acc;
          });
    }
    {
      const float eglast = expf(Gs[c - 1]);
      const float* dlast = Dec + (c - 1) * c;
      block_mma<MP, true, true>(
          K, bv, c, tid, nthr,
          [&](int m, int k) { return dlast[k] * to_f(Ks[k * KSTR + m]); },
          [&](int k, int nn) { return D[k * BV + nn]; },
          [&](int m, int nn, float acc) { S[m * BV + nn] = eglast * S[m * BV + nn] + acc; });
    }
    __syncthreads();
  }

  // Final state slice.
  float* fin = out + BTH * V + state_off;
  for (int idx = tid; idx < K * bv; idx += nthr) {
    const int r = idx / bv, col = idx % bv;
    fin[(int64_t)r * V + v0 + col] = S[r * BV + col];
  }
}

#define GDP_FWD_ENTRY(NAME, TYPE)                                                              \
  extern "C" __global__ void __launch_bounds__(GDP_THREADS)                                    \
      NAME(const TYPE* qk, const TYPE* v, const float* aux, const int* seqs,                   \
           const float* h0_override, int use_h0_override, float* out, int B, int T, int H,     \
           int K, int V, int n, int has_h0, float scale, int BV) {                             \
    gdp_fwd<TYPE>(qk, v, aux, seqs, h0_override, use_h0_override, out, B, T, H, K, V, n,       \
                  has_h0, scale, BV);                                                          \
  }

GDP_FWD_ENTRY(gdp_fwd_f32, float)
GDP_FWD_ENTRY(gdp_fwd_bf16, __nv_bfloat16)
GDP_FWD_ENTRY(gdp_fwd_f16, __half)

#include "gdp_bwd.cuh"
#include "gdp_fwd_chunked.cuh"
#include "gdp_bwd_chunked.cuh"
#include "copy.cuh"
#include "cp_fix.cuh"

// One decode step, fused (`src/op/recurrent.rs`, `gated_delta_product_step_fused`): per
// (batch row, head) and 128 value columns, the state slice is read once, decayed, updated by the
// n Householder sub-steps and read by the query, and written once. One column per thread, so a
// warp's load or store touches 32 consecutive columns of a row: whole 128-byte lines (the
// 32-byte row segments of the previous layout, 8 columns x 4 row groups per warp, reached 57%
// of the copy rate). The rows are split in GDP_STEP_PARTS parts of ROWS rows over the block's
// four groups of four warps (ROWS = K / 4 rounded up to a power of two, at least 8); a column
// dot x·S is each thread's partial over its rows, the four partials summed through shared
// memory (one barrier per dot, two buffers in turn). The state is read and written with the
// streaming (evict-first) cache hint: each byte is touched once, and the hint took 3-6% off
// the step on an H200. q and k (zero past row K), the block's v columns and beta are
// staged in shared memory while the state loads are in flight: one round trip to global memory.
// q, k and v come in their own dtype T (f32, bf16 or f16), the gates in f32, each contiguous;
// the state and the output are f32:
//   state [B, H, K, V];  q [B, H, K], k [B, n, H, K], v [B, n, H, V], g [B, H], beta [B, n, H]
//   out   = [o (B H V) | new state (B H K V)]
// Kernels gdp_step_<T>_k<4 ROWS> for T = f32, bf16, f16 and ROWS = 8, 16, 32, 64 (K <= 32, 64,
// 128, 256). Dynamic shared memory: `gdp_step_smem_floats` floats (`src/op/cuda/step.rs` repeats
// the formula).
#define GDP_STEP_COLS 128
#define GDP_STEP_PARTS 4
#define GDP_STEP_THREADS (GDP_STEP_COLS * GDP_STEP_PARTS)

// Rows per part: K / GDP_STEP_PARTS rounded up to a power of two, at least 8.
__host__ __device__ __forceinline__ int gdp_step_rows_per_part(int K) {
  int rows = 8;
  while (rows * GDP_STEP_PARTS < K) rows *= 2;
  return rows;
}

// Dynamic shared memory of the step kernel, in floats (layout in gdp_step_impl).
__host__ __device__ __forceinline__ int gdp_step_smem_floats(int K, int n) {
  return (1 + n) * GDP_STEP_PARTS * gdp_step_rows_per_part(K) + n * GDP_STEP_COLS +
         ((n + 3) & ~3) + 2 * GDP_STEP_PARTS * GDP_STEP_COLS;
}

template <int ROWS, typename T>
__device__ __forceinline__ void gdp_step_impl(const float* __restrict__ state,
                                              const T* __restrict__ q_all,
                                              const T* __restrict__ kk, const T* __restrict__ vv,
                                              const float* __restrict__ gg,
                                              const float* __restrict__ bb,
                                              float* __restrict__ out, int B, int H, int K,
                                              int V, int n, float scale) {
  constexpr int COLS = GDP_STEP_COLS, PARTS = GDP_STEP_PARTS, KP = PARTS * ROWS;
  // Shared memory: x [1 + n][KP] (q, then k_j; zero past row K), v [n][COLS] of the block's
  // columns, beta [n] (padded to 4), the dot partials [2][PARTS][COLS].
  extern __shared__ __align__(16) unsigned char gdps_smem[];
  float* xs = reinterpret_cast<float*>(gdps_smem);
  float* vs = xs + (1 + n) * KP;
  float* bs = vs + n * COLS;
  float* red = bs + ((n + 3) & ~3);
  const int tid = threadIdx.x, c = tid % COLS, part = tid / COLS;
  const int bh = blockIdx.x, b = bh / H, h = bh % H;
  const int col0 = blockIdx.y * COLS, col = col0 + c;
  const bool valid = col < V;
  const int r0 = part * ROWS;
  const int64_t BH = (int64_t)B * H;
  const T* q = q_all + (int64_t)bh * K;
  const float* s_in = state + (int64_t)bh * K * V + (int64_t)r0 * V + col;
  float* s_out = out + BH * V + (int64_t)bh * K * V + (int64_t)r0 * V + col;

  // The small inputs (q and k rows, zero past row K; the block's v columns; beta; the gate)
  // are loaded into registers before the state, where each thread has at most one element of
  // each (K <= 128 at n <= 3): their round trips then overlap the state loads' instead of
  // queueing behind them one after another.
  const int nx = (1 + n) * KP, nv = n * COLS;
  auto x_at = [&](int i) {
    const int j = i / KP - 1, r = i % KP;  // j = -1: the query
    return r >= K ? 0.f : to_f(j < 0 ? q[r] : kk[(((int64_t)b * n + j) * H + h) * K + r]);
  };
  auto v_at = [&](int i) {
    const int j = i / COLS, cj = col0 + i % COLS;
    return cj < V ? to_f(vv[(((int64_t)b * n + j) * H + h) * V + cj]) : 0.f;
  };
  const bool one_pass = nx <= GDP_STEP_THREADS && nv <= GDP_STEP_THREADS;
  float x_mine = 0.f, v_mine = 0.f, b_mine = 0.f;
  if (one_pass) {
    if (tid < nx) x_mine = x_at(tid);
    if (tid < nv) v_mine = v_at(tid);
    if (tid < n) b_mine = bb[((int64_t)b * n + tid) * H + h];
  }
  const float g_bh = gg[bh];

  // Row i of this thread is state row r0 + i, for i < rows; rows past K stay zero. Every row
  // valid (K a multiple of 4 ROWS) is the unguarded path: per-row guards made the compiler keep
  // per-row addresses and spill.
  const int rows = valid ? min(ROWS, max(K - r0, 0)) : 0;
  float s[ROWS];
  if (rows == ROWS) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i) s[i] = __ldcs(s_in + (int64_t)i * V);
  } else {
#pragma unroll
    for (int i = 0; i < ROWS; ++i) s[i] = i < rows ? __ldcs(s_in + (int64_t)i * V) : 0.f;
  }
  if (one_pass) {
    if (tid < nx) xs[tid] = x_mine;
    if (tid < nv) vs[tid] = v_mine;
    if (tid < n) bs[tid] = b_mine;
  } else {
    for (int i = tid; i < nx; i += GDP_STEP_THREADS) xs[i] = x_at(i);
    for (int i = tid; i < nv; i += GDP_STEP_THREADS) vs[i] = v_at(i);
    if (tid < n) bs[tid] = bb[((int64_t)b * n + tid) * H + h];
  }
  const float decay = expf(g_bh);
#pragma unroll
  for (int i = 0; i < ROWS; ++i) s[i] *= decay;
  __syncthreads();

  // Column dot x·S over all K rows for this thread's column; `buf` alternates between the two
  // partial buffers (a buffer is rewritten only after the next dot's barrier, which every
  // thread reaches after reading it).
  auto column_dot = [&](const float* x, float* buf) {
    const float4* x4 = reinterpret_cast<const float4*>(x + r0);
    float p0 = 0.f, p1 = 0.f;
#pragma unroll
    for (int i = 0; i < ROWS / 4; ++i) {
      const float4 xv = x4[i];
      p0 = fmaf(xv.x, s[4 * i], p0);
      p1 = fmaf(xv.y, s[4 * i + 1], p1);
      p0 = fmaf(xv.z, s[4 * i + 2], p0);
      p1 = fmaf(xv.w, s[4 * i + 3], p1);
    }
    buf[tid] = p0 + p1;
    __syncthreads();
    float t = buf[c];
#pragma unroll
    for (int p = 1; p < PARTS; ++p) t += buf[p * COLS + c];
    return t;
  };
  for (int j = 0; j < n; ++j) {
    const float* kj = xs + (1 + j) * KP;
    const float pred = column_dot(kj, red + (j & 1) * PARTS * COLS);
    const float delta = bs[j] * (vs[j * COLS + c] - pred);
    const float4* k4 = reinterpret_cast<const float4*>(kj + r0);
#pragma unroll
    for (int i = 0; i < ROWS / 4; ++i) {
      const float4 kv = k4[i];
      s[4 * i] = fmaf(kv.x, delta, s[4 * i]);
      s[4 * i + 1] = fmaf(kv.y, delta, s[4 * i + 1]);
      s[4 * i + 2] = fmaf(kv.z, delta, s[4 * i + 2]);
      s[4 * i + 3] = fmaf(kv.w, delta, s[4 * i + 3]);
    }
  }
  const float ov = column_dot(xs, red + (n & 1) * PARTS * COLS);
  if (part == 0 && valid) out[(int64_t)bh * V + col] = scale * ov;
  if (rows == ROWS) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i) __stcs(s_out + (int64_t)i * V, s[i]);
  } else {
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
      if (i < rows) __stcs(s_out + (int64_t)i * V, s[i]);
  }
}

// Two blocks per multiprocessor (at most 64 registers) up to ROWS = 32: one block of 16 warps
// waits at each dot's barrier with no other block's loads to overlap.
#define GDP_STEP_ENTRY(NAME, TYPE, ROWS, MIN_BLOCKS)                                            \
  extern "C" __global__ void __launch_bounds__(GDP_STEP_THREADS, MIN_BLOCKS)                    \
      NAME(const float* state, const TYPE* q, const TYPE* k, const TYPE* v, const float* g,     \
           const float* beta, float* out, int B, int H, int K, int V, int n, float scale) {     \
    gdp_step_impl<ROWS, TYPE>(state, q, k, v, g, beta, out, B, H, K, V, n, scale);              \
  }
#define GDP_STEP_ENTRIES(T, TYPE)                           \
  GDP_STEP_ENTRY(gdp_step_##T##_k32, TYPE, 8, 2)            \
  GDP_STEP_ENTRY(gdp_step_##T##_k64, TYPE, 16, 2)           \
  GDP_STEP_ENTRY(gdp_step_##T##_k128, TYPE, 32, 2)          \
  GDP_STEP_ENTRY(gdp_step_##T##_k256, TYPE, 64, 1)
GDP_STEP_ENTRIES(f32, float)
GDP_STEP_ENTRIES(bf16, __nv_bfloat16)
GDP_STEP_ENTRIES(f16, __half)
