// Vector bodies written once on GCC vector types of W lanes and compiled per ISA (8 lanes for
// the baseline and AVX2, 16 for AVX-512), picked per call from a cached choice (vector_isa(),
// sdpa_tile.h; cpu_choice.h). Inlining a baseline body into a target function compiles it for
// that target, so no intrinsics are needed. Included by the .cpp files that hold such bodies
// (sdpa_tile.cpp, decode_vectors.cpp, additive_terms.cpp), after their
// `#pragma GCC optimize("fp-contract=fast")`. The helpers sit in an unnamed namespace: each of
// those files gets its own always-inlined copy.
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

// x, held in a register for all its uses: GCC folds a loaded vector into every FMA that reads
// it, one load per use (decoding's value rows, each vector feeding two output rows: 16 loads
// per 8 vectors a key, past the two 512-bit loads a Zen 5 issues a cycle: that product took
// 1.6x the time in L1). REG: whether a vector fits one register, as in the AVX2 and AVX-512
// bodies; the baseline's 8 lanes take two SSE registers, which the constraint cannot name.
template <bool REG, int W>
ATTNX_BODY vf<W> in_register(vf<W> x) {
  if constexpr (REG) asm("" : "+v"(x));
  return x;
}

// The sum of a vector's lanes, halving the vector at each step: log2(W) adds deep, where a sum
// in lane order chains W of them (exp_sum on a decoding block's 16 keys, whose reduction is
// most of its work: exp_sum took 17% of the decoding kernel's time at D = 64 on a Zen 5).
template <int W>
ATTNX_BODY float hsum(vf<W> v) {
  if constexpr (W == 16) {
    return hsum<8>(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
  } else if constexpr (W == 8) {
    return hsum<4>(__builtin_shufflevector(v, v, 0, 1, 2, 3) +
                   __builtin_shufflevector(v, v, 4, 5, 6, 7));
  } else if constexpr (W == 4) {
    return (v[0] + v[2]) + (v[1] + v[3]);
  } else {
    float s = 0.0f;
    for (int t = 0; t < W; ++t) s += v[t];
    return s;
  }
}

// out[t] = the sum of a_t's lanes, t < 4: the four reduced together (decode's dot products,
// additive attention's scores: four keys at a time).
ATTNX_BODY void hsum4(vf<4> a0, vf<4> a1, vf<4> a2, vf<4> a3, float* out) {
  const vf<8> p01 = __builtin_shufflevector(a0, a1, 0, 1, 4, 5, 2, 3, 6, 7);  // a0 lo, a1 lo, a0 hi, a1 hi
  const vf<8> p23 = __builtin_shufflevector(a2, a3, 0, 1, 4, 5, 2, 3, 6, 7);
  const vf<4> h01 = __builtin_shufflevector(p01, p01, 0, 1, 2, 3) + __builtin_shufflevector(p01, p01, 4, 5, 6, 7);
  const vf<4> h23 = __builtin_shufflevector(p23, p23, 0, 1, 2, 3) + __builtin_shufflevector(p23, p23, 4, 5, 6, 7);
  // h01: a0 x2, a1 x2; h23: a2 x2, a3 x2
  const vf<4> sums = __builtin_shufflevector(h01, h23, 0, 2, 4, 6) + __builtin_shufflevector(h01, h23, 1, 3, 5, 7);
  std::memcpy(out, &sums, sizeof(sums));
}
ATTNX_BODY void hsum4(vf<8> a0, vf<8> a1, vf<8> a2, vf<8> a3, float* out) {
  hsum4(__builtin_shufflevector(a0, a0, 0, 1, 2, 3) + __builtin_shufflevector(a0, a0, 4, 5, 6, 7),
        __builtin_shufflevector(a1, a1, 0, 1, 2, 3) + __builtin_shufflevector(a1, a1, 4, 5, 6, 7),
        __builtin_shufflevector(a2, a2, 0, 1, 2, 3) + __builtin_shufflevector(a2, a2, 4, 5, 6, 7),
        __builtin_shufflevector(a3, a3, 0, 1, 2, 3) + __builtin_shufflevector(a3, a3, 4, 5, 6, 7), out);
}

// The sums of four vectors' lanes, reduced together: shuffles that halve all four at each step
// cost 4 instructions a key, where a lane-by-lane sum of each costs 2W.
ATTNX_BODY void hsum4(vf<16> a0, vf<16> a1, vf<16> a2, vf<16> a3, float* out) {
  const vf<16> p01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                     __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vf<16> p23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                     __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // lanes: a0 x4, a1 x4, a2 x4, a3 x4
  const vf<16> q = __builtin_shufflevector(p01, p23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                   __builtin_shufflevector(p01, p23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  hsum4(__builtin_shufflevector(q, q, 0, 1, 2, 3), __builtin_shufflevector(q, q, 4, 5, 6, 7),
        __builtin_shufflevector(q, q, 8, 9, 10, 11), __builtin_shufflevector(q, q, 12, 13, 14, 15), out);
}

// s[r][t + u] = the sum of a[r][u]'s lanes, for four rows r and four keys u at once: each
// row's four vectors halved to one whose 128-bit lanes hold a key's four partial sums (as in
// hsum4), then the four rows' partials summed in-lane together and transposed to rows; the
// same additions in the same order as hsum4 row by row, in 30 shuffles where four hsum4 took
// 48 (decoding's dot products of a GQA group's four rows: 20% less time in L1, Zen 5).
ATTNX_BODY void hsum4x4(const vf<16> (&a)[4][4], float* const* s, int64_t t) {
  vf<16> q[4];  // q[r]: 128-bit lane u holds key u's four partial sums of row r
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) {
    const vf<16> p01 =
        __builtin_shufflevector(a[r][0], a[r][1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(a[r][0], a[r][1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vf<16> p23 =
        __builtin_shufflevector(a[r][2], a[r][3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
        __builtin_shufflevector(a[r][2], a[r][3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    q[r] = __builtin_shufflevector(p01, p23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(p01, p23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  // lane u: two partials of row 0 (1), then two of row 2 (3): partials 0 + 2 and 1 + 3
  const vf<16> h01 = __builtin_shufflevector(q[0], q[1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
                     __builtin_shufflevector(q[0], q[1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const vf<16> h23 = __builtin_shufflevector(q[2], q[3], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
                     __builtin_shufflevector(q[2], q[3], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  // lane u: rows 0-3 of key u
  const vf<16> keys = __builtin_shufflevector(h01, h23, 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
                      __builtin_shufflevector(h01, h23, 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
  const vf<16> rows = __builtin_shufflevector(keys, keys, 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int r = 0; r < 4; ++r) std::memcpy(s[r] + t, reinterpret_cast<const float*>(&rows) + 4 * r, 16);
}

// 2^y for y < 127 (y = x log2(e) in the softmax kernels: exp_sum, decode_vectors): y's rounded
// to an integer n and a fraction |f| <= 1/2, 2^f by a degree-5 polynomial (fitted for relative
// error: 9e-8, 1.6e-7 with float rounding), n added to the exponent bits. Exactly 0 below -64
// (so 2^-inf = 0). Softmax arguments stay at most 8 log2(e) (the forward's lazy running max,
// sdpa_cpu.cpp LAZY_MAX; others never positive), so there is no overflow clamp. The
// AVX2 and AVX-512 bodies give the same values bitwise (both contract the polynomial to FMAs).
template <int W>
ATTNX_BODY vf<W> exp2v(vf<W> y) {
  // Below -64 the result is 0: the mask at the end discards whatever the rounding makes of
  // such y (-inf included), so they need no clamp (7% of exp_sum's time). Every caller's
  // argument is relative to a term of 1 (a row's max, its lse, a cap): terms under 2^-64 add
  // less than 2^-33 of a sum even over 2^31 keys. Kept down to 2^-125, such probabilities times
  // the values made subnormal products in P V, each a microcode assist on Intel cores: an
  // ALiBi forward (B 1 H 8 L 2048 D 64, random slopes in [0, 1)) took 1.41-1.50x the plain
  // forward's time, 1.02x with the CPU flushing subnormals, 1.01x with this bound (Xeon family 6
  // model 207, one thread).
  const vi<W> dead = y < splat<W>(-64.0f);
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
