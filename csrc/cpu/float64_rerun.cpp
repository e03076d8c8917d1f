#include "float64_rerun.h"

namespace attnx::cpu {

bool any_non_finite(at::TensorList ts) {
  for (const at::Tensor& t : ts) {
    if (t.defined() && !at::isfinite(t).all().item<bool>()) return true;
  }
  return false;
}

bool finite_inputs(at::TensorList ts, const std::optional<at::Tensor>& mask) {
  return !any_non_finite(ts) &&
         (!mask.has_value() || mask->scalar_type() == at::kBool ||
          !(at::isnan(*mask) | at::isposinf(*mask)).any().item<bool>());
}

}  // namespace attnx::cpu
