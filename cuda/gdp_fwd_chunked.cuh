// Gated DeltaProduct forward for bf16 inputs in two launches (FLA's split, with the output fused
// into the state scan). Included by gdp.cu after gdp_bwd.cuh (uses its gate-cumsum helpers).
//
// 1. gdp_fwd_wy_bf16, grid (chunks, H), fully parallel (block x is chunk x, or order[x] where an
//    order is given, then a 1-D grid; where `ready` is given, each block counts its chunk as
//    ready once its outputs are written (gdpc_signal_ready), for a scan running at the same
//    time): per interleaved chunk of c <= 64 rows
//    (compensated gate cumsum G, dec(i, j) = e^{G_i - G_j} for j <= i),
//      A  = strict_lower(β_i k_i·k_j dec),  Ainv = (I + A)^-1          (f32, cuda/inverse.cuh)
//      W  = Ainv bf16(β e^G ⊙ K)   [64, K]     U = Ainv bf16(β ⊙ V)   [64, V]
//      P  = scale (q_r·k_j) dec(i_r, j)   [64, 64] for the query rows i_r = first + r n
//      coef = [scale e^{G_{i_r}} (64) | e^{G_last - G_i} (64) | e^{G_last}, 0...]   (f32)
//    written to a scratch buffer: W, U, P in bf16 (tensor-core operands), coef in f32. The
//    products run on tensor cores from bf16 fragments (ldmatrix); the inverse is f32 FFMA
//    (tri_inverse64) and enters the W and U products as bf16(Ainv diag(β e^G)) and
//    bf16(Ainv diag(β)) against the unscaled keys and values (FLA rounds Ainv and the scaled
//    rows separately).
// 2. gdp_fwd_scan_bf16_<BV>_<KPT>, grid (N*H, ceil(V / BV)), sequential over the chunks of a
//    sequence, the f32 state slice S [K, BV] in registers (in mma accumulator layout), a bf16
//    copy of it in shared memory:
//      Delta = U - W S
//      o_r   = coef_q[r] (q_r S) + P bf16(Delta)
//      S     = e^{G_last} S + K^T bf16(coef_k ⊙ Delta)
//    (FLA rounds the same operands to bf16.) The chunk's operands (W, K and Q rows, P, the U
//    slice, coef) are copied with cp.async into one of NS = 2 or 3 stage buffers, NS - 1 chunks
//    ahead of the one computing (from per-chunk row tables built ahead, no per-element index
//    arithmetic); products read their fragments with ldmatrix (cuda/ldsm.cuh). Where `ready` is
//    given, the scan runs beside the WY kernel (`src/op/cuda/pipeline.rs`) and waits for a
//    chunk's group to be ready before it copies the chunk's operands (gdpc_wait_ready).
//
// Table (int): per sequence (batch row, first token, tokens, first chunk) at 4 s, then per chunk
// (sequence, chunk index within it) at 4 N + 2 c. Scratch per (chunk, head) at
// (chunk * H + head): W [64][K], U [64][V], P [64][64] (bf16) and coef [3][64] (f32).

#include "ldsm.cuh"

#define GDPC_THREADS 128

// Quotients by n without an integer division (a long subroutine on the scans' sequential path):
// rn = 1/n (f32) and rnd = 1/n (f64), computed once per block.
//  - gdpc_div_small(x, rn) = floor(x / n) for 0 <= x < 2^22 (row counts within a chunk):
//    floor((x + 1/2) · rn): no multiple of n lies in (x, x + 1/2], and the product's relative
//    error (2^-23) stays below the 1/(2 n x) margin;
//  - gdpc_div_row(p, rnd) = floor(p / n) for 0 <= p < 2^31 (row offsets within a sequence; the
//    launchers check that T·n fits in i32): the same in f64 (relative error 2^-52).
__device__ __forceinline__ int gdpc_div_small(int x, float rn) {
  return (int)(((float)x + 0.5f) * rn);
}
__device__ __forceinline__ int gdpc_div_row(int64_t p, double rnd) {
  return (int)(((double)p + 0.5) * rnd);
}

// Geometry of the interleaved chunk that starts at row p0 of a sequence of L rows (rows t·n +
// n − 1 are query rows): its rows c, the token t0 = floor(p0 / n) (given) and sub-row r0 of row
// p0 (p0 = t0 n + r0), its first query row first = n − 1 − r0 (in token t0) and its query rows
// nq.
struct GdpcChunk {
  int c, t0, r0, first, nq;
  __device__ __forceinline__ GdpcChunk(int64_t p0, int64_t L, int n, float rn, int t0_) {
    c = (int)min((int64_t)GDP_CHUNK, L - p0);
    t0 = t0_;
    r0 = (int)p0 - t0 * n;
    first = n - 1 - r0;
    nq = first < c ? gdpc_div_small(c - 1 - first, rn) + 1 : 0;
  }
};

// Queries and keys. The chunked bf16 kernels take them as two base pointers `qb`, `kb` and a
// flag `split`:
//   split = 0: the packed qk [B, T, n+1, H, K]; qb = qk, kb = qk + H·K (token stride (n+1)·H·K
//              for both);
//   split = r >= 1: FLA's separate q [B, T, Hk, K] (token stride Hk·K) and k [B, T·n, Hk, K]
//              (token stride n·Hk·K), read in place, with Hk = H / r key heads: value head h
//              reads key head h / r (grouped value heads; r = 1: one key head per value head).
// The part of GdpcRows that one block's chunks share: the key heads read, this value head's
// key head and the token strides. The scans build it once, not per chunk (its two divisions
// by the group size were 5% of the forward scan's instructions per chunk step).
struct GdpcHeads {
  int64_t qt, kt;          // token strides of the queries and the keys read
  int64_t qt_out, kt_out;  // token strides of their gradients
  int n, H, K, head;
  int HK, khead;  // key heads read, and the one of this value head
  float rn;       // 1 / n
  __device__ __forceinline__ GdpcHeads(int n_, float rn_, int H_, int K_, int head_, int split)
      : n(n_), H(H_), K(K_), head(head_), rn(rn_) {
    const int grp = split > 0 ? split : 1;
    HK = H_ / grp;
    khead = head_ / grp;
    qt = (int64_t)(split ? 1 : n_ + 1) * HK * K_;
    kt = (int64_t)(split ? n_ : n_ + 1) * HK * K_;
    qt_out = (int64_t)(split ? 1 : n_ + 1) * H_ * K_;
    kt_out = (int64_t)(split ? n_ : n_ + 1) * H_ * K_;
  }
};

// Row offsets of the interleaved chunk `ch` of a sequence whose first token is tok0: key row i
// (i < c) from kb, query row r (r < nq) from qb; and where the gradient kernel writes their
// gradients, per value head (dq [B, T, H, K] and dk [B, T·n, H, K] for the separate layout,
// which the op sums over each group; the packed layout's own offsets).
struct GdpcRows {
  GdpcHeads hd;  // the block's part
  int64_t tok0, t0;
  int r0;
  __device__ __forceinline__ GdpcRows(int64_t tok0_, const GdpcChunk& ch, const GdpcHeads& hd_)
      : hd(hd_), tok0(tok0_), t0(ch.t0), r0(ch.r0) {}
  __device__ __forceinline__ GdpcRows(int64_t tok0_, const GdpcChunk& ch, int n_, float rn_,
                                      int H_, int K_, int head_, int split)
      : GdpcRows(tok0_, ch, GdpcHeads(n_, rn_, H_, K_, head_, split)) {}
  __device__ __forceinline__ int64_t key(int i) const { return key_at(i, hd.kt, hd.HK, hd.khead); }
  // The first query row is in token t0 (r0 + first = n − 1).
  __device__ __forceinline__ int64_t query(int r) const {
    return (tok0 + t0 + r) * hd.qt + (int64_t)hd.khead * hd.K;
  }
  // Where the gradients of key row i and query row r go.
  __device__ __forceinline__ int64_t key_out(int i) const {
    return key_at(i, hd.kt_out, hd.H, hd.head);
  }
  __device__ __forceinline__ int64_t query_out(int r) const {
    return (tok0 + t0 + r) * hd.qt_out + (int64_t)hd.head * hd.K;
  }
  // Token of query row r.
  __device__ __forceinline__ int64_t query_token(int r) const { return tok0 + t0 + r; }

 private:
  __device__ __forceinline__ int64_t key_at(int i, int64_t stride, int heads, int h) const {
    const int x = r0 + i, q = gdpc_div_small(x, hd.rn);
    return (tok0 + t0 + q) * stride + (int64_t)((x - q * hd.n) * heads + h) * hd.K;
  }
};

