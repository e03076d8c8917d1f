// Where the saved log-sum-exp stops being enough for the backward passes of the CPU kernels.
#pragma once
#include <cmath>

namespace attnx::cpu {

// A row's lse = m + log(l) (m its largest score) keeps log(l) only to the precision of |m|:
// when every key of a row carries a huge finite bias (padding by finfo.min, -1e9, ...), it
// rounds to m, and exp(s - lse) gives each of the row's l tied keys 1, not 1 / l. Backward
// passes take rows with |lse| above this (where a float keeps under 16 fractional bits) from m
// and l recomputed, or renormalize them by the sum of their exp(s - lse): either cancels the
// rounding whatever its size.
constexpr double HUGE_LSE = 256.0;

// Whether a row's saved lse is one of those (empty rows, lse = -inf, are not).
inline bool huge_lse(double lse) { return std::isfinite(lse) && std::abs(lse) > HUGE_LSE; }

}  // namespace attnx::cpu
