// Global -> shared tile copies of the SDPA backward kernel (sdpa_bwd.cuh).
#pragma once

#include "common.cuh"
#include "mma.cuh"

namespace attnx {
namespace cuda {

// Rows [row0, row0 + rows) of a (L, cols) matrix with row stride `row_stride` into a (rows, D)
// shared tile of row stride LD, zero past L rows and `cols` columns. With `vec16` (16-byte
// aligned rows, cols % 8 == 0: a 16-byte chunk is wholly in or out) through cp.async, which the
// caller commits and waits for; otherwise element by element, visible after the next barrier.
template <typename T, int D, int LD, int Threads>
__device__ __forceinline__ void load_tile_async(T* dst, const T* src, int64_t row_stride, int row0,
                                                int rows, int L, int cols, bool vec16) {
  if (vec16) {
    constexpr int V = 16 / sizeof(T);
    for (int idx = threadIdx.x; idx < rows * (D / V); idx += Threads) {
      const int r = idx / (D / V), c = (idx % (D / V)) * V;
      const int g = row0 + r;
      const bool in = g < L && c < cols;
      // an out-of-bounds chunk reads nothing: any valid address will do
      cp_async_16(dst + r * LD + c, in ? src + int64_t(g) * row_stride + c : src, in);
    }
    return;
  }
  for (int idx = threadIdx.x; idx < rows * D; idx += Threads) {
    const int r = idx / D, c = idx % D;
    const int g = row0 + r;
    dst[r * LD + c] = (g < L && c < cols) ? src[int64_t(g) * row_stride + c] : from_float<T>(0.f);
  }
}

}  // namespace cuda
}  // namespace attnx
