// std::vector whose storage starts on a 64-byte cache line, and a bare buffer that does. The
// micro-kernels load and store 16 floats (one line) at a time from panels and score tiles; at a
// plain vector's 16-byte alignment each of those loads splits over two lines (+1-1.5% on the
// forward aligned, L = 2k-4k, interleaved in one process).
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

// n values on 64-byte lines, left uninitialized: for buffers written in full before any read
// (the forward's packed K and V, sdpa_products.h), where zeroing up to 64 MiB first would be a
// pass on one thread, and would place every page on that thread's memory node.
template <typename T>
class line_buffer {
 public:
  explicit line_buffer(std::size_t n)
      : n_(n), p_(n > 0 ? LineAllocator<T>().allocate(n) : nullptr) {}
  ~line_buffer() {
    if (p_ != nullptr) LineAllocator<T>().deallocate(p_, n_);
  }
  line_buffer(const line_buffer&) = delete;
  line_buffer& operator=(const line_buffer&) = delete;
  T* data() { return p_; }
  const T* data() const { return p_; }

 private:
  std::size_t n_;
  T* p_;
};

}  // namespace attnx::cpu
