// Gated DeltaProduct backward for bf16 inputs in FLA's split: one sequential reverse scan of the
// state gradient, everything else parallel over (chunk, head). Included by gdp.cu after
// gdp_fwd_chunked.cuh (uses its row tables, staging helpers and the WY / forward-scan kernels).
//
// Launches (src/op/cuda/backward.rs, dh_scan.rs, grads.rs), per interleaved chunk of c <= 64 rows with start state
// h, state gradient dS at its end, W, U, P, coef as in gdp_fwd_chunked.cuh:
//  1. gdp_fwd_wy_bf16 (with `ag`): W, U, P, coef and bf16(Ainv) of every chunk.
//  2. gdp_fwd_scan_bf16_<BV>_<KPT> (with `hs`, `dn`, no output): h and Delta = U - W h (bf16).
//  3. gdp_bwd_dh_bf16_<BV>_<KPT>, grid (N*H, ceil(V / BV)), sequential over the chunks from the
//     last, the f32 state gradient slice dS [K, BV] in registers, a bf16 copy in shared memory:
//       dDelta = diag(Dl) K dS + P^T dO                      (written, bf16)
//       dS     = e^{G_last} dS + Q^T diag(coef_q) dO - W^T dDelta
//     and dS at each chunk's end (written, bf16); the initial-state gradient at the end (f32).
//     Where `ready` is given, it runs beside the WY kernel, which takes the chunks from the
//     sequences' ends, and waits for a chunk's group of WY factors (gdpc_wait_ready) before it
//     copies them; the forward scan's rerun then follows the WY kernel on the device's stream.
//  4. gdp_bwd_grads_bf16_<KP>_<VP>, grid (chunks, H), every gradient of the chunk's rows (the
//     formulas of gdp_bwd.cuh, with dA = -dvb Delta^T for the strictly lower part):
//       dvb = Ainv^T dDelta,  dv = diag(β) dvb
//       ds  = scale (dO Delta^T) ⊙ dec[query rows]
//       dq  = diag(coef_q) dO h^T + ds K
//       dk  = diag(Dl) Delta dS^T + ds^T Q - diag(β e^G) dvb h^T + Z K,
//             Z_ij = β_i dM_ij + β_j dM_ji,  dM = strict_lower(-(dvb Delta^T) ⊙ dec)
//       dβ, dg per row as in gdp_bwd.cuh (P13, P14), the gate gradient's reverse cumsum
//       chunk-local; every output element has one writer (plain stores).
//     Where the scan of 3 runs alone (the forward kept h and Delta) and leaves most
//     multiprocessors idle (B1 H16: 64 blocks on 132), the `_pipe` entry (K = V = 128,
//     n >= 2) runs beside it as persistent blocks (gdpg_pipe below): the scan counts each
//     group of chunks done, and the blocks take the (chunk, head) pairs in the order the scan
//     finishes them, waiting for each chunk's group; once the scan is done, a second launch on
//     all multiprocessors takes the pairs left.
// dO enters as bf16 (gdp_f32_to_bf16), like FLA's; products on tensor cores with f32
// accumulators, operands rounded to bf16 where FLA rounds them.

// acc[2 p + j] += op(A)[m0 .. m0 + 16, 0 .. kd) op(B)[0 .. kd, n0 + 16 p + 8 j ..) for p < NP,
// j < 2, kd a multiple of 16. AT: A stored transposed ([k][m]); BT: B stored transposed ([n][k]).
template <int NP, bool AT, bool BT>
__device__ __forceinline__ void gdpg_mma(float (&acc)[2 * NP][4], const __nv_bfloat16* A,
                                         int lda, int m0, const __nv_bfloat16* B, int ldb, int n0,
                                         int kd, int lane) {
  for (int k0 = 0; k0 < kd; k0 += 16) {
    uint32_t a[4];
    if (AT)
      ldsm_a_t(a, A, lda, m0, k0, lane);
    else
      ldsm_a(a, A, lda, m0, k0, lane);
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      uint32_t b[2][2];
      if (BT)
        ldsm_b_nk(b, B, ldb, k0, n0 + 16 * p, lane);
      else
        ldsm_b_kn(b, B, ldb, k0, n0 + 16 * p, lane);
      MmaBf16::mma(acc[2 * p], a, b[0]);
      MmaBf16::mma(acc[2 * p + 1], a, b[1]);
    }
  }
}

// Sum over the four lanes of a quad (the lanes that share an accumulator row).
__device__ __forceinline__ float gdpg_quad_sum(float x) {
#ifdef GDP_EMU
  return gdp_emu_quad_sum(x);
#else
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
#endif
}

// The chunk-local gate gradient of gdpb_gate_grad (gdp_bwd.cuh) on one warp instead of one
// thread: lane l holds rows 2l and 2l + 1 (c <= 64), the exclusive prefix of A1 and the
// reverse cumsum of DG come from warp scans. r0: the sub-step of row 0 (p0 mod n). `put(i, tk,
// x)` as there: x for the token whose slot 0 is row i, token p0 / n + tk.
template <typename Put>
__device__ __forceinline__ void gdpg_gate_grad_warp(const float* A1, const float* DG, int c,
                                                    int r0, int n, int lane, Put put) {
  const int i0 = 2 * lane, i1 = i0 + 1;
  const float a0 = i0 < c ? A1[i0] : 0.f, a1 = i1 < c ? A1[i1] : 0.f;
  const float d0 = i0 < c ? DG[i0] : 0.f, d1 = i1 < c ? DG[i1] : 0.f;
  float pa = a0 + a1, sd = d0 + d1;  // -> inclusive prefix of the pairs / suffix from this pair
  for (int d = 1; d < 32; d <<= 1) {
    const float up = gdpg_shfl_up(pa, d, lane), down = gdpg_shfl_down(sd, d, lane);
    if (lane >= d) pa += up;
    if (lane + d < 32) sd += down;
  }
  const float before = gdpg_shfl_up(pa, 1, lane), after = gdpg_shfl_down(sd, 1, lane);
  const float pre0 = lane > 0 ? before : 0.f, suf1 = d1 + (lane < 31 ? after : 0.f);
  const float x[2] = {d0 + suf1 + pre0, suf1 + (pre0 + a0)};
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int i = i0 + e;
    if (i < c && (r0 + i) % n == 0) put(i, (r0 + i) / n, x[e]);
  }
}

// Sum over the warp.
__device__ __forceinline__ float gdpg_warp_sum(float x) {
#ifdef GDP_EMU
  return gdp_emu_xor_sum(x, 31);
#else
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
#endif
}

// Sum over the eight lanes that share an accumulator column (same t).
__device__ __forceinline__ float gdpg_column_sum(float x) {
#ifdef GDP_EMU
  return gdp_emu_column_sum(x);
#else
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  x += __shfl_xor_sync(0xffffffffu, x, 16);
  return x;
#endif
}

extern "C" __global__ void gdp_f32_to_bf16(GDP_KERNEL_PARAMS(GDP_CAST_FIELDS, _)) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += stride)
    dst[i] = __float2bfloat16_rn(src[i]);
}

