// Gated DeltaProduct: backward of the chunked (WY) algorithm on CUDA, and the two
// context-parallel summaries. Included by gdp.cu after fused_fwd.cuh (uses GDP_CHUNK, GDP_THREADS,
// to_f, KPad, load_rows of common.cuh); products on tensor cores through block_mma (cuda/mma.cuh).
//
// Mirrors `src/op/cpu/backward.rs` (fla_gdp.md §3). The recurrence is column-separable over V,
// so one block handles one (table entry, head) for BV value columns, like the forward. Every
// gradient except dv and dh0 is a SUM over V tiles of per-tile partials (the backward is linear
// in the per-column quantities), so dq, dk, dbeta and dg are atomically added (f32) into the
// zero-initialised output, while dv and dh0 are written exactly per tile.
//
// Per block, mode GDPB_FULL: a forward scan that stores every chunk's start state S[K, BV] to
// the scratch `hs`, then the reverse pass over chunks (re-preparing the WY factors from the
// stored state). Mode GDPB_FWD_SUM runs only the forward scan on the value columns widened to
// [v | 0_K] from the initial state [h0 | I_K] and writes the final state [K, V + K] = [ΔS | M]
// (the forward summary of `src/cp/protocol.rs`). Mode GDPB_BWD_SUM runs only the dS chain of the
// reverse pass with do widened to [do | 0_K] from dht = [dht | I_K] and writes the initial-state
// gradient [K, V + K] = [γ | Mᵀ] (the backward summary).
//
// The table holds 5 ints per entry: (batch row, first token, tokens, state row, first chunk in
// `hs`); the state row indexes h0 / dht / dh0 ([*, H, K, V]); summaries are written per table
// entry. Outputs of GDPB_FULL (`out`, f32, zero-initialised):
//   [dqk (B*T*(n+1)*H*K) | dv (B*T*n*H*V) | dg (B*T*H) | dbeta (B*T*n*H) | dh0 (N*H*K*V)?]
//
// Per chunk (c rows, nq query rows at i = first + r n), with h the chunk start state, dS the
// state gradient at the chunk end, dec(i, j) = e^{G_i - G_j} (j <= i, else 0), Dl_i = dec(c-1, i):
//   X = diag(β) V - diag(β e^G) K h,  Δ = Ainv X,  P = scale (Q Kᵀ) ⊙ dec[query rows]
//   dΔ = diag(Dl) K dS + Pᵀ dO,  ds = scale (dO Δᵀ) ⊙ dec[query rows],  dvb = Ainvᵀ dΔ
//   dq = diag(scale e^G) dO hᵀ + ds K
//   dk = diag(Dl) Δ dSᵀ + dsᵀ Q - diag(β e^G) dvb hᵀ + Z K,  Z_ij = β_i dM_ij + β_j dM_ji
//   dAinv = strict_lower(dΔ Xᵀ),  dM = strict_lower(-(Ainvᵀ dAinv Ainvᵀ) ⊙ dec)
//   dv = diag(β) dvb,  dβ_i = e^{G_i} k_i·dkbg_i + v_i·dvb_i + Σ_j dM_ij k_i·k_j
//   dS <- e^{G_last} dS + Σ_r scale e^{G_r} q_r dO_rᵀ - Kᵀ diag(β e^G) dvb
// where k_i·dkbg_i = -dvb_i·(K h)_i; the gate gradient of the chunk-local cumsum is reduced and
// reverse-cumsummed as in the CPU code, except that the k·dk_inter terms (-a_i on every row,
// +Σ a on the last) enter as their exact prefix sums, which keeps these large dS-driven terms
// from cancelling in f32, and that the gate cumsum is compensated (TwoSum), so that G_i - G_j
// stays accurate when |G| is large (strong gates).

#define GDPB_FULL 0
#define GDPB_FWD_SUM 1
#define GDPB_BWD_SUM 2

// The gate cumsum G is kept as an unevaluated sum hi + lo (TwoSum), so that G_i - G_j keeps its
// low-order bits when |G| is large (strong gates): a plain f32 cumsum loses ulp(|G|) in every
// difference, and the gate gradient's reverse cumsum amplifies that.
__device__ __forceinline__ float gdpb_gdiff(const float* G, const float* Gl, int i, int j) {
  return (G[i] - G[j]) + (Gl[i] - Gl[j]);
}