// A thread's share of copying rows of `len` bf16 values 16 bytes at a time: column block cv of
// rows r0, r0 + rs, ... (`ok` when len is a multiple of 8 and the rows split evenly over the
// threads, so that no per-element division is needed).
struct GdpcSplit {
  int cv, r0, rs;
  bool ok;
  __device__ __forceinline__ GdpcSplit(int len, int tid, int nthr) {
    const int vpr = len >> 3;
    ok = len % 8 == 0 && vpr > 0 && nthr % vpr == 0;
    cv = ok ? tid % vpr : 0;
    r0 = ok ? tid / vpr : 0;
    rs = ok ? nthr / vpr : 1;
  }
};

// Element offset of (r, col) in a swizzled tile (ldsm.cuh) of `rows` rows.
__device__ __forceinline__ int gdpc_sw_el(int r, int col, int rows) {
  return gdp_sw_at(r, col >> 3, rows) + (col & 7);
}

// Copies rows [0, rows) of `len` bf16 values (row r at src + off(r)) into a shared tile with row
// stride ld (SW: a swizzled tile of ld rows), and zeros rows [rows, zrows). cp.async when `vec`
// (the split is ok and every row start is 16-byte aligned), plain loads otherwise. Columns
// [len, ..) are not touched.
template <bool SW = false, typename Off>
__device__ __forceinline__ void gdpc_stage_rows(__nv_bfloat16* __restrict__ dst, int ld,
                                                const __nv_bfloat16* __restrict__ src, Off off,
                                                int rows, int zrows, int len, bool vec,
                                                const GdpcSplit& sp, int tid, int nthr) {
  // The swizzled copy written out beside the padded one: with one loop and a computed offset,
  // nvcc 13.0 compiled every kernel that stages padded rows to different machine code.
  if constexpr (SW) {
    if (vec && sp.ok) {
      for (int r = sp.r0; r < zrows; r += sp.rs) {
        __nv_bfloat16* d = dst + gdpc_sw_el(r, sp.cv * 8, ld);
        if (r < rows)
          cp_async16(d, src + off(r) + sp.cv * 8);
        else
          *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
      }
    } else {
      const __nv_bfloat16 zero = __float2bfloat16_rn(0.f);
      for (int idx = tid; idx < zrows * len; idx += nthr) {
        const int r = idx / len, d = idx - r * len;
        dst[gdpc_sw_el(r, d, ld)] = r < rows ? src[off(r) + d] : zero;
      }
    }
    return;
  }
  if (vec && sp.ok) {
    for (int r = sp.r0; r < zrows; r += sp.rs) {
      __nv_bfloat16* d = dst + r * ld + sp.cv * 8;
      if (r < rows)
        cp_async16(d, src + off(r) + sp.cv * 8);
      else
        *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
    }
  } else {
    const __nv_bfloat16 zero = __float2bfloat16_rn(0.f);
    for (int idx = tid; idx < zrows * len; idx += nthr) {
      const int r = idx / len, d = idx - r * len;
      dst[r * ld + d] = r < rows ? src[off(r) + d] : zero;
    }
  }
}

// Shared offset of a thread's i-th 16-byte piece in gdpc_stage_tile's loops into a swizzled
// tile of tile_rows rows: row r0 + i RS, columns cv .. cv + 7. With RS a multiple of 8 a
// thread's rows share their swizzle, so the offsets differ by constants.
template <int RS>
__device__ __forceinline__ int gdpc_staged_at(int r0, int i, int cv, int tile_rows) {
  static_assert(RS % 8 == 0, "a thread's rows must share their swizzle phase");
  return gdp_sw_at(r0, cv >> 3, tile_rows) + i * RS * 64;
}

// gdpc_stage_rows for tiles whose row length LEN, row stride LD and thread count NTHR are known
// at compile time (LEN a multiple of 8 whose 16-byte blocks divide NTHR): thread tid copies
// column block tid mod (LEN / 8) of rows r0, r0 + RS, ... in an unrolled loop of at most
// MAXROWS / RS steps with shared-memory offsets fixed at compile time, so that a 16-byte copy
// costs little more than its cp.async (the scans' staging was ~30% of their sequential step's
// instructions through the general loop). Row r comes from src + off(r); rows [rows, zrows)
// are zeroed (zrows <= MAXROWS). Every row start must be 16-byte aligned. ZFILL: a row past
// `rows` by one zero-filling copy instead of a store on a second branch; where the compiler
// knows r < zrows (the forward scans, gdp_assume_tid) such a copy has no branch at all. (In the
// kernels without the assumption it gave no fewer branches and more instructions.) SW: into a
// swizzled tile of `tile_rows` rows (ldsm.cuh) instead of rows of stride LD.
template <int LEN, int LD, int MAXROWS, int NTHR, bool ZFILL = false, bool SW = false,
          typename Off>
__device__ __forceinline__ void gdpc_stage_tile(__nv_bfloat16* __restrict__ dst,
                                                const __nv_bfloat16* __restrict__ src, Off off,
                                                int rows, int zrows, int tid, int tile_rows = 0) {
  constexpr int VPR = LEN / 8, RS = NTHR / VPR, STEPS = (MAXROWS + RS - 1) / RS;
  static_assert(LEN % 8 == 0 && NTHR % VPR == 0, "16-byte blocks of a row must divide NTHR");
  if constexpr (SW) {
    const int cv = 8 * (tid % VPR), r0 = tid / VPR;
    src += cv;
#pragma unroll
    for (int i = 0; i < STEPS; ++i) {
      const int r = r0 + i * RS;
      __nv_bfloat16* d = dst + gdpc_staged_at<RS>(r0, i, cv, tile_rows);
      const bool copy = r < rows;
      if constexpr (ZFILL) {
        if (r < zrows) cp_async16_zfill(d, copy ? src + off(r) : src, copy);
      } else {
        if (copy) cp_async16(d, src + off(r));
        if (!copy && r < zrows) *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
      }
    }
    return;
  }
  const int cv = 8 * (tid % VPR), r0 = tid / VPR;
  dst += r0 * LD + cv;
  src += cv;
#pragma unroll
  for (int i = 0; i < STEPS; ++i) {
    const int r = r0 + i * RS;
    const bool copy = r < rows;
    if constexpr (ZFILL) {
      if (r < zrows) cp_async16_zfill(dst + i * RS * LD, copy ? src + off(r) : src, copy);
    } else {
      if (copy) cp_async16(dst + i * RS * LD, src + off(r));
      if (!copy && r < zrows)
        *reinterpret_cast<uint4*>(dst + i * RS * LD) = make_uint4(0, 0, 0, 0);
    }
  }
}

// The same for `rows` rows at a fixed source row stride (row r at src + r · stride), the row
// pointer formed once, so that each step's source is a constant or one-add offset from it.
template <int LEN, int LD, int MAXROWS, int NTHR, bool SW = false>
__device__ __forceinline__ void gdpc_stage_tile_strided(__nv_bfloat16* __restrict__ dst,
                                                        const __nv_bfloat16* __restrict__ src,
                                                        int stride, int rows, int tid,
                                                        int tile_rows = 0) {
  constexpr int VPR = LEN / 8, RS = NTHR / VPR, STEPS = (MAXROWS + RS - 1) / RS;
  static_assert(LEN % 8 == 0 && NTHR % VPR == 0, "16-byte blocks of a row must divide NTHR");
  if constexpr (SW) {
    const int cv = 8 * (tid % VPR), r0 = tid / VPR;
    src += (int64_t)r0 * stride + cv;
#pragma unroll
    for (int i = 0; i < STEPS; ++i)
      if (r0 + i * RS < rows)
        cp_async16(dst + gdpc_staged_at<RS>(r0, i, cv, tile_rows),
                   src + (int64_t)(i * RS) * stride);
    return;
  }
  const int cv = 8 * (tid % VPR), r0 = tid / VPR;
  dst += r0 * LD + cv;
  src += (int64_t)r0 * stride + cv;
#pragma unroll
  for (int i = 0; i < STEPS; ++i)
    if (r0 + i * RS < rows) cp_async16(dst + i * RS * LD, src + (int64_t)(i * RS) * stride);
}

// Copies the shared bf16 tile [ROWS][LD] out to global rows (row r at dst + r · stride), columns
// [0, ncols) (ncols a multiple of 8, dst and the rows 16-byte aligned) as 16-byte pieces, each
// 32-bit word XORed with `flip` (0x80008000 negates both bf16 values of a word exactly; 0
// copies them).
template <int LEN, int LD, int ROWS, int NTHR>
__device__ __forceinline__ void gdpc_copy_tile_out(__nv_bfloat16* __restrict__ dst, int stride,
                                                   const __nv_bfloat16* __restrict__ src,
                                                   int ncols, int tid, uint32_t flip) {
  constexpr int VPR = LEN / 8, RS = NTHR / VPR, STEPS = (ROWS + RS - 1) / RS;
  static_assert(LEN % 8 == 0 && NTHR % VPR == 0, "16-byte blocks of a row must divide NTHR");
  const int cv = 8 * (tid % VPR), r0 = tid / VPR;
  if (cv >= ncols) return;
  dst += (int64_t)r0 * stride + cv;
  src += r0 * LD + cv;
#pragma unroll
  for (int i = 0; i < STEPS; ++i)
    if (r0 + i * RS < ROWS) {
      uint4 x = *reinterpret_cast<const uint4*>(src + i * RS * LD);
      x.x ^= flip, x.y ^= flip, x.z ^= flip, x.w ^= flip;
      *reinterpret_cast<uint4*>(dst + (int64_t)(i * RS) * stride) = x;
    }
}

