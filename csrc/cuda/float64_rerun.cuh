// What the float64 reruns share (sdpa_fwd.cuh rerun_row, decode.cu, sdpa_bwd_rerun.cu,
// additive_bwd_rerun.cu): slow paths, a warp a row, for rows whose float32 scores or sums passed
// float's range (scores past it, bf16 values near the dtype's largest). A lane holds up to
// kRerunCols columns of the warp's row.
#pragma once

#include <algorithm>

#include "common.cuh"

namespace attnx {
namespace cuda {

// A block's warps, one row (task) each at a time. The kernels declare one block per SM at the
// least (__launch_bounds__(32 * kRerunWarps, 1)), so ptxas may give a thread every register:
// without it, it held them at 128 and the additive query pass spilled.
constexpr int kRerunWarps = 4;
constexpr int kRerunMaxBlocks = 264;  // the grid's blocks at most (two per SM of an H100)
constexpr int kRerunCols = 256 / 32;  // columns a lane holds at a time

// The grid of a rerun over `tasks` rows: each launch returns at once unless its flag is set,
// so the grid is small whatever the sizes (a few microseconds a backward).
inline dim3 rerun_grid(int64_t tasks) {
  const int64_t blocks = (tasks + kRerunWarps - 1) / kRerunWarps;
  return dim3(unsigned(std::min<int64_t>(kRerunMaxBlocks, blocks)));
}

// float(x), inf past float's range (converting such a double is undefined in C++), NaN kept.
__device__ __forceinline__ float saturated(double x) {
  if (fabs(x) <= 3.4028234663852886e38) return float(x);
  return x > 0 ? INFINITY : x < 0 ? -INFINITY : NAN;
}

// A row's lse as the kernels return it: +inf past float's largest, and float's lowest (not
// -inf, which stands for a row that admits no key: the backward then takes its probabilities as
// 0) past that. Triton's sdpa_fwd_rerun.py saturates alike.
__device__ __forceinline__ float lse_as_float(double x) {
  if (x > 3.4028234663852886e38) return INFINITY;
  return x < -3.4028234663852886e38 ? -3.4028234663852886e38f : float(x);
}

// A row's online softmax in float64, score by score (a warp's lanes hold the same values): the
// running max m and sum l of exp(s - m).
struct RowSoftmax64 {
  double m = -INFINITY, l = 0.0;
  // Takes an admitted score x (not -inf: skip those); returns its weight exp(x - m) against the
  // new max, and in *a the rescale of the terms before it (0 for the first).
  __device__ __forceinline__ double add(double x, double* a) {
    const double m_new = fmax(m, x);
    *a = exp(m - m_new);
    const double w = exp(x - m_new);
    l = l * *a + w;
    m = m_new;
    return w;
  }
  // -inf for a row that admitted no score (NaN kept).
  __device__ __forceinline__ float lse() const {
    return l != 0.0 ? lse_as_float(m + log(l)) : -INFINITY;
  }
};

// sum_c a[c] b[c] over c < n, lanes over c, in float (as the fast kernels' scores) or float64.
template <typename T>
__device__ __forceinline__ float warp_dot_f(const T* a, const T* b, int n, int lane) {
  float x = 0.f;
  for (int c = lane; c < n; c += 32) x += to_float(a[c]) * to_float(b[c]);
#pragma unroll
  for (int w = 16; w >= 1; w /= 2) x += __shfl_xor_sync(0xffffffffu, x, w);
  return x;
}
template <typename T>
__device__ __forceinline__ double warp_dot_d(const T* a, const T* b, int n, int lane) {
  double x = 0.0;
  // not unrolled: the callers are rare rerun paths, and the KV-cache split kernel must keep its
  // registers (an unrolled float64 loop there spilled)
#pragma unroll 1
  for (int c = lane; c < n; c += 32) x += double(to_float(a[c])) * double(to_float(b[c]));
#pragma unroll
  for (int w = 16; w >= 1; w /= 2) x += __shfl_xor_sync(0xffffffffu, x, w);
  return x;
}

}  // namespace cuda
}  // namespace attnx