// The counters of a gradient kernel beside the state-gradient scan (`pipe`, zeroed): [0] the
// next (chunk, head) pair to take, [1] the scan's blocks done, then from GDPG_PIPE_COUNTERS one
// counter per (group of GDPC_READY_GROUP chunks, head) at gdpc_ready_index(..) * H + head,
// incremented by each value tile's scan block once the group's dS and dDelta are written.
#define GDPG_PIPE_COUNTERS 2

// ----------------------------------------------------------------------------------------------
// Kernel 3: the reverse scan of the state gradient. Template as the forward scan: BV value
// columns, KPT padded keys, NW warps; warp w computes dDelta for the rows of tile w % 4 and its
// column half, and owns the state-gradient rows of tiles w, w + NW, ...

// Shared memory of one stage buffer (bytes): W, K rows, Q rows [*][KPT + 8], P [QR][72], dO
// [QR][BV + 8] (bf16), coef [3][64] (f32).
__host__ __device__ constexpr int gdpd_stage_bytes(int KP, int QR, int BV) {
  return 2 * ((64 + 64 + QR) * (KP + 8) + QR * 72 + QR * (BV + 8)) + 4 * 3 * 64;
}

template <int BV, int KPT, int NW>
__device__ __forceinline__ void gdp_bwd_dh_bf16_impl(
    const __nv_bfloat16* __restrict__ qb, const __nv_bfloat16* __restrict__ kb, int split,
    const int* __restrict__ table, const __nv_bfloat16* __restrict__ wg,
    const __nv_bfloat16* __restrict__ pg,
    const float* __restrict__ cg, const __nv_bfloat16* __restrict__ dob,
    const float* __restrict__ dht, int has_dht, __nv_bfloat16* __restrict__ dhs,
    __nv_bfloat16* __restrict__ ddn, float* __restrict__ dh0, int write_dh0, int B, int TT,
    int H, int K, int V, int VD, int wide_from, int wide_to, int n, int QR, int NS,
    const int* __restrict__ ready, int* __restrict__ signal) {
  constexpr int C = GDP_CHUNK, NT = BV / 8, LB = BV + 8, LC = C + 8, LK = KPT + 8;
  constexpr int NTW = NT * 4 / NW, NPW = NTW / 2;
  constexpr int MT = KPT / 16, STW = (MT + NW - 1) / NW;
  static_assert(NPW >= 1, "a warp's column range must hold a pair of n8 tiles");
  const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int mi = warp & 3, nc0 = (warp >> 2) * 8 * NTW;
  const int sidx = blockIdx.x / H, head = blockIdx.x % H;
  const int v0 = blockIdx.y * BV;
  const int bv = min(BV, V - v0);
  const int seq_b = table[4 * sidx], seq_start = table[4 * sidx + 1], seq_len = table[4 * sidx + 2];
  const int cbase = table[4 * sidx + 3];
  const int64_t tok0 = (int64_t)seq_b * TT + seq_start;
  const int64_t L = (int64_t)seq_len * n;
  const int nch = (int)((L + C - 1) / C);
  const float rn = 1.f / (float)n;
  const double rnd = 1.0 / (double)n;
  const int64_t KV = (int64_t)K * V;
  const int64_t state_off = ((int64_t)sidx * H + head) * KV;
  const bool vk = gdpc_qk_vec(qb, kb, K);
  const bool vu = (V % 8 == 0) && (bv % 8 == 0);
  // dO holds the first VD value columns (rows of VD elements); the block's columns past them
  // read as zero (a context-parallel rank's scan on [dO | 0_K]). dO's rows 16 bytes at a time
  // also need a 16-byte aligned base (a view may start anywhere).
  const int bd = max(0, min(bv, VD - v0));
  // Only the sequences [wide_from, wide_to) want the columns past VD.
  if (bd == 0 && (sidx < wide_from || sidx >= wide_to)) return;
  const bool vdo = (VD % 8 == 0) && (bd % 8 == 0) && gdpc_aligned16(dob);
  const bool ddn_rows = ddn != nullptr && vu && gdpc_aligned16(ddn);

  extern __shared__ __align__(16) unsigned char gdpcs_smem[];
  const int stage_bytes = gdpd_stage_bytes(KPT, QR, BV);
  __nv_bfloat16* Sb = reinterpret_cast<__nv_bfloat16*>(gdpcs_smem + NS * stage_bytes);  // [2][KPT][LB]
  __nv_bfloat16* Dd = Sb + 2 * KPT * LB;  // [C][LB]  bf16(-dDelta)
  __nv_bfloat16* Dq = Dd + C * LB;        // [QR][LB] bf16(coef_q ⊙ dO)
  struct Stage {
    __nv_bfloat16 *W, *Kr, *Q, *P, *DO;
    float* cf;
  };
  auto stage = [&](int s) {
    unsigned char* base = gdpcs_smem + s * stage_bytes;
    Stage st;
    st.W = reinterpret_cast<__nv_bfloat16*>(base);    // [C][LK]
    st.Kr = st.W + C * LK;                             // [C][LK]
    st.Q = st.Kr + C * LK;                             // [QR][LK]
    st.P = st.Q + QR * LK;                             // [QR][LC]
    st.DO = st.P + QR * LC;                            // [QR][LB]
    st.cf = reinterpret_cast<float*>(st.DO + QR * LB);  // [3][C]
    return st;
  };
  // Row tables of NS chunks, by step (step s handles chunk nch - 1 - s, in slot s mod NS, the
  // stage its operands go to): element offsets of the key rows in kb and the query rows in qb, and of
  // the query tokens' rows in dO (-1 past the rows), and the chunk's geometry.
  int64_t* tables = reinterpret_cast<int64_t*>(Dq + QR * LB);  // [NS][3][C]
  GdpcMeta* meta = reinterpret_cast<GdpcMeta*>(tables + NS * 3 * C);  // [NS]
  const GdpcHeads heads_of(n, rn, H, K, head, split);
  auto fill_table = [&](int step, int slot_of) {
    const int ci = nch - 1 - step;
    int64_t* koff = tables + slot_of * 3 * C;
    int64_t* qoff = koff + C;
    int64_t* ooff = qoff + C;
    const int64_t p0 = (int64_t)ci * C;
    const GdpcChunk ch(p0, L, n, rn, gdpc_div_row(p0, rnd));
    const GdpcRows rows(tok0, ch, heads_of);
    for (int i = tid; i < C; i += nthr) {
      koff[i] = i < ch.c ? rows.key(i) : -1;
      qoff[i] = i < ch.nq ? rows.query(i) : -1;
      ooff[i] = i < ch.nq ? (rows.query_token(i) * H + head) * (int64_t)VD : -1;
    }
    if (tid == 0) meta[slot_of] = GdpcMeta{ch.c, ch.nq, ch.t0};
  };
  const GdpcSplit sp_u(bd, tid, nthr);
  // Issues the copies of step `step`'s chunk into stage s (one cp.async group; its slot's row
  // table and geometry are ready).
  auto prefetch = [&](int step, int s) {
    const int ci = nch - 1 - step;
    const Stage st = stage(s);
    const GdpcMeta m = meta[s];
    const int c = m.c, nq = m.nq;
    const int64_t* koff = tables + s * 3 * C;
    const int64_t* qoff = koff + C;
    const int64_t* ooff = qoff + C;
    const int64_t slot = (int64_t)(cbase + ci) * H + head;
    gdpc_stage_wkqp<KPT, NW * 32>(st.W, st.Kr, st.Q, st.P, wg + slot * C * K, kb, qb,
                                  pg + slot * C * C, koff, qoff, c, nq, QR, K, vk, tid);
    // Columns [bd, BV) of the dO tiles were zeroed once (below) and are never written.
    if (bd == 0) {
    } else if (vdo && bd == BV) {
      gdpc_stage_tile<BV, LB, C, NW * 32>(st.DO, dob + v0, [&](int r) { return ooff[r]; }, nq, QR,
                                          tid);
    } else if (vdo) {
      gdpc_stage_rows(st.DO, LB, dob + v0, [&](int r) { return ooff[r]; }, nq, QR, bd, true,
                      sp_u, tid, nthr);
    } else {
      for (int idx = tid; idx < QR * bd; idx += nthr) {
        const int r = idx / bd, col = idx - r * bd;
        st.DO[r * LB + col] = r < nq ? dob[ooff[r] + v0 + col] : __float2bfloat16_rn(0.f);
      }
    }
    for (int i = tid; i < 3 * C / 4; i += nthr)
      cp_async16(st.cf + 4 * i, cg + slot * 3 * C + 4 * i);
    cp_async_commit();
  };
  (void)B;

  // ---- dS at the sequence end: dht (or zero), in registers and Sb[0].
  float S[STW][NT][4];
#pragma unroll
  for (int s = 0; s < STW; ++s)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * (warp + NW * s) + g + (e >= 2 ? 8 : 0), col = 8 * j + 2 * t + (e & 1);
        S[s][j][e] =
            (has_dht && r < K && col < bv) ? dht[state_off + (int64_t)r * V + v0 + col] : 0.f;
      }
  for (int s = 0; s < NS; ++s) {
    const Stage st = stage(s);
    gdpc_zero_cols(st.W, LK, C, K, KPT, tid, nthr);
    gdpc_zero_cols(st.Kr, LK, C, K, KPT, tid, nthr);
    gdpc_zero_cols(st.Q, LK, QR, K, KPT, tid, nthr);
    gdpc_zero_cols(st.DO, LB, QR, bd, BV, tid, nthr);
  }
  auto store_sb = [&](__nv_bfloat16* sb) {
#pragma unroll
    for (int s = 0; s < STW; ++s)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * (warp + NW * s) + g + 8 * h, col = 8 * j + 2 * t;
          if (r < KPT)
            *reinterpret_cast<__nv_bfloat162*>(sb + r * LB + col) =
                __floats2bfloat162_rn(S[s][j][2 * h], S[s][j][2 * h + 1]);
        }
  };
  store_sb(Sb);
  for (int st = 0; st < min(NS, nch); ++st) fill_table(st, st);
  // The WY factors of the chunk of a step, when a WY kernel computes them at the same time
  // (taking the chunks from the sequences' ends: gdpc_wait_ready as in the forward scan).
  // (thread 0: chunks from ready_from on are known to be ready)
  int ready_from = nch;
  auto wait_ready = [&](int step) {
    const int ci = nch - 1 - step;
    if (ready == nullptr || tid != 0 || ci >= ready_from) return;
    const int group = ci / GDPC_READY_GROUP;
    ready_from = group * GDPC_READY_GROUP;
    gdpc_wait_ready(ready + gdpc_ready_index(cbase, sidx, ci) * H + head,
                    min(nch, (group + 1) * GDPC_READY_GROUP) - ready_from);
  };
  for (int st = 0; st < min(NS - 1, nch); ++st) wait_ready(st);
  __syncthreads();
  for (int st = 0; st < min(NS - 1, nch); ++st) prefetch(st, st);

  // sc: the step's stage and table slot (step mod NS).
  for (int step = 0, sc = 0; step < nch; ++step) {
    const int ci = nch - 1 - step;
    const int cur = step & 1;
    const Stage st = stage(sc);
    const __nv_bfloat16* sb = Sb + cur * KPT * LB;
    // Read before the barrier below, after which fill_table(step + NS) rewrites the slot.
    const GdpcMeta m = meta[sc];
    const int nq = m.nq;
    const int64_t slot = (int64_t)(cbase + ci) * H + head;
    if (NS == 3 && step + 1 < nch)
      cp_async_wait<1>();
    else
      cp_async_wait<0>();
    if (step + NS - 1 < nch) wait_ready(step + NS - 1);
    __syncthreads();
    const int s_prev = sc == 0 ? NS - 1 : sc - 1;
    if (step + NS - 1 < nch) prefetch(step + NS - 1, s_prev);
    if (step + NS < nch) fill_table(step + NS, sc);
    if (++sc == NS) sc = 0;

    // dS at this chunk's end (bf16) for the gradient kernel (not for a CP summary: null).
    if (dhs != nullptr)
      gdpc_store_state_tile<BV, KPT, NW * 32>(dhs + slot * KV + v0, sb, K, V, bv, vu, tid);

    // ---- Phase A: dDelta = diag(Dl) K dS + P^T dO for rows 16 mi.., this warp's columns.
    {
      const int m0 = 16 * mi;
      float acc[NTW][4] = {};
      gdpc_mma_kn<KPT, NPW>(acc, st.Kr, LK, m0, sb, LB, nc0, lane);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float dl = st.cf[C + m0 + g + 8 * h];
#pragma unroll
        for (int j = 0; j < NTW; ++j) acc[j][2 * h] *= dl, acc[j][2 * h + 1] *= dl;
      }
      gdpg_mma<NPW, true, false>(acc, st.P, LC, m0, st.DO, LB, nc0, QR, lane);
      __nv_bfloat16* dd = ddn == nullptr ? nullptr : ddn + slot * C * (int64_t)V + v0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = m0 + g + 8 * h;
#pragma unroll
        for (int j = 0; j < NTW; ++j) {
          const int col = nc0 + 8 * j + 2 * t;
          const float d0 = acc[j][2 * h], d1 = acc[j][2 * h + 1];
          *reinterpret_cast<__nv_bfloat162*>(Dd + r * LB + col) = __floats2bfloat162_rn(-d0, -d1);
          if (ddn != nullptr && !ddn_rows)
            gdpc_store_pair(dd + (int64_t)r * V, col, bv, d0, d1, vu);
        }
      }
    }
    // bf16(coef_q ⊙ dO) for the state update, eight values per 16-byte piece.
    for (int idx = tid; idx < QR * (BV / 8); idx += NW * 32) {
      const int r = idx / (BV / 8), c8 = 8 * (idx - r * (BV / 8));
      const float cq = st.cf[r];
      uint4 x = *reinterpret_cast<const uint4*>(st.DO + r * LB + c8);
      __nv_bfloat162* pair = reinterpret_cast<__nv_bfloat162*>(&x);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 d = __bfloat1622float2(pair[e]);
        pair[e] = __floats2bfloat162_rn(cq * d.x, cq * d.y);
      }
      *reinterpret_cast<uint4*>(Dq + r * LB + c8) = x;
    }
    __syncthreads();
    // dDelta for the gradient kernel from Dd (its bf16 values negated, exactly) as 16-byte row
    // pieces: a quarter of the pair stores' instructions.
    if (ddn_rows)
      gdpc_copy_tile_out<BV, LB, C, NW * 32>(ddn + slot * C * (int64_t)V + v0, V, Dd, bv, tid,
                                              0x80008000u);

    // ---- Phase B: dS = e^{G_last} dS + Q^T Dq + W^T Dd for this warp's state rows.
    {
      const float eglast = st.cf[2 * C];
      const int mq16 = 16 * ((nq + 15) / 16);
#pragma unroll
      for (int s = 0; s < STW; ++s) {
        const int m0 = 16 * (warp + NW * s);
        if (m0 < KPT) {
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) S[s][j][e] *= eglast;
          gdpg_mma<NT / 2, true, false>(S[s], st.Q, LK, m0, Dq, LB, 0, mq16, lane);
          gdpg_mma<NT / 2, true, false>(S[s], st.W, LK, m0, Dd, LB, 0, C, lane);
        }
      }
      store_sb(Sb + (cur ^ 1) * KPT * LB);
    }
    // A gradient kernel beside this scan (gdpg_pipe): the chunk's dS and dDelta are written;
    // one add per group of chunks, when its first chunk is done (the scan runs backwards).
    if (signal != nullptr && ci % GDPC_READY_GROUP == 0)
      gdpc_signal_ready(signal + GDPG_PIPE_COUNTERS + gdpc_ready_index(cbase, sidx, ci) * H + head,
                        tid);
  }

  if (write_dh0) {
#pragma unroll
    for (int s = 0; s < STW; ++s)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 16 * (warp + NW * s) + g + (e >= 2 ? 8 : 0), col = 8 * j + 2 * t + (e & 1);
          if (r < K && col < bv) dh0[state_off + (int64_t)r * V + v0 + col] = S[s][j][e];
        }
  }
  if (signal != nullptr) gdpc_signal_ready(signal + 1, tid);  // this block is done
}