// Copies a warp's 16-row bf16 tile out of shared memory (element (r, col) at tile + r · LDT +
// col, chunk coordinates) to global rows (row r at dst + off(r)): rows r0 .. r0 + 15 below
// `rows`, columns c0 .. c0 + 8 PPR below `ncols` (a multiple of 8), as 16-byte pieces. The
// warp wrote the tile itself: call it after __syncwarp.
template <int PPR, int LDT, typename Off>
__device__ __forceinline__ void gdpc_warp_tile_out(__nv_bfloat16* __restrict__ dst, Off off,
                                                   const __nv_bfloat16* tile, int r0, int c0,
                                                   int rows, int ncols, int lane) {
  constexpr int PIECES = 16 * PPR;
#pragma unroll
  for (int it = 0; it < (PIECES + 31) / 32; ++it) {
    const int id = lane + 32 * it, r = r0 + id / PPR, col = c0 + 8 * (id % PPR);
    if (id < PIECES && r < rows && col < ncols)
      *reinterpret_cast<uint4*>(dst + off(r) + col) =
          *reinterpret_cast<const uint4*>(tile + r * LDT + col);
  }
}

// The operands both scans stage for a chunk: W [C][K] (row r at w + r K), its c key rows and nq
// query rows (at kb + koff[i], qb + qoff[r]; zeros to C and QR rows) into [*][KPT + 8] tiles, and
// P [QR][C] (row r at p + r C) into [QR][C + 8]; without QP (a scan with no output) W and the
// key rows only. The compile-time path when K = KPT and the rows are 16-byte aligned (vk), the
// general one otherwise. ZFILL: the gathered rows through gdpc_stage_tile's zero-filling copies
// (the forward scans with an output).
template <int KPT, int NTHR, bool QP = true, bool ZFILL = false, bool SW = false>
__device__ __forceinline__ void gdpc_stage_wkqp(
    __nv_bfloat16* W, __nv_bfloat16* Kr, __nv_bfloat16* Q, __nv_bfloat16* P,
    const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ kb,
    const __nv_bfloat16* __restrict__ qb, const __nv_bfloat16* __restrict__ p,
    const int64_t* koff, const int64_t* qoff, int c, int nq, int QR, int K, bool vk, int tid) {
  constexpr int C = GDP_CHUNK, LK = KPT + 8;
  // Row stride of the [*][KPT] tiles, or (SW) their rows.
  const int ldw = SW ? C : LK, ldq = SW ? QR : LK;
  if (vk && K == KPT) {
    gdpc_stage_tile_strided<KPT, LK, C, NTHR, SW>(W, w, KPT, C, tid, C);
    gdpc_stage_tile<KPT, LK, C, NTHR, ZFILL, SW>(Kr, kb, [&](int i) { return koff[i]; }, c, C,
                                                 tid, C);
    if constexpr (QP)
      gdpc_stage_tile<KPT, LK, C, NTHR, ZFILL, SW>(Q, qb, [&](int r) { return qoff[r]; }, nq, QR,
                                                   tid, QR);
  } else {
    const GdpcSplit sp(K, tid, NTHR);
    gdpc_stage_rows<SW>(W, ldw, w, [&](int r) { return (int64_t)r * K; }, C, C, K, vk, sp, tid,
                        NTHR);
    gdpc_stage_rows<SW>(Kr, ldw, kb, [&](int i) { return koff[i]; }, c, C, K, vk, sp, tid, NTHR);
    if constexpr (QP)
      gdpc_stage_rows<SW>(Q, ldq, qb, [&](int r) { return qoff[r]; }, nq, QR, K, vk, sp, tid,
                          NTHR);
  }
  if constexpr (QP) gdpc_stage_tile_strided<C, C + 8, C, NTHR, SW>(P, p, C, QR, tid, QR);
}

// Per-chunk geometry kept in shared memory next to a chunk's row table, so that it is worked out
// once per chunk (in fill_table) and not again where the chunk is staged and computed: rows c,
// query rows nq, token of query row 0 within the sequence.
struct GdpcMeta {
  int c, nq, tq0;
};

// Zeros columns [c0, c1) of rows [0, rows) of a shared bf16 tile.
__device__ __forceinline__ void gdpc_zero_cols(__nv_bfloat16* dst, int ld, int rows, int c0,
                                               int c1, int tid, int nthr) {
  const int w = c1 - c0;
  if (w <= 0) return;
  for (int idx = tid; idx < rows * w; idx += nthr)
    dst[(idx / w) * ld + c0 + idx % w] = __float2bfloat16_rn(0.f);
}

// gdpc_zero_cols on a swizzled tile (ldsm.cuh) of `rows` rows.
__device__ __forceinline__ void gdpc_zero_cols_sw(__nv_bfloat16* dst, int rows, int c0, int c1,
                                                  int tid, int nthr) {
  const int w = c1 - c0;
  if (w <= 0) return;
  for (int idx = tid; idx < rows * w; idx += nthr)
    dst[gdpc_sw_el(idx / w, c0 + idx % w, rows)] = __float2bfloat16_rn(0.f);
}

// Stores a bf16 pair (cols col, col + 1 of a row; the second only when col + 1 < ncols).
// Stores an f32 pair (cols col, col + 1 of a row; the second only when col + 1 < ncols), as one
// 8-byte store where both fit and the address is 8-byte aligned (rows of an odd width are not).
__device__ __forceinline__ void gdpc_store_pair(float* row, int col, int ncols, float x0,
                                                float x1) {
  if (col + 1 < ncols && (reinterpret_cast<uintptr_t>(row + col) & 7) == 0) {
    *reinterpret_cast<float2*>(row + col) = make_float2(x0, x1);
  } else {
    if (col < ncols) row[col] = x0;
    if (col + 1 < ncols) row[col + 1] = x1;
  }
}

__device__ __forceinline__ void gdpc_store_pair(__nv_bfloat16* row, int col, int ncols, float x0,
                                                float x1, bool vec) {
  if (vec && col + 1 < ncols) {
    *reinterpret_cast<__nv_bfloat162*>(row + col) = __floats2bfloat162_rn(x0, x1);
  } else {
    if (col < ncols) row[col] = __float2bfloat16_rn(x0);
    if (col + 1 < ncols) row[col + 1] = __float2bfloat16_rn(x1);
  }
}

// Readiness of the WY factors for a scan running beside the WY kernel, counted per group of
// GDPC_READY_GROUP consecutive chunks of one sequence and one head: counter
// gdpc_ready_index(cbase, s, ci) * H + head (cbase: the sequence's first chunk, s: its index,
// ci: the chunk's index within it; unique per group, below (chunks / G + N + 1) * H). The
// writer: every thread's global stores fenced at device scope, the block's barrier, then one
// release add. The reader (one thread, before the block's barrier that precedes the copies, once
// per group): acquire loads until the group is complete, with a back-off; after 10 s it traps
// (an error instead of a hang: the launcher runs the two side by side only where the scan
// leaves most multiprocessors to the WY kernel). One acquire per group instead of per chunk:
// an acquire is a round trip on the scan's sequential path.
#define GDPC_READY_GROUP 8
__host__ __device__ __forceinline__ int64_t gdpc_ready_index(int cbase, int s, int ci) {
  return (int64_t)(cbase / GDPC_READY_GROUP) + s + ci / GDPC_READY_GROUP;
}
__device__ __forceinline__ void gdpc_signal_ready(int* counter, int tid) {
#ifdef GDP_EMU
  if (tid == 0) __atomic_fetch_add(counter, 1, __ATOMIC_RELEASE);
#else
  __threadfence();
  __syncthreads();
  if (tid == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
#endif
}
__device__ __forceinline__ void gdpc_wait_ready(const int* counter, int count) {
#ifdef GDP_EMU
  assert(__atomic_load_n(counter, __ATOMIC_ACQUIRE) == count);  // the emulation runs WY first
#else
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
  if (v >= count) return;
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (unsigned ns = 32;; ns = min(2 * ns, 1024u)) {
    __nanosleep(ns);
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(counter) : "memory");
    if (v >= count) return;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > 10000000000ull) __trap();
  }
#endif
}

// ----------------------------------------------------------------------------------------------
// Kernel 1: WY factors of every chunk.

// Whether p may be read or written 16 bytes at a time (cp.async, uint4): a 16-byte aligned
// address.
__device__ __forceinline__ bool gdpc_aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}
// Whether the rows of q and k can be copied 16 bytes at a time.
__device__ __forceinline__ bool gdpc_qk_vec(const __nv_bfloat16* qb, const __nv_bfloat16* kb,
                                            int K) {
  return K % 8 == 0 && gdpc_aligned16(qb) && gdpc_aligned16(kb);
}

