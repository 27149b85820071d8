// Context parallelism's correction of a widened scan's rows (src/op/cuda/cp_fix.rs), and at the
// end of this file the fold of the summaries of a sequence's segments (src/op/cuda/fold.rs).
//
// A scan run from the initial state [S0 | I_K] on the value columns widened to [x | 0_K] is
// affine in the state it starts from, so every row it writes is [y0 | y~] with the true row,
// once the state S that should have been added to S0 is known, y = y0 + y~ S. That holds for
// the forward scan's outputs (o0 and Q~), and for the state-gradient scan's chunk states and
// dDelta rows (with the transposed maps). This kernel applies it:
//
//   Y[row, j] = X[row, j] + sum_k X[row, V + k] S[k, j]        (j < V, k < K)
//
// X: bf16 rows of width W = V + K; Y: rows of width V (bf16 or f32); S: f32 [nseq, H, K, V]
// per (sequence, head), or null for a plain copy of the first V columns.
// Rows: row i (< outer_per_seq * inner) of sequence s and head h is at
//   ((outer * H + h) * inner + i % inner)  with  outer = outer0 + s * outer_per_seq + i / inner,
// i.e. o [B*T, H, 1, .] (inner 1), chunk states [slots, H, K, .] (inner K), dDelta
// [slots, H, 64, .] (inner 64).
// GDP_FIX_THREADS threads a block (eight warps, each on 16-row tiles). The product runs on bf16
// tensor cores with f32 accumulation, S rounded to bf16: every row it writes is a bf16 row of
// the scan (o, the chunk states and dDelta that the gradient kernel reads in bf16, or o in
// f32 from the bf16 o0), so S's rounding stays within the rows' own (S split into hi + lo
// took twice the products and shared memory for digits the output does not keep).

#pragma once

#define GDP_FIX_THREADS 256
#define GDP_FIX_COLS 128

// Stores v0 (and v1 after it, where `both`): as one pair where `paired` (aligned), else one by
// one.
__device__ __forceinline__ void gdp_fix_store2(float* y, float v0, float v1, bool both,
                                               bool paired) {
  if (both && paired) {
    *reinterpret_cast<float2*>(y) = make_float2(v0, v1);
  } else {
    y[0] = v0;
    if (both) y[1] = v1;
  }
}
__device__ __forceinline__ void gdp_fix_store2(__nv_bfloat16* y, float v0, float v1, bool both,
                                               bool paired) {
  if (both && paired) {
    *reinterpret_cast<__nv_bfloat162*>(y) = __floats2bfloat162_rn(v0, v1);
  } else {
    y[0] = __float2bfloat16_rn(v0);
    if (both) y[1] = __float2bfloat16_rn(v1);
  }
}

