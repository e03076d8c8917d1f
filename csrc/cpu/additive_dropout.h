// The dropout decision of attnx/_rng.py, bit for bit: one counter-based 32-bit hash of
// (seed, b * H + h, i, j), so this kernel drops exactly what every other backend drops.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace attnx::cpu::additive {

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

class Dropout {
 public:
  Dropout(double p, const std::optional<at::Tensor>& seed) : active_(p > 0.0) {
    if (!active_) return;
    TORCH_CHECK(seed.has_value() && seed->numel() == 2 && seed->scalar_type() == at::kLong &&
                    seed->device().is_cpu(),
                "attnx additive: expected an int64 CPU seed of 2 elements for dropout");
    const at::Tensor s = seed->contiguous();
    seed0_ = static_cast<uint32_t>(s.data_ptr<int64_t>()[0]);
    seed1_ = static_cast<uint32_t>(s.data_ptr<int64_t>()[1]);
    // As _rng.keep_threshold: min(floor(p * 2**32), 2**32 - 1).
    threshold_ = static_cast<uint32_t>(
        std::min<uint64_t>(static_cast<uint64_t>(p * 4294967296.0), 0xFFFFFFFFull));
    scale_ = 1.0 / (1.0 - p);
  }

  // The hash state shared by all keys of query row i of head bh = b * H + h.
  uint32_t row_key(int64_t bh, int64_t i) const {
    if (!active_) return 0;
    const uint32_t key_bh = mix32(seed0_ ^ mix32(static_cast<uint32_t>(bh) ^ seed1_));
    return mix32(key_bh ^ static_cast<uint32_t>(i));
  }

  // What probability (row, j) is multiplied by: 1 without dropout, else 0 or 1 / (1 - p).
  double factor(uint32_t row_key, int64_t j) const {
    if (!active_) return 1.0;
    return mix32(row_key ^ static_cast<uint32_t>(j)) >= threshold_ ? scale_ : 0.0;
  }

 private:
  bool active_;
  uint32_t seed0_ = 0, seed1_ = 0, threshold_ = 0;
  double scale_ = 1.0;
};

}  // namespace attnx::cpu::additive