// Stages rows [0, rows) of `len` bf16 values (row r at src + off(r)) into a shared tile of row
// stride LD and zeros rows [rows, zrows) (zrows <= MAXROWS), on NT threads (tid < NT): through
// gdpc_stage_tile, whose offsets are fixed at compile time, where the rows are exactly LEN wide
// and 16-byte aligned (`vec`), else through gdpc_stage_rows (whose index arithmetic was a
// quarter of the gradient kernel's instructions).
template <int LEN, int LD, int MAXROWS, int NT, typename Off>
__device__ __forceinline__ void gdpc_stage_fixed(__nv_bfloat16* __restrict__ dst,
                                                 const __nv_bfloat16* __restrict__ src, Off off,
                                                 int rows, int zrows, int len, bool vec,
                                                 int tid) {
  if (vec && len == LEN) {
    gdpc_stage_tile<LEN, LD, MAXROWS, NT>(dst, src, off, rows, zrows, tid);
  } else {
    const GdpcSplit sp(len, tid, NT);
    gdpc_stage_rows(dst, LD, src, off, rows, zrows, len, vec, sp, tid, NT);
  }
}

// gdpc_stage_fixed for the WY kernel, whose row stride ld is known at run time: the tile copies
// for rows of 64 or 128 values (ld 72 or 136), the general copy otherwise.
template <typename Off>
__device__ __forceinline__ void gdpc_stage_wy(__nv_bfloat16* __restrict__ dst, int ld,
                                              const __nv_bfloat16* __restrict__ src, Off off,
                                              int rows, int zrows, int len, bool vec,
                                              int tid) {
  constexpr int C = GDP_CHUNK, NT = GDPC_THREADS;
  if (ld == 136) {
    gdpc_stage_fixed<128, 136, C, NT>(dst, src, off, rows, zrows, len, vec, tid);
  } else if (ld == 72) {
    gdpc_stage_fixed<64, 72, C, NT>(dst, src, off, rows, zrows, len, vec, tid);
  } else {
    const GdpcSplit sp(len, tid, NT);
    gdpc_stage_rows(dst, ld, src, off, rows, zrows, len, vec, sp, tid, NT);
  }
}

__device__ __forceinline__ void gdp_fwd_wy_bf16_impl(
    const __nv_bfloat16* __restrict__ qb, const __nv_bfloat16* __restrict__ kb, int split,
    const __nv_bfloat16* __restrict__ vv, const float* __restrict__ aux,
    const int* __restrict__ table, __nv_bfloat16* __restrict__ wg, __nv_bfloat16* __restrict__ ug,
    __nv_bfloat16* __restrict__ pg, float* __restrict__ cg, __nv_bfloat16* __restrict__ ag, int B,
    int TT, int H, int K, int V, int n, int N, float scale, const int* __restrict__ order,
    int* __restrict__ ready) {
  constexpr int C = GDP_CHUNK;
  const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31, warp = tid >> 5;
  // With an order: a 1-D grid, block x = (order[x / H], x mod H), so that the blocks (started in
  // the order of x) take the chunks time-major across heads too.
  const int chunk = order != nullptr ? order[blockIdx.x / H] : blockIdx.x;
  const int head = order != nullptr ? blockIdx.x % H : blockIdx.y;
  const int sidx = table[4 * N + 2 * chunk], ci = table[4 * N + 2 * chunk + 1];
  const int seq_b = table[4 * sidx], seq_start = table[4 * sidx + 1], seq_len = table[4 * sidx + 2];
  const int64_t tok0 = (int64_t)seq_b * TT + seq_start;
  const int64_t L = (int64_t)seq_len * n;
  const int64_t p0 = (int64_t)ci * C;
  const float rn = 1.f / (float)n;
  const GdpcChunk ch(p0, L, n, rn, (int)p0 / n);
  const int c = ch.c, first = ch.first, nq = ch.nq;
  const int mq = (nq + 15) / 16;  // 16-row tiles of query rows
  const int64_t BTH = (int64_t)B * TT * H;
  const int KP = (K + 15) & ~15, VP = (V + 15) & ~15;
  const int LK = KP + 8, LV = VP + 8;  // bf16 row strides
  const bool vk = gdpc_qk_vec(qb, kb, K);
  const bool vvec = (V % 8 == 0) && gdpc_aligned16(vv);
  const GdpcRows rows(tok0, ch, n, rn, H, K, head, split);

  constexpr int CS = GDP_INV_LD;  // f32 row stride of A and its inverse
  extern __shared__ __align__(16) unsigned char gdpc_smem[];
  // [C][CS] A (zero where read outside strict lower c x c), then in place (I + A)^-1.
  float* A = reinterpret_cast<float*>(gdpc_smem);
  float* G = A + C * CS;                             // [C]     gate cumsum (hi)
  float* Gl = G + C;                                 // [C]     its rounding error
  float* Bt = Gl + C;                                // [C]     beta
  float* Eg = Bt + C;                                // [C]     e^G
  float* sk = Eg + C;                                // [C]     β e^G (0 past c): W's column scale
  float* sv = sk + C;                                // [C]     β (0 past c): U's column scale
  __nv_bfloat16* Ks = reinterpret_cast<__nv_bfloat16*>(sv + C);  // [C][LK] K
  __nv_bfloat16* QV = Ks + C * LK;  // [C][max(LK, LV)] Q (query rows), then V

  // ---- Stage K and Q; gates and betas meanwhile.
  gdpc_stage_wy(Ks, LK, kb, [&](int i) { return rows.key(i); }, c, C, K, vk, tid);
  gdpc_stage_wy(QV, LK, qb, [&](int r) { return rows.query(r); }, nq, 16 * mq, K, vk, tid);
  cp_async_commit();
  gdpc_zero_cols(Ks, LK, C, K, KP, tid, nthr);
  gdpc_zero_cols(QV, LK, 16 * mq, K, KP, tid, nthr);
  for (int i = tid; i < c; i += nthr) {
    const int x = rows.r0 + i;  // row i counted from the token of row 0 (32-bit: no int64 div)
    G[i] = (x % n == 0) ? aux[(tok0 + rows.t0 + x / n) * H + head] : 0.f;
    Bt[i] = aux[BTH + ((tok0 * n + p0 + i) * H + head)];
  }
  __syncthreads();
  if (warp == 0) gdpb_cumsum_warp(G, Gl, c, lane);
  cp_async_wait<0>();
  __syncthreads();
  for (int i = tid; i < C; i += nthr) {
    Eg[i] = i < c ? expf(G[i] + Gl[i]) : 0.f;
    sk[i] = i < c ? Bt[i] * Eg[i] : 0.f;
    sv[i] = i < c ? Bt[i] : 0.f;
  }

  // ---- A = strict_lower(β_i (k_i·k_j) dec_ij) (warp w: rows 16 w.., the w + 1 16-column
  // pairs up to its diagonal) and P = scale (q_r·k_j) dec(i_r, j) (query tile mq − 1 − w on
  // warp w, the pairs up to its last row's diagonal: the long query tiles go to the warps with
  // short A rows).
  const int64_t slot = (int64_t)chunk * H + head;
  __nv_bfloat16* pm = pg + slot * C * C;
  const int g = lane >> 2, t = lane & 3;
  for (int pass = 0; pass < 2; ++pass) {
    const bool is_p = pass == 1;
    if (is_p && warp >= mq) break;
    const int m0 = 16 * (is_p ? mq - 1 - warp : warp);
    const int npairs =
        is_p ? (first + (min(m0 + 15, nq - 1)) * n) / 16 + 1 : warp + 1;  // 16-column pairs
    const __nv_bfloat16* a_src = is_p ? QV : Ks;
    float acc[8][4] = {};
    for (int k0 = 0; k0 < KP; k0 += 16) {
      uint32_t a[4];
      ldsm_a(a, a_src, LK, m0, k0, lane);
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        if (p < npairs) {
          uint32_t b[2][2];
          ldsm_b_nk(b, Ks, LK, k0, 16 * p, lane);
          MmaBf16::mma(acc[2 * p], a, b[0]);
          MmaBf16::mma(acc[2 * p + 1], a, b[1]);
        }
      }
    }
    // This thread's two rows: the decay's row index, its gate cumsum and the row scale, held
    // in registers (the stores to A below would otherwise reload them for every element).
    int ri[2];
    bool ok[2];
    float gi[2], gli[2], si[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = m0 + g + 8 * h;
      ok[h] = is_p ? i < nq : i < c;
      ri[h] = is_p ? min(first + i * n, C - 1) : i;
      gi[h] = G[ri[h]];
      gli[h] = Gl[ri[h]];
      si[h] = is_p ? scale : Bt[i];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      // P: every column (zeros past the pairs computed); A: the pairs up to the diagonal.
      if (is_p || j < 2 * npairs) {
        const int col = 8 * j + 2 * t;
        const float2 gj = *reinterpret_cast<const float2*>(G + col);
        const float2 glj = *reinterpret_cast<const float2*>(Gl + col);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i = m0 + g + 8 * h;
          float x[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int jj = col + e;
            // Select before exponentiating (pitfall P4): the argument is <= 0 for jj <= ri.
            const float dec =
                jj <= ri[h] ? expf((gi[h] - (e ? gj.y : gj.x)) + (gli[h] - (e ? glj.y : glj.x)))
                            : 0.f;
            const float a = acc[j][2 * h + e];
            if (is_p)
              x[e] = (ok[h] && jj < c) ? a * (si[h] * dec) : 0.f;
            else
              x[e] = (ok[h] && jj < i) ? (a * si[h]) * dec : 0.f;
          }
          if (is_p)
            *reinterpret_cast<__nv_bfloat162*>(pm + i * C + col) =
                __floats2bfloat162_rn(x[0], x[1]);
          else
            *reinterpret_cast<float2*>(A + i * CS + col) = make_float2(x[0], x[1]);
        }
      }
    }
  }
  // Rows of P past the query tiles, up to the rows the scans stage (`query_rows` in
  // src/op/cuda/plan.rs: the 16-row tiles of ceil(64 / n)), which they read as zeros; no kernel
  // reads the rows past those.
  const int staged_rows = 16 * (((C + n - 1) / n + 15) / 16);
  for (int idx = tid; idx < (staged_rows - 16 * mq) * C / 8; idx += nthr)
    reinterpret_cast<uint4*>(pm + 16 * mq * C)[idx] = make_uint4(0, 0, 0, 0);
  __syncthreads();

  // ---- V into QV (Q is no longer read) while the inverse runs.
  gdpc_stage_wy(
      QV, LV, vv, [&](int i) { return ((tok0 * n + p0 + i) * H + head) * (int64_t)V; }, c, C, V,
      vvec, tid);
  cp_async_commit();
  gdpc_zero_cols(QV, LV, C, V, VP, tid, nthr);
  tri_inverse64(A, tid);
  const float* Ai = A;
  cp_async_wait<0>();
  __syncthreads();
  if (ag != nullptr) {  // bf16(Ainv) for the backward (gdp_bwd_chunked.cuh)
    __nv_bfloat16* a = ag + slot * C * C;
    for (int idx = tid; idx < C * C / 2; idx += nthr) {
      const int i = idx / (C / 2), j = 2 * (idx % (C / 2));
      *reinterpret_cast<__nv_bfloat162*>(a + i * C + j) =
          __floats2bfloat162_rn(Ai[i * CS + j], Ai[i * CS + j + 1]);
    }
  }

  // ---- W = Ainv diag(β e^G) K [C, K], U = Ainv diag(β) V [C, V]: warp w rows 16 w.., the
  // column scales folded into the A fragments (the inverse rounded to bf16 once, scaled). Both
  // products' fragments are taken first, so that the inverse's tile is free for the output:
  // each warp writes a 16 x 64 tile of W or U there (its own rows: no block barrier) and copies
  // it out in 16-byte rows, four stores per lane, instead of 4-byte pairs (64 per thread).
  {
    const int m0 = 16 * warp;
    uint32_t a[2][4][4];
#pragma unroll
    for (int pass = 0; pass < 2; ++pass)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float* scl = pass == 1 ? sv : sk;
          const int row = m0 + g + ((r & 1) ? 8 : 0), col = 16 * ks + 2 * t + ((r & 2) ? 8 : 0);
          const float2 x = *reinterpret_cast<const float2*>(Ai + row * CS + col);
          a[pass][ks][r] = MmaBf16::pack(x.x * scl[col], x.y * scl[col + 1]);
        }
    __syncthreads();  // every warp's fragments taken: the inverse's tile is free
    constexpr int LO = 72;  // bf16 row stride of a warp's output tile (conflict-free writes)
    __nv_bfloat16* tile = reinterpret_cast<__nv_bfloat16*>(A) + warp * 16 * LO;
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
      const bool is_u = pass == 1;
      const int D = is_u ? V : K, DP = is_u ? VP : KP, ld = is_u ? LV : LK;
      const __nv_bfloat16* bsrc = is_u ? QV : Ks;
      __nv_bfloat16* dst = (is_u ? ug : wg) + (slot * C + m0) * D;
      const bool vst = (D % 2 == 0);
      const bool rows16 = (D % 8 == 0) && gdpc_aligned16(dst);
      for (int n0 = 0; n0 < DP; n0 += 64) {
        float acc[8][4] = {};
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            if (n0 + 16 * p < DP) {
              uint32_t b[2][2];
              ldsm_b_kn(b, bsrc, ld, 16 * ks, n0 + 16 * p, lane);
              MmaBf16::mma(acc[2 * p], a[pass][ks], b[0]);
              MmaBf16::mma(acc[2 * p + 1], a[pass][ks], b[1]);
            }
          }
        }
        if (!rows16) {
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int i = g + 8 * h, col = n0 + 8 * j + 2 * t;
              gdpc_store_pair(dst + (int64_t)i * D, col, D, acc[j][2 * h], acc[j][2 * h + 1],
                              vst);
            }
          continue;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            *reinterpret_cast<__nv_bfloat162*>(tile + (g + 8 * h) * LO + 8 * j + 2 * t) =
                __floats2bfloat162_rn(acc[j][2 * h], acc[j][2 * h + 1]);
        __syncwarp();
        // 16 rows x 8 pieces of 8 columns; the last tile may end inside a piece (D % 8 == 0:
        // pieces are whole or past D).