// Stores the 8 values v[0..8) at y (16-byte aligned).
__device__ __forceinline__ void gdp_fix_store8(float* y, const float (&v)[8]) {
  reinterpret_cast<float4*>(y)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(y)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void gdp_fix_store8(__nv_bfloat16* y, const float (&v)[8]) {
  uint4 p;
  p.x = MmaBf16::pack(v[0], v[1]);
  p.y = MmaBf16::pack(v[2], v[3]);
  p.z = MmaBf16::pack(v[4], v[5]);
  p.w = MmaBf16::pack(v[6], v[7]);
  *reinterpret_cast<uint4*>(y) = p;
}

// Grid: (row groups, ceil(V / 128), nseq * H). Each block keeps S's 128 columns in shared
// memory (as bf16 pairs, converted once); each warp then walks 16-row tiles of its
// (sequence, head) on its own, reading X straight from global memory (no block barrier in the
// loop, so many warps keep loads in flight; staging each warp's rows through shared memory left
// room for one block per multiprocessor and was slower).
//
// Where the rows allow it (V and K multiples of 8, X and Y 16-byte aligned: `vec`), every lane
// reads and writes 16-byte pieces of its rows: lane (g, t) holds columns 8t .. 8t + 7 of each
// 32-column group of rows g and g + 8. The mma's k and n indices are then permutations of the
// columns (a product does not depend on the order of its k terms, and S's columns are laid out
// to match): in k step s of k group c, slots 2t, 2t + 1 hold X~ columns 32c + 8t + 4s + {0, 1}
// and slots 2t + 8, 2t + 9 columns 32c + 8t + 4s + {2, 3}; in n8 tile 4q + i, slot n stands for
// output column 32q + 8 (n / 2) + 2i + n % 2, so that lane t's accumulators of the four tiles
// of group q are the 8 consecutive columns 32q + 8t .. + 7. S's bf16 pairs sit in shared memory
// in the order the lanes read them (32 consecutive words per fragment: no bank conflicts).
// Otherwise each lane reads 4-byte pairs in the mma's own layout.
template <typename TO>
__device__ __forceinline__ void gdp_cp_fix_impl(const __nv_bfloat16* __restrict__ x,
                                                TO* __restrict__ y, const float* __restrict__ s,
                                                int H, int K, int V, long long outer0,
                                                int outer_per_seq, int inner) {
  extern __shared__ __align__(16) unsigned char gdp_fix_smem[];
  const int W = V + K;
  const int KP = (K + 31) & ~31;    // k padded to the 32 columns of a group
  const int LB = GDP_FIX_COLS + 8;  // B row stride (32-bit pairs) of the pair-wise layout
  uint32_t* bs = reinterpret_cast<uint32_t*>(gdp_fix_smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = GDP_FIX_THREADS / 32;
  const int g = lane >> 2, t = lane & 3;
  const int seq = blockIdx.z / H, head = blockIdx.z - seq * H;
  const int rows = outer_per_seq * inner;
  const int n0 = blockIdx.y * GDP_FIX_COLS;
  const long long seq_outer = outer0 + (long long)seq * outer_per_seq;
  const bool vec = V % 8 == 0 && K % 8 == 0 &&
                   (reinterpret_cast<uintptr_t>(x) & 15) == 0 &&
                   (reinterpret_cast<uintptr_t>(y) & 15) == 0;
  const bool pair_in = (W % 2 == 0) && (V % 2 == 0) && (K % 2 == 0);
  const bool pair_out =
      (V % 2 == 0) && ((reinterpret_cast<uintptr_t>(y) & (2 * sizeof(TO) - 1)) == 0);

  if (s != nullptr) {
    // S's bf16 pairs into shared memory; each thread issues SU pairs' loads before it converts
    // any, so that a block waits for a few round trips to L2, not one per pair.
    constexpr int SU = 8;
    const float* sh = s + (long long)blockIdx.z * K * V;
    const int total = (KP / 2) * GDP_FIX_COLS;
    for (int base = tid; base < total; base += SU * GDP_FIX_THREADS) {
      float s0[SU], s1[SU];
#pragma unroll
      for (int u = 0; u < SU; ++u) {
        const int idx = base + u * GDP_FIX_THREADS;
        const int kk = idx / GDP_FIX_COLS, col = n0 + idx - kk * GDP_FIX_COLS;
        const bool in = idx < total && col < V;
        s0[u] = in && 2 * kk < K ? sh[(long long)(2 * kk) * V + col] : 0.f;
        s1[u] = in && 2 * kk + 1 < K ? sh[(long long)(2 * kk + 1) * V + col] : 0.f;
      }
#pragma unroll
      for (int u = 0; u < SU; ++u) {
        const int idx = base + u * GDP_FIX_THREADS;
        if (idx >= total) break;
        const int kk = idx / GDP_FIX_COLS, n = idx - kk * GDP_FIX_COLS;
        int at = kk * LB + n;
        if (vec) {
          // kk = 16 c + 4 t' + 2 s' + half (half: the fragment's b[0] or b[1]); column
          // n = 32 q + 8 (g' / 2) + 2 i + g' % 2; the word of lane 4 g' + t'.
          const int c = kk >> 4, tk = (kk >> 2) & 3, sk = (kk >> 1) & 1, half = kk & 1;
          const int q = n >> 5, gn = 2 * ((n & 31) >> 3) + (n & 1), i = (n & 7) >> 1;
          at = ((((c * 2 + sk) * 2 + half) * 4 + q) * 4 + i) * 32 + 4 * gn + tk;
        }
        bs[at] = MmaBf16::pack(s0[u], s1[u]);
      }
    }
    __syncthreads();
  }
  const int mtiles = (rows + 15) / 16;
  // The rows g and g + 8 of a 16-row tile: their element offsets over rows (-1 past the rows).
  auto tile_rows = [&](int tile, long long (&ra)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = 16 * tile + g + 8 * h;
      ra[h] = i < rows ? ((seq_outer + i / inner) * H + head) * inner + i % inner : -1;
    }
  };
  if (vec) {
    for (int tile = blockIdx.x * nwarps + warp; tile < mtiles; tile += gridDim.x * nwarps) {
      long long ra[2];
      tile_rows(tile, ra);
      // acc[q][h][e]: row g + 8 h, column n0 + 32 q + 8 t + e.
      float acc[GDP_FIX_COLS / 32][2][8];
#pragma unroll
      for (int q = 0; q < GDP_FIX_COLS / 32; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = n0 + 32 * q + 8 * t;
          uint4 p = make_uint4(0, 0, 0, 0);
          if (ra[h] >= 0 && col < V) p = *reinterpret_cast<const uint4*>(x + ra[h] * W + col);
          const uint32_t w[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[e]));
            acc[q][h][2 * e] = f.x, acc[q][h][2 * e + 1] = f.y;
          }
        }
      if (s != nullptr) {
        // Key group c's pieces of rows g and g + 8 (zeros past the rows or K).
        auto key_pieces = [&](int c, uint4 (&p)[2]) {
          const int col = V + 32 * c + 8 * t;
#pragma unroll
          for (int h = 0; h < 2; ++h)
            p[h] = ra[h] >= 0 && col < W ? *reinterpret_cast<const uint4*>(x + ra[h] * W + col)
                                         : make_uint4(0, 0, 0, 0);
        };
        uint4 next[2];
        key_pieces(0, next);
        for (int c = 0; c < KP / 32; ++c) {
          // Group c + 1's loads in flight during group c's products.
          const uint4 p[2] = {next[0], next[1]};
          if (c + 1 < KP / 32) key_pieces(c + 1, next);
#pragma unroll
          for (int sk = 0; sk < 2; ++sk) {
            const uint32_t a[4] = {sk ? p[0].z : p[0].x, sk ? p[1].z : p[1].x,
                                   sk ? p[0].w : p[0].y, sk ? p[1].w : p[1].y};
            const uint32_t* frag = bs + (c * 2 + sk) * 2 * 4 * 4 * 32 + lane;
#pragma unroll
            for (int q = 0; q < GDP_FIX_COLS / 32; ++q)
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const uint32_t b[2] = {frag[(q * 4 + i) * 32], frag[((4 + q) * 4 + i) * 32]};
                float d[4] = {acc[q][0][2 * i], acc[q][0][2 * i + 1], acc[q][1][2 * i],
                              acc[q][1][2 * i + 1]};
                MmaBf16::mma(d, a, b);
                acc[q][0][2 * i] = d[0], acc[q][0][2 * i + 1] = d[1];
                acc[q][1][2 * i] = d[2], acc[q][1][2 * i + 1] = d[3];
              }
          }
        }
      }
#pragma unroll
      for (int q = 0; q < GDP_FIX_COLS / 32; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = n0 + 32 * q + 8 * t;
          if (ra[h] >= 0 && col < V) gdp_fix_store8(y + ra[h] * V + col, acc[q][h]);
        }
    }
    return;
  }
  // A pair of bf16 of X's row at element offset `r` (or -1: zeros) at column `c` below `lim`.
  auto pair_at = [&](long long r, int c, int lim) -> uint32_t {
    if (r < 0 || c >= lim) return 0u;
    const __nv_bfloat16* p = x + r * W + c;
    if (pair_in && c + 1 < lim) return *reinterpret_cast<const uint32_t*>(p);
    __nv_bfloat162 v;
    v.x = p[0];
    v.y = c + 1 < lim ? p[1] : __float2bfloat16_rn(0.f);
    return *reinterpret_cast<const uint32_t*>(&v);
  };
  for (int tile = blockIdx.x * nwarps + warp; tile < mtiles; tile += gridDim.x * nwarps) {
    long long ra[2];
    tile_rows(tile, ra);
    float acc[GDP_FIX_COLS / 8][4];
#pragma unroll
    for (int j = 0; j < GDP_FIX_COLS / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t p = pair_at(ra[h], n0 + 8 * j + 2 * t, V);
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&p));
        acc[j][2 * h] = f.x, acc[j][2 * h + 1] = f.y;
      }
    if (s != nullptr) {
      for (int k0 = 0; k0 < KP; k0 += 16) {
        uint32_t a[4];
        a[0] = pair_at(ra[0], V + k0 + 2 * t, W);
        a[1] = pair_at(ra[1], V + k0 + 2 * t, W);
        a[2] = pair_at(ra[0], V + k0 + 2 * t + 8, W);
        a[3] = pair_at(ra[1], V + k0 + 2 * t + 8, W);
        const int kk = k0 / 2 + t;
#pragma unroll
        for (int j = 0; j < GDP_FIX_COLS / 8; ++j) {
          const uint32_t b[2] = {bs[kk * LB + 8 * j + g], bs[(kk + 4) * LB + 8 * j + g]};
          MmaBf16::mma(acc[j], a, b);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < GDP_FIX_COLS / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = n0 + 8 * j + 2 * t;
        if (ra[h] >= 0 && col < V)
          gdp_fix_store2(y + ra[h] * V + col, acc[j][2 * h], acc[j][2 * h + 1], col + 1 < V,
                         pair_out);
      }
  }
}

