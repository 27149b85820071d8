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