#pragma unroll
        for (int it = 0; it < 4; ++it) {
          const int id = lane + 32 * it, r = id >> 3, col = n0 + 8 * (id & 7);
          if (col < D)
            *reinterpret_cast<uint4*>(dst + (int64_t)r * D + col) =
                *reinterpret_cast<const uint4*>(tile + r * LO + (col - n0));
        }
        __syncwarp();  // the tile is read before the next one overwrites it
      }
    }
  }

  float* cf = cg + slot * 3 * C;
  for (int i = tid; i < C; i += nthr) {
    cf[i] = i < nq ? scale * Eg[first + i * n] : 0.f;
    cf[C + i] = i < c ? expf(gdpb_gdiff(G, Gl, c - 1, i)) : 0.f;
    cf[2 * C + i] = i == 0 ? Eg[c - 1] : 0.f;
  }
  if (ready != nullptr)
    gdpc_signal_ready(ready + gdpc_ready_index(table[4 * sidx + 3], sidx, ci) * H + head, tid);
}

extern "C" __global__ void __launch_bounds__(GDPC_THREADS)
    gdp_fwd_wy_bf16(GDP_KERNEL_PARAMS(GDP_WY_FIELDS, _)) {
  gdp_fwd_wy_bf16_impl(q, k, split, v, aux, table, w, u, p, coef, ainv, batch, tokens, heads, dk,
                       dv, n, nseq, scale, order, ready);
}

// ----------------------------------------------------------------------------------------------
// Kernel 2: the state scan and the output. Template: BV value columns per block (16, 32, 64),
// KPT the key dimension padded to 64, 128 or 256 (a compile-time k loop; columns past K are
// zero), NW warps (4 for BV = 16, else 8). Warp w computes Delta and the output for the rows of
// 16-row tile w % 4 and the value columns of its half (NW = 8) of the block, and owns the state
// rows of tiles w, w + NW, ... (all BV columns) in registers.

// Shared memory of one stage buffer (bytes); QR query rows per chunk.
__host__ __device__ constexpr int gdpc_stage_bytes(int KP, int QR, int BV) {
  return 2 * ((64 + 64 + QR) * (KP + 8) + QR * 72 + 64 * (BV + 8)) + 4 * 3 * 64;
}

// Shared memory of the forward scan (bytes): NS stage buffers, the bf16 state twice, bf16 Delta
// twice (Dn, Dk), and NS chunks' row tables (64 key and 64 query row offsets) and geometry.
__host__ __device__ constexpr int gdpc_scan_smem_bytes(int KP, int QR, int BV, int NS) {
  return NS * gdpc_stage_bytes(KP, QR, BV) + 2 * 2 * KP * (BV + 8) + 2 * 2 * 64 * (BV + 8) +
         8 * NS * 2 * 64 + 12 * NS;
}

// Copies rows 0 .. K - 1, columns 0 .. bv - 1 of a bf16 state tile in shared memory (row r at
// sb + r (BV + 8)) to global rows of stride V (row r at dst + r V): 16-byte pieces when the
// columns allow it (vu), else element by element. Every thread of the block takes part.
template <int BV>
__device__ __forceinline__ void gdpc_store_state(__nv_bfloat16* dst,
                                                 const __nv_bfloat16* sb, int K, int V, int bv,
                                                 bool vu, int tid, int nthr) {
  constexpr int LB = BV + 8;
  if (vu) {
    constexpr int VPR = BV / 8;
    for (int idx = tid; idx < K * VPR; idx += nthr) {
      const int r = idx / VPR, c8 = 8 * (idx - r * VPR);
      if (c8 < bv)
        *reinterpret_cast<uint4*>(dst + (int64_t)r * V + c8) =
            *reinterpret_cast<const uint4*>(sb + r * LB + c8);
    }
  } else {
    for (int idx = tid; idx < K * BV; idx += nthr) {
      const int r = idx / BV, col = idx - r * BV;
      if (col < bv) dst[(int64_t)r * V + col] = sb[r * LB + col];
    }
  }
}

