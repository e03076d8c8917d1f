// PLACEHOLDER until the fused kernel lands (issue 3): every call fails loudly.
#include "sdpa_cpu.h"

#include <c10/util/Exception.h>

namespace attnx::cpu {

std::tuple<at::Tensor, at::Tensor> sdpa_fwd(const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, const std::optional<at::Tensor>&,
                                            double, int64_t, int64_t, double,
                                            const std::optional<at::Tensor>&) {
  TORCH_CHECK(false, "attnx::sdpa_fwd: the CPU kernel is not written yet");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sdpa_bwd(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, double, int64_t,
    int64_t, double, const std::optional<at::Tensor>&, bool) {
  TORCH_CHECK(false, "attnx::sdpa_bwd: the CPU kernel is not written yet");
}

}  // namespace attnx::cpu
