// Calls attnx::sdpa_fwd and attnx::additive_fwd through the dispatcher, as a LibTorch user
// would, and checks them against plain ATen formulas.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cstdio>
#include <tuple>

namespace {

int failures = 0;

void expect_close(const at::Tensor& got, const at::Tensor& want, const char* what) {
  const double err = (got - want).abs().max().item<double>();
  std::printf("%s: max error %.3g\n", what, err);
  if (!(err < 1e-5)) ++failures;
}

}  // namespace

int main() {
  torch::manual_seed(0);
  auto q = torch::randn({2, 3, 17, 16});
  auto k = torch::randn({2, 3, 23, 16});
  auto v = torch::randn({2, 3, 23, 8});
  auto mask = torch::rand({17, 23}).gt(0.3).expand({2, 3, 17, 23});
  const double scale = 0.25;

  auto sdpa = c10::Dispatcher::singleton()
                  .findSchemaOrThrow("attnx::sdpa_fwd", "")
                  .typed<std::tuple<at::Tensor, at::Tensor>(
                      const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const std::optional<at::Tensor>&, double, int64_t, int64_t, double,
                      const std::optional<at::Tensor>&)>();
  auto [out, lse] = sdpa.call(q, k, v, mask, scale, -17, 23, 0.0, std::nullopt);
  auto s = torch::matmul(q, k.transpose(-1, -2)).mul(scale).masked_fill(mask.logical_not(), -INFINITY);
  expect_close(out, torch::matmul(torch::softmax(s, -1), v), "sdpa out");
  expect_close(lse, torch::logsumexp(s, -1), "sdpa lse");

  auto vv = torch::randn({3, 16});
  auto additive = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("attnx::additive_fwd", "")
                      .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                          const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const std::optional<at::Tensor>&, int64_t, int64_t,
                          double, const std::optional<at::Tensor>&, bool)>();
  auto [aout, alse, weights] = additive.call(q, k, v, vv, std::nullopt, -17, 23, 0.0, std::nullopt, false);
  auto score = (torch::tanh(q.unsqueeze(3) + k.unsqueeze(2)) * vv.view({1, 3, 1, 1, 16})).sum(-1);
  expect_close(aout, torch::matmul(torch::softmax(score, -1), v), "additive out");

  std::printf(failures ? "FAILED\n" : "OK\n");
  return failures ? 1 : 0;
}