// gdpc_store_state for NTHR threads with the 16-byte copy unrolled at compile time when K = KPT
// and the columns allow it (the loop over K costs 86 instructions per warp and step at B1 T32768
// BV 32). The states-only kernels and the state-gradient scan use it (6–8% faster); the forward
// scans with an output keep the loop, which their code generation favours by 1.5–3%.
template <int BV, int KPT, int NTHR>
__device__ __forceinline__ void gdpc_store_state_tile(__nv_bfloat16* dst,
                                                      const __nv_bfloat16* sb, int K, int V,
                                                      int bv, bool vu, int tid) {
  if (vu && K == KPT)
    gdpc_copy_tile_out<BV, BV + 8, KPT, NTHR>(dst, V, sb, bv, tid, 0u);
  else
    gdpc_store_state<BV>(dst, sb, K, V, bv, vu, tid, NTHR);
}

// One stage buffer of the forward scans at `base`: a chunk's operands, QR query rows. In the
// scans with SW, W, the key rows, the query rows and P are swizzled tiles (ldsm.cuh) at the start
// of their allocations, which keep the padded rows' sizes (the host's `scan_smem_bytes` gives the
// same total). Every tile's offset in the stage, and the stage size, are multiples of 128 bytes,
// as the swizzle's bank pattern needs (the scans declare no static shared memory, so dynamic
// memory starts at 0).
template <int KPT, int BV>
struct GdpcStage {
  static constexpr int C = GDP_CHUNK, LK = KPT + 8, LC = C + 8, LB = BV + 8;
  __nv_bfloat16 *W, *Kr, *Q, *P, *U;
  float* cf;
  __device__ __forceinline__ GdpcStage(unsigned char* base, int QR) {
    W = reinterpret_cast<__nv_bfloat16*>(base);  // [C][LK]
    Kr = W + C * LK;                              // [C][LK]  key rows
    Q = Kr + C * LK;                              // [QR][LK] query rows
    P = Q + QR * LK;                              // [QR][LC]
    U = P + QR * LC;                              // [C][LB]  U slice
    cf = reinterpret_cast<float*>(U + C * LB);    // [3][C]
  }
};

// acc[2 p + j] += A[m0 .. m0 + 16, 0 .. KD) B[0 .. KD, n0 + 16 p + 8 j ..) for p < NP, j < 2:
// A row-major in shared memory (ldmatrix; SW: a swizzled tile of lda rows), B row-major [k][n]
// (ldmatrix.trans), bf16 operands.
template <int KD, int NP, bool SW = false>
__device__ __forceinline__ void gdpc_mma_kn(float (&acc)[2 * NP][4], const __nv_bfloat16* A,
                                            int lda, int m0, const __nv_bfloat16* B, int ldb,
                                            int n0, int lane) {
#pragma unroll
  for (int k0 = 0; k0 < KD; k0 += 16) {
    uint32_t a[4];
    if constexpr (SW)
      ldsm_a_sw(a, A, lda, m0, k0, lane);
    else
      ldsm_a(a, A, lda, m0, k0, lane);
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      uint32_t b[2][2];
      ldsm_b_kn(b, B, ldb, k0, n0 + 16 * p, lane);
      MmaBf16::mma(acc[2 * p], a, b[0]);
      MmaBf16::mma(acc[2 * p + 1], a, b[1]);
    }
  }
}