#define GDPD_SCAN_ENTRY(BV, KPT, NW)                                                          \
  extern "C" __global__ void __launch_bounds__(NW * 32)                                     \
      gdp_bwd_dh_bf16_##BV##_##KPT(GDP_KERNEL_PARAMS(GDP_DH_FIELDS, _)) {                    \
    gdp_bwd_dh_bf16_impl<BV, KPT, NW>(q, k, split, table, w, p, coef, dob, dht, has_dht, dhs, \
                                      ddn, dh0, write_dh0, batch, tokens, heads, dk, dv,     \
                                      dv_in, wide_from, wide_to, n, qr, ns, ready, signal);  \
  }
GDPD_SCAN_ENTRY(16, 64, 4)
GDPD_SCAN_ENTRY(16, 128, 4)
GDPD_SCAN_ENTRY(32, 64, 8)
GDPD_SCAN_ENTRY(32, 128, 8)
GDPD_SCAN_ENTRY(64, 64, 8)
GDPD_SCAN_ENTRY(64, 128, 8)
// BV 128 (219 registers at K = 128, no spills): beside the states rerun at BV 128, one block of
// each per multiprocessor (see the states-only kernels in gdp_fwd_chunked.cuh).
GDPD_SCAN_ENTRY(128, 64, 8)
GDPD_SCAN_ENTRY(128, 128, 8)

