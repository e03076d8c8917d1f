// Global -> shared tile copies of the SDPA forward and backward kernels (sdpa_fwd.cuh,
// sdpa_bwd.cuh): one loader for Q, K, V and dO tiles in both.
#pragma once

#include "common.cuh"
#include "mma.cuh"

namespace attnx {
namespace cuda {

// Rows [row0, row0 + Rows) of a (L, cols) matrix with row stride `row_stride` into a (Rows, D)
// shared tile of row stride LD, zero past L rows and `cols` columns, in 16-byte chunks of 8
// elements: through cp.async when `vec16` (16-byte aligned rows, cols % 8 == 0, so a chunk is
// wholly in or out; the caller commits and waits), else by plain loads (visible after the next
// barrier, like the copies after the wait). The cp.async path is unrolled over the thread's
// Rows * D / 8 / Threads chunks (compile-time counts); where Threads is a multiple of the
// chunks a row holds, a thread keeps one column and steps its rows by Threads / (D / 8), so a
// chunk costs a row test, an address add and the copy (a runtime loop over both paths took
// about 100 instructions a chunk, a division-based unrolled one about 16).
template <typename T, int Rows, int D, int LD, int Threads>
__device__ __forceinline__ void load_tile_async(T* dst, const T* src, int64_t row_stride, int row0,
                                                int L, int cols, bool vec16) {
  static_assert(D % 8 == 0, "whole 16-byte chunks");
  constexpr int kChunks = D / 8;
  constexpr int kTotal = Rows * kChunks;
  if (vec16) {
    const unsigned tid = threadIdx.x;
    if constexpr (Threads % kChunks == 0 && kTotal % Threads == 0) {
      constexpr int kStep = Threads / kChunks;  // rows between a thread's chunks
      const int r0 = int(tid / kChunks), c = int(tid % kChunks) * 8;
      const bool col_in = c < cols;
      const T* from = src + int64_t(row0 + r0) * row_stride + c;
      const int64_t step = kStep * row_stride;
#pragma unroll
      for (int i = 0; i < kTotal / Threads; ++i) {
        // an out-of-bounds chunk reads nothing (src-size 0): its address is never dereferenced
        cp_async_16(dst + (r0 + i * kStep) * LD + c, from + i * step,
                    col_in && row0 + r0 + i * kStep < L);
      }
    } else {
#pragma unroll
      for (int i = 0; i < (kTotal + Threads - 1) / Threads; ++i) {
        const unsigned idx = tid + unsigned(i * Threads);
        if (kTotal % Threads == 0 || idx < unsigned(kTotal)) {
          const int r = int(idx / kChunks), c = int(idx % kChunks) * 8;
          const int g = row0 + r;
          const bool in = g < L && c < cols;
          cp_async_16(dst + r * LD + c, in ? src + int64_t(g) * row_stride + c : src, in);
        }
      }
    }
    return;
  }
  for (int idx = threadIdx.x; idx < kTotal; idx += Threads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const int g = row0 + r;
    T* d = dst + r * LD + c;
#pragma unroll
    for (int e = 0; e < 8; ++e)
      d[e] = (g < L && c + e < cols) ? src[int64_t(g) * row_stride + c + e] : from_float<T>(0.f);
  }
}

}  // namespace cuda
}  // namespace attnx