// The forward scan of one (sequence, head, BV value columns) block over the chunks: the state
// in registers, each chunk's operands staged NS - 1 chunks ahead. OUT = false compiles the
// states-only kernel (`gdp_fwd_states_bf16_*`: no output, launched with QR = 0, so that a stage
// holds W, the key rows, U and the coefficients only), which the backward's states rerun and
// context parallelism's final-state summaries run. SW: W, the key rows, the query rows and P in
// swizzled tiles (ldsm.cuh), else in rows padded by 8 values (GdpcStage): a choice per kernel,
// by measurement (GDPC_SCAN_ENTRY below).
template <int BV, int KPT, int NW, bool OUT, bool SW>
__device__ __forceinline__ void gdp_fwd_scan_bf16_impl(
    const __nv_bfloat16* __restrict__ qb, const __nv_bfloat16* __restrict__ kb, int split,
    const float* __restrict__ aux, const int* __restrict__ table, const __nv_bfloat16* __restrict__ wg,
    const __nv_bfloat16* __restrict__ ug, const __nv_bfloat16* __restrict__ pg,
    const float* __restrict__ cg, const float* __restrict__ h0_override, int use_h0_override,
    float* __restrict__ out, __nv_bfloat16* __restrict__ outb, float* __restrict__ fin,
    __nv_bfloat16* __restrict__ hs, __nv_bfloat16* __restrict__ dn, int B, int TT, int H, int K,
    int V, int VU, int wide_from, int wide_to, int n, int has_h0, int QR, int NS,
    const int* __restrict__ ready) {
  constexpr int C = GDP_CHUNK, NT = BV / 8, LB = BV + 8, LK = KPT + 8;
  // The [*][KPT] tiles' and P's row strides, or (SW) their rows.
  const int ldw = SW ? C : LK, ldq = SW ? QR : LK, ldp = SW ? QR : C + 8;
  constexpr int NTW = NT * 4 / NW, NPW = NTW / 2;  // n8 tiles / pairs of a warp's column half
  constexpr int MT = KPT / 16, STW = (MT + NW - 1) / NW;  // state tiles, per warp
  static_assert(NPW >= 1, "a warp's column range must hold a pair of n8 tiles");
  const int tid = threadIdx.x, nthr = blockDim.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int mi = warp & 3, nc0 = (warp >> 2) * 8 * NTW;  // Delta / output tile, column offset
  const int sidx = blockIdx.x / H, head = blockIdx.x % H;
  const int v0 = blockIdx.y * BV;
  // The forward scans with an output: the block's NW warps told to the compiler. (The same
  // assumption in the staging helpers of every scan took 2-4% off the BV 32 forward scan at B1
  // and slowed the states-only kernels and the state-gradient scan.)
  if constexpr (OUT) gdp_assume_tid(tid, NW * 32);
  const int bv = min(BV, V - v0);
  // U holds the first VU value columns (rows of VU elements); the block's columns past them
  // read as zero (a context-parallel rank's scan on [U | 0_K]), and only the sequences
  // [wide_from, wide_to) want them: the others' blocks there have nothing to do.
  const int bu = max(0, min(bv, VU - v0));
  if (bu == 0 && (sidx < wide_from || sidx >= wide_to)) return;
  const int seq_b = table[4 * sidx], seq_start = table[4 * sidx + 1], seq_len = table[4 * sidx + 2];
  const int cbase = table[4 * sidx + 3];
  const int64_t tok0 = (int64_t)seq_b * TT + seq_start;
  const int64_t L = (int64_t)seq_len * n;
  const int nch = (int)((L + C - 1) / C);
  const float rn = 1.f / (float)n;
  const double rnd = 1.0 / (double)n;
  const int64_t BTH = (int64_t)B * TT * H;
  const int64_t KV = (int64_t)K * V;
  const int64_t state_off = ((int64_t)sidx * H + head) * KV;
  const bool vk = gdpc_qk_vec(qb, kb, K);
  const bool vu = (V % 8 == 0) && (bv % 8 == 0);
  const bool vuu = (VU % 8 == 0) && (bu % 8 == 0);  // U's rows 16 bytes at a time
  // Delta and the output leave through shared memory as 16-byte row pieces.
  const bool dn_rows = dn != nullptr && vu && gdpc_aligned16(dn);
  const bool o_rows = OUT && outb != nullptr && vu && gdpc_aligned16(outb);

  extern __shared__ __align__(16) unsigned char gdpcs_smem[];
  const int stage_bytes = gdpc_stage_bytes(KPT, QR, BV);
  __nv_bfloat16* Sb = reinterpret_cast<__nv_bfloat16*>(gdpcs_smem + NS * stage_bytes);  // [2][KPT][LB]
  __nv_bfloat16* Dn = Sb + 2 * KPT * LB;  // [C][LB] bf16(Delta)
  __nv_bfloat16* Dk = Dn + C * LB;       // [C][LB] bf16(coef_k ⊙ Delta)
  using Stage = GdpcStage<KPT, BV>;
  auto stage = [&](int s) { return Stage(gdpcs_smem + s * stage_bytes, QR); };

  // Element offsets into kb and qb of the key and query rows of chunk ci (-1 past its rows) and the
  // chunk's geometry, NS chunks' worth: chunk ci's in slot ci % NS, which is also the stage its
  // operands are copied into.
  int64_t* tables = reinterpret_cast<int64_t*>(Dk + C * LB);  // [NS][2][C]
  GdpcMeta* meta = reinterpret_cast<GdpcMeta*>(tables + NS * 2 * C);  // [NS]
#ifdef GDP_EMU
  assert(reinterpret_cast<unsigned char*>(meta + NS) - gdpcs_smem ==
         gdpc_scan_smem_bytes(KPT, QR, BV, NS));
#endif
  const GdpcHeads heads_of(n, rn, H, K, head, split);
  auto fill_table = [&](int ci, int slot_of) {
    int64_t* koff = tables + slot_of * 2 * C;
    int64_t* qoff = koff + C;
    const int64_t p0 = (int64_t)ci * C;
    const GdpcChunk ch(p0, L, n, rn, gdpc_div_row(p0, rnd));
    const GdpcRows rows(tok0, ch, heads_of);
    for (int i = tid; i < C; i += nthr) {
      koff[i] = i < ch.c ? rows.key(i) : -1;
      qoff[i] = i < ch.nq ? rows.query(i) : -1;
    }
    if (tid == 0) meta[slot_of] = GdpcMeta{ch.c, ch.nq, ch.t0};
  };
  const GdpcSplit sp_u(bu, tid, nthr);
  const GdpcSplit sp_z(bv - bu, tid, nthr);  // the columns [bu, bv) as 16-byte pieces
  const bool zero16 = sp_z.ok && bu % 8 == 0;
  // Issues the copies of chunk ci into stage s (one cp.async group; its slot's row table and
  // geometry are ready).
  auto prefetch = [&](int ci, int s) {
    const Stage st = stage(s);
    const GdpcMeta m = meta[s];
    const int c = m.c, nq = m.nq;
    const int64_t* koff = tables + s * 2 * C;
    const int64_t* qoff = koff + C;
    const int64_t slot = (int64_t)(cbase + ci) * H + head;
    const __nv_bfloat16* u = ug + slot * C * VU + v0;
    gdpc_stage_wkqp<KPT, NW * 32, OUT, OUT, SW>(st.W, st.Kr, st.Q, st.P, wg + slot * C * K, kb,
                                                qb, pg + slot * C * C, koff, qoff, c, nq, QR, K,
                                                vk, tid);
    // Columns [bu, bv) of the block's own are zero: the output, staged through the U tile,
    // wrote them at the previous chunk of this stage (past bv nothing is read into a column
    // below bv: the columns are independent).
    if (zero16) {
      for (int r = sp_z.r0; r < C; r += sp_z.rs)
        *reinterpret_cast<uint4*>(st.U + r * LB + bu + 8 * sp_z.cv) = make_uint4(0, 0, 0, 0);
    } else if (bu < bv) {
      gdpc_zero_cols(st.U, LB, C, bu, bv, tid, nthr);
    }
    if (bu == 0) {
    } else if (vuu && bu == BV) {
      gdpc_stage_tile_strided<BV, LB, C, NW * 32>(st.U, u, VU, C, tid);
    } else if (vuu) {
      gdpc_stage_rows(st.U, LB, u, [&](int r) { return (int64_t)r * VU; }, C, C, bu, true, sp_u,
                      tid, nthr);
    } else {
      for (int idx = tid; idx < C * bu; idx += nthr) {
        const int r = idx / bu, col = idx - r * bu;
        st.U[r * LB + col] = u[(int64_t)r * VU + col];
      }
    }
    for (int i = tid; i < 3 * C / 4; i += nthr) cp_async16(st.cf + 4 * i, cg + slot * 3 * C + 4 * i);
    cp_async_commit();
  };
  // ---- Initial state: registers (rows 16 (w + NW s) + g (+8), cols 8 j + 2 t (+1)) and Sb[0].
  float S[STW][NT][4];
  {
    const float* h0 = nullptr;
    if (use_h0_override)
      h0 = h0_override + state_off;
    else if (has_h0)
      h0 = aux + BTH * (1 + n) + state_off;
#pragma unroll
    for (int s = 0; s < STW; ++s)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = 16 * (warp + NW * s) + g + (e >= 2 ? 8 : 0), col = 8 * j + 2 * t + (e & 1);
          S[s][j][e] = (h0 != nullptr && r < K && col < bv) ? h0[(int64_t)r * V + v0 + col] : 0.f;
        }
    // Padding columns of the operand tiles (never written by the copies) stay zero. (This loop
    // and store_sb below run under `tid < nthr`, true for every thread: written out, it changes
    // nvcc 13.0's register allocation for the whole kernel; the BV 32 forward scan no longer
    // spills, and the forward scans at BV 16 and 32 ran 7-19% faster on the H200, the
    // states-only kernels 0-4% slower.)
    for (int s = 0; s < NS && tid < nthr; ++s) {
      const Stage st = stage(s);
      if constexpr (SW) {
        gdpc_zero_cols_sw(st.W, C, K, KPT, tid, nthr);
        gdpc_zero_cols_sw(st.Kr, C, K, KPT, tid, nthr);
        gdpc_zero_cols_sw(st.Q, QR, K, KPT, tid, nthr);
      } else {
        gdpc_zero_cols(st.W, LK, C, K, KPT, tid, nthr);
        gdpc_zero_cols(st.Kr, LK, C, K, KPT, tid, nthr);
        gdpc_zero_cols(st.Q, LK, QR, K, KPT, tid, nthr);
      }
      gdpc_zero_cols(st.U, LB, C, bv, BV, tid, nthr);
    }
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
  if (tid < nthr) store_sb(Sb);
  for (int ci = 0; ci < min(NS, nch); ++ci) fill_table(ci, ci);
  // The WY factors of chunk ci, when a WY kernel computes them at the same time.
  // (thread 0: chunks below ready_to are known to be ready)
  int ready_to = 0;
  auto wait_ready = [&](int ci) {
    if (ready == nullptr || tid != 0 || ci < ready_to) return;
    const int group = ci / GDPC_READY_GROUP;
    ready_to = min(nch, (group + 1) * GDPC_READY_GROUP);
    gdpc_wait_ready(ready + gdpc_ready_index(cbase, sidx, ci) * H + head,
                    ready_to - group * GDPC_READY_GROUP);
  };
  for (int ci = 0; ci < min(NS - 1, nch); ++ci) wait_ready(ci);
  __syncthreads();
  for (int ci = 0; ci < min(NS - 1, nch); ++ci) prefetch(ci, ci);

  // sc: chunk ci's stage and table slot (ci mod NS).
  for (int ci = 0, sc = 0; ci < nch; ++ci) {
    const int cur = ci & 1;  // the bf16 state's buffer
    const Stage st = stage(sc);
    const __nv_bfloat16* sb = Sb + cur * KPT * LB;
    // Read before the barrier below, after which fill_table(ci + NS) rewrites the slot.
    const GdpcMeta m = meta[sc];
    const int nq = m.nq;
    // Chunks ci .. ci + NS - 2 are in flight (one cp.async group each): wait for chunk ci's.
    if (NS == 3 && ci + 1 < nch)
      cp_async_wait<1>();
    else
      cp_async_wait<0>();
    if (ci + NS - 1 < nch) wait_ready(ci + NS - 1);
    __syncthreads();  // chunk ci staged; chunk ci - 1 done with its stage and with Dn / Dk
    // Chunk ci + NS - 1 into the stage chunk ci - 1 used.
    const int s_prev = sc == 0 ? NS - 1 : sc - 1;
    if (ci + NS - 1 < nch) prefetch(ci + NS - 1, s_prev);
    // Row table of chunk ci + NS (its slot was last read by the prefetch of chunk ci).
    if (ci + NS < nch) fill_table(ci + NS, sc);
    if (++sc == NS) sc = 0;
    const int64_t slot = (int64_t)(cbase + ci) * H + head;
    // Where the query rows fill at most two row tiles (n >= 2), the warps of row tiles 2 and 3
    // have no output rows: they store the chunk's start state and Delta for the backward after
    // their part of the state update, off the output warps' path. (Sb[cur] is next written at
    // the end of the next step, Dn in its phase A: both after its first barrier.) At BV 64 only:
    // at BV 32 it made the B1 scan 2% slower and its stores no faster.
    const bool store_team = OUT && BV >= 64 && (out != nullptr || outb != nullptr) && nq <= 32;
    if (hs != nullptr && !store_team) {  // the chunk's start state (bf16) for the backward
      if constexpr (OUT)
        gdpc_store_state<BV>(hs + slot * KV + v0, sb, K, V, bv, vu, tid, nthr);
      else
        gdpc_store_state_tile<BV, KPT, NW * 32>(hs + slot * KV + v0, sb, K, V, bv, vu, tid);
    }

    // ---- Phase A: Delta = U - W S for rows 16 mi.., this warp's columns; into Dn and Dk.
    {
      const int m0 = 16 * mi;
      float acc[NTW][4] = {};
      gdpc_mma_kn<KPT, NPW, SW>(acc, st.W, ldw, m0, sb, LB, nc0, lane);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = m0 + g + 8 * h;
        const float ck = st.cf[C + r];
#pragma unroll
        for (int j = 0; j < NTW; ++j) {
          const int col = nc0 + 8 * j + 2 * t;
          const float2 uu = __bfloat1622float2(
              *reinterpret_cast<const __nv_bfloat162*>(st.U + r * LB + col));
          const float d0 = uu.x - acc[j][2 * h], d1 = uu.y - acc[j][2 * h + 1];
          *reinterpret_cast<__nv_bfloat162*>(Dn + r * LB + col) = __floats2bfloat162_rn(d0, d1);
          *reinterpret_cast<__nv_bfloat162*>(Dk + r * LB + col) =
              __floats2bfloat162_rn(ck * d0, ck * d1);
          if (dn != nullptr && !dn_rows)
            gdpc_store_pair(dn + (slot * C + r) * V + v0, col, bv, d0, d1, vu);
        }
      }
    }
    __syncthreads();
    // Delta for the backward (the states rerun) from Dn, whose bf16 values the pair stores
    // above would write, as 16-byte row pieces: a quarter of the store instructions.
    if (dn_rows && !store_team)
      gdpc_copy_tile_out<BV, LB, C, NW * 32>(dn + slot * C * V + v0, V, Dn, bv, tid, 0u);

    // ---- Phase B: output rows 16 mi.. (if query rows), this warp's columns; then its state.
    if (OUT && (out != nullptr || outb != nullptr) && 16 * mi < nq) {
      const int m0 = 16 * mi;
      float acc[NTW][4] = {};
      gdpc_mma_kn<KPT, NPW, SW>(acc, st.Q, ldq, m0, sb, LB, nc0, lane);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float cq = st.cf[m0 + g + 8 * h];
#pragma unroll
        for (int j = 0; j < NTW; ++j) acc[j][2 * h] *= cq, acc[j][2 * h + 1] *= cq;
      }
      gdpc_mma_kn<C, NPW, SW>(acc, st.P, ldp, m0, Dn, LB, nc0, lane);
      if (o_rows) {
        // Through this warp's rows and columns of the chunk's U slice (read in phase A only; the
        // next copy into this stage comes after the next step's barrier), then out as 16-byte
        // row pieces: a quarter of the pair stores' instructions.
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < NTW; ++j)
            *reinterpret_cast<__nv_bfloat162*>(st.U + (m0 + g + 8 * h) * LB + nc0 + 8 * j + 2 * t) =
                __floats2bfloat162_rn(acc[j][2 * h], acc[j][2 * h + 1]);
        __syncwarp();
        gdpc_warp_tile_out<NTW, LB>(
            outb, [&](int r) { return ((tok0 + m.tq0 + r) * H + head) * (int64_t)V + v0; }, st.U,
            m0, nc0, nq, bv, lane);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = m0 + g + 8 * h;
        if (r < nq && !o_rows) {
          const int64_t at = ((tok0 + m.tq0 + r) * H + head) * (int64_t)V + v0;
#pragma unroll
          for (int j = 0; j < NTW; ++j) {
            const int col = nc0 + 8 * j + 2 * t;
            const float x0 = acc[j][2 * h], x1 = acc[j][2 * h + 1];
            if (outb != nullptr) {
              gdpc_store_pair(outb + at, col, bv, x0, x1, vu);
            } else {
              gdpc_store_pair(out + at, col, bv, x0, x1);
            }
          }
        }
      }
    }
    {
      const float eglast = st.cf[2 * C];
#pragma unroll
      for (int s = 0; s < STW; ++s) {
        const int m0 = 16 * (warp + NW * s);
        if (m0 < KPT) {
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) S[s][j][e] *= eglast;
#pragma unroll
          for (int k0 = 0; k0 < C; k0 += 16) {
            uint32_t a[4];
            if constexpr (SW)
              ldsm_a_t_sw(a, st.Kr, ldw, m0, k0, lane);
            else
              ldsm_a_t(a, st.Kr, ldw, m0, k0, lane);
#pragma unroll
            for (int p = 0; p < NT / 2; ++p) {
              uint32_t b[2][2];
              ldsm_b_kn(b, Dk, LB, k0, 16 * p, lane);
              MmaBf16::mma(S[s][2 * p], a, b[0]);
              MmaBf16::mma(S[s][2 * p + 1], a, b[1]);
            }
          }
        }
      }
      store_sb(Sb + (cur ^ 1) * KPT * LB);
    }
    if (store_team && mi >= 2) {
      constexpr int TEAM = NW * 16;  // the threads of row tiles 2 and 3
      const int ttid = ((warp >> 2) * 2 + (mi - 2)) * 32 + lane;
      if (hs != nullptr) gdpc_store_state<BV>(hs + slot * KV + v0, sb, K, V, bv, vu, ttid, TEAM);
      if (dn_rows) gdpc_copy_tile_out<BV, LB, C, TEAM>(dn + slot * C * V + v0, V, Dn, bv, ttid, 0u);
    }
  }

  if (fin == nullptr) return;
  fin += state_off;