// ----------------------------------------------------------------------------------------------
// Kernel 4: every gradient of one (chunk, head), 16 warps: warp w takes the rows of 16-row tile
// w % 4 and column quarter w / 4 of each product. KP, VP: K and V padded to 64 or 128.

#define GDPG_THREADS 512
#define GDPG_GROUPS 4  // column groups (GDPG_THREADS / 128)

#define GDPG_WARPS (GDPG_THREADS / 32)

// Shared memory (bytes) of gdp_bwd_grads_bf16 (the carve-up at its top).
__host__ __device__ constexpr int gdpg_smem_bytes(int KP, int VP, int QR) {
  return 2 * ((64 + QR) * (KP + 8) + (KP + 4 * 64 + QR) * (VP + 8) + (64 + QR) * 72) +
         4 * (64 * 68 + 5 * 64 + 6 * GDPG_GROUPS * 64 + 4 * 64 + GDPG_WARPS);
}

// Σ a_i b_i over eight bf16 pairs (16 bytes of each operand), in f32.
__device__ __forceinline__ float gdpg_dot8(const uint4& a, const uint4& b) {
  const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&b);
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 u = __bfloat1622float2(x[e]), v = __bfloat1622float2(y[e]);
    s += u.x * v.x + u.y * v.y;
  }
  return s;
}

