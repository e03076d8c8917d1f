// SmemGrants (csrc/cuda/smem_grants.h), the cache behind launch_kernel's
// cudaFuncSetAttribute: the attribute is set once per device and kernel and again only for a
// larger size, never for sizes within the 48 KB default, and a failed call is retried.
#include "cuda/smem_grants.h"

#include <cstdio>
#include <utility>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const char* what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAILED", what);
  if (!ok) ++failures;
}

}  // namespace

int main() {
  attnx::cuda::SmemGrants grants;
  std::vector<std::pair<const void*, size_t>> calls;
  int fail_next = 0;  // error code the next grant returns
  auto grant = [&](const void* kernel, size_t bytes) {
    calls.emplace_back(kernel, bytes);
    const int err = fail_next;
    fail_next = 0;
    return err;
  };
  const int a = 0, b = 0;  // two kernels' addresses
  const size_t big = 100 * 1024;

  expect(grants.reserve(0, &a, 48 * 1024, grant) == 0 && calls.empty(),
         "no call within the 48 KB default");
  for (int launch = 0; launch < 5; ++launch) grants.reserve(0, &a, big, grant);
  expect(calls.size() == 1 && calls[0].second == big, "one call for five launches of a kernel");
  grants.reserve(0, &a, big - 1024, grant);
  expect(calls.size() == 1, "no call for a smaller size");
  grants.reserve(0, &a, big + 1024, grant);
  expect(calls.size() == 2 && calls[1].second == big + 1024, "a call for a larger size");
  grants.reserve(0, &b, big, grant);
  expect(calls.size() == 3 && calls[2].first == &b, "a call per kernel");
  grants.reserve(1, &a, big, grant);
  expect(calls.size() == 4, "a call per device");

  fail_next = 7;
  expect(grants.reserve(2, &a, big, grant) == 7, "a failed call's error is returned");
  expect(grants.reserve(2, &a, big, grant) == 0 && calls.size() == 6,
         "a failed call is not remembered: the next launch tries again");
  grants.reserve(2, &a, big, grant);
  expect(calls.size() == 6, "and once it succeeded, no more calls");
  return failures == 0 ? 0 : 1;
}
