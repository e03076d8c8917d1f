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

template <int W>
ATTNX_BODY vf<W> splat(float x) {
  return vf<W>{} + x;
}

// 2^y for y <= 0 (y = x log2(e) in the softmax kernels: exp_sum, decode_vectors): y's rounded
// to an integer n and a fraction |f| <= 1/2, 2^f by a degree-5 polynomial (fitted for relative
// error: 9e-8, 1.6e-7 with float rounding), n added to the exponent bits. Exactly 0 below -125
// (so 2^-inf = 0). Softmax arguments are never positive, so there is no overflow clamp. The
// AVX2 and AVX-512 bodies give the same values bitwise (both contract the polynomial to FMAs).
template <int W>
ATTNX_BODY vf<W> exp2v(vf<W> y) {
  // Below -125 the result is 0: the mask at the end discards whatever the rounding makes of
  // such y (-inf included), so they need no clamp (7% of exp_sum's time).
  const vi<W> dead = y < splat<W>(-125.0f);
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer n
  const vf<W> t = y + splat<W>(magic);
  const vf<W> f = y - (t - splat<W>(magic));
  vf<W> p = splat<W>(1.32647e-3f);
  p = p * f + splat<W>(9.67151e-3f);
  p = p * f + splat<W>(5.550734e-2f);
  p = p * f + splat<W>(2.4022242e-1f);
  p = p * f + splat<W>(6.9314698e-1f);
  p = p * f + splat<W>(1.0f);
  // t's bits are magic's plus n, and magic's low 9 bits are 0: shifted by 23, they are n's.
  return (vf<W>)(((vi<W>)p + ((vi<W>)t << 23)) & ~dead);
}

}  // namespace
}  // namespace attnx::cpu