__device__ __forceinline__ float gdpb_dec(const float* G, const float* Gl, int i, int j) {
  // Select before exponentiating (pitfall P4): the argument is <= 0 for j <= i.
  return j <= i ? expf(gdpb_gdiff(G, Gl, i, j)) : 0.f;
}

// The chunk-local reverse cumsum of the gate gradient (one thread): DG[0..c) holds each row's
// gradient of the gate cumsum except the k·dk_inter terms, A1[0..c) those terms a1_i. These
// enter as -a1_i on every row plus Σ_m a1_m on the last row, whose reverse cumsum is the
// exclusive prefix Σ_{m<i} a1_m: added as such, so that these large (dS-driven) terms do not
// cancel in f32. `put(i, tk, x)` receives the gate gradient x of the token whose slot 0 is row
// i (p0 + i ≡ 0 mod n), token p0 / n + tk of the sequence. A1 is overwritten. The sub-step and
// token of each row are counted down, not divided out: this loop runs on one thread.
template <typename Put>
__device__ __forceinline__ void gdpb_gate_grad(float* A1, const float* DG, int c, int64_t p0,
                                               int n, Put put) {
  float pre = 0.f;
  for (int i = 0; i < c; ++i) {
    const float a = A1[i];
    A1[i] = pre;
    pre += a;
  }
  if (c <= 0) return;
  const int last = (int)(p0 % n) + c - 1;  // row c - 1, counted from the token of row 0
  int sub = last % n, tk = last / n;
  float acc = 0.f;
  for (int i = c - 1; i >= 0; --i) {
    acc += DG[i];
    if (sub == 0) {
      put(i, tk, acc + A1[i]);
      sub = n - 1;
      --tk;
    } else {
      --sub;
    }
  }
}

// In-place compensated cumsum of G[0..c) (one thread, in the CPU's order): G gets the running
// f32 sums, Gl their accumulated rounding errors.
__device__ __forceinline__ void gdpb_cumsum(float* G, float* Gl, int c) {
  float hi = 0.f, lo = 0.f;
  for (int i = 0; i < c; ++i) {
    const float g = G[i];
    const float s = hi + g;
    const float bp = s - hi;
    lo += (hi - (s - bp)) + (g - bp);
    hi = s;
    G[i] = hi;
    Gl[i] = lo;
  }
}

// __shfl_up_sync / __shfl_down_sync over the full warp (a lane with no source keeps x).
__device__ __forceinline__ float gdpg_shfl_up(float x, int d, int lane) {
#ifdef GDP_EMU
  return gdp_emu_shfl(x, lane >= d ? lane - d : lane);
#else
  return __shfl_up_sync(0xffffffffu, x, d);
#endif
}
__device__ __forceinline__ float gdpg_shfl_down(float x, int d, int lane) {
#ifdef GDP_EMU
  return gdp_emu_shfl(x, lane + d < 32 ? lane + d : lane);
#else
  return __shfl_down_sync(0xffffffffu, x, d);
#endif
}

// TwoSum: s = fl(a + b) and its rounding error e (a + b = s + e exactly).
__device__ __forceinline__ void gdpb_two_sum(float a, float b, float& s, float& e) {
  s = a + b;
  const float bp = s - a;
  e = (a - (s - bp)) + (b - bp);
}

// gdpb_cumsum on one warp (all 32 lanes; c <= 64): lane l takes rows 2l and 2l + 1, and a
// shuffle scan combines (sum, error) pairs with TwoSum, so that G + Gl holds the prefix sums
// to about the serial version's precision (in another order of additions, so not
// bit-identical to it). For the bf16 kernels, where the serial loop kept the block waiting.
__device__ __forceinline__ void gdpb_cumsum_warp(float* G, float* Gl, int c, int lane) {
  const int i0 = 2 * lane;
  const float a = i0 < c ? G[i0] : 0.f, b = i0 + 1 < c ? G[i0 + 1] : 0.f;
  float hi, lo;
  gdpb_two_sum(a, b, hi, lo);
  for (int d = 1; d < 32; d <<= 1) {
    const float uh = gdpg_shfl_up(hi, d, lane), ul = gdpg_shfl_up(lo, d, lane);
    if (lane >= d) {
      float s, e;
      gdpb_two_sum(uh, hi, s, e);
      hi = s;
      lo += ul + e;
    }
  }
  // This lane's exclusive prefix is the previous lane's inclusive one.
  float ph = gdpg_shfl_up(hi, 1, lane), pl = gdpg_shfl_up(lo, 1, lane);
  if (lane == 0) ph = 0.f, pl = 0.f;
  float s0, e0, s1, e1;
  gdpb_two_sum(ph, a, s0, e0);
  const float l0 = pl + e0;
  gdpb_two_sum(s0, b, s1, e1);
  if (i0 < c) G[i0] = s0, Gl[i0] = l0;
  if (i0 + 1 < c) G[i0 + 1] = s1, Gl[i0 + 1] = l0 + e1;
}

