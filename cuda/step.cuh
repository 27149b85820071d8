// The fused decode step gdp_step_{f32,bf16,f16}_k*. Included by gdp.cu (uses to_f of
// common.cuh).
//
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
      NAME(GDP_KERNEL_PARAMS(GDP_STEP_FIELDS, TYPE)) {                                         \
    gdp_step_impl<ROWS, TYPE>(state, q, k, v, g, beta, out, batch, heads, dk, dv, n, scale);    \
  }
#define GDP_STEP_ENTRIES(T, TYPE)                           \
  GDP_STEP_ENTRY(gdp_step_##T##_k32, TYPE, 8, 2)            \
  GDP_STEP_ENTRY(gdp_step_##T##_k64, TYPE, 16, 2)           \
  GDP_STEP_ENTRY(gdp_step_##T##_k128, TYPE, 32, 2)          \
  GDP_STEP_ENTRY(gdp_step_##T##_k256, TYPE, 64, 1)
GDP_STEP_ENTRIES(f32, float)
GDP_STEP_ENTRIES(bf16, __nv_bfloat16)
GDP_STEP_ENTRIES(f16, __half)
