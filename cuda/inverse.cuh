// (I + A)^-1 of a strictly lower-triangular c x c block (c <= 64), blocked, in f32 FFMA (no
// tensor cores here: the solve is where TF32 would cost accuracy, fla_gdp.md §8).
//
// Step 1: the four 16 x 16 diagonal blocks by forward substitution, one lane per column, the
//         column in registers (so the 16 steps are register FMAs, not shared-memory round trips).
// Step 2: 16 -> 32: X10 = -X11 (A10 X00) for the two 32 x 32 diagonal blocks.
// Step 3: 32 -> 64: X10 = -X11 (A10 X00) with 32 x 32 blocks.
// The column-by-column substitution it replaces had a 64-step dependent chain per thread of
// shared-memory loads; here the longest chain is 16 register steps plus two short products.
//
// Called by threads [base, base + nthr) of the block (nthr a multiple of 64, base a multiple of
// 32; `tid` counts from base), which synchronise with named barrier `bar` (not 0, which
// __syncthreads uses), so the rest of the block may do other work meanwhile. A is read below the
// diagonal only; every entry of Ai (row stride c) is written. No scratch memory.

#pragma once

__device__ __forceinline__ void named_barrier(int bar, int nthr) {
#ifdef GDP_EMU
  gdp_emu_named_barrier(bar, nthr);
#else
  asm volatile("bar.sync %0, %1;\n" ::"r"(bar), "r"(nthr) : "memory");
#endif
}

__device__ __forceinline__ void tri_inverse(const float* __restrict__ A, float* __restrict__ Ai,
                                            int c, int tid, int nthr, int bar) {
  // Zero the strict upper triangle and the off-diagonal blocks the steps below do not write.
  for (int idx = tid; idx < c * c; idx += nthr) {
    const int i = idx / c, j = idx - i * c;
    if (j > i || (j >> 4) != (i >> 4)) Ai[idx] = 0.f;
  }
  // Step 1: lanes of 16 threads, one per column of a diagonal block.
  for (int col = tid; col < 64; col += nthr) {
    const int blk = col >> 4, l = col & 15, r0 = blk * 16;
    if (col < c) {
      float x[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) x[r] = r == l ? 1.f : 0.f;
#pragma unroll
      for (int r = 1; r < 16; ++r) {
        if (r0 + r < c && r > l) {
          const float* arow = A + (r0 + r) * c + r0;
          float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
          for (int m = 0; m + 1 < r; m += 2) {
            acc0 = fmaf(arow[m], x[m], acc0);
            acc1 = fmaf(arow[m + 1], x[m + 1], acc1);
          }
          if (r & 1) acc0 = fmaf(arow[r - 1], x[r - 1], acc0);
          x[r] = -(acc0 + acc1);
        }
      }
#pragma unroll
      for (int r = 0; r < 16; ++r)
        if (r0 + r < c && r >= l) Ai[(r0 + r) * c + col] = x[r];
    }
  }
  named_barrier(bar, nthr);
  // Steps 2 and 3: for each pair of diagonal blocks of size w at rows r0 and r0 + w,
  // X10 = -X11 (A10 X00). T = A10 X00 goes into the X10 block itself (zero until now); each
  // thread keeps its X10 values in registers until every thread has read T.
  for (int w = 16; w < 64; w *= 2) {
    const int total = (64 / (2 * w)) * w * w;  // 512, then 1024 elements
    // T = A10 X00 (X00 lower triangular: the k loop starts at the column).
    for (int idx = tid; idx < total; idx += nthr) {
      const int p = idx / (w * w), e = idx - p * w * w, i = e / w, j = e - i * w;
      const int r1 = p * 2 * w + w, c0 = p * 2 * w;
      if (r1 + i < c && c0 + j < c) {
        float acc = 0.f;
        for (int k = j; k < w && c0 + k < c; ++k)
          acc = fmaf(A[(r1 + i) * c + c0 + k], Ai[(c0 + k) * c + c0 + j], acc);
        Ai[(r1 + i) * c + c0 + j] = acc;
      }
    }
    named_barrier(bar, nthr);
    // X10 = -X11 T (X11 lower triangular: the k loop stops at the row).
    float res[1024 / 64];
#pragma unroll
    for (int it = 0; it < 1024 / 64; ++it) {
      const int idx = tid + it * nthr;
      res[it] = 0.f;
      if (idx < total) {
        const int p = idx / (w * w), e = idx - p * w * w, i = e / w, j = e - i * w;
        const int r1 = p * 2 * w + w, c0 = p * 2 * w;
        if (r1 + i < c && c0 + j < c) {
          float acc = 0.f;
          for (int k = 0; k <= i && r1 + k < c; ++k)
            acc = fmaf(Ai[(r1 + i) * c + r1 + k], Ai[(r1 + k) * c + c0 + j], acc);
          res[it] = -acc;
        }
      }
    }
    named_barrier(bar, nthr);
#pragma unroll
    for (int it = 0; it < 1024 / 64; ++it) {
      const int idx = tid + it * nthr;
      if (idx < total) {
        const int p = idx / (w * w), e = idx - p * w * w, i = e / w, j = e - i * w;
        const int r1 = p * 2 * w + w, c0 = p * 2 * w;
        if (r1 + i < c && c0 + j < c) Ai[(r1 + i) * c + c0 + j] = res[it];
      }
    }
    named_barrier(bar, nthr);
  }
}