template <int KP, int VP, bool TILES>
__device__ __forceinline__ void gdp_bwd_grads_bf16_impl(
    const __nv_bfloat16* __restrict__ qb, const __nv_bfloat16* __restrict__ kb, int split,
    const __nv_bfloat16* __restrict__ vv, const float* __restrict__ aux,
    const int* __restrict__ table, const __nv_bfloat16* __restrict__ ag, const __nv_bfloat16* __restrict__ hs,
    const __nv_bfloat16* __restrict__ dhs, const __nv_bfloat16* __restrict__ dn,
    const __nv_bfloat16* __restrict__ ddn, const __nv_bfloat16* __restrict__ dob,
    float* __restrict__ out, __nv_bfloat16* __restrict__ dqb, __nv_bfloat16* __restrict__ dkb,
    __nv_bfloat16* __restrict__ dvb_out,
    float* __restrict__ dgates, int B, int TT, int H, int K, int V, int n, int N, float scale,
    int QR, int chunk, int head) {
  constexpr int C = GDP_CHUNK, LK = KP + 8, LV = VP + 8, LC = C + 8, LF = 68;
  constexpr int NG = GDPG_GROUPS;
  // 16-column pairs of a warp's column group in products with K, V and 64 columns.
  constexpr int NPK = KP / (16 * NG), NPV = VP / (16 * NG), NPC = C / (16 * NG);
  static_assert(NPK >= 1 && NPV >= 1 && NPC >= 1, "a column group holds a pair of n8 tiles");
  // Launched with GDPG_THREADS threads: loops over the block's threads unroll at compile time.
  constexpr int nthr = GDPG_THREADS;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int mi = warp & 3, hf = warp >> 2;  // row tile, column group
  const int m0 = 16 * mi;
  const int sidx = table[4 * N + 2 * chunk], ci = table[4 * N + 2 * chunk + 1];
  const int seq_b = table[4 * sidx], seq_start = table[4 * sidx + 1], seq_len = table[4 * sidx + 2];
  const int64_t tok0 = (int64_t)seq_b * TT + seq_start;
  const int64_t L = (int64_t)seq_len * n;
  const int64_t p0 = (int64_t)ci * C;
  const float rn = 1.f / (float)n;
  const GdpcChunk ch(p0, L, n, rn, (int)p0 / n);
  const int c = ch.c, first = ch.first, nq = ch.nq;
  const int mq = (nq + 15) / 16;
  const int64_t BTH = (int64_t)B * TT * H;
  const int64_t qk_len = BTH * (n + 1) * K, v_len = BTH * n * V;
  // The packed f32 [dqk | dv | dg | dβ] (out; packed qk only), or bf16 dq, dk (in the layout
  // of qb, kb at H heads, GdpcRows::query_out / key_out; a null dkb with a packed dqk in dqb:
  // the keys follow the query slot) and dv and
  // f32 [dg | dβ] (dgates).
  float* const dg_out = out != nullptr ? out + qk_len + v_len : dgates;
  float* const db_out = dg_out + BTH;
  __nv_bfloat16* const dk_out =
      (dkb != nullptr || dqb == nullptr) ? dkb : dqb + (int64_t)H * K;
  enum Grad { kDq, kDk, kDv };
  // Stores a pair of columns of row `at` (a GdpcRows offset, or dv's) of dq, dk or dv.
  auto put_pair = [&](Grad which, int64_t at, int col, int ncols, float x0, float x1) {
    if (out != nullptr) {
      const int64_t base = which == kDv ? qk_len : which == kDk ? (int64_t)H * K : 0;
      gdpc_store_pair(out + base + at, col, ncols, x0, x1);
    } else {
      __nv_bfloat16* dst = which == kDv ? dvb_out : which == kDk ? dk_out : dqb;
      gdpc_store_pair(dst + at, col, ncols, x0, x1, ncols % 2 == 0);
    }
  };
  const int64_t slot = (int64_t)chunk * H + head;
  const int64_t KV = (int64_t)K * V;
  const bool vk = gdpc_qk_vec(qb, kb, K);
  const bool vv8 = V % 8 == 0;
  const GdpcRows rows(tok0, ch, n, rn, H, K, head, split);
  // Element offset of chunk row i in v and dv ([B, T·n, H, V]).
  const auto v_row = [&](int i) { return ((tok0 * n + p0 + i) * H + head) * (int64_t)V; };

  extern __shared__ __align__(16) unsigned char gdpg_smem[];
  __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(gdpg_smem);  // [C][LK]   K rows
  __nv_bfloat16* Qs = Ks + C * LK;                                    // [QR][LK]  Q rows
  __nv_bfloat16* HB = Qs + QR * LK;    // [KP][LV]  h
  __nv_bfloat16* Dn = HB + KP * LV;    // [C][LV]   Delta
  __nv_bfloat16* DVB = Dn + C * LV;    // [C][LV]   dvb
  __nv_bfloat16* Dd = DVB + C * LV;    // [C][LV]   dDelta            } after phase 1:
  __nv_bfloat16* Vs = Dd + C * LV;     // [C][LV]   V rows            } DHB [KP][LV], dS
  __nv_bfloat16* DHB = Dd;             //                               (chunk end)
  __nv_bfloat16* DOs = Vs + C * LV;    // [QR][LV]  dO (query rows)
  __nv_bfloat16* Ab = DOs + QR * LV;   // [C][LC]   Ainv, then Z
  __nv_bfloat16* DSb = Ab + C * LC;    // [QR][LC]  ds
  float* DM = reinterpret_cast<float*>(DSb + QR * LC);  // [C][LF] dM
  float* G = DM + C * LF;  // [C] gate cumsum (hi)
  float* Gl = G + C;       // [C] its rounding error
  float* Bt = Gl + C;      // [C] beta (0 past c)
  float* Eg = Bt + C;      // [C] e^G
  float* Dl = Eg + C;      // [C] e^{G_last - G}
  float* RED = Dl + C;     // [6][NG][C] per-row partial sums of the column groups
  // Partial sums kept apart and added in a fixed order, not by float atomics, so that the
  // gate and beta gradients are the same bits run to run.
  float* CS = RED + 6 * NG * C;  // [C / 16][C] column sums of dM ⊙ β KKᵀ per 16-row tile
  float* HDS = CS + (C / 16) * C;  // [GDPG_WARPS] h·dS per warp
  enum { R_A1 = 0, R_A2, R_A3, R_KB, R_VB, R_MK };
  // TILES: the bf16 dv and dk leave through a dead tile as 16-byte row pieces where rows allow
  // (a quarter of the pair stores' instructions): dv through DM's space (written from phase 2
  // on) at row stride LT, dk through DVB (read up to phase 2) where its rows hold KP + 8 values.
  // Measured at K = V = 128 on an H200: 3% off the kernel at n >= 2, 5% onto it at n = 1.
  constexpr int LT = 2 * LF;
  static_assert(LT >= VP + 8, "dv's tile fits DM's rows");
  const bool bf16_out = TILES && out == nullptr;
  const bool dv_rows = bf16_out && V % 8 == 0 && gdpc_aligned16(dvb_out);
  const bool dk_rows = bf16_out && LV >= KP + 8 && K % 8 == 0 && gdpc_aligned16(dk_out);
  __nv_bfloat16* const DVt = reinterpret_cast<__nv_bfloat16*>(DM);
  auto red = [&](int q, int grp, int i) -> float& { return RED[(q * NG + grp) * C + i]; };
  // Sums this warp's per-thread partials x[h] (rows r0 + g + 8 h) over the quad and stores them
  // as the partials of quantity q of column group grp.
  auto put_rows = [&](int q, int grp, int r0, const float (&x)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = gdpg_quad_sum(x[h]);
      if (t == 0) red(q, grp, r0 + g + 8 * h) = sum;
    }
  };

  // ---- Stage everything but dS (one cp.async group; dS goes where dDelta and V were, after
  // phase 1); gates meanwhile.
  const auto by_v = [&](int r) { return (int64_t)r * V; };
  gdpc_stage_fixed<KP, LK, C, nthr>(Ks, kb, [&](int i) { return rows.key(i); }, c, C, K, vk,
                                    tid);
  gdpc_stage_fixed<KP, LK, C, nthr>(Qs, qb, [&](int r) { return rows.query(r); }, nq, 16 * mq, K,
                                    vk, tid);
  gdpc_stage_fixed<VP, LV, KP, nthr>(HB, hs + slot * KV, by_v, K, KP, V, vv8, tid);
  gdpc_stage_fixed<VP, LV, C, nthr>(Dn, dn + slot * C * V, by_v, C, C, V, vv8, tid);
  gdpc_stage_fixed<VP, LV, C, nthr>(Dd, ddn + slot * C * V, by_v, C, C, V, vv8, tid);
  gdpc_stage_fixed<VP, LV, C, nthr>(
      Vs, vv, v_row, c, C, V, vv8 && gdpc_aligned16(vv), tid);
  gdpc_stage_fixed<VP, LV, C, nthr>(
      DOs, dob, [&](int r) { return (rows.query_token(r) * H + head) * (int64_t)V; }, nq, 16 * mq,
      V, vv8 && gdpc_aligned16(dob), tid);
  gdpc_stage_fixed<C, LC, C, nthr>(Ab, ag + slot * C * C, [&](int r) { return (int64_t)r * C; },
                                   C, C, C, true, tid);
  cp_async_commit();
  gdpc_zero_cols(Ks, LK, C, K, KP, tid, nthr);
  gdpc_zero_cols(Qs, LK, 16 * mq, K, KP, tid, nthr);
  gdpc_zero_cols(HB, LV, KP, V, VP, tid, nthr);
  gdpc_zero_cols(Dn, LV, C, V, VP, tid, nthr);
  gdpc_zero_cols(Dd, LV, C, V, VP, tid, nthr);
  gdpc_zero_cols(Vs, LV, C, V, VP, tid, nthr);
  gdpc_zero_cols(DOs, LV, 16 * mq, V, VP, tid, nthr);
  for (int i = tid; i < C; i += nthr) {
    const int64_t p = p0 + i;
    const int x = rows.r0 + i;  // row i counted from the token of row 0 (32-bit: no int64 div)
    G[i] = (i < c && x % n == 0) ? aux[(tok0 + rows.t0 + x / n) * H + head] : 0.f;
    Bt[i] = i < c ? aux[BTH + ((tok0 * n + p) * H + head)] : 0.f;
  }
  __syncthreads();
  if (warp == 0) gdpb_cumsum_warp(G, Gl, c, lane);
  __syncthreads();
  for (int i = tid; i < C; i += nthr) {
    Eg[i] = i < c ? expf(G[i] + Gl[i]) : 0.f;
    Dl[i] = i < c ? expf(gdpb_gdiff(G, Gl, c - 1, i)) : 0.f;
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- Phase 1: dvb = Ainvᵀ dDelta (dv, dvb and v·dvb per row); ds.
  {
    // Ainvᵀ is upper triangular: row tile r0 sums dDelta's rows from r0 on. The row tile
    // (warp + warp / 4) % 4 gives every multiprocessor quarter (warp % 4) one of each length.
    const int r0 = 16 * ((mi + hf) & 3), n0 = hf * (VP / NG);
    float dvb[2 * NPV][4] = {};
    gdpg_mma<NPV, true, false>(dvb, Ab + r0 * LC, LC, r0, Dd + r0 * LV, LV, n0, C - r0, lane);
    float vb[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 2 * NPV; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = r0 + g + 8 * h, col = n0 + 8 * j + 2 * t;
        const float d0 = dvb[j][2 * h], d1 = dvb[j][2 * h + 1];
        const float2 vx = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(Vs + i * LV + col));
        vb[h] += d0 * vx.x + d1 * vx.y;
        *reinterpret_cast<__nv_bfloat162*>(DVB + i * LV + col) = __floats2bfloat162_rn(d0, d1);
        if (dv_rows)
          *reinterpret_cast<__nv_bfloat162*>(DVt + i * LT + col) =
              __floats2bfloat162_rn(Bt[i] * d0, Bt[i] * d1);
        else if (i < c)
          put_pair(kDv, v_row(i), col, V, Bt[i] * d0, Bt[i] * d1);
      }
    if (dv_rows) {
      __syncwarp();
      gdpc_warp_tile_out<2 * NPV, LT>(dvb_out, v_row, DVt, r0, n0, c, V, lane);
    }
    put_rows(R_VB, hf, r0, vb);
  }
  // ds by 16 x 16 tiles, the row tile warp / 4 and the column tile (warp - warp / 4) % 4
  // (as dM's below), so that the multiprocessor quarters (warp % 4) share the tiles below the
  // causal limit evenly where the query rows fill fewer than four row tiles (n >= 2) and where
  // they fill four (n = 1: 3, 2, 3, 2 of the ten); tiles wholly above it skip the product.
  static_assert(NPC == 1, "the 64 x 64 products go by 16 x 16 tiles, one per warp");
  if ((warp >> 2) < mq) {
    const int r0 = 16 * (warp >> 2), n0 = (((warp & 3) - (warp >> 2)) & 3) * (C / NG);
    const int last_query = min(first + min(r0 + 15, nq - 1) * n, C - 1);
    float acc[2 * NPC][4] = {};
    if (n0 <= last_query) gdpg_mma<NPC, false, true>(acc, DOs, LV, r0, Dn, LV, n0, VP, lane);
    // This thread's two query rows: their chunk row and gate cumsum in registers (gdpb_dec's
    // arithmetic, without reloading the row's values for every element).
    int ri[2];
    float gi[2], gli[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ri[h] = min(first + (r0 + g + 8 * h) * n, C - 1);
      gi[h] = G[ri[h]];
      gli[h] = Gl[ri[h]];
    }
#pragma unroll
    for (int j = 0; j < 2 * NPC; ++j) {
      const int col = n0 + 8 * j + 2 * t;
      const float2 gj = *reinterpret_cast<const float2*>(G + col);
      const float2 glj = *reinterpret_cast<const float2*>(Gl + col);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + g + 8 * h;
        float x[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int jj = col + e;
          // Select before exponentiating (pitfall P4): the argument is <= 0 for jj <= ri.
          x[e] = (r < nq && jj < c && jj <= ri[h])
                     ? acc[j][2 * h + e] *
                           (scale * expf((gi[h] - (e ? gj.y : gj.x)) + (gli[h] - (e ? glj.y : glj.x))))
                     : 0.f;
        }
        *reinterpret_cast<__nv_bfloat162*>(DSb + r * LC + col) = __floats2bfloat162_rn(x[0], x[1]);
      }
    }
  }
  __syncthreads();
  // dS (chunk end) into the space of dDelta and V (rows past K zero; columns past V are).
  gdpc_stage_fixed<VP, LV, KP, nthr>(DHB, dhs + slot * KV, by_v, K, KP, V, vv8, tid);
  cp_async_commit();

  // ---- Phase 2: dq; dM (and its row / column sums against β k·k); dk from dvb hᵀ and dsᵀ Q.
  const int nk0 = hf * (KP / NG);
  // dq for the query rows, 16-row tiles by the column groups. Where the query rows fill at most
  // two tiles (n >= 2) and a group's columns split in two, the warps of the other row tiles take
  // half of them: otherwise half the warps do these products (40% of the phase's) while the
  // others wait at the next barrier. A half's q·dq partial sums go to rows 32.. of R_A3.
  const bool split_dq = NPK % 2 == 0 && mq <= 2;
  const int dq_tile = split_dq ? (mi & 1) : mi, dq_half = split_dq ? (mi >> 1) : 0;
  auto dq_part = [&](auto np) {
    constexpr int NP = decltype(np)::value;
    const int r0 = 16 * dq_tile, c0 = nk0 + dq_half * (16 * NP);
    float acc[2 * NP][4] = {};
    gdpg_mma<NP, false, true>(acc, DOs, LV, r0, HB, LV, c0, VP, lane);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + g + 8 * h;
      const float cq = r < nq ? scale * Eg[first + r * n] : 0.f;
#pragma unroll
      for (int j = 0; j < 2 * NP; ++j) acc[j][2 * h] *= cq, acc[j][2 * h + 1] *= cq;
    }
    gdpg_mma<NP, false, false>(acc, DSb, LC, r0, Ks, LK, c0, C, lane);
    float a3[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 2 * NP; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + g + 8 * h, col = c0 + 8 * j + 2 * t;
        const float2 qx = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(Qs + r * LK + col));
        a3[h] += acc[j][2 * h] * qx.x + acc[j][2 * h + 1] * qx.y;
        if (r < nq) put_pair(kDq, rows.query_out(r), col, K, acc[j][2 * h], acc[j][2 * h + 1]);
      }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = gdpg_quad_sum(a3[h]);
      if (t == 0) red(R_A3, hf, r0 + g + 8 * h + 32 * dq_half) = sum;
    }
  };
  if (dq_tile < mq) {
    if constexpr (NPK % 2 == 0) {
      if (split_dq)
        dq_part(std::integral_constant<int, NPK / 2>{});
      else
        dq_part(std::integral_constant<int, NPK>{});
    } else {
      dq_part(std::integral_constant<int, NPK>{});
    }
  }
  {
    // dM by 16 x 16 tiles: the row tile warp / 4, the column tile (warp - warp / 4) % 4, so
    // that the ten tiles on or below the diagonal (the others are zero) fall 3, 2, 3, 2 on the
    // multiprocessor quarters (warp % 4) instead of 1, 2, 3, 4.
    const int r0 = 16 * (warp >> 2), ct = ((warp & 3) - (warp >> 2)) & 3, n0 = ct * (C / NG);
    const bool live = n0 <= r0;
    float da[2 * NPC][4] = {}, kk[2 * NPC][4] = {};
    if (live) {
      gdpg_mma<NPC, false, true>(da, DVB, LV, r0, Dn, LV, n0, VP, lane);
      gdpg_mma<NPC, false, true>(kk, Ks, LK, r0, Ks, LK, n0, KP, lane);
    }
    float mk[2] = {0.f, 0.f};
    float gi[2], gli[2], bi[2];  // this thread's rows' gate cumsum and beta
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = r0 + g + 8 * h;
      gi[h] = G[i];
      gli[h] = Gl[i];
      bi[h] = Bt[i];
    }