extern "C" __global__ void __launch_bounds__(GDP_FIX_THREADS)
    gdp_cp_fix_bf16(GDP_KERNEL_PARAMS(GDP_FIX_FIELDS, __nv_bfloat16)) {
  gdp_cp_fix_impl(x, y, s, heads, dk, dv, outer0, outer_per_seq, inner);
}

extern "C" __global__ void __launch_bounds__(GDP_FIX_THREADS)
    gdp_cp_fix_f32(GDP_KERNEL_PARAMS(GDP_FIX_FIELDS, float)) {
  gdp_cp_fix_impl(x, y, s, heads, dk, dv, outer0, outer_per_seq, inner);
}

// [x | I_K] per (sequence, head): out [blocks, K, V + K] f32 from x [blocks, K, V] (or zeros
// where x is null), the identity in the last K columns. Four elements a thread where V and K
// are multiples of 4 and the rows 16-byte aligned (one 16-byte load and store, one division
// per four elements), else one.
extern "C" __global__ void gdp_cp_widen_states(GDP_KERNEL_PARAMS(GDP_WIDEN_FIELDS, _)) {
  const int K = dk, V = dv;
  const int W = V + K;
  const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const bool vec = V % 4 == 0 && K % 4 == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0 &&
                   (reinterpret_cast<uintptr_t>(x) & 15) == 0;
  if (vec) {
    const int W4 = W / 4;
    const long long total4 = blocks * K * W4;
    for (long long i = first; i < total4; i += stride) {
      const long long row = i / W4;
      const int col = 4 * (int)(i - row * W4), r = (int)(row % K);
      float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
      if (col < V) {
        if (x != nullptr) v = *reinterpret_cast<const float4*>(x + row * V + col);
      } else {
        const int d = col - V;
        v = make_float4(d == r ? 1.f : 0.f, d + 1 == r ? 1.f : 0.f, d + 2 == r ? 1.f : 0.f,
                        d + 3 == r ? 1.f : 0.f);
      }
      *reinterpret_cast<float4*>(out + row * W + col) = v;
    }
    return;
  }
  const long long total = blocks * K * W;
  for (long long i = first; i < total; i += stride) {
    const long long row = i / W;
    const int col = (int)(i - row * W), r = (int)(row % K);
    out[i] = col < V ? (x != nullptr ? x[row * V + col] : 0.f) : (col - V == r ? 1.f : 0.f);
  }
}

