// Gated DeltaProduct forward for bf16 inputs in two launches (FLA's split, with the output fused
// into the state scan). Included by gdp.cu after gdp_bwd.cuh (uses its gate-cumsum helpers).
//
// 1. gdp_fwd_wy_bf16, grid (chunks, H), fully parallel: per interleaved chunk of c <= 64 rows
//    (compensated gate cumsum G, dec(i, j) = e^{G_i - G_j} for j <= i),
//      A  = strict_lower(β_i k_i·k_j dec),  Ainv = (I + A)^-1          (f32, cuda/inverse.cuh)
//      W  = Ainv diag(β e^G) K   [64, K]     U = Ainv diag(β) V   [64, V]
//      P  = scale (q_r·k_j) dec(i_r, j)   [64, 64] for the query rows i_r = first + r n
//      coef = [scale e^{G_{i_r}} (64) | e^{G_last - G_i} (64) | e^{G_last}, 0...]   (f32)
//    written to a scratch buffer: W, U, P in bf16 (tensor-core operands), coef in f32. The
//    products run on tensor cores from bf16 operands staged in shared memory (K, Q, and the
//    scaled, transposed K and V); the inverse is solved in f32 and rounded to bf16 for W and U,
//    as FLA does.
// 2. gdp_fwd_scan_bf16, grid (N*H, ceil(V / BV)), sequential over the chunks of a sequence, the
//    state slice S [K, BV] in f32 in shared memory:
//      Delta = U - W S,   o_r = coef_q[r] q_r S + P Delta,   S = e^{G_last} S + (coef_k ⊙ K)^T Delta
//    Products on tensor cores from bf16 operands staged in shared memory in fragment order
//    (rows padded by 8 elements: conflict-free 32-bit fragment loads), f32 accumulators. Like
//    FLA, the state and Delta enter the products rounded to bf16; S itself stays f32.
//
// Table (int): per sequence (batch row, first token, tokens, first chunk) at 4 s, then per chunk
// (sequence, chunk index within it) at 4 N + 2 c. Scratch per (chunk, head) at
// (chunk * H + head): W [64][K], U [64][V], P [64][64] (bf16) and coef [3][64] (f32).

#define GDPC_THREADS 128

// 16-row/8-column tensor-core tile loop over bf16 operands in shared memory: A row-major
// [m][k] (stride lda elements), B given transposed, [n][k] (stride ldb). Every row and k column
// the loop touches must exist (zero padded): m0 + 16 WM rows, n0 + 8 WN rows of Bt, kd a
// multiple of 16.
template <int WM, int WN>
__device__ __forceinline__ void gdpc_mma(float (&acc)[WM][WN][4], const __nv_bfloat16* A, int lda,
                                         const __nv_bfloat16* Bt, int ldb, int m0, int n0,
                                         int kd, int lane) {
  const int g = lane >> 2, t = lane & 3;
  for (int k0 = 0; k0 < kd; k0 += 16) {
    uint32_t a[WM][4], b[WN][2];
#pragma unroll
    for (int i = 0; i < WM; ++i) {
      const __nv_bfloat16* p = A + (m0 + 16 * i + g) * lda + k0 + 2 * t;
      a[i][0] = *reinterpret_cast<const uint32_t*>(p);
      a[i][1] = *reinterpret_cast<const uint32_t*>(p + 8 * lda);
      a[i][2] = *reinterpret_cast<const uint32_t*>(p + 8);
      a[i][3] = *reinterpret_cast<const uint32_t*>(p + 8 * lda + 8);
    }
#pragma unroll
    for (int j = 0; j < WN; ++j) {
      const __nv_bfloat16* p = Bt + (n0 + 8 * j + g) * ldb + k0 + 2 * t;
      b[j][0] = *reinterpret_cast<const uint32_t*>(p);
      b[j][1] = *reinterpret_cast<const uint32_t*>(p + 8);
    }
#pragma unroll
    for (int i = 0; i < WM; ++i)
#pragma unroll
      for (int j = 0; j < WN; ++j) MmaBf16::mma(acc[i][j], a[i], b[j]);
  }
}

