// The 32-bit mixing function of the dropout hash of attnx/_rng.py, the one definition the CPU
// and CUDA kernels share, so that every backend drops the same elements. No ATen: the
// vectorized row kernels of cpu/sdpa_tile.cpp and the device code include it too.
#pragma once
#include <cstdint>

#ifdef __CUDACC__
#define ATTNX_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTNX_HOST_DEVICE inline
#endif

namespace attnx {

// uint32 arithmetic wraps mod 2**32, which is exactly what _rng.py emulates with int64.
ATTNX_HOST_DEVICE uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

}  // namespace attnx