#pragma unroll
  for (int s = 0; s < STW; ++s)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = 16 * (warp + NW * s) + g + (e >= 2 ? 8 : 0), col = 8 * j + 2 * t + (e & 1);
        if (r < K && col < bv) fin[(int64_t)r * V + v0 + col] = S[s][j][e];
      }
}

// SW (swizzled operand tiles) where it measured faster: the forward scans at BV 16 and 32 and the
// states-only kernel at BV 32, K = 128 (docs/cuda.md, "Forward (bf16)"; K = 64 and 256 untimed).
#define GDPC_SCAN_ENTRY(NAME, BV, KPT, NW, OUT, SW)                                            \
  extern "C" __global__ void __launch_bounds__(NW * 32)                                         \
      NAME##_##BV##_##KPT(GDP_KERNEL_PARAMS(GDP_SCAN_FIELDS, _)) {                              \
    gdp_fwd_scan_bf16_impl<BV, KPT, NW, OUT, SW>(                                               \
        q, k, split, aux, table, w, u, p, coef, h0_override, use_h0_override, out, outb, fin,   \
        hs, dn, batch, tokens, heads, dk, dv, dv_in, wide_from, wide_to, n, has_h0, qr, ns,     \
        ready);                                                                                 \
  }
GDPC_SCAN_ENTRY(gdp_fwd_scan_bf16, 16, 64, 4, true, false)
GDPC_SCAN_ENTRY(gdp_fwd_scan_bf16, 16, 128, 4, true, true)
GDPC_SCAN_ENTRY(gdp_fwd_scan_bf16, 16, 256, 4, true, false)
GDPC_SCAN_ENTRY(gdp_fwd_scan_bf16, 32, 64, 8, true, false)
GDPC_SCAN_ENTRY(gdp_fwd_scan_bf16, 32, 128, 8, true, true)
GDPC_SCAN_ENTRY(gdp_fwd_scan_bf16, 32, 256, 8, true, false)
GDPC_SCAN_ENTRY(gdp_fwd_scan_bf16, 64, 64, 8, true, false)
GDPC_SCAN_ENTRY(gdp_fwd_scan_bf16, 64, 128, 8, true, false)
// The states-only kernels (OUT = false, QR = 0): the backward's states rerun and the final-state
// summaries; faster than the forward scan with its output switched off.
GDPC_SCAN_ENTRY(gdp_fwd_states_bf16, 16, 64, 4, false, false)
GDPC_SCAN_ENTRY(gdp_fwd_states_bf16, 16, 128, 4, false, false)
GDPC_SCAN_ENTRY(gdp_fwd_states_bf16, 16, 256, 4, false, false)
GDPC_SCAN_ENTRY(gdp_fwd_states_bf16, 32, 64, 8, false, false)
GDPC_SCAN_ENTRY(gdp_fwd_states_bf16, 32, 128, 8, false, true)
GDPC_SCAN_ENTRY(gdp_fwd_states_bf16, 32, 256, 8, false, false)
GDPC_SCAN_ENTRY(gdp_fwd_states_bf16, 64, 64, 8, false, false)
GDPC_SCAN_ENTRY(gdp_fwd_states_bf16, 64, 128, 8, false, false)
// BV 128 (64 state values per thread at K = 128, 200 registers, no spills): beside the
// state-gradient scan at BV 128, 64 blocks of each at B4 T4096 H16 share the GPU, one block of
// each per multiprocessor, faster than 128 blocks of each at BV 64 (`scan_pair_plan`).
GDPC_SCAN_ENTRY(gdp_fwd_states_bf16, 128, 64, 8, false, false)
GDPC_SCAN_ENTRY(gdp_fwd_states_bf16, 128, 128, 8, false, false)
