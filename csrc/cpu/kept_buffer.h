// Float storage on 64-byte lines, uninitialized, that a call borrows from one buffer kept
// across calls. The forward's packed K and V (32 MiB for 8 heads at L = 4096, D = 128, past
// glibc's largest mmap threshold) came fresh from the OS on every call, and the kernel faulting
// and zeroing those pages cost the causal forward 5-6% there (+0-2% at L = 1024 or D = 64;
// interleaved in one process, 2 threads). The kept buffer grows to the largest request up to
// KEPT_FLOATS and is never returned; a larger request, or one made while another call holds
// the buffer, gets storage of its own, freed with it.
#pragma once
#include <cstddef>

namespace attnx::cpu {

constexpr std::size_t KEPT_FLOATS = std::size_t{16} << 20;  // 64 MiB

class KeptBuffer {
 public:
  explicit KeptBuffer(std::size_t n);
  ~KeptBuffer();
  KeptBuffer(const KeptBuffer&) = delete;
  KeptBuffer& operator=(const KeptBuffer&) = delete;
  float* data() const { return p_; }

 private:
  float* p_ = nullptr;
  bool borrowed_ = false;  // from the kept buffer; else p_ is this call's own (or null)
};

}  // namespace attnx::cpu
