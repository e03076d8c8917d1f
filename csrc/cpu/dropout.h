// The dropout decision of attnx/_rng.py, bit for bit, shared by the CPU kernels: one
// counter-based 32-bit hash of (seed, b * Hq + h, i, j), so they drop exactly what every other
// backend drops for the same seed.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "../dropout_hash.h"

namespace attnx::cpu {

struct Dropout {
  bool on = false;
  uint32_t s0 = 0, s1 = 0, threshold = 0;
  double inv_keep = 1.0;

  Dropout(double p, const std::optional<at::Tensor>& seed) {
    if (p <= 0.0) return;
    TORCH_CHECK(seed.has_value() && seed->numel() == 2 && seed->scalar_type() == at::kLong &&
                    seed->device().is_cpu(),
                "attnx: dropout_p > 0 needs seed, an int64 (2,) CPU tensor");
    const at::Tensor s = seed->contiguous();
    s0 = static_cast<uint32_t>(s.data_ptr<int64_t>()[0]);
    s1 = static_cast<uint32_t>(s.data_ptr<int64_t>()[1]);
    // As _rng.keep_threshold: min(floor(p * 2**32), 2**32 - 1).
    const double t = std::floor(p * 4294967296.0);
    threshold = t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
    inv_keep = 1.0 / (1.0 - p);
    on = true;
  }

  uint32_t key_bh(int64_t bh) const { return mix32(s0 ^ mix32(static_cast<uint32_t>(bh) ^ s1)); }
  static uint32_t key_row(uint32_t key_bh, int64_t i) {
    return dropout_row_key(key_bh, static_cast<uint32_t>(i));
  }
  // The hash state shared by all keys of query row i of head bh (0 when dropout is off).
  uint32_t row_key(int64_t bh, int64_t i) const { return on ? key_row(key_bh(bh), i) : 0; }
  // What probability (row, j) is multiplied by: 1 without dropout, else 0 or 1 / (1 - p).
  double factor(uint32_t row_key, int64_t j) const {
    if (!on) return 1.0;
    return dropout_hash(row_key, static_cast<uint32_t>(j)) >= threshold ? inv_keep : 0.0;
  }
};

}  // namespace attnx::cpu