#pragma unroll
    for (int j = 0; j < 2 * NPC; ++j) {
      float cs[2] = {0.f, 0.f};
      const int col = n0 + 8 * j + 2 * t;
      const float2 gj = *reinterpret_cast<const float2*>(G + col);
      const float2 glj = *reinterpret_cast<const float2*>(Gl + col);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = r0 + g + 8 * h;
        float dmp[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int jj = col + e;
          // gdpb_dec(G, Gl, i, jj) for jj < i (selected before exponentiating, pitfall P4).
          const float dm =
              (jj < i && i < c)
                  ? -da[j][2 * h + e] *
                        expf((gi[h] - (e ? gj.y : gj.x)) + (gli[h] - (e ? glj.y : glj.x)))
                  : 0.f;
          dmp[e] = dm;
          mk[h] += dm * kk[j][2 * h + e];
          cs[e] += dm * bi[h] * kk[j][2 * h + e];
        }
        *reinterpret_cast<float2*>(DM + i * LF + col) = make_float2(dmp[0], dmp[1]);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        // Every (row tile, column) written once: the four warps of a row tile take its four
        // column tiles; those above the diagonal add zero.
        const float s = gdpg_column_sum(cs[e]);
        if (g == 0) CS[(r0 / 16) * C + n0 + 8 * j + 2 * t + e] = live ? s : 0.f;
      }
    }
    put_rows(R_MK, ct, r0, mk);
  }
  // dk = -diag(β e^G) dvb hᵀ + dsᵀ Q. The row sums k·dkbg = -Σ_v dvb (K h) are taken here as
  // -Σ_k K ⊙ (dvb hᵀ), from this product's accumulators: no K h product of their own.
  float dk[2 * NPK][4] = {};
  {
    gdpg_mma<NPK, false, true>(dk, DVB, LV, m0, HB, LV, nk0, VP, lane);
    float acc[2 * NPK][4] = {};
    if (mq > 0) gdpg_mma<NPK, true, false>(acc, DSb, LC, m0, Qs, LK, nk0, 16 * mq, lane);
    float s[2], a2[2] = {0.f, 0.f}, kb[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = m0 + g + 8 * h;
      s[h] = -(Bt[i] * Eg[i]);
    }
#pragma unroll
    for (int j = 0; j < 2 * NPK; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = m0 + g + 8 * h, col = nk0 + 8 * j + 2 * t;
        const float2 kx = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(Ks + i * LK + col));
        kb[h] -= dk[j][2 * h] * kx.x + dk[j][2 * h + 1] * kx.y;
        a2[h] += acc[j][2 * h] * kx.x + acc[j][2 * h + 1] * kx.y;
        dk[j][2 * h] = s[h] * dk[j][2 * h] + acc[j][2 * h];
        dk[j][2 * h + 1] = s[h] * dk[j][2 * h + 1] + acc[j][2 * h + 1];
      }
    put_rows(R_A2, hf, m0, a2);
    put_rows(R_KB, hf, m0, kb);
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- Phase 3: Z = β_i dM_ij + β_j dM_ji into Ab (Ainv is no longer read); h·dS.
  static_assert(C * C % nthr == 0 && KP * VP % (8 * nthr) == 0, "whole loop steps");
