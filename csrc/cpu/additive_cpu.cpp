// PLACEHOLDER until the fused kernel lands (issue 3): every call fails loudly.
#include "additive_cpu.h"

#include <c10/util/Exception.h>

namespace attnx::cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor> additive_fwd(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, int64_t, int64_t, double,
    const std::optional<at::Tensor>&, bool) {
  TORCH_CHECK(false, "attnx::additive_fwd: the CPU kernel is not written yet");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> additive_bwd(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
    int64_t, int64_t, double, const std::optional<at::Tensor>&, bool) {
  TORCH_CHECK(false, "attnx::additive_bwd: the CPU kernel is not written yet");
}

}  // namespace attnx::cpu
