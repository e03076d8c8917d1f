// Host twins of ../mma.cuh's primitives, with the fragment layouts of the PTX ISA documented
// there. mma and ldmatrix are warp collectives (.sync.aligned: every lane arrives with the same
// call); each lane brings its own operands (ldmatrix: its own row address), the last lane to
// arrive gathers them and computes for the warp. Products of fp16/bf16 are exact in fp32 and
// summed in fp32, as on the tensor cores (which do not fix the order of the additions).
// cp.async copies land only at the issuing thread's matching wait (scheduler.h), so a missing
// wait or commit leaves the NaN bytes shared memory starts with.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace attnx {
namespace cuda {
namespace mma_host {

inline float from_bits(uint16_t bits, __half) {
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}
inline float from_bits(uint16_t bits, __nv_bfloat16) {
  __nv_bfloat16_raw raw;
  raw.x = bits;
  return __bfloat162float(__nv_bfloat16(raw));
}

// Element `half` (0: low, 1: high) of a register as float, read as T.
template <typename T>
float element(uint32_t r, int half) {
  return from_bits(uint16_t(r >> (16 * half)), T());
}

inline uint32_t join(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

// ldmatrix over `matrices` 8x8 matrices, optionally transposed: lane 8i + r's address is row r
// of matrix i; register i of lane l is row l/4, elements 2(l%4), +1 (trans: column l/4, rows).
template <int N>
void ldmatrix(uint32_t (&r)[N], const void* row, bool trans, const char* what) {
  struct Slot {
    const void* row;
    uint32_t* out;
  } slot{row, r};
  ::attnx::host::warp_collective(what, 0, &slot, [trans](void* const* slots) {
    uint16_t m[N][8][8];
    for (int i = 0; i < N; ++i)
      for (int k = 0; k < 8; ++k) {
        const void* p = static_cast<const Slot*>(slots[8 * i + k])->row;
        if (!::attnx::host::in_dynamic_smem(p, 16) || reinterpret_cast<uintptr_t>(p) % 16 != 0)
          ::attnx::host::misuse("ldmatrix row address not 16-byte aligned in dynamic shared memory");
        std::memcpy(m[i][k], p, 16);
      }
    for (int l = 0; l < 32; ++l) {
      uint32_t* out = static_cast<const Slot*>(slots[l])->out;
      const int g = l / 4, t = l % 4;
      for (int i = 0; i < N; ++i)
        out[i] = trans ? join(m[i][2 * t][g], m[i][2 * t + 1][g])
                       : join(m[i][g][2 * t], m[i][g][2 * t + 1]);
    }
  });
}

}  // namespace mma_host

template <typename T>
void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value,
                "mma_m16n8k16 takes __half or __nv_bfloat16");
  struct Slot {
    float* d;
    const uint32_t* a;
    const uint32_t* b;
  } slot{d, a, b};
  ::attnx::host::warp_collective(
      std::is_same<T, __half>::value ? "mma.m16n8k16.f16" : "mma.m16n8k16.bf16", 0, &slot,
      [](void* const* slots) {
        float A[16][16], B[16][8], D[16][8];
        for (int l = 0; l < 32; ++l) {
          const Slot& s = *static_cast<const Slot*>(slots[l]);
          const int g = l / 4, t = l % 4;
          for (int e = 0; e < 2; ++e) {
            A[g][2 * t + e] = mma_host::element<T>(s.a[0], e);
            A[g + 8][2 * t + e] = mma_host::element<T>(s.a[1], e);
            A[g][2 * t + 8 + e] = mma_host::element<T>(s.a[2], e);
            A[g + 8][2 * t + 8 + e] = mma_host::element<T>(s.a[3], e);
            B[2 * t + e][g] = mma_host::element<T>(s.b[0], e);
            B[2 * t + 8 + e][g] = mma_host::element<T>(s.b[1], e);
            D[g][2 * t + e] = s.d[e];
            D[g + 8][2 * t + e] = s.d[2 + e];
          }
        }
        for (int l = 0; l < 32; ++l) {
          float* d = static_cast<const Slot*>(slots[l])->d;
          const int g = l / 4, t = l % 4;
          for (int e = 0; e < 4; ++e) {
            const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
            float acc = D[row][col];
            for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
            d[e] = acc;
          }
        }
      });
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  mma_host::ldmatrix(r, row, false, "ldmatrix.x4");
}
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  mma_host::ldmatrix(r, row, true, "ldmatrix.x4.trans");
}
inline void ldmatrix_x2(uint32_t (&r)[2], const void* row) {
  mma_host::ldmatrix(r, row, false, "ldmatrix.x2");
}
inline void ldmatrix_x2_trans(uint32_t (&r)[2], const void* row) {
  mma_host::ldmatrix(r, row, true, "ldmatrix.x2.trans");
}

inline void cp_async_16(void* smem, const void* gmem, bool in_bounds) {
  ::attnx::host::async_copy(smem, in_bounds ? gmem : nullptr);
}
inline void cp_async_commit() { ::attnx::host::async_commit(); }
template <int N>
void cp_async_wait() {
  ::attnx::host::async_wait(N);
}

}  // namespace cuda
}  // namespace attnx
