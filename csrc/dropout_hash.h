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

// Row and column indices enter the hash spread by these odd multipliers (attnx/_rng.py says
// why: XORed in as they are, heads and rows came out as permutations of one another).
constexpr uint32_t kDropoutRowMul = 0x9E3779B1u, kDropoutColMul = 0x85EBCA77u;

// The hash state of query row i of the head whose key is key_bh.
ATTNX_HOST_DEVICE uint32_t dropout_row_key(uint32_t key_bh, uint32_t i) {
  return mix32(key_bh ^ (i * kDropoutRowMul));
}

// r of element (row, j): kept where r >= the threshold.
ATTNX_HOST_DEVICE uint32_t dropout_hash(uint32_t key_row, uint32_t j) {
  return mix32(key_row ^ (j * kDropoutColMul));
}

}  // namespace attnx
