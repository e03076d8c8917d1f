#include "kept_buffer.h"

#include <atomic>
#include <new>

namespace attnx::cpu {
namespace {

float* allocate(std::size_t n) {
  return static_cast<float*>(::operator new(n * sizeof(float), std::align_val_t(64)));
}
void release(float* p) {
  if (p != nullptr) ::operator delete(p, std::align_val_t(64));
}

// The kept buffer; `taken` guards it: whoever sets it owns kept and kept_n until clearing it.
std::atomic<bool> taken{false};
float* kept = nullptr;
std::size_t kept_n = 0;

}  // namespace

KeptBuffer::KeptBuffer(std::size_t n) {
  if (n == 0) return;
  if (n <= KEPT_FLOATS && !taken.exchange(true, std::memory_order_acquire)) {
    if (kept_n < n) {
      release(kept);
      kept = nullptr, kept_n = 0;
      try {
        kept = allocate(n);
      } catch (...) {
        taken.store(false, std::memory_order_release);
        throw;
      }
      kept_n = n;
    }
    p_ = kept, borrowed_ = true;
    return;
  }
  p_ = allocate(n);
}

KeptBuffer::~KeptBuffer() {
  if (borrowed_) {
    taken.store(false, std::memory_order_release);
  } else {
    release(p_);
  }
}

}  // namespace attnx::cpu
