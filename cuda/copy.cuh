// Strided row copy for the op's q/k packing (src/op/pack.rs on CUDA): `rows` rows of `width`
// bytes from src (row stride src_ld bytes) to dst (dst_ld), 16 bytes per thread where both
// pointers, the width and the strides allow it (else 4, else 1). Grid (x: columns, y: rows), so
// that no thread divides an index; Candle's copy2d moves one element per thread and divides.

extern "C" __global__ void gdp_copy_rows(GDP_KERNEL_PARAMS(GDP_COPY_ROWS_FIELDS, _)) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                         (uintptr_t)width | (uintptr_t)src_ld | (uintptr_t)dst_ld;
  const int64_t x0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t xs = (int64_t)gridDim.x * blockDim.x;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const unsigned char* s = src + r * src_ld;
    unsigned char* d = dst + r * dst_ld;
    if ((bits & 15) == 0) {
      for (int64_t x = x0; 16 * x < width; x += xs)
        reinterpret_cast<uint4*>(d)[x] = reinterpret_cast<const uint4*>(s)[x];
    } else if ((bits & 3) == 0) {
      for (int64_t x = x0; 4 * x < width; x += xs)
        reinterpret_cast<uint32_t*>(d)[x] = reinterpret_cast<const uint32_t*>(s)[x];
    } else {
      for (int64_t x = x0; x < width; x += xs) d[x] = s[x];
    }
  }
}

// An f32 value rounded to T (nearest, ties to even).
template <class T>
__device__ __forceinline__ T gdp_round_to(float x);
template <>
__device__ __forceinline__ float gdp_round_to<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 gdp_round_to<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Gradients of key heads that r value heads each read, summed over each group: dst row o (of d
// values) is the f32 sum of src rows o·r .. o·r + r - 1, in that order, rounded to T (the value
// heads of a key head are consecutive: [B, T, Hk, r, D] -> [B, T, Hk, D]). Eight bf16 values
// per thread where d and both pointers allow 16-byte accesses, else one; a grid-stride loop.
template <class T>
__device__ __forceinline__ void gdp_sum_groups_impl(const T* __restrict__ src, T* __restrict__ dst,
                                                    long long rows, int r, int d) {
  const int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t is = (int64_t)gridDim.x * blockDim.x;
  if constexpr (sizeof(T) == 2) {
    const uintptr_t bits = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
    if (d % 8 == 0 && (bits & 15) == 0) {
      const int64_t per_row = d / 8, total = rows * per_row;
      for (int64_t i = i0; i < total; i += is) {
        const int64_t o = i / per_row, c = i - o * per_row;
        float acc[8] = {};
        for (int j = 0; j < r; ++j) {
          const uint4 x = *reinterpret_cast<const uint4*>(src + (o * r + j) * d + 8 * c);
          const T* e = reinterpret_cast<const T*>(&x);
#pragma unroll
          for (int m = 0; m < 8; ++m) acc[m] += to_f(e[m]);
        }
        uint4 y;
        T* e = reinterpret_cast<T*>(&y);
#pragma unroll
        for (int m = 0; m < 8; ++m) e[m] = gdp_round_to<T>(acc[m]);
        *reinterpret_cast<uint4*>(dst + o * d + 8 * c) = y;
      }
      return;
    }
  }
  const int64_t total = rows * d;
  for (int64_t i = i0; i < total; i += is) {
    const int64_t o = i / d, c = i - o * d;
    float acc = 0.f;
    for (int j = 0; j < r; ++j) acc += to_f(src[(o * r + j) * d + c]);
    dst[i] = gdp_round_to<T>(acc);
  }
}

#define GDP_SUM_GROUPS_ENTRY(NAME, T)                                              \
  extern "C" __global__ void NAME(GDP_KERNEL_PARAMS(GDP_SUM_GROUPS_FIELDS, T)) { \
    gdp_sum_groups_impl<T>(src, dst, rows, r, d);                                  \
  }
GDP_SUM_GROUPS_ENTRY(gdp_sum_groups_bf16, __nv_bfloat16)
GDP_SUM_GROUPS_ENTRY(gdp_sum_groups_f32, float)
