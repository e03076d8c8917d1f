// Global -> shared tile copies of the SDPA forward and backward kernels (sdpa_fwd.cuh,
// sdpa_bwd.cuh): one loader for Q, K, V and dO tiles in both.
#pragma once

#include "common.cuh"
#include "mma.cuh"

namespace attnx {
namespace cuda {

// Rows [row0, row0 + rows) of a (L, cols) matrix with row stride `row_stride` into a (rows, D)
// shared tile of row stride LD, zero past L rows and `cols` columns, in 16-byte chunks of 8
// elements: through cp.async when `vec16` (16-byte aligned rows, cols % 8 == 0, so a chunk is
// wholly in or out; the caller commits and waits), else by plain loads (visible after the next
// barrier, like the copies after the wait).
template <typename T, int D, int LD, int Threads>
__device__ __forceinline__ void load_tile_async(T* dst, const T* src, int64_t row_stride, int row0,
                                                int rows, int L, int cols, bool vec16) {
  static_assert(D % 8 == 0, "whole 16-byte chunks");
  constexpr int kChunks = D / 8;
  for (int idx = threadIdx.x; idx < rows * kChunks; idx += Threads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const int g = row0 + r;
    T* d = dst + r * LD + c;
    if (vec16) {
      const bool in = g < L && c < cols;
      // an out-of-bounds chunk reads nothing: any valid address will do
      cp_async_16(d, in ? src + int64_t(g) * row_stride + c : src, in);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        d[e] = (g < L && c + e < cols) ? src[int64_t(g) * row_stride + c + e] : from_float<T>(0.f);
    }
  }
}

}  // namespace cuda
}  // namespace attnx