#pragma unroll
  for (int step = 0; step < C * C / nthr; ++step) {
    const int idx = step * nthr + tid, i = idx >> 6, j = idx & 63;
    Ab[i * LC + j] = __float2bfloat16_rn(Bt[i] * DM[i * LF + j] + Bt[j] * DM[j * LF + i]);
  }
  {
    // Padded rows and columns of both tiles are zero; 16 bytes of each per step.
    constexpr int BPR = VP / 8;  // 16-byte blocks per row
    float s = 0.f;
#pragma unroll
    for (int step = 0; step < KP * BPR / nthr; ++step) {
      const int idx = step * nthr + tid, r = idx / BPR, col = 8 * (idx % BPR);
      s += gdpg_dot8(*reinterpret_cast<const uint4*>(HB + r * LV + col),
                     *reinterpret_cast<const uint4*>(DHB + r * LV + col));
    }
    s = gdpg_warp_sum(s);
    if (lane == 0) HDS[warp] = s;
  }
  __syncthreads();

  // ---- Phase 4: dk += Z K + diag(Dl) Delta dSᵀ; store dk.
  {
    float acc[2 * NPK][4] = {};
    gdpg_mma<NPK, false, false>(dk, Ab, LC, m0, Ks, LK, nk0, C, lane);
    gdpg_mma<NPK, false, true>(acc, Dn, LV, m0, DHB, LV, nk0, VP, lane);
    float a1[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 2 * NPK; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = m0 + g + 8 * h, col = nk0 + 8 * j + 2 * t;
        const float dl = Dl[i];
        const float x0 = dl * acc[j][2 * h], x1 = dl * acc[j][2 * h + 1];
        const float2 kx = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(Ks + i * LK + col));
        a1[h] += x0 * kx.x + x1 * kx.y;
        if (dk_rows)
          *reinterpret_cast<__nv_bfloat162*>(DVB + i * LV + col) =
              __floats2bfloat162_rn(dk[j][2 * h] + x0, dk[j][2 * h + 1] + x1);
        else if (i < c)
          put_pair(kDk, rows.key_out(i), col, K, dk[j][2 * h] + x0, dk[j][2 * h + 1] + x1);
      }
    if (dk_rows) {
      __syncwarp();
      gdpc_warp_tile_out<2 * NPK, LV>(dk_out, [&](int i) { return rows.key_out(i); }, DVB, m0, nk0,
                                      c, K, lane);
    }
    put_rows(R_A1, hf, m0, a1);
  }
  __syncthreads();

  // ---- Phase 5: dβ and the gate gradient per row (gdp_bwd.cuh P13, P14; the reverse cumsum
  // on warp 0). DM's space holds the row values (DG) and A1.
  float* DG = DM;
  float* A1 = DM + C;
  for (int i = tid; i < c; i += nthr) {
    auto sum2 = [&](int q) {
      float x = 0.f;
      for (int grp = 0; grp < NG; ++grp) x += red(q, grp, i);
      return x;
    };
    const float kb = sum2(R_KB), vb = sum2(R_VB), mk = sum2(R_MK);
    const int64_t p = p0 + i;
    db_out[(tok0 * n + p) * H + head] = Eg[i] * kb + vb + mk;
    float cs = 0.f;
    for (int rt = 0; rt < C / 16; ++rt) cs += CS[rt * C + i];
    float dg = -sum2(R_A2) + Bt[i] * Eg[i] * kb + Bt[i] * mk - cs;
    if ((rows.r0 + i) % n == n - 1) {
      const int r = (i - first) / n;  // the query row of this token
      for (int grp = 0; grp < NG; ++grp)
        dg += split_dq ? red(R_A3, grp, r) + red(R_A3, grp, r + 32) : red(R_A3, grp, r);
    }
    if (i == c - 1) {
      float hds = 0.f;
      for (int w = 0; w < GDPG_WARPS; ++w) hds += HDS[w];
      dg += Eg[c - 1] * hds;
    }
    DG[i] = dg;
    A1[i] = sum2(R_A1);
  }
  __syncthreads();
  if (warp == 0)
    gdpg_gate_grad_warp(A1, DG, c, rows.r0, n, lane, [&](int, int tk, float x) {
      dg_out[(tok0 + rows.t0 + tk) * H + head] = x;
    });
}

