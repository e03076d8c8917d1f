// Vector bodies written once on GCC vector types of W lanes and compiled per ISA (8 lanes for
// the baseline and AVX2, 16 for AVX-512), picked per call from a cached CPU check
// (vector_isa(), sdpa_tile.h). Inlining a baseline body into a target function compiles it for
// that target, so no intrinsics are needed. Included by the .cpp files that hold such bodies
// (sdpa_tile.cpp, decode_vectors.cpp), after their `#pragma GCC optimize("fp-contract=fast")`.
// The helpers sit in an unnamed namespace: each of those files gets its own always-inlined copy.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define ATTNX_X86_DISPATCH 1
#define ATTNX_AVX2 __attribute__((target("avx2,fma")))
#define ATTNX_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))
#endif
#define ATTNX_BODY static inline __attribute__((always_inline))
#if defined(__GNUC__) && !defined(__clang__)
// The bodies pass vectors by value, always inlined: GCC's note that a vector argument's ABI
// depends on the ISA concerns calls that never happen.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace attnx::cpu {
namespace {

template <int W>
struct Vec {
  typedef float f __attribute__((vector_size(4 * W)));
  typedef int32_t i __attribute__((vector_size(4 * W)));
  typedef uint32_t u __attribute__((vector_size(4 * W)));
};
template <int W>
using vf = typename Vec<W>::f;
template <int W>
using vi = typename Vec<W>::i;
template <int W>
using vu = typename Vec<W>::u;

template <int W>
ATTNX_BODY vf<W> load(const float* p) {
  vf<W> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <int W>
ATTNX_BODY void store(float* p, vf<W> v) {
  std::memcpy(p, &v, sizeof(v));
}

}  // namespace
}  // namespace attnx::cpu
