// The 32-bit mixing function of the dropout hash of attnx/_rng.py (no ATen: the vectorized row
// kernels of sdpa_tile.cpp include it too).
#pragma once
#include <cstdint>

namespace attnx::cpu {

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

}  // namespace attnx::cpu
