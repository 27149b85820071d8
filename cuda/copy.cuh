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

// dq or dk of grouped value heads summed into their key heads: dst row o (of d values) is the
// f32 sum of src rows o·r .. o·r + r - 1, in that order, rounded to bf16 (the value heads of a
// key head are consecutive: [B, T, Hk, r, D] -> [B, T, Hk, D]). Eight values per thread where
// d and both pointers allow 16-byte accesses, else one; a grid-stride loop over the values.
extern "C" __global__ void gdp_sum_groups_bf16(GDP_KERNEL_PARAMS(GDP_SUM_GROUPS_FIELDS, _)) {
  const int64_t i0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t is = (int64_t)gridDim.x * blockDim.x;
  const bool vec = d % 8 == 0 && ((reinterpret_cast<uintptr_t>(src) |
                                   reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
  if (vec) {
    const int64_t per_row = d / 8, total = rows * per_row;
    for (int64_t i = i0; i < total; i += is) {
      const int64_t o = i / per_row, c = i - o * per_row;
      float acc[8] = {};
      for (int j = 0; j < r; ++j) {
        const uint4 x = *reinterpret_cast<const uint4*>(src + (o * r + j) * d + 8 * c);
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 f = __bfloat1622float2(p[e]);
          acc[2 * e] += f.x;
          acc[2 * e + 1] += f.y;
        }
      }
      uint4 y;
      __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(&y);
#pragma unroll
      for (int e = 0; e < 4; ++e) q[e] = __floats2bfloat162_rn(acc[2 * e], acc[2 * e + 1]);
      *reinterpret_cast<uint4*>(dst + o * d + 8 * c) = y;
    }
  } else {
    const int64_t total = rows * d;
    for (int64_t i = i0; i < total; i += is) {
      const int64_t o = i / d, c = i - o * d;
      float acc = 0.f;
      for (int j = 0; j < r; ++j) acc += __bfloat162float(src[(o * r + j) * d + c]);
      dst[i] = __float2bfloat16_rn(acc);
    }
  }
}
