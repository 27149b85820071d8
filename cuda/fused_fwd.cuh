// Gated DeltaProduct: the one-kernel forward gdp_fwd_{f32,bf16,f16} of the chunked (WY)
// algorithm on CUDA, any dtype. Included by gdp.cu (uses GDP_CHUNK, GDP_THREADS, to_f, KPad and
// load_rows of common.cuh).
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

#define GDP_FWD_ENTRY(NAME, TYPE)                                                            \
  extern "C" __global__ void __launch_bounds__(GDP_THREADS)                                  \
      NAME(GDP_KERNEL_PARAMS(GDP_FUSED_FWD_FIELDS, TYPE)) {                                  \
    gdp_fwd<TYPE>(qk, v, aux, seqs, h0_override, use_h0_override, out, batch, tokens, heads, \
                  dk, dv, n, has_h0, scale, bv);                                             \
  }

GDP_FWD_ENTRY(gdp_fwd_f32, float)
GDP_FWD_ENTRY(gdp_fwd_bf16, __nv_bfloat16)
GDP_FWD_ENTRY(gdp_fwd_f16, __half)
