#include "float64_rerun.h"

#include <cstdint>
#include <cstring>

namespace attnx::cpu {

bool any_non_finite(at::TensorList ts) {
  for (const at::Tensor& t : ts) {
    if (t.defined() && !at::isfinite(t).all().item<bool>()) return true;
  }
  return false;
}

// AVX2 clone where GCC can make one: the loop runs over whole gradients (additive backward).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
bool any_non_finite(const float* x, int64_t n) {
  constexpr uint32_t exponent = 0x7f800000u;  // all ones: inf or NaN
  uint32_t found = 0;
  for (int64_t a = 0; a < n; ++a) {
    uint32_t bits;
    std::memcpy(&bits, x + a, sizeof bits);
    found |= (bits & exponent) == exponent;
  }
  return found != 0;
}

bool finite_inputs(at::TensorList ts, const std::optional<at::Tensor>& mask) {
  return !any_non_finite(ts) &&
         (!mask.has_value() || mask->scalar_type() == at::kBool ||
          !(at::isnan(*mask) | at::isposinf(*mask)).any().item<bool>());
}

}  // namespace attnx::cpu
