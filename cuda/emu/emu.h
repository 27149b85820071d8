// CPU emulation of the CUDA subset the GDP kernels use, so that they can be checked against a
// float64 reference without a GPU (cuda/emu/kernels.cpp). Every CUDA thread is a std::thread;
// __syncthreads and bar.sync are std::barriers; a warp-level mma.sync is a warp barrier around a
// shared exchange of the 32 lanes' fragment registers; atomicAdd is std::atomic_ref.
// Included before the kernels with `-include emu.h -DGDP_EMU`; device code compiles as C++20.
#pragma once
#include <assert.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x = 0, y = 0, z = 0;
};
extern thread_local dim3 threadIdx;
extern dim3 blockIdx, blockDim, gridDim;

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __shared__
#define __align__(x)

// The vector types with CUDA's alignment (16, 8, 16 bytes), so that a kernel's misaligned vector
// access is misaligned here too (`run.sh` builds with -fsanitize=alignment, which reports it).
struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
template <class T>
T __ldg(const T* p) {
  return *p;
}
// Streaming (evict-first) loads and stores: plain accesses here.
template <typename T>
T __ldcs(const T* p) {
  return *p;
}
template <typename T>
void __stcs(T* p, T x) {
  *p = x;
}
inline float __uint_as_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

struct __nv_bfloat16 {
  uint16_t b;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
inline float __bfloat162float(__nv_bfloat16 x) { return __uint_as_float(uint32_t(x.b) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {uint16_t((u >> 16) | 0x40)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return {uint16_t(u >> 16)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 h) {
  return {__bfloat162float(h.x), __bfloat162float(h.y)};
}
struct __half {
  uint16_t b;
};
inline float __half2float(__half x) {
  _Float16 h;
  memcpy(&h, &x.b, 2);
  return (float)h;
}
inline __half __ushort_as_half(unsigned short u) { return {u}; }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline double atomicAdd(double* p, double v) { return std::atomic_ref<double>(*p).fetch_add(v); }
using std::max;
using std::min;

// ---- Block-level synchronisation (reset by the launcher for every block).
struct EmuBlock {
  std::unique_ptr<std::barrier<>> sync;                 // __syncthreads
  std::vector<std::unique_ptr<std::barrier<>>> warps;   // one per warp (mma exchange)
  std::unique_ptr<std::barrier<>> named[16];            // bar.sync id, count
  std::mutex named_mu;
  // Fragment registers of every lane, two buffers: a (4 per thread), b (2 per thread).
  std::vector<uint32_t> frag_a, frag_b;
  // Row addresses of every lane for ldmatrix, two buffers.
  std::vector<const void*> ldsm_rows;
  // Values of every lane for the shuffle reductions, two buffers.
  std::vector<float> shfl;
};
extern EmuBlock* g_block;
inline void __syncthreads() { g_block->sync->arrive_and_wait(); }
// The 1-based position of the least significant set bit (0 for 0).
inline int __ffs(int x) { return __builtin_ffs(x); }

// ---- cp.async: a thread's copies land only when it waits for their group (the latest the GPU
// may land them), so that a read of a stage whose copies its issuer has not waited for, fenced
// by a barrier, sees the stage's old bytes here as it may on the GPU. The source is read at the
// issue (the kernels never write what they copy from).
struct EmuCpAsync {
  struct Copy {
    void* dst;
    int n;
    unsigned char bytes[16];
  };
  std::vector<Copy> open;                 // issued, not yet committed
  std::vector<std::vector<Copy>> groups;  // committed, oldest first
};
inline thread_local EmuCpAsync gdp_emu_cp_async_state;
// `copy` false: 16 zero bytes (the zero-filling form, source size 0).
inline void gdp_emu_cp_async16_zfill(void* dst, const void* src, bool copy) {
  EmuCpAsync::Copy c;
  c.dst = dst;
  c.n = 16;
  if (copy)
    memcpy(c.bytes, src, 16);
  else
    memset(c.bytes, 0, 16);
  gdp_emu_cp_async_state.open.push_back(c);
}
inline void gdp_emu_cp_async16(void* dst, const void* src) {
  gdp_emu_cp_async16_zfill(dst, src, true);
}
// An n-byte copy (n <= 16).
inline void gdp_emu_cp_async(void* dst, const void* src, int n) {
  EmuCpAsync::Copy c;
  c.dst = dst;
  c.n = n;
  memcpy(c.bytes, src, n);
  gdp_emu_cp_async_state.open.push_back(c);
}
inline void gdp_emu_cp_async_commit() {
  auto& st = gdp_emu_cp_async_state;
  st.groups.push_back(std::move(st.open));
  st.open.clear();
}
inline void gdp_emu_cp_async_wait(int n) {
  auto& st = gdp_emu_cp_async_state;
  while ((int)st.groups.size() > n) {
    for (const auto& c : st.groups.front()) memcpy(c.dst, c.bytes, c.n);
    st.groups.erase(st.groups.begin());
  }
}
inline void gdp_emu_named_barrier(int id, int count) {
  std::barrier<>* b;
  {
    std::lock_guard<std::mutex> g(g_block->named_mu);
    auto& slot = g_block->named[id];
    if (!slot) slot = std::make_unique<std::barrier<>>(count);
    b = slot.get();
  }
  b->arrive_and_wait();
}

// ---- Tensor-core emulation. Fragment layouts of the PTX ISA (mma.m16n8k16 .bf16 and
// mma.m16n8k8 .tf32, row.col, f32 accumulators); lane = 4 g + t.
inline uint32_t gdp_emu_cvt_tf32(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7f800000u) == 0x7f800000u) return u;
  u += 0x1000u;  // round to nearest, ties away from zero (cvt.rna)
  return u & 0xffffe000u;
}

// One warp barrier per mma: every lane publishes its registers in one of two buffers (by the
// parity of its call count), waits for the warp, and computes its own four outputs from the
// published registers. A lane reuses a buffer two calls later, after a barrier that every lane
// reaches only once it has read that buffer.
template <int KS, typename Elem>
inline void gdp_emu_mma(float* c, const uint32_t* a, const uint32_t* b, Elem elem) {
  thread_local unsigned calls = 0;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  EmuBlock& blk = *g_block;
  const int buf = calls++ & 1;
  const size_t nthr = blk.frag_b.size() / 4;  // two buffers of 2 registers per thread
  uint32_t* fa = &blk.frag_a[(buf * nthr + warp * 32) * 4];
  uint32_t* fb = &blk.frag_b[(buf * nthr + warp * 32) * 2];
  for (int r = 0; r < 4; ++r) fa[lane * 4 + r] = a[r];
  for (int r = 0; r < 2; ++r) fb[lane * 2 + r] = b[r];
  blk.warps[warp]->arrive_and_wait();
  const int g = lane >> 2, t = lane & 3;
  for (int e = 0; e < 4; ++e) {
    const int m = g + (e >= 2 ? 8 : 0), n = 2 * t + (e & 1);
    double acc = c[e];
    for (int k = 0; k < KS; ++k) acc += (double)elem.a(fa, m, k) * (double)elem.b(fb, k, n);
    c[e] = (float)acc;
  }
}

// Element (m, k) of A and (k, n) of B from the published registers (PTX ISA fragment layouts of
// mma.m16n8k16 .bf16 and mma.m16n8k8 .tf32; lane = 4 g + t).
struct EmuBf16Frag {
  static float half(uint32_t w, int h) {
    return __uint_as_float(h ? (w & 0xffff0000u) : (w << 16));
  }
  float a(const uint32_t* fa, int m, int k) const {
    const int lane = 4 * (m & 7) + ((k & 7) >> 1), r = (m >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return half(fa[lane * 4 + r], k & 1);
  }
  float b(const uint32_t* fb, int k, int n) const {
    const int lane = 4 * n + ((k & 7) >> 1), r = k >= 8 ? 1 : 0;
    return half(fb[lane * 2 + r], k & 1);
  }
};
struct EmuTf32Frag {
  // The tensor core reads the top 19 bits of each tf32 operand.
  static float v(uint32_t w) { return __uint_as_float(w & 0xffffe000u); }
  float a(const uint32_t* fa, int m, int k) const {
    const int lane = 4 * (m & 7) + (k & 3), r = (m >= 8 ? 1 : 0) + (k >= 4 ? 2 : 0);
    return v(fa[lane * 4 + r]);
  }
  float b(const uint32_t* fb, int k, int n) const {
    return v(fb[(4 * n + (k & 3)) * 2 + (k >= 4 ? 1 : 0)]);
  }
};

inline void gdp_emu_mma_bf16(float* c, const uint32_t* a, const uint32_t* b) {
  gdp_emu_mma<16>(c, a, b, EmuBf16Frag{});
}
inline void gdp_emu_mma_tf32(float* c, const uint32_t* a, const uint32_t* b) {
  gdp_emu_mma<8>(c, a, b, EmuTf32Frag{});
}

// ldmatrix .x4 (optionally .trans): lane l gives the address of row l % 8 of matrix l / 8 (eight
// 16-bit elements); register i of lane l = 4 g + t holds, of matrix i, the elements (g, 2t) and
// (g, 2t + 1), or with .trans (2t, g) and (2t + 1, g). Same two-buffer scheme as the mma.
inline void gdp_emu_ldsm(uint32_t (&r)[4], const void* p, bool trans) {
  thread_local unsigned calls = 0;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  EmuBlock& blk = *g_block;
  const int buf = calls++ & 1;
  const size_t nthr = blk.ldsm_rows.size() / 2;
  const void** rows = &blk.ldsm_rows[buf * nthr + warp * 32];
  rows[lane] = p;
  blk.warps[warp]->arrive_and_wait();
  const int g = lane >> 2, t = lane & 3;
  auto elem = [&](int i, int row, int col) {
    return static_cast<const uint16_t*>(rows[8 * i + row])[col];
  };
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = trans ? elem(i, 2 * t, g) : elem(i, g, 2 * t);
    const uint32_t hi = trans ? elem(i, 2 * t + 1, g) : elem(i, g, 2 * t + 1);
    r[i] = lo | (hi << 16);
  }
}

// __syncwarp (full mask): the warp's barrier.
inline void __syncwarp(unsigned = 0xffffffffu) { g_block->warps[threadIdx.x >> 5]->arrive_and_wait(); }

// Every lane of the warp publishes x; returns the warp's 32 published values after a warp
// barrier. Two buffers used alternately (one counter for every exchange), so that a lane's next
// exchange never overwrites values another lane may still be reading (as in the mma).
inline const float* gdp_emu_exchange(float x) {
  thread_local unsigned calls = 0;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  EmuBlock& blk = *g_block;
  const int buf = calls++ & 1;
  const size_t nthr = blk.shfl.size() / 2;
  float* v = &blk.shfl[buf * nthr + warp * 32];
  v[lane] = x;
  blk.warps[warp]->arrive_and_wait();
  return v;
}

// Sum of x over the lanes l ^ m for every m made of the bits of `mask` (a butterfly of
// __shfl_xor_sync over those bits).
inline float gdp_emu_xor_sum(float x, int mask) {
  const float* v = gdp_emu_exchange(x);
  const int lane = threadIdx.x & 31;
  float s = 0.f;
  for (int m = 0; m < 32; ++m)
    if ((m & ~mask) == 0) s += v[lane ^ m];
  return s;
}

// __shfl_sync(full mask, x, src): lane src's x.
inline float gdp_emu_shfl(float x, int src) { return gdp_emu_exchange(x)[src & 31]; }
inline float gdp_emu_quad_sum(float x) { return gdp_emu_xor_sum(x, 3); }
inline float gdp_emu_column_sum(float x) { return gdp_emu_xor_sum(x, 28); }

extern unsigned char smem_raw[];
extern unsigned char gdpb_smem[];
extern unsigned char gdpc_smem[];
extern unsigned char gdpcs_smem[];
extern unsigned char gdpg_smem[];
extern unsigned char gdps_smem[];