// Copies `rows` rows of `len` bf16 values from global memory (row r at src + off(r)) to shared
// memory (row stride ld), 16 bytes at a time when `vec` (len and ld multiples of 8, src and dst
// 16-byte aligned). Offsets come from a per-chunk table, not from divisions per element.
template <typename Off>
__device__ __forceinline__ void gdpc_copy_rows(__nv_bfloat16* __restrict__ dst, int ld,
                                               const __nv_bfloat16* __restrict__ src, Off off,
                                               int rows, int len, bool vec, int tid, int nthr) {
  if (vec) {
    const int vpr = len >> 3;
    for (int idx = tid; idx < rows * vpr; idx += nthr) {
      const int r = idx / vpr, cv = idx - r * vpr;
      *reinterpret_cast<uint4*>(dst + r * ld + cv * 8) =
          __ldg(reinterpret_cast<const uint4*>(src + off(r) + cv * 8));
    }
  } else {
    for (int idx = tid; idx < rows * len; idx += nthr) {
      const int r = idx / len, d = idx - r * len;
      dst[r * ld + d] = src[off(r) + d];
    }
  }
}

__device__ __forceinline__ void gdpc_unpack8(uint4 w, float* x) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    x[2 * e] = __uint_as_float(u[e] << 16);
    x[2 * e + 1] = __uint_as_float(u[e] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint4 gdpc_pack8(const float* x) {
  uint32_t u[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x[2 * e], x[2 * e + 1]);
    u[e] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return make_uint4(u[0], u[1], u[2], u[3]);
}

// Element offsets into qk of the key and query rows of a chunk (rows past its end: -1).
__device__ __forceinline__ void gdpc_row_offsets(int64_t* koff, int64_t* qoff, int64_t tok0,
                                                 int64_t p0, int c, int first, int nq, int n,
                                                 int H, int K, int head, int tid, int nthr) {
  for (int i = tid; i < GDP_CHUNK; i += nthr) {
    const int64_t p = p0 + i;
    koff[i] = i < c ? ((tok0 + p / n) * (n + 1) + 1 + p % n) * H * K + (int64_t)head * K : -1;
    const int64_t pq = p0 + first + (int64_t)i * n;
    qoff[i] = i < nq ? ((tok0 + pq / n) * (n + 1)) * H * K + (int64_t)head * K : -1;
  }
}

// ----------------------------------------------------------------------------------------------
// Kernel 1: WY factors of every chunk.

extern "C" __global__ void __launch_bounds__(GDPC_THREADS)
    gdp_fwd_wy_bf16(const __nv_bfloat16* __restrict__ qk, const __nv_bfloat16* __restrict__ vv,
                    const float* __restrict__ aux, const int* __restrict__ table,
                    __nv_bfloat16* __restrict__ wg, __nv_bfloat16* __restrict__ ug,
                    __nv_bfloat16* __restrict__ pg, float* __restrict__ cg, int B, int TT, int H,
                    int K, int V, int n, int N, float scale) {
  constexpr int C = GDP_CHUNK;
  const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = nthr >> 5;
  const int chunk = blockIdx.x, head = blockIdx.y;
  const int sidx = table[4 * N + 2 * chunk], ci = table[4 * N + 2 * chunk + 1];
  const int seq_b = table[4 * sidx], seq_start = table[4 * sidx + 1], seq_len = table[4 * sidx + 2];
  const int64_t tok0 = (int64_t)seq_b * TT + seq_start;
  const int64_t L = (int64_t)seq_len * n;
  const int64_t p0 = (int64_t)ci * C;
  const int c = (int)min((int64_t)C, L - p0);
  const int first = (int)(((int64_t)(n - 1) - p0 % n + n) % n);
  const int nq = first < c ? (c - 1 - first) / n + 1 : 0;
  const int64_t BTH = (int64_t)B * TT * H;
  // K padded to the mma k step; K and V padded to the 32-column output tiles of W and U.
  const int KP = (K + 15) & ~15, KN = (K + 31) & ~31, VN = (V + 31) & ~31;
  const int LK = KP + 8, LC = C + 8;  // bf16 row strides of the operand buffers

  extern __shared__ __align__(16) unsigned char gdpc_smem[];
  float* A = reinterpret_cast<float*>(gdpc_smem);  // [C][C]   A (row stride c)
  float* Ai = A + C * C;                             // [C][C]   (I + A)^-1 (row stride c)
  float* G = Ai + C * C;                             // [C]      gate cumsum (hi)
  float* Gl = G + C;                                 // [C]      its rounding error
  float* Bt = Gl + C;                                // [C]      beta
  float* Eg = Bt + C;                                // [C]      e^G
  int64_t* koff = reinterpret_cast<int64_t*>(Eg + C);  // [C]    key row offsets
  int64_t* qoff = koff + C;                            // [C]    query row offsets
  __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(qoff + C);  // [C][LK]  K
  __nv_bfloat16* Qs = Ks + C * LK;                                 // [C][LK]  Q (query rows)
  __nv_bfloat16* KbT = Qs + C * LK;                                // [KN][LC] (β e^G ⊙ K)^T
  __nv_bfloat16* VbT = KbT + KN * LC;                              // [VN][LC] (β ⊙ V)^T
  __nv_bfloat16* Aib = VbT + VN * LC;                              // [C][LC]  Ainv (bf16)

  gdpc_row_offsets(koff, qoff, tok0, p0, c, first, nq, n, H, K, head, tid, nthr);
  for (int i = tid; i < c; i += nthr) {
    const int64_t p = p0 + i;
    G[i] = (p % n == 0) ? aux[(tok0 + p / n) * H + head] : 0.f;
    Bt[i] = aux[BTH + ((tok0 * n + p) * H + head)];
  }
  __syncthreads();
  if (tid == 0) gdpb_cumsum(G, Gl, c);
  __syncthreads();
  for (int i = tid; i < c; i += nthr) Eg[i] = expf(G[i] + Gl[i]);
  __syncthreads();

  // ---- Stage K, Q (row-major, zero padded) and the scaled, transposed K and V.
  const __nv_bfloat16 zero = __float2bfloat16_rn(0.f);
  for (int idx = tid; idx < C * KP; idx += nthr) {
    const int i = idx % C, d = idx / C;  // consecutive threads: consecutive rows
    const __nv_bfloat16 kv = (i < c && d < K) ? qk[koff[i] + d] : zero;
    Ks[i * LK + d] = kv;
    Qs[i * LK + d] = (i < nq && d < K) ? qk[qoff[i] + d] : zero;
    KbT[d * LC + i] = __float2bfloat16_rn((i < c ? Bt[i] * Eg[i] : 0.f) * __bfloat162float(kv));
  }
  for (int idx = C * KP + tid; idx < C * KN; idx += nthr) KbT[(idx / C) * LC + idx % C] = zero;
  for (int idx = tid; idx < C * VN; idx += nthr) {
    const int i = idx % C, d = idx / C;
    float x = 0.f;
    if (i < c && d < V) x = Bt[i] * __bfloat162float(vv[((tok0 * n + p0 + i) * H + head) * V + d]);
    VbT[d * LC + i] = __float2bfloat16_rn(x);
  }
  __syncthreads();

  // ---- A = strict_lower(β_i (k_i·k_j) dec_ij) (tiles on/above the diagonal skipped) and
  // P = scale (q_r·k_j) dec(i_r, j), from one tile list.
  const int64_t slot = (int64_t)chunk * H + head;
  __nv_bfloat16* pm = pg + slot * C * C;
  for (int tile = warp; tile < 16; tile += nwarps) {
    const bool is_p = tile >= 8;
    const int m0 = ((tile & 7) >> 1) * 16, n0 = (tile & 1) * 32;
    if (!is_p && n0 >= m0 + 15) continue;
    float acc[1][4][4] = {};
    gdpc_mma<1, 4>(acc, is_p ? Qs : Ks, LK, Ks, LK, m0, n0, KP, lane);
    if (is_p)
      mma_store<1, 4>(acc, lane, m0, n0, C, C, [&](int r, int j, float a) {
        const float x = (r < nq && j < c) ? a * (scale * gdpb_dec(G, Gl, first + r * n, j)) : 0.f;
        pm[r * C + j] = __float2bfloat16_rn(x);
      });
    else
      mma_store<1, 4>(acc, lane, m0, n0, c, c, [&](int i, int j, float a) {
        if (j < i) A[i * c + j] = (a * Bt[i]) * gdpb_dec(G, Gl, i, j);
      });
  }
  __syncthreads();
  tri_inverse(A, Ai, c, tid, nthr, 1);
  __syncthreads();
  for (int idx = tid; idx < C * C; idx += nthr) {
    const int i = idx / C, j = idx % C;
    Aib[i * LC + j] = __float2bfloat16_rn(i < c && j < c ? Ai[i * c + j] : 0.f);
  }
  __syncthreads();

  // ---- W = Ainv KbTᵀ [C, K] and U = Ainv VbTᵀ [C, V] (rows >= c come out zero).
  __nv_bfloat16* w = wg + slot * C * K;
  __nv_bfloat16* u = ug + slot * C * V;
  const int tw = KN / 32, tu = VN / 32;
  for (int tile = warp; tile < 4 * (tw + tu); tile += nwarps) {
    const bool is_u = tile >= 4 * tw;
    const int t2 = is_u ? tile - 4 * tw : tile, tn = is_u ? tu : tw;
    const int m0 = (t2 / tn) * 16, n0 = (t2 % tn) * 32;
    float acc[1][4][4] = {};
    gdpc_mma<1, 4>(acc, Aib, LC, is_u ? VbT : KbT, LC, m0, n0, C, lane);
    if (is_u)
      mma_store<1, 4>(acc, lane, m0, n0, C, V,
                      [&](int i, int d, float a) { u[i * V + d] = __float2bfloat16_rn(a); });
    else
      mma_store<1, 4>(acc, lane, m0, n0, C, K,
                      [&](int i, int d, float a) { w[i * K + d] = __float2bfloat16_rn(a); });
  }

  float* cf = cg + slot * 3 * C;
  for (int i = tid; i < C; i += nthr) {
    cf[i] = i < nq ? scale * Eg[first + i * n] : 0.f;
    cf[C + i] = i < c ? expf(gdpb_gdiff(G, Gl, c - 1, i)) : 0.f;
    cf[2 * C + i] = i == 0 ? Eg[c - 1] : 0.f;
  }
}

// ----------------------------------------------------------------------------------------------
// Kernel 2: the state scan and the output.

extern "C" __global__ void __launch_bounds__(GDPC_THREADS)
    gdp_fwd_scan_bf16(const __nv_bfloat16* __restrict__ qk, const float* __restrict__ aux,
                      const int* __restrict__ table, const __nv_bfloat16* __restrict__ wg,
                      const __nv_bfloat16* __restrict__ ug, const __nv_bfloat16* __restrict__ pg,
                      const float* __restrict__ cg, const float* __restrict__ h0_override,
                      int use_h0_override, float* __restrict__ out, int B, int TT, int H, int K,
                      int V, int n, int has_h0, int BV) {
  constexpr int C = GDP_CHUNK;
  const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const int nwarps = nthr >> 5;
  const int sidx = blockIdx.x / H, head = blockIdx.x % H;
  const int v0 = blockIdx.y * BV;
  const int bv = min(BV, V - v0);
  const int seq_b = table[4 * sidx], seq_start = table[4 * sidx + 1], seq_len = table[4 * sidx + 2];
  const int cbase = table[4 * sidx + 3];
  const int64_t tok0 = (int64_t)seq_b * TT + seq_start;
  const int64_t L = (int64_t)seq_len * n;
  const int nch = (int)((L + C - 1) / C);
  const int64_t BTH = (int64_t)B * TT * H;
  const int64_t KV = (int64_t)K * V;
  const int64_t state_off = ((int64_t)sidx * H + head) * KV;
  const int KP = (K + 15) & ~15;         // K padded to the mma k step
  const int LK = KP + 8, LC = C + 8;     // bf16 row strides of the operand buffers
  const int SS = BV + 4;                 // f32 row stride of the state
  const bool vk = (K % 8 == 0) && ((reinterpret_cast<uintptr_t>(qk) & 15) == 0);
  const bool vu = (V % 8 == 0);  // U rows start 16-byte aligned; bv is then a multiple of 8

  extern __shared__ __align__(16) unsigned char gdpc_smem[];
  float* S = reinterpret_cast<float*>(gdpc_smem);  // [KP][SS]  state (f32)
  float* U = S + KP * SS;                            // [C][SS]   U, then Delta (f32)
  float* cf = U + C * SS;                            // [3][C]    coefficients
  int64_t* koff = reinterpret_cast<int64_t*>(cf + 3 * C);  // [C] key row offsets
  int64_t* qoff = koff + C;                                // [C] query row offsets
  __nv_bfloat16* St = reinterpret_cast<__nv_bfloat16*>(qoff + C);   // [BV][LK] S^T
  __nv_bfloat16* Ws = St + BV * LK;                                   // [C][LK]  W
  __nv_bfloat16* Qe = Ws + C * LK;                                    // [C][LK]  coef_q q
  __nv_bfloat16* Ps = Qe + C * LK;                                    // [C][LC]  P
  __nv_bfloat16* KdT = Ps + C * LC;                                   // [KP][LC] (coef_k ⊙ K)^T
  __nv_bfloat16* Dt = KdT + KP * LC;                                  // [BV][LC] Delta^T

  {
    const float* h0 = nullptr;
    if (use_h0_override)
      h0 = h0_override + state_off;
    else if (has_h0)
      h0 = aux + BTH * (1 + n) + state_off;
    for (int idx = tid; idx < KP * BV; idx += nthr) {
      const int r = idx / BV, col = idx % BV;
      const float x = (h0 != nullptr && r < K && col < bv) ? h0[(int64_t)r * V + v0 + col] : 0.f;
      S[r * SS + col] = x;
      St[col * LK + r] = __float2bfloat16_rn(x);
    }
    // Padding columns of the operand rows stay zero for the whole scan.
    for (int idx = tid; idx < C * (LK - K); idx += nthr) {
      const int r = idx / (LK - K), d = K + idx % (LK - K);
      Ws[r * LK + d] = __float2bfloat16_rn(0.f);
      Qe[r * LK + d] = __float2bfloat16_rn(0.f);
    }
    for (int idx = tid; idx < (KP - K) * LC; idx += nthr)
      KdT[K * LC + idx] = __float2bfloat16_rn(0.f);
  }
  __syncthreads();

  for (int ci = 0; ci < nch; ++ci) {
    const int64_t p0 = (int64_t)ci * C;
    const int c = (int)min((int64_t)C, L - p0);
    const int first = (int)(((int64_t)(n - 1) - p0 % n + n) % n);
    const int nq = first < c ? (c - 1 - first) / n + 1 : 0;
    const int64_t slot = (int64_t)(cbase + ci) * H + head;
    const __nv_bfloat16* w = wg + slot * C * K;
    const __nv_bfloat16* u = ug + slot * C * V;
    const __nv_bfloat16* pm = pg + slot * C * C;

    // ---- Stage the chunk's operands: W, U, P and the coefficients copied; the query rows
    // scaled by coef_q and the key rows by coef_k (transposed) in a second pass.
    gdpc_row_offsets(koff, qoff, tok0, p0, c, first, nq, n, H, K, head, tid, nthr);
    for (int i = tid; i < 3 * C; i += nthr) cf[i] = cg[slot * 3 * C + i];
    gdpc_copy_rows(Ws, LK, w, [&](int r) { return (int64_t)r * K; }, C, K, vk, tid, nthr);
    gdpc_copy_rows(Ps, LC, pm, [&](int r) { return (int64_t)r * C; }, C, C, true, tid, nthr);
    if (vu) {
      const int vpr = BV / 8;
      for (int idx = tid; idx < C * vpr; idx += nthr) {
        const int r = idx / vpr, col = (idx - r * vpr) * 8;
        float x[8] = {};
        if (col < bv) gdpc_unpack8(__ldg(reinterpret_cast<const uint4*>(u + r * V + v0 + col)), x);
        float4* d = reinterpret_cast<float4*>(U + r * SS + col);
        d[0] = make_float4(x[0], x[1], x[2], x[3]);
        d[1] = make_float4(x[4], x[5], x[6], x[7]);
      }
    } else {
      for (int idx = tid; idx < C * BV; idx += nthr) {
        const int r = idx / BV, col = idx - r * BV;
        U[r * SS + col] = col < bv ? __bfloat162float(u[r * V + v0 + col]) : 0.f;
      }
    }
    __syncthreads();
    if (vk) {
      const int vpr = K / 8;
      for (int idx = tid; idx < C * vpr; idx += nthr) {
        // Consecutive threads take consecutive rows: the transposed stores to KdT then fall in
        // consecutive 2-byte slots.
        const int r = idx % C, cv = idx / C;
        float x[8] = {};
        if (r < nq) {
          gdpc_unpack8(__ldg(reinterpret_cast<const uint4*>(qk + qoff[r] + cv * 8)), x);
#pragma unroll
          for (int e = 0; e < 8; ++e) x[e] *= cf[r];
        }
        *reinterpret_cast<uint4*>(Qe + r * LK + cv * 8) = gdpc_pack8(x);
        float y[8] = {};
        if (r < c) {
          gdpc_unpack8(__ldg(reinterpret_cast<const uint4*>(qk + koff[r] + cv * 8)), y);
#pragma unroll
          for (int e = 0; e < 8; ++e) y[e] *= cf[C + r];
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) KdT[(cv * 8 + e) * LC + r] = __float2bfloat16_rn(y[e]);
      }
    } else {
      for (int idx = tid; idx < C * K; idx += nthr) {
        const int r = idx % C, d = idx / C;
        const float q = r < nq ? cf[r] * __bfloat162float(qk[qoff[r] + d]) : 0.f;
        Qe[r * LK + d] = __float2bfloat16_rn(q);
        const float kd = r < c ? cf[C + r] * __bfloat162float(qk[koff[r] + d]) : 0.f;
        KdT[d * LC + r] = __float2bfloat16_rn(kd);
      }
    }
    __syncthreads();

    // ---- Delta = U - W S   [C, BV]: into U (f32) and Dt (bf16, transposed).
    {
      const int tn = BV / 32, tiles = (C / 16) * tn;
      for (int tile = warp; tile < tiles; tile += nwarps) {
        const int m0 = (tile / tn) * 16, n0 = (tile % tn) * 32;
        float acc[1][4][4] = {};
        gdpc_mma<1, 4>(acc, Ws, LK, St, LK, m0, n0, KP, lane);
        mma_store<1, 4>(acc, lane, m0, n0, C, BV, [&](int m, int nn, float a) {
          const float d = U[m * SS + nn] - a;
          U[m * SS + nn] = d;
          Dt[nn * LC + m] = __float2bfloat16_rn(d);
        });
      }
    }
    __syncthreads();

    // ---- o = Qe S + P Delta (query rows) and S = e^{G_last} S + KdT Delta, one tile list.
    {
      const int tn = BV / 32;
      const int mq = (nq + 15) / 16;
      const int o_tiles = mq * tn, s_tiles = (KP / 16) * tn;
      const float eglast = cf[2 * C];
      for (int tile = warp; tile < o_tiles + s_tiles; tile += nwarps) {
        float acc[1][4][4] = {};
        if (tile < o_tiles) {
          const int m0 = (tile / tn) * 16, n0 = (tile % tn) * 32;
          gdpc_mma<1, 4>(acc, Qe, LK, St, LK, m0, n0, KP, lane);
          gdpc_mma<1, 4>(acc, Ps, LC, Dt, LC, m0, n0, C, lane);
          mma_store<1, 4>(acc, lane, m0, n0, nq, bv, [&](int r, int nn, float a) {
            const int64_t tok = tok0 + (p0 + first + (int64_t)r * n) / n;
            out[(tok * H + head) * V + v0 + nn] = a;
          });
        } else {
          const int t2 = tile - o_tiles;
          const int m0 = (t2 / tn) * 16, n0 = (t2 % tn) * 32;
          gdpc_mma<1, 4>(acc, KdT, LC, Dt, LC, m0, n0, C, lane);
          mma_store<1, 4>(acc, lane, m0, n0, KP, BV, [&](int m, int nn, float a) {
            S[m * SS + nn] = eglast * S[m * SS + nn] + a;
          });
        }
      }
    }
    __syncthreads();
    for (int idx = tid; idx < (KP / 2) * BV; idx += nthr) {
      // Consecutive threads write consecutive 32-bit pairs of a row of S^T.
      const int rp = idx % (KP / 2), col = idx / (KP / 2);
      const __nv_bfloat162 h =
          __floats2bfloat162_rn(S[2 * rp * SS + col], S[(2 * rp + 1) * SS + col]);
      *reinterpret_cast<__nv_bfloat162*>(St + col * LK + 2 * rp) = h;
    }
    __syncthreads();
  }

  float* fin = out + BTH * V + state_off;
  for (int idx = tid; idx < K * bv; idx += nthr) {
    const int r = idx / bv, col = idx % bv;
    fin[(int64_t)r * V + v0 + col] = S[r * SS + col];
  }
}
