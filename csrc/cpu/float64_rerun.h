// When the float32 kernels hand a call to float64: finite inputs never give NaN, but float32
// overflows on scores or sums past its range (|q| |k| ~ 1e19, values ~ 3e38, huge additive v).
// The kernels detect it (each its own way) and rerun the call in float64, which holds every
// product and sum of float32 values; these are the checks they share.
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <optional>

namespace attnx::cpu {

// float64 itself overflows only on values near its range: a row's sum of p v, kept unnormalized
// until the end (up to e^2 L max|v|, p against a running max that may lag by 2), passes 1.8e308
// with |v| ~ 1e306 over a few hundred keys, where the answer, a convex combination of the values,
// is finite. Such a call runs again on the values times kShrinkValues (a power of two: exact
// but for values under 2^-958) and scales its output back; outputs non-finite from non-finite
// inputs come out the same.
constexpr double kShrinkValues = 0x1p-64;

// Whether every value of the tensors is finite (undefined tensors pass), and a float mask has
// no NaN or +inf (-inf is a refusal). When they are not, an overflow is the input's, and the
// call keeps its float32 result.
bool finite_inputs(at::TensorList ts, const std::optional<at::Tensor>& mask);

// Whether some value of the tensors is NaN or +-inf.
bool any_non_finite(at::TensorList ts);

// Whether some x[0, n) is NaN or +-inf: a serial pass over the bits (an integer OR, which
// compilers vectorize), for a kernel's own output: no tensors, no parallel region (ATen's
// isfinite-all took half of a short decoding call).
bool any_non_finite(const float* x, int64_t n);

// Whether x is NaN or +-inf, as an int so that loops that write values OR it up vectorized
// (the kernels flag their outputs as they write them, not in a pass after).
template <typename T>
inline int non_finite(T x) {
  return !(std::abs(x) <= std::numeric_limits<T>::max());
}

}  // namespace attnx::cpu
