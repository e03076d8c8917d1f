// std::vector whose storage starts on a 64-byte cache line. The micro-kernels load and store
// 16 floats (one line) at a time from panels and score tiles; at a plain vector's 16-byte
// alignment each of those loads splits over two lines (+1-1.5% on the forward aligned, L =
// 2k-4k, interleaved in one process).
#pragma once
#include <cstddef>
#include <new>
#include <vector>

namespace attnx::cpu {

template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const {
    return true;
  }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const {
    return false;
  }
};

template <typename T>
using line_vector = std::vector<T, LineAllocator<T>>;

}  // namespace attnx::cpu
