// Which kernels may already use how much dynamic shared memory, per device: a launch above the
// 48 KB default needs cudaFuncSetAttribute(kernel, MaxDynamicSharedMemorySize, bytes) first,
// and that call costs a driver round trip, so it is made once per device and kernel (and again
// only for a larger size), not on every launch. Plain C++ (the CUDA call is passed in), so the
// caching is tested without a GPU (tests/cpp/test_smem_grants.cpp).
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <utility>

namespace attnx {
namespace cuda {

class SmemGrants {
 public:
  static constexpr size_t kDefaultLimit = 48 * 1024;  // usable without any attribute

  // Makes sure `kernel` on `device` may use `bytes`, calling `grant(kernel, bytes)` (which
  // returns an error code, 0 on success) only when no earlier call granted as much. Returns
  // 0 or the code of the failed call; a failed call is not remembered.
  template <typename Grant>
  auto reserve(int device, const void* kernel, size_t bytes, Grant grant)
      -> decltype(grant(kernel, bytes)) {
    using Err = decltype(grant(kernel, bytes));
    if (bytes <= kDefaultLimit) return Err(0);
    const std::lock_guard<std::mutex> lock(mutex_);
    size_t& have = granted_[{device, kernel}];
    if (bytes <= have) return Err(0);
    const Err err = grant(kernel, bytes);
    if (err == Err(0)) have = bytes;
    return err;
  }

 private:
  std::mutex mutex_;
  std::map<std::pair<int, const void*>, size_t> granted_;
};

}  // namespace cuda
}  // namespace attnx