// (I + A)^-1 of a strictly lower-triangular 64 x 64 block, in place: M holds A on entry and the
// inverse on exit, with row stride GDP_INV_LD (rows padded so that a column read by eight rows
// is bank-conflict free). A must be zero wherever it is read outside the block's strict lower
// triangle (rows past a partial chunk: their rows and columns of the inverse come out as the
// identity's); its entries on and above the diagonal are never read, and every entry of the
// inverse is written. Same scheme as tri_inverse (16 x 16 substitution, then two merges), with
// the merges as register-tiled f32 products (each thread a 1 x 4 or 1 x 8 strip). In place, each
// step reads the A blocks it overwrites into registers before a barrier: a merge of W x W
// blocks reads A10 (rows c0 + W.., columns c0..) that no earlier step wrote. One f32 tile of
// shared memory instead of two (the WY kernel's fourth block per multiprocessor). Threads
// [0, 128) of the block; synchronises with __syncthreads.
#define GDP_INV_LD 68

template <int W>
__device__ __forceinline__ void tri_inverse64_merge(float* __restrict__ M, int tid) {
  // Pairs of W x W diagonal blocks at rows c0 and r1 = c0 + W: X10 = -X11 (A10 X00).
  constexpr int NP = 64 / (2 * W), TPR = 128 / (NP * W), J = W / TPR;  // threads per row, strip
  const int p = tid / (128 / NP), rest = tid % (128 / NP), i = rest / TPR, j0 = (rest % TPR) * J;
  const int c0 = 2 * W * p, r1 = c0 + W;
  float acc[J] = {};
#pragma unroll
  for (int k = 0; k < W; ++k) {
    const float a = M[(r1 + i) * GDP_INV_LD + c0 + k];
#pragma unroll
    for (int j = 0; j < J; ++j) acc[j] = fmaf(a, M[(c0 + k) * GDP_INV_LD + c0 + j0 + j], acc[j]);
  }
  __syncthreads();  // every row of A10 read: T = A10 X00 replaces it
#pragma unroll
  for (int j = 0; j < J; ++j) M[(r1 + i) * GDP_INV_LD + c0 + j0 + j] = acc[j];
  __syncthreads();
  float res[J] = {};
#pragma unroll
  for (int k = 0; k < W; ++k) {
    const float x = M[(r1 + i) * GDP_INV_LD + r1 + k];
#pragma unroll
    for (int j = 0; j < J; ++j) res[j] = fmaf(x, M[(r1 + k) * GDP_INV_LD + c0 + j0 + j], res[j]);
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < J; ++j) M[(r1 + i) * GDP_INV_LD + c0 + j0 + j] = -res[j];
  __syncthreads();
}

__device__ __forceinline__ void tri_inverse64(float* __restrict__ M, int tid) {
  float x[16];
  if (tid < 64) {
    // Column `tid` of its 16 x 16 diagonal block by forward substitution, in registers.
    const int col = tid, l = col & 15, r0 = col & ~15;
#pragma unroll
    for (int r = 0; r < 16; ++r) x[r] = r == l ? 1.f : 0.f;
#pragma unroll
    for (int r = 1; r < 16; ++r) {
      if (r > l) {
        const float* arow = M + (r0 + r) * GDP_INV_LD + r0;
        float acc0 = 0.f, acc1 = 0.f;
#pragma unroll
        for (int m = 0; m + 1 < r; m += 2) {
          acc0 = fmaf(arow[m], x[m], acc0);
          acc1 = fmaf(arow[m + 1], x[m + 1], acc1);
        }
        if (r & 1) acc0 = fmaf(arow[r - 1], x[r - 1], acc0);
        x[r] = -(acc0 + acc1);
      }
    }
  } else {
    // Zero the blocks right of the diagonal blocks (never read; the merges write those left of
    // them).
    for (int idx = tid - 64; idx < 64 * 64; idx += 64) {
      const int i = idx >> 6, j = idx & 63;
      if (j >= (i & ~15) + 16) M[i * GDP_INV_LD + j] = 0.f;
    }
  }
  __syncthreads();  // the diagonal blocks of A read: their inverses replace them
  if (tid < 64) {
#pragma unroll
    for (int r = 0; r < 16; ++r) M[((tid & ~15) + r) * GDP_INV_LD + tid] = x[r];
  }
  __syncthreads();
  tri_inverse64_merge<16>(M, tid);
  tri_inverse64_merge<32>(M, tid);
}