template <typename T>
__device__ void gdp_bwd(const T* __restrict__ qk, const T* __restrict__ vv,
                        const float* __restrict__ aux, const int* __restrict__ table,
                        const float* __restrict__ h0, int has_h0src,
                        const float* __restrict__ dout, const float* __restrict__ dht,
                        float* __restrict__ hs, float* __restrict__ out, int B, int TT, int H,
                        int K, int V, int n, int ext, int mode, int write_dh0, float scale,
                        int BV) {
  constexpr int C = GDP_CHUNK;
  static_assert(GDP_THREADS >= GDP_CHUNK, "thread i keeps row i's k·dkbg and v·dvb (P10-P13)");
  using MP = typename MmaFor<T>::type;          // tensor-core operand type (cuda/mma.cuh)
  constexpr bool SI = MmaFor<T>::split_inputs;  // whether input operands need hi + lo
  const int tid = threadIdx.x;
  const int nthr = blockDim.x;
  const int Vw = V + ext;  // columns of the (possibly widened) state
  const int v0 = blockIdx.y * BV;
  const int bv = min(BV, Vw - v0);
  const int sidx = blockIdx.x / H;
  const int head = blockIdx.x % H;
  const int* ent = table + 5 * sidx;
  const int seq_b = ent[0], seq_start = ent[1], seq_len = ent[2], srow = ent[3], coff = ent[4];
  const int KSTR = K + KPad<T>::value;
  constexpr int EV = 16 / sizeof(T);
  const bool vec_k = (K % EV == 0) && ((reinterpret_cast<uintptr_t>(qk) & 15) == 0);
  const bool full = mode == GDPB_FULL;
  // Row stride of the [*][BV] buffers: odd, so that column walks (S[kk][k] over kk) spread over
  // the banks instead of hitting one.
  const int SB = BV + 1;

  extern __shared__ __align__(16) unsigned char gdpb_smem[];
  float* S = reinterpret_cast<float*>(gdpb_smem);  // [K][BV] state / chunk start state h
  float* DS = S + (size_t)K * SB;                   // [K][BV] dS
  float* VT = DS + (size_t)K * SB;                  // [C][BV] v tile
  float* KH = VT + C * SB;                          // [C][BV] K h
  float* DL = KH + C * SB;                          // [C][BV] Δ
  float* DD = DL + C * SB;                          // [C][BV] K dS, then dΔ
  float* DO = DD + C * SB;                          // [C][BV] dO of the query rows
  float* DVB = DO + C * SB;                         // [C][BV] dvb
  float* CA = DVB + C * SB;                         // [C][C] K Kᵀ (raw, full)
  float* CB = CA + C * C;                           // [C][C] A, ds, dAinv, dM
  float* CC = CB + C * C;                           // [C][C] Ainv
  float* CD = CC + C * C;                           // [C][C] Q Kᵀ -> P, then T1
  // The block-wide sums of the gate gradient, in f64: their float atomics would make dg depend
  // on the order in which the warps arrive (at K = 256 with strong gates, a relative error of
  // 2e-6 to 1.2e-5 between runs), while f64 sums of f32 products are exact to far below f32.
  // 8-byte aligned: every buffer above has an even number of floats.
  double* A2 = reinterpret_cast<double*>(CD + C * C);  // [C] k_i·(dsᵀQ)_i
  double* A3 = A2 + C;                                 // [C] q_r·dq_r
  double* MISC = A3 + C;                               // [2] MISC[0]: h·dS
  float* Gs = reinterpret_cast<float*>(MISC + 2);      // [C] gate, then its cumsum
  float* Eg = Gs + C;                               // [C] e^G
  float* Dl = Eg + C;                               // [C] e^{G_last - G}
  float* Bt = Dl + C;                               // [C] beta
  float* A1 = Bt + C;                               // [C] a1_i = k_i·dk_inter_i
  float* DG = A1 + C;                               // [C] gradient of the gate cumsum
  float* Gsl = DG + C;                              // [C] rounding error of the cumsum
  T* Ks = reinterpret_cast<T*>(Gsl + C);            // [C][KSTR]
  T* Qs = Ks + (size_t)C * KSTR;                    // [C][KSTR]

  const int64_t BTH = (int64_t)B * TT * H;
  const int64_t KV = (int64_t)K * V;
  const int64_t qk_len = BTH * (n + 1) * K;
  const int64_t v_len = BTH * n * V;
  const int64_t dg_off = qk_len + v_len;
  const int64_t db_off = dg_off + BTH;
  const int64_t dh0_off = db_off + BTH * n;
  const int64_t tok0 = (int64_t)seq_b * TT + seq_start;
  const int64_t L = (int64_t)seq_len * n;
  const int nch = (int)((L + C - 1) / C);
  auto key_off = [&](int64_t p) {
    return ((tok0 + p / n) * (n + 1) + 1 + p % n) * H * K + (int64_t)head * K;
  };
  auto q_off = [&](int64_t p) { return ((tok0 + p / n) * (n + 1)) * H * K + (int64_t)head * K; };

  // ================= forward scan (modes FULL, FWD_SUM) =================
  if (mode != GDPB_BWD_SUM) {
    const float* h0p = has_h0src ? h0 + ((int64_t)srow * H + head) * KV : nullptr;
    for (int idx = tid; idx < K * BV; idx += nthr) {
      const int r = idx / BV, col = idx % BV, gc = v0 + col;
      float x = 0.f;
      if (col < bv) {
        if (gc < V)
          x = h0p != nullptr ? h0p[(int64_t)r * V + gc] : 0.f;
        else
          x = (gc - V == r) ? 1.f : 0.f;
      }
      S[r * SB + col] = x;
    }
    __syncthreads();
    for (int ci = 0; ci < nch; ++ci) {
      const int64_t p0 = (int64_t)ci * C;
      const int c = (int)min((int64_t)C, L - p0);
      if (full) {
        float* dst = hs + ((int64_t)(coff + ci) * H + head) * KV;
        for (int idx = tid; idx < K * bv; idx += nthr) {
          const int r = idx / bv, col = idx % bv;
          dst[(int64_t)r * V + v0 + col] = S[r * SB + col];
        }
      }
      load_rows<T>(Ks, KSTR, qk, [&](int i) { return key_off(p0 + i); }, c, K, vec_k, tid, nthr);
      for (int idx = tid; idx < c * bv; idx += nthr) {
        const int i = idx / bv, col = idx % bv, gc = v0 + col;
        const int64_t row = tok0 * n + p0 + i;
        VT[i * SB + col] = gc < V ? to_f(vv[(row * H + head) * V + gc]) : 0.f;
      }
      for (int i = tid; i < c; i += nthr) {
        const int64_t p = p0 + i;
        Gs[i] = (p % n == 0) ? aux[(tok0 + p / n) * H + head] : 0.f;
        Bt[i] = aux[BTH + ((tok0 * n + p) * H + head)];
      }
      __syncthreads();
      if (tid == 0) gdpb_cumsum(Gs, Gsl, c);
      __syncthreads();
      for (int i = tid; i < c; i += nthr) {
        Eg[i] = expf(Gs[i] + Gsl[i]);
        Dl[i] = expf(gdpb_gdiff(Gs, Gsl, c - 1, i));
      }
      // A = strict_lower(β_i (k_i·k_j) dec_ij) into CB (only below the diagonal is read).
      block_mma<MP, SI, SI, 1, 4, kStrictLowerOut>(
          c, c, K, tid, nthr, [&](int m, int k) { return to_f(Ks[m * KSTR + k]); },
          [&](int k, int j) { return to_f(Ks[j * KSTR + k]); },
          [&](int i, int j, float acc) {
            if (j < i) CB[i * c + j] = (acc * Bt[i]) * gdpb_dec(Gs, Gsl, i, j);
          });
      // K h
      block_mma<MP, SI, true>(
          c, bv, K, tid, nthr, [&](int m, int k) { return to_f(Ks[m * KSTR + k]); },
          [&](int k, int col) { return S[k * SB + col]; },
          [&](int i, int col, float acc) { KH[i * SB + col] = acc; });
      __syncthreads();
      tri_inverse(CB, CC, c, tid, nthr, 1);
      __syncthreads();
      // Δ = Ainv X, X = β V - β e^G K h
      block_mma<MP, true, true, 1, 4, kLowerA>(
          c, bv, c, tid, nthr, [&](int i, int m) { return CC[i * c + m]; },
          [&](int m, int col) { return Bt[m] * (VT[m * SB + col] - Eg[m] * KH[m * SB + col]); },
          [&](int i, int col, float acc) { DL[i * SB + col] = acc; });
      __syncthreads();
      {
        const float eglast = expf(Gs[c - 1] + Gsl[c - 1]);
        block_mma<MP, true, true>(
            K, bv, c, tid, nthr, [&](int m, int k) { return Dl[k] * to_f(Ks[k * KSTR + m]); },
            [&](int k, int col) { return DL[k * SB + col]; },
            [&](int m, int col, float acc) { S[m * SB + col] = eglast * S[m * SB + col] + acc; });
      }
      __syncthreads();
    }
    if (mode == GDPB_FWD_SUM) {
      float* dst = out + ((int64_t)sidx * H + head) * K * Vw;
      for (int idx = tid; idx < K * bv; idx += nthr) {
        const int r = idx / bv, col = idx % bv;
        dst[(int64_t)r * Vw + v0 + col] = S[r * SB + col];
      }
      return;
    }
  }

  // ================= reverse pass (modes FULL, BWD_SUM) =================
  {
    const float* dhtp = dht + ((int64_t)srow * H + head) * KV;
    for (int idx = tid; idx < K * BV; idx += nthr) {
      const int r = idx / BV, col = idx % BV, gc = v0 + col;
      float x = 0.f;
      if (col < bv) {
        if (gc < V)
          x = dhtp[(int64_t)r * V + gc];
        else
          x = (gc - V == r) ? 1.f : 0.f;
      }
      DS[r * SB + col] = x;
    }
  }
  __syncthreads();
  for (int ci = nch - 1; ci >= 0; --ci) {
    const int64_t p0 = (int64_t)ci * C;
    const int c = (int)min((int64_t)C, L - p0);
    const int first = (int)(((int64_t)(n - 1) - p0 % n + n) % n);
    const int nq = first < c ? (c - 1 - first) / n + 1 : 0;

    // ---- P1: loads.
    load_rows<T>(Ks, KSTR, qk, [&](int i) { return key_off(p0 + i); }, c, K, vec_k, tid, nthr);
    load_rows<T>(
        Qs, KSTR, qk, [&](int r) { return q_off(p0 + first + (int64_t)r * n); }, nq, K, vec_k,
        tid, nthr);
    for (int idx = tid; idx < nq * bv; idx += nthr) {
      const int r = idx / bv, col = idx % bv, gc = v0 + col;
      const int64_t p = p0 + first + (int64_t)r * n;
      DO[r * SB + col] = gc < V ? dout[((tok0 + p / n) * H + head) * V + gc] : 0.f;
    }
    for (int i = tid; i < c; i += nthr) {
      const int64_t p = p0 + i;
      Gs[i] = (p % n == 0) ? aux[(tok0 + p / n) * H + head] : 0.f;
      Bt[i] = aux[BTH + ((tok0 * n + p) * H + head)];
      A2[i] = 0.0;
      A3[i] = 0.0;
    }
    if (tid == 0) MISC[0] = 0.0;
    if (full) {
      for (int idx = tid; idx < c * bv; idx += nthr) {
        const int i = idx / bv, col = idx % bv, gc = v0 + col;
        const int64_t row = tok0 * n + p0 + i;
        VT[i * SB + col] = gc < V ? to_f(vv[(row * H + head) * V + gc]) : 0.f;
      }
      const float* src = hs + ((int64_t)(coff + ci) * H + head) * KV;
      for (int idx = tid; idx < K * BV; idx += nthr) {
        const int r = idx / BV, col = idx % BV;
        S[r * SB + col] = col < bv ? src[(int64_t)r * V + v0 + col] : 0.f;
      }
    }
    __syncthreads();
    // ---- P2: gate cumsum (one thread, in the CPU's order).
    if (tid == 0) gdpb_cumsum(Gs, Gsl, c);
    __syncthreads();
    // ---- P3: e^G, Dl, K Kᵀ, Q Kᵀ, K dS, K h.
    for (int i = tid; i < c; i += nthr) {
      Eg[i] = expf(Gs[i] + Gsl[i]);
      Dl[i] = expf(gdpb_gdiff(Gs, Gsl, c - 1, i));
    }
    block_mma<MP, SI, SI>(
        c, c, K, tid, nthr, [&](int m, int k) { return to_f(Ks[m * KSTR + k]); },
        [&](int k, int j) { return to_f(Ks[j * KSTR + k]); },
        [&](int i, int j, float acc) { CA[i * c + j] = acc; });
    if (nq > 0) {
      block_mma<MP, SI, SI>(
          nq, c, K, tid, nthr, [&](int r, int k) { return to_f(Qs[r * KSTR + k]); },
          [&](int k, int j) { return to_f(Ks[j * KSTR + k]); },
          [&](int r, int j, float acc) { CD[r * c + j] = acc; });
    }
    block_mma<MP, SI, true>(
        c, bv, K, tid, nthr, [&](int m, int k) { return to_f(Ks[m * KSTR + k]); },
        [&](int k, int col) { return DS[k * SB + col]; },
        [&](int i, int col, float acc) { DD[i * SB + col] = acc; });
    if (full) {
      block_mma<MP, SI, true>(
          c, bv, K, tid, nthr, [&](int m, int k) { return to_f(Ks[m * KSTR + k]); },
          [&](int k, int col) { return S[k * SB + col]; },
          [&](int i, int col, float acc) { KH[i * SB + col] = acc; });
    }
    __syncthreads();
    // ---- P4: A (CB) and P = scale (Q Kᵀ) ⊙ dec (CD, in place).
    for (int idx = tid; idx < c * c; idx += nthr) {
      const int i = idx / c, j = idx % c;
      CB[idx] = j < i ? (CA[idx] * Bt[i]) * gdpb_dec(Gs, Gsl, i, j) : 0.f;
    }
    for (int idx = tid; idx < nq * c; idx += nthr) {
      const int r = idx / c, j = idx % c;
      CD[idx] = CD[idx] * (scale * gdpb_dec(Gs, Gsl, first + r * n, j));
    }
    __syncthreads();
    // ---- P5: Ainv.
    tri_inverse(CB, CC, c, tid, nthr, 1);
    __syncthreads();
    if (full) {
      // ---- P6: Δ = Ainv X.
      block_mma<MP, true, true, 1, 4, kLowerA>(
          c, bv, c, tid, nthr, [&](int i, int m) { return CC[i * c + m]; },
          [&](int m, int col) { return Bt[m] * (VT[m * SB + col] - Eg[m] * KH[m * SB + col]); },
          [&](int i, int col, float acc) { DL[i * SB + col] = acc; });
      __syncthreads();
      // ---- P7: k·dk_inter per row, h·dS, ds (CB).
      for (int i = tid; i < c; i += nthr) {
        float acc = 0.f;
        for (int col = 0; col < bv; ++col) acc = fmaf(DL[i * SB + col], DD[i * SB + col], acc);
        A1[i] = Dl[i] * acc;
      }
      {
        float acc = 0.f;
        bool any = false;
        for (int idx = tid; idx < K * bv; idx += nthr) {
          const int r = idx / bv, col = idx % bv;
          acc = fmaf(S[r * SB + col], DS[r * SB + col], acc);
          any = true;
        }
        if (any) atomicAdd(&MISC[0], (double)acc);
      }
      if (nq > 0) {
        block_mma<MP, true, true>(
            nq, c, bv, tid, nthr, [&](int r, int k) { return DO[r * SB + k]; },
            [&](int k, int j) { return DL[j * SB + k]; },
            [&](int r, int j, float acc) {
              CB[r * c + j] = acc * (scale * gdpb_dec(Gs, Gsl, first + r * n, j));
            });
      }
      __syncthreads();
    }
    // ---- P8: dΔ = diag(Dl) K dS + Pᵀ dO (in place in DD).
    block_mma<MP, true, true>(
        c, bv, nq, tid, nthr, [&](int i, int r) { return CD[r * c + i]; },
        [&](int r, int col) { return DO[r * SB + col]; },
        [&](int i, int col, float acc) { DD[i * SB + col] = Dl[i] * DD[i * SB + col] + acc; });
    __syncthreads();
    // ---- P9: dvb (and dv); dq, dk (first part).
    block_mma<MP, true, true>(
        c, bv, c, tid, nthr, [&](int i, int m) { return CC[m * c + i]; },
        [&](int m, int col) { return DD[m * SB + col]; },
        [&](int i, int col, float acc) {
          DVB[i * SB + col] = acc;
          if (full && v0 + col < V)
            out[qk_len + ((tok0 * n + p0 + i) * H + head) * V + v0 + col] = Bt[i] * acc;
        });
    if (full) {
      if (nq > 0) {
        block_mma<MP, true, true>(
            nq, K, bv + c, tid, nthr,
            [&](int r, int k) {
              return k < bv ? (scale * Eg[first + r * n]) * DO[r * SB + k] : CB[r * c + (k - bv)];
            },
            [&](int k, int kk) {
              return k < bv ? S[kk * SB + k] : to_f(Ks[(k - bv) * KSTR + kk]);
            },
            [&](int r, int kk, float acc) {
              atomicAdd(out + q_off(p0 + first + (int64_t)r * n) + kk, acc);
              atomicAdd(&A3[r], (double)acc * to_f(Qs[r * KSTR + kk]));
            });
      }
      // dk_inter (acc1) and dsᵀQ (acc2) apart: their k-dot products enter the gate gradient
      // differently (see P14).
      block_mma_split<MP, true, true, true, SI>(
          c, K, bv, nq, tid, nthr, [&](int i, int k) { return Dl[i] * DL[i * SB + k]; },
          [&](int k, int kk) { return DS[kk * SB + k]; },
          [&](int i, int r) { return CB[r * c + i]; },
          [&](int r, int kk) { return to_f(Qs[r * KSTR + kk]); },
          [&](int i, int kk, float acc1, float acc2) {
            atomicAdd(out + key_off(p0 + i) + kk, acc1 + acc2);
            atomicAdd(&A2[i], (double)acc2 * to_f(Ks[i * KSTR + kk]));
          });
    }
    __syncthreads();
    // ---- P10: dAinv (CB), k·dkbg and v·dvb of row tid (kept in registers until P13, where
    // the same thread reads them: c <= GDP_CHUNK <= blockDim.x); dS carried to the chunk start.
    float kb_row = 0.f, vb_row = 0.f;
    if (full) {
      block_mma<MP, true, true>(
          c, c, bv, tid, nthr, [&](int i, int col) { return DD[i * SB + col]; },
          [&](int col, int j) { return Bt[j] * (VT[j * SB + col] - Eg[j] * KH[j * SB + col]); },
          [&](int i, int j, float acc) { CB[i * c + j] = j < i ? acc : 0.f; });
      if (tid < c) {
        for (int col = 0; col < bv; ++col) {
          const float d = DVB[tid * SB + col];
          kb_row = fmaf(d, KH[tid * SB + col], kb_row);
          vb_row = fmaf(d, VT[tid * SB + col], vb_row);
        }
        kb_row = -kb_row;
      }
    }
    {
      const float eglast = expf(Gs[c - 1] + Gsl[c - 1]);
      block_mma<MP, SI, true>(
          K, bv, nq + c, tid, nthr,
          [&](int m, int k) {
            return k < nq ? to_f(Qs[k * KSTR + m]) : to_f(Ks[(k - nq) * KSTR + m]);
          },
          [&](int k, int col) {
            if (k < nq) return (scale * Eg[first + k * n]) * DO[k * SB + col];
            const int j = k - nq;
            return -(Bt[j] * Eg[j]) * DVB[j * SB + col];
          },
          [&](int m, int col, float acc) {
            DS[m * SB + col] = eglast * DS[m * SB + col] + acc;
          });
    }
    __syncthreads();
    if (full) {
      // ---- P11: T1 = dAinv Ainvᵀ (CD).
      block_mma<MP, true, true>(
          c, c, c, tid, nthr, [&](int i, int m) { return CB[i * c + m]; },
          [&](int m, int j) { return CC[j * c + m]; },
          [&](int i, int j, float acc) { CD[i * c + j] = acc; });
      __syncthreads();
      // ---- P12: dM = strict_lower(-(Ainvᵀ T1) ⊙ dec) (CB).
      block_mma<MP, true, true>(
          c, c, c, tid, nthr, [&](int i, int m) { return CC[m * c + i]; },
          [&](int m, int j) { return CD[m * c + j]; },
          [&](int i, int j, float acc) {
            CB[i * c + j] = j < i ? -acc * gdpb_dec(Gs, Gsl, i, j) : 0.f;
          });
      __syncthreads();
      // ---- P13: dk (second part), dbeta, gate gradient per row.
      block_mma<MP, true, true>(
          c, K, bv + c, tid, nthr,
          [&](int i, int k) {
            if (k < bv) return -(Bt[i] * Eg[i]) * DVB[i * SB + k];
            const int j = k - bv;
            return Bt[i] * CB[i * c + j] + Bt[j] * CB[j * c + i];
          },
          [&](int k, int kk) {
            return k < bv ? S[kk * SB + k] : to_f(Ks[(k - bv) * KSTR + kk]);
          },
          [&](int i, int kk, float acc) { atomicAdd(out + key_off(p0 + i) + kk, acc); });
      if (tid < c) {
        const int i = tid;
        float mk = 0.f, colsum = 0.f;
        for (int j = 0; j < c; ++j) {
          mk = fmaf(CB[i * c + j], CA[i * c + j], mk);
          colsum = fmaf(CB[j * c + i] * Bt[j], CA[j * c + i], colsum);
        }
        const int64_t p = p0 + i;
        atomicAdd(out + db_off + (tok0 * n + p) * H + head, Eg[i] * kb_row + vb_row + mk);
        double dg = -A2[i] + (double)(Bt[i] * Eg[i] * kb_row) + (double)(Bt[i] * mk) - colsum;
        if (p % n == n - 1) dg += A3[(i - first) / n];
        if (i == c - 1) dg += (double)expf(Gs[c - 1] + Gsl[c - 1]) * MISC[0];
        DG[i] = (float)dg;
      }
      __syncthreads();
      // ---- P14: reverse chunk-local cumsum; slot 0 of every token gets its gate gradient.
      if (tid == 0)
        gdpb_gate_grad(A1, DG, c, p0, n, [&](int, int tk, float x) {
          atomicAdd(out + dg_off + (tok0 + p0 / n + tk) * H + head, x);
        });
      __syncthreads();
    }
  }

  // Initial-state gradient (exact per tile) or the backward summary.
  if (full) {
    if (write_dh0) {
      float* dst = out + dh0_off + ((int64_t)srow * H + head) * KV;
      for (int idx = tid; idx < K * bv; idx += nthr) {
        const int r = idx / bv, col = idx % bv;
        dst[(int64_t)r * V + v0 + col] = DS[r * SB + col];
      }
    }
  } else {
    float* dst = out + ((int64_t)sidx * H + head) * K * Vw;
    for (int idx = tid; idx < K * bv; idx += nthr) {
      const int r = idx / bv, col = idx % bv;
      dst[(int64_t)r * Vw + v0 + col] = DS[r * SB + col];
    }
  }
}

#define GDP_BWD_ENTRY(NAME, TYPE)                                                              \
  extern "C" __global__ void __launch_bounds__(GDP_THREADS)                                    \
      NAME(GDP_KERNEL_PARAMS(GDP_FUSED_BWD_FIELDS, TYPE)) {                                    \
    gdp_bwd<TYPE>(qk, v, aux, table, h0, has_h0src, dout, dht, hs, out, batch, tokens, heads,  \
                  dk, dv, n, ext, mode, write_dh0, scale, bv);                                 \
  }

GDP_BWD_ENTRY(gdp_bwd_f32, float)
GDP_BWD_ENTRY(gdp_bwd_bf16, __nv_bfloat16)
GDP_BWD_ENTRY(gdp_bwd_f16, __half)