// gdp_fold_chains: value columns per block, the largest K, threads per block, and value
// columns per thread.
#define GDP_FOLD_COLS 16
#define GDP_FOLD_MAX_K 256
#define GDP_FOLD_THREADS 256
#define GDP_FOLD_CT 8

// Shared memory of gdp_fold_chains (bytes) with passes of P key columns: the state's tile
// s [K][COLS] and a pass of x̃'s columns [K][P + 4] (rows of P + 4 floats keep the 16-byte row
// reads conflict-free, P + 1 the 4-byte ones), f32: 76 KB at K = P = 128 (over the default
// 48 KB: the launcher opts in).
__host__ __device__ constexpr int gdp_fold_smem_bytes(int K, int P) {
  return K * (GDP_FOLD_COLS + P + 4) * 4;
}

// Chains of summaries folded into states, each chain from its start state: for every step p of
// chain c (steps[chain_at[c]] .. steps[chain_at[c + 1]] - 1, in order), the state before the
// step goes to row rows[p] of `out` (none where rows[p] < 0; zeros while the chain has no
// state), and a step id >= 0 applies the summary t[id] = [x⁰ | x̃] (f32 [K, V + K] per head):
// s = x⁰ + x̃ s, or s = x⁰ where the chain has no state yet; an id < 0 passes the state
// unchanged (an empty segment). `s0` (f32 [chains, H, K, V], or null: no start state), `out`
// [rows, H, K, V], `fin` (the final states [chains, H, K, V], zeros where none; or null).
// Block (chain, head, 16 value columns), 256 threads. The forward's fold over a sequence's
// segments S_{j+1} = ΔS_j + M_j S_j, the backward's e_j = γ_{j+1} + Mᵀ_{j+1} e_{j+1} and a
// context-parallel rank's fold of its peers' summaries, each in one launch.
//
// A chain's steps are sequential and few blocks run, so a step is bound by the latency of its
// loads: it copies x̃ into shared memory in passes of `pass_cols` key columns (a power of two;
// the launcher takes all K at once where shared memory allows), every copy of a pass in flight
// together, x⁰'s loads issued just before them. The copies are 16 bytes each where K and V are
// multiples of 4 and the summaries 16-byte aligned (a quarter of the instructions: the copies'
// issue bounds a step at K = 128), else 4 bytes (rows of any width). Thread t owns the rows
// t mod 128 + 128 j and CT = 8 value columns, reading its rows of the pass (conflict-free; four
// key columns at once on the 16-byte path) and the state's columns (a broadcast). Each output
// is x⁰ plus the products in increasing key order: f32, the same bits run to run, on either
// path.
extern "C" __global__ void __launch_bounds__(GDP_FOLD_THREADS)
    gdp_fold_chains(GDP_KERNEL_PARAMS(GDP_FOLD_FIELDS, _)) {
  constexpr int COLS = GDP_FOLD_COLS, CT = GDP_FOLD_CT, NT = GDP_FOLD_THREADS;
  constexpr int RT = NT / (COLS / CT);  // threads per column group (128)
  constexpr int R = GDP_FOLD_MAX_K / RT;  // rows per thread, at most
  const int K = dk, V = dv, W = V + K, P = pass_cols;
  const bool vec = K % 4 == 0 && V % 4 == 0 && (reinterpret_cast<uintptr_t>(t) & 15) == 0;
  const int LX = vec ? P + 4 : P + 1;
  const int pshift = __ffs(P) - 1;
  const int chain = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
  const int col0 = blockIdx.z * COLS;
  const int ic = tid % COLS, ir = tid / COLS;  // the I/O loops: rows ir + NT / COLS i
  constexpr int IR = NT / COLS;
  const bool in_col = col0 + ic < V;
  const int rl = tid % RT, cg = tid / RT;  // the products: rows rl + RT j, columns cg CT ..
  const int ccol = col0 + cg * CT;
  extern __shared__ __align__(16) unsigned char gdp_fold_smem[];
  float* s = reinterpret_cast<float*>(gdp_fold_smem);  // [K][COLS]
  float* xs = s + K * COLS;                              // [K][LX]
  const long long KV = (long long)K * V;
  bool has = s0 != nullptr;
  for (int r = ir; r < K; r += IR)
    s[r * COLS + ic] =
        has && in_col ? s0[((long long)chain * heads + h) * KV + (long long)r * V + col0 + ic]
                      : 0.f;
  __syncthreads();
  static_assert(CT == 8, "state_cols reads two float4");
  // This thread's CT columns of the state's key row m (a broadcast read).
  auto state_cols = [&](int m, float (&sv)[CT]) {
    const float4 lo = *reinterpret_cast<const float4*>(s + m * COLS + cg * CT);
    const float4 hi = *reinterpret_cast<const float4*>(s + m * COLS + cg * CT + 4);
    sv[0] = lo.x, sv[1] = lo.y, sv[2] = lo.z, sv[3] = lo.w;
    sv[4] = hi.x, sv[5] = hi.y, sv[6] = hi.z, sv[7] = hi.w;
  };
  for (int p = chain_at[chain]; p < chain_at[chain + 1]; ++p) {
    const int row = rows[p], id = steps[p];
    if (row >= 0 && in_col)
      for (int r = ir; r < K; r += IR)
        out[((long long)row * heads + h) * KV + (long long)r * V + col0 + ic] = s[r * COLS + ic];
    if (id < 0) continue;  // the same for every thread of the block
    const float* x = t + ((long long)id * heads + h) * K * (long long)W;
    // This thread's rows and columns of x⁰ (in flight while the first pass is copied).
    float acc[R][CT];
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int r = rl + RT * j;
      const float* xr = x + (long long)r * W + ccol;
      if (vec && r < K && ccol + CT <= V) {
        const float4 lo = *reinterpret_cast<const float4*>(xr);
        const float4 hi = *reinterpret_cast<const float4*>(xr + 4);
        const float v[CT] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int c = 0; c < CT; ++c) acc[j][c] = v[c];
      } else {
#pragma unroll
        for (int c = 0; c < CT; ++c) acc[j][c] = r < K && ccol + c < V ? xr[c] : 0.f;
      }
    }
    for (int m0 = 0; m0 < (has ? K : 0); m0 += P) {
      if (m0 > 0) __syncthreads();  // every read of the previous pass is done
      const int pw = min(P, K - m0);  // a multiple of 4 on the 16-byte path
      if (vec) {
        for (int e = tid; e < K * P / 4; e += NT) {
          const int r = e >> (pshift - 2), m = 4 * (e & (P / 4 - 1));
          if (m < pw) cp_async16(xs + r * LX + m, x + (long long)r * W + V + m0 + m);
        }
      } else {
        for (int e = tid; e < K * P; e += NT) {
          const int r = e >> pshift, m = e & (P - 1);
          if (m < pw) cp_async4(xs + r * LX + m, x + (long long)r * W + V + m0 + m);
        }
      }
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      if (vec) {
        for (int m = 0; m < pw; m += 4) {
          float4 xv[R];
#pragma unroll
          for (int j = 0; j < R; ++j) {
            const int r = rl + RT * j;
            xv[j] = r < K ? *reinterpret_cast<const float4*>(xs + r * LX + m)
                          : make_float4(0.f, 0.f, 0.f, 0.f);
          }
#pragma unroll
          for (int mm = 0; mm < 4; ++mm) {
            float sv[CT];
            state_cols(m0 + m + mm, sv);
#pragma unroll
            for (int j = 0; j < R; ++j) {
              const float xj = reinterpret_cast<const float*>(&xv[j])[mm];
              if (rl + RT * j < K)
#pragma unroll
                for (int c = 0; c < CT; ++c) acc[j][c] = fmaf(xj, sv[c], acc[j][c]);
            }
          }
        }
      } else {
        for (int m = 0; m < pw; ++m) {
          float sv[CT];
          state_cols(m0 + m, sv);
#pragma unroll
          for (int j = 0; j < R; ++j) {
            const int r = rl + RT * j;
            if (r < K) {
              const float xv = xs[r * LX + m];
#pragma unroll
              for (int c = 0; c < CT; ++c) acc[j][c] = fmaf(xv, sv[c], acc[j][c]);
            }
          }
        }
      }
    }
    __syncthreads();  // every read of s is done
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int r = rl + RT * j;
      if (r < K)
#pragma unroll
        for (int c = 0; c < CT; ++c) s[r * COLS + cg * CT + c] = ccol + c < V ? acc[j][c] : 0.f;
    }
    has = true;
    __syncthreads();
  }
  if (fin != nullptr && in_col)
    for (int r = ir; r < K; r += IR)
      fin[((long long)chain * heads + h) * KV + (long long)r * V + col0 + ic] =
          has ? s[r * COLS + ic] : 0.f;
}