// Persistent gradient blocks beside the state-gradient scan (or, with beside = 0, after it):
// each block takes the pairs `pipe[0]++` (every head of a chunk in turn, the chunks in the
// order `order`: table ids from the sequences' ends), waits (beside) for the chunk's group of
// dS and dDelta (`ready_count` value tiles' adds), and computes its gradients. Thread 0 takes
// the next pair while the block computes the current one, so that the atomic's round trip
// overlaps the products. Beside the scan, a block that finds it done (all `scan_blocks`
// blocks counted in pipe[1]) computes the pair it holds and leaves the rest to the launch
// after the scan. The launcher gives the blocks beside the scan at most the multiprocessors
// the scan leaves, so the scan's blocks always find room and the waits end.
template <class Grads>
__device__ __forceinline__ void gdpg_pipe(int* pipe, const int* order, const int* table, int N,
                                          int H, int items, int ready_count, int beside,
                                          int scan_blocks, Grads grads) {
#ifdef GDP_EMU
  static int taken;  // the emulation runs one block at a time
  auto take = [&] { return __atomic_fetch_add(pipe, 1, __ATOMIC_RELAXED); };
  auto scan_done = [&] { return __atomic_load_n(pipe + 1, __ATOMIC_RELAXED) >= scan_blocks; };
#else
  __shared__ int taken;
  auto take = [&] { return atomicAdd(pipe, 1); };
  auto scan_done = [&] { return *reinterpret_cast<volatile int*>(pipe + 1) >= scan_blocks; };
#endif
  // Thread 0's: the pair index taken, and whether the scan was done when it was taken.
  int it = threadIdx.x == 0 ? take() : 0;
  bool last = false;
  for (;;) {
    if (threadIdx.x == 0) {
      int pair = -1;
      if (it < items) {
        const int chunk = order[it / H];
        if (beside) {
          const int sidx = table[4 * N + 2 * chunk], ci = table[4 * N + 2 * chunk + 1];
          gdpc_wait_ready(pipe + GDPG_PIPE_COUNTERS +
                              gdpc_ready_index(table[4 * sidx + 3], sidx, ci) * H + it % H,
                          ready_count);
        }
        pair = chunk * H + it % H;
      }
      taken = pair;
    }
    __syncthreads();
    const int pair = taken;
    if (pair < 0) return;
    if (threadIdx.x == 0) {
      if (last) {
        it = items;
      } else {
        last = beside && scan_done();
        it = take();
      }
    }
    grads(pair / H, pair % H);
    __syncthreads();  // every thread has read `taken` and left the shared tiles
  }
}

// gdp_bwd_grads_bf16_<KP>_<VP>[_tiles]: `_tiles` stores dv and dk through shared memory (TILES);
// grid (chunks, H). gdp_bwd_grads_bf16_128_128_tiles_pipe: persistent blocks (gdpg_pipe), only
// where they were measured (K = V = 128, n >= 2; `ptxas` gives the other shapes' persistent
// kernels spills, and the 64 x 64 one twice its grid kernel's registers).
#define GDPG_ARGS(KP, VP, TILES, CHUNK, HEAD)                                                  \
  gdp_bwd_grads_bf16_impl<KP, VP, TILES>(q, k, split, v, aux, table, ainv, hs, dhs, dn, ddn,  \
                                         dob, out, dq, dk_out, dv_out, dgates, batch, tokens,  \
                                         heads, dk, dv, n, nseq, scale, qr, CHUNK, HEAD)
#define GDPG_ENTRY(KP, VP, TILES, SUFFIX)                                                      \
  extern "C" __global__ void __launch_bounds__(GDPG_THREADS)                                   \
      gdp_bwd_grads_bf16_##KP##_##VP##SUFFIX(GDP_KERNEL_PARAMS(GDP_GRADS_FIELDS, _)) {         \
    GDPG_ARGS(KP, VP, TILES, blockIdx.x, blockIdx.y);                                          \
  }
GDPG_ENTRY(64, 64, false, )
GDPG_ENTRY(64, 128, false, )
GDPG_ENTRY(128, 64, false, )
GDPG_ENTRY(128, 128, false, )
// Only where it was measured faster: K = V = 128 at n >= 2 (the launch picks it).
GDPG_ENTRY(128, 128, true, _tiles)
extern "C" __global__ void __launch_bounds__(GDPG_THREADS)
    gdp_bwd_grads_bf16_128_128_tiles_pipe(GDP_KERNEL_PARAMS(GDP_GRADS_PIPE_FIELDS, _)) {
  gdpg_pipe(pipe, order, table, nseq, heads, items, ready_count, beside, scan_blocks,
            [&](int chunk, int head) { GDPG_ARGS(128, 128, true, chunk, head); });
}
