// Shared-memory tile primitives of the bf16 two-kernel forward (cuda/gdp_fwd_chunked.cuh):
// `ldmatrix` fragment loads for mma.sync m16n8k16 and `cp.async` copies from global memory.
//
// Fragment loads (whole warp, every lane; tiles are bf16, rows 16-byte aligned; `ld` is the row
// stride in elements, a multiple of 8 — a stride of 8 mod 64 elements is bank-conflict free):
//   ldsm_a     A [16 x 16] at (m0, k0) of a row-major [m][k] tile
//   ldsm_a_t   A [16 x 16] at (m0, k0) of a tile stored transposed, [k][m] (A = stored^T)
//   ldsm_b_kn  B [16 x 16] = two n8 tiles at (k0, n0) of a row-major [k][n] tile
//   ldsm_b_nk  B [16 x 16] = two n8 tiles at (k0, n0) of a tile stored transposed, [n][k]
// B results: b[j] is the fragment of columns n0 + 8 j.
//
// Swizzled tiles (the forward scans' staged operands): a [rows][cols] tile (cols a multiple of
// 64) stored as cols / 64 boxes of [rows][64], one after another, in which the 16-byte piece p
// of row r lies at piece p ^ (r & 7) of the row (gdp_sw_at). Eight rows of one piece then fall
// in eight different bank groups with no padding, for ldmatrix and for the copies alike. Box
// bases 128-byte aligned.
//   ldsm_a_sw    ldsm_a on a swizzled [m][k] tile of `rows` rows
//   ldsm_a_t_sw  ldsm_a_t on a swizzled [k][m] tile of `rows` rows
//
// `GDP_EMU` swaps the inline PTX for the CPU emulation of cuda/emu.

#pragma once

#include <stdint.h>

#include <cuda_bf16.h>

// Tells the compiler that the thread index tid lies in [0, nthr), the block's threads, so that
// row bounds that hold for every thread fold away at compile time (without it nvcc 13.0 wraps
// each 16-byte copy of a full tile in a branch and forms its 64-bit addresses again inside it).
// The emulation checks it.
__device__ __forceinline__ void gdp_assume_tid(int tid, int nthr) {
#ifdef GDP_EMU
  assert(tid >= 0 && tid < nthr);
#else
  __builtin_assume(tid >= 0 && tid < nthr);
#endif
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const __nv_bfloat16* p, bool trans) {
#ifdef GDP_EMU
  gdp_emu_ldsm(r, p, trans);
#else
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
#endif
}

// Matrix i of an x4 load takes its eight row addresses from lanes 8 i .. 8 i + 7.
__device__ __forceinline__ void ldsm_a(uint32_t (&a)[4], const __nv_bfloat16* t, int ld, int m0,
                                       int k0, int lane) {
  // Matrices: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
  ldsm_x4(a, t + (m0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8, false);
}

__device__ __forceinline__ void ldsm_a_t(uint32_t (&a)[4], const __nv_bfloat16* t, int ld, int m0,
                                         int k0, int lane) {
  const int i = lane >> 3, r = lane & 7;
  ldsm_x4(a, t + (k0 + (i >> 1) * 8 + r) * ld + m0 + (i & 1) * 8, true);
}

__device__ __forceinline__ void ldsm_b_kn(uint32_t (&b)[2][2], const __nv_bfloat16* t, int ld,
                                          int k0, int n0, int lane) {
  const int i = lane >> 3, r = lane & 7;
  uint32_t x[4];
  ldsm_x4(x, t + (k0 + (i & 1) * 8 + r) * ld + n0 + (i >> 1) * 8, true);
  b[0][0] = x[0], b[0][1] = x[1], b[1][0] = x[2], b[1][1] = x[3];
}

__device__ __forceinline__ void ldsm_b_nk(uint32_t (&b)[2][2], const __nv_bfloat16* t, int ld,
                                          int k0, int n0, int lane) {
  const int i = lane >> 3, r = lane & 7;
  uint32_t x[4];
  ldsm_x4(x, t + (n0 + (i >> 1) * 8 + r) * ld + k0 + (i & 1) * 8, false);
  b[0][0] = x[0], b[0][1] = x[1], b[1][0] = x[2], b[1][1] = x[3];
}

// Element offset of 16-byte piece p (columns 8 p .. 8 p + 7) of row r in a swizzled tile of
// `rows` rows.
__host__ __device__ __forceinline__ int gdp_sw_at(int r, int p, int rows) {
  return ((p >> 3) * rows + r) * 64 + (((p & 7) ^ (r & 7)) << 3);
}

__device__ __forceinline__ void ldsm_a_sw(uint32_t (&a)[4], const __nv_bfloat16* t, int rows,
                                          int m0, int k0, int lane) {
  ldsm_x4(a, t + gdp_sw_at(m0 + (lane & 15), (k0 >> 3) + (lane >> 4), rows), false);
}

__device__ __forceinline__ void ldsm_a_t_sw(uint32_t (&a)[4], const __nv_bfloat16* t, int rows,
                                            int m0, int k0, int lane) {
  const int i = lane >> 3, r = lane & 7;
  ldsm_x4(a, t + gdp_sw_at(k0 + (i >> 1) * 8 + r, (m0 >> 3) + (i & 1), rows), true);
}

// 16-byte asynchronous copy global -> shared (both 16-byte aligned), and its group fences.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
#ifdef GDP_EMU
  // The hardware faults on a misaligned 16-byte copy; the emulation says where instead.
  assert(((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0);
  gdp_emu_cp_async16(dst, src);
#else
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
#endif
}

// 4-byte asynchronous copy global -> shared (both 4-byte aligned): rows of any width.
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
#ifdef GDP_EMU
  assert(((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 3) == 0);
  gdp_emu_cp_async(dst, src, 4);
#else
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
#endif
}

// cp_async16 that writes 16 zero bytes to dst instead of copying when `copy` is false (the
// copy's source size 0: nothing is read from src, which must still be a global address): a row
// that may lie past a tile's rows costs one instruction and no branch around the copy.
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, bool copy) {
#ifdef GDP_EMU
  assert((reinterpret_cast<uintptr_t>(dst) & 15) == 0);
  assert(!copy || (reinterpret_cast<uintptr_t>(src) & 15) == 0);
  gdp_emu_cp_async16_zfill(dst, src, copy);
#else
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(copy ? 16 : 0)
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#ifdef GDP_EMU
  gdp_emu_cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most `N` of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef GDP_EMU
  gdp_emu_cp_async_wait(N);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
