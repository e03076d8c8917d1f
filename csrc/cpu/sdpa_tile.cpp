// Let a * b + c become one FMA where the target has it (ISO -std modes turn contraction off).
#pragma GCC optimize("fp-contract=fast")
#include "sdpa_tile.h"

#include "cpu_choice.h"
#include "score_mods.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

// AVX-512 runs exp_sum in 2/3 of AVX2's time even on Zen 4, whose 512-bit units are two 256-bit
// ones (0.20 vs 0.30 ns per element on 256-key rows, one core): half the instructions to issue.
#include "vector_body.h"

namespace attnx::cpu {
namespace {

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

template <int W>
ATTNX_BODY vu<W> splatu(uint32_t x) {
  return vu<W>{} + x;
}
// 0, 1, ..., W - 1
template <int W>
ATTNX_BODY vu<W> lanes() {
  vu<W> v;
  for (int t = 0; t < W; ++t) v[t] = static_cast<uint32_t>(t);
  return v;
}
// The last n % W elements, padded with `fill`.
template <int W>
ATTNX_BODY vf<W> load_tail(const float* p, int64_t n, float fill) {
  float buf[W];
  for (int64_t t = 0; t < W; ++t) buf[t] = t < n ? p[t] : fill;
  return load<W>(buf);
}
template <int W>
ATTNX_BODY void store_tail(float* p, int64_t n, vf<W> v) {
  float buf[W];
  store<W>(buf, v);
  for (int64_t t = 0; t < n; ++t) p[t] = buf[t];
}

template <int W>
ATTNX_BODY vf<W> vmax(vf<W> a, vf<W> b) {
  return a > b ? a : b;
}
// The max of a vector's lanes, halving the vector at each step: log2(W) maxima deep, where the
// lanes one by one chained W scalar ones (extracts included: row_max then exp_sum on a 256-key
// row took 98 ns that way, 67 this way, Xeon family 6 model 207, one thread). Rows hold no NaN
// here (the bodies' comparisons drop it).
template <int W>
ATTNX_BODY float hmax(vf<W> v) {
  if constexpr (W == 16) {
    return hmax<8>(vmax<8>(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)));
  } else if constexpr (W == 8) {
    return hmax<4>(vmax<4>(__builtin_shufflevector(v, v, 0, 1, 2, 3),
                           __builtin_shufflevector(v, v, 4, 5, 6, 7)));
  } else {
    static_assert(W == 4, "vectors of 4, 8 or 16 lanes");
    const vf<4> h = vmax<4>(v, __builtin_shufflevector(v, v, 2, 3, 0, 1));
    return std::max(h[0], h[1]);
  }
}
template <int W>
ATTNX_BODY float row_max_body(const float* x, int64_t n) {
  vf<W> m0 = splat<W>(NEG_INF), m1 = m0;
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    const vf<W> a = load<W>(x + j), b = load<W>(x + j + W);
    m0 = a > m0 ? a : m0;
    m1 = b > m1 ? b : m1;
  }
  for (; j + W <= n; j += W) {
    const vf<W> a = load<W>(x + j);
    m0 = a > m0 ? a : m0;
  }
  if (j < n) {
    const vf<W> a = load_tail<W>(x + j, n - j, NEG_INF);
    m0 = a > m0 ? a : m0;
  }
  m0 = m1 > m0 ? m1 : m0;
  return hmax<W>(m0);
}

template <int W>
ATTNX_BODY void row_max4_body(const float* const* x, int64_t n, float* out) {
  vf<W> m[4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) m[r] = splat<W>(NEG_INF);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) m[r] = vmax<W>(load<W>(x[r] + j), m[r]);
  }
  if (j < n) {
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) m[r] = vmax<W>(load_tail<W>(x[r] + j, n - j, NEG_INF), m[r]);
  }
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) out[r] = hmax<W>(m[r]);
}

template <int W>
ATTNX_BODY float abs_max_body(const float* x, int64_t n) {
  const vi<W> magnitude = vi<W>{} + 0x7FFFFFFF;  // all bits but the sign
  vf<W> m = splat<W>(0.0f);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const vf<W> a = (vf<W>)((vi<W>)load<W>(x + j) & magnitude);
    m = a > m ? a : m;
  }
  float top = hmax<W>(m);
  for (; j < n; ++j) top = std::max(top, std::abs(x[j]));
  return top;
}

// exp(x - sub) as 2^y. With FMA and |sub| <= FUSED_SUB_MAX, y = x log2(e) - sub log2(e) in one
// rounding: against exp(x - sub) with a degree-6 polynomial, +1-3% on the causal forward at
// L = 4096 (interleaved in one process, 2 threads). The rounding of sub log2(e) scales the
// call's terms alike, by at most |sub| 2^-24 relative (3.8e-6 at 64): the size of the rounding
// of a float lse near sub, which the backward's exp(s - lse) already carries. Past the bound
// that error grows, and past ~1e9 the row's max term itself would leave exp2v's range (y > 0
// by the rounding), so there, and without FMA (where x log2(e) would round on its own, an error
// growing with |x|, not |x - sub|), y = (x - sub) log2(e): exact for x near sub.
constexpr float FUSED_SUB_MAX = 64.0f;

template <int W, bool FUSED>
ATTNX_BODY vf<W> exp_arg(vf<W> x, float sub) {
  const vf<W> c = splat<W>(1.44269504088896341f);
  return FUSED ? x * c - splat<W>(sub * 1.44269504088896341f) : (x - splat<W>(sub)) * c;
}

// x[0, n) = exp(x - sub) in place, n <= W (n == W: a whole vector); returns the new values
// (0 past n: the tail loads -inf there). With TRACK, *top takes the max of the old values and
// keep[0, n) a copy of them.
template <int W, bool FUSED, bool TRACK = false>
ATTNX_BODY vf<W> exp_in_place(float* x, int64_t n, float sub, vf<W>* top = nullptr,
                              float* keep = nullptr) {
  const vf<W> raw = n == W ? load<W>(x) : load_tail<W>(x, n, NEG_INF);
  if constexpr (TRACK) *top = vmax<W>(raw, *top);
  const vf<W> a = exp2v<W>(exp_arg<W, FUSED>(raw, sub));
  if (n == W) {
    store<W>(x, a);
    if constexpr (TRACK) store<W>(keep, raw);
  } else {
    store_tail<W>(x, n, a);
    if constexpr (TRACK) store_tail<W>(keep, n, raw);
  }
  return a;
}

template <int W, bool FUSED>
ATTNX_BODY float exp_sum_loop(float* x, int64_t n, float sub) {
  vf<W> acc = splat<W>(0.0f);
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    const vf<W> a = exp_in_place<W, FUSED>(x + j, W, sub);
    const vf<W> b = exp_in_place<W, FUSED>(x + j + W, W, sub);
    acc += a + b;  // one accumulator: a second spilled to the stack (5% slower, AVX2)
  }
  for (; j + W <= n; j += W) acc += exp_in_place<W, FUSED>(x + j, W, sub);
  if (j < n) acc += exp_in_place<W, FUSED>(x + j, n - j, sub);
  return hsum<W>(acc);
}

template <int W, bool FUSED, bool TRACK>
ATTNX_BODY void exp_sum4_loop(float* const* x, int64_t n, const float* sub, float* sums,
                              float* maxes, float* const* keep) {
  vf<W> acc[4] = {}, top[4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) top[r] = splat<W>(NEG_INF);
  for (int64_t j = 0; j < n; j += W) {
    const int64_t m = std::min<int64_t>(W, n - j);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      acc[r] += exp_in_place<W, FUSED, TRACK>(x[r] + j, m, sub[r], &top[r],
                                              TRACK ? keep[r] + j : nullptr);
    }
  }
  hsum4(acc[0], acc[1], acc[2], acc[3], sums);
  if constexpr (TRACK) {
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) maxes[r] = hmax<W>(top[r]);
  }
}

template <int W, bool FMA = true>
ATTNX_BODY void exp_sum4_body(float* const* x, int64_t n, const float* sub, float* sums,
                              float* maxes, float* const* keep) {
  bool fused = FMA;  // the four rows take one form: fused where every sub allows it
  for (int r = 0; r < 4; ++r) fused = fused && std::abs(sub[r]) <= FUSED_SUB_MAX;
  if (maxes != nullptr) {
    if (fused) return exp_sum4_loop<W, true, true>(x, n, sub, sums, maxes, keep);
    return exp_sum4_loop<W, false, true>(x, n, sub, sums, maxes, keep);
  }
  if (fused) return exp_sum4_loop<W, true, false>(x, n, sub, sums, maxes, keep);
  exp_sum4_loop<W, false, false>(x, n, sub, sums, maxes, keep);
}

template <int W, bool FMA = true>
ATTNX_BODY float exp_sum_body(float* x, int64_t n, float sub) {
  if (FMA && std::abs(sub) <= FUSED_SUB_MAX) return exp_sum_loop<W, true>(x, n, sub);
  return exp_sum_loop<W, false>(x, n, sub);
}

template <int W>
ATTNX_BODY vu<W> mix(vu<W> x) {
  x ^= x >> 16;
  x *= splatu<W>(0x7FEB352Du);
  x ^= x >> 15;
  x *= splatu<W>(0x846CA68Bu);
  x ^= x >> 16;
  return x;
}

template <int W>
ATTNX_BODY void dropout_body(float* x, int64_t n, uint32_t key_row, uint32_t j0,
                             uint32_t threshold, float inv_keep) {
  const vu<W> key = splatu<W>(key_row), thr = splatu<W>(threshold);
  const vf<W> inv = splat<W>(inv_keep), zero = splat<W>(0.0f);
  // column j's spread index j * kDropoutColMul (dropout_hash), stepped by an add
  const vu<W> step = splatu<W>(uint32_t(W) * kDropoutColMul);
  vu<W> col = (splatu<W>(j0) + lanes<W>()) * splatu<W>(kDropoutColMul);
  for (int64_t j = 0; j < n; j += W, col += step) {
    const vu<W> r = mix<W>(key ^ col);
    const vi<W> keep = (vi<W>)(r >= thr);
    if (j + W <= n) {
      store<W>(x + j, keep ? load<W>(x + j) * inv : zero);
    } else {
      store_tail<W>(x + j, n - j, keep ? load_tail<W>(x + j, n - j, 0.0f) * inv : zero);
    }
  }
}

template <int W>
ATTNX_BODY void softmax_grad_body(float* ds, const float* p, int64_t n, float d) {
  const vf<W> dv = splat<W>(d);
  int64_t j = 0;
  for (; j + W <= n; j += W) store<W>(ds + j, load<W>(p + j) * (load<W>(ds + j) - dv));
  for (; j < n; ++j) ds[j] = p[j] * (ds[j] - d);
}

// s[j] -= slope |diag - j| over s[0, n), |diag| and n below kAlibiInt32 (alibi_row): the
// distances in int32 lanes, each converted once (as the int64 loop converts them).
template <int W>
ATTNX_BODY void alibi_body(float* s, int64_t n, float slope, int64_t diag) {
  const vf<W> sl = splat<W>(slope);
  const vi<W> lane = (vi<W>)lanes<W>();
  for (int64_t j = 0; j < n; j += W) {
    const vi<W> d = (vi<W>{} + static_cast<int32_t>(diag - j)) - lane;
    const vf<W> dist = __builtin_convertvector(d < 0 ? -d : d, vf<W>);
    if (j + W <= n) {
      store<W>(s + j, load<W>(s + j) - sl * dist);
    } else {
      store_tail<W>(s + j, n - j, load_tail<W>(s + j, n - j, 0.0f) - sl * dist);
    }
  }
}

// s = cap tanh(s / cap), and dcap = 1 - tanh^2 (if not null). tanh(|y|) = (1 - z) / (1 + z),
// z = exp(-2 |y|) from exp2v, for |y| >= 1/4 (where 1 - z >= 0.39 keeps z's relative error,
// 1.6e-7, within 2.5e-7 of the result); below, its odd Taylor series to y^9 (next term under
// 2.2e-9 relative). std::tanh in a scalar loop made the soft-capped forward 2.5x slower.
template <int W>
ATTNX_BODY void softcap_body(float* s, int64_t n, float cap, float* dcap) {
  const vf<W> inv = splat<W>(1.0f / cap), c = splat<W>(cap), one = splat<W>(1.0f);
  const vi<W> sign = vi<W>{} + static_cast<int32_t>(0x80000000u);
  for (int64_t j = 0; j < n; j += W) {
    const bool full = j + W <= n;
    const vf<W> y = (full ? load<W>(s + j) : load_tail<W>(s + j, n - j, 0.0f)) * inv;
    const vf<W> a = (vf<W>)((vi<W>)y & ~sign);
    const vf<W> z = exp2v<W>(a * splat<W>(-2.88539008177792681f));  // -2 log2(e) |y|
    const vf<W> far = (one - z) / (one + z);
    const vf<W> a2 = a * a;
    vf<W> p = splat<W>(62.0f / 2835.0f);
    p = p * a2 + splat<W>(-17.0f / 315.0f);
    p = p * a2 + splat<W>(2.0f / 15.0f);
    p = p * a2 + splat<W>(-1.0f / 3.0f);
    const vf<W> near = a + a * a2 * p;
    const vf<W> t = (vf<W>)((vi<W>)(a < splat<W>(0.25f) ? near : far) | ((vi<W>)y & sign));
    if (full) {
      store<W>(s + j, c * t);
      if (dcap != nullptr) store<W>(dcap + j, one - t * t);
    } else {
      store_tail<W>(s + j, n - j, c * t);
      if (dcap != nullptr) store_tail<W>(dcap + j, n - j, one - t * t);
    }
  }
}

// The W mask bits of keys pos .. pos + W - 1, from the W / 8 + 1 bytes that hold them (loaded
// as a uint16_t and a byte: a 3-byte memcpy went through the stack, 13% of the masked forward).
template <int W>
ATTNX_BODY uint32_t mask_word(const uint8_t* bits, int64_t pos) {
  static_assert(W == 8 || W == 16, "W / 8 + 1 bytes: 2 or 3");
  const uint8_t* at = bits + (pos >> 3);
  uint16_t two;
  std::memcpy(&two, at, sizeof(two));  // little-endian: bit k of the pair is key 8 (pos / 8) + k
  uint32_t word = two;
  if (W == 16) word |= static_cast<uint32_t>(at[2]) << 16;
  return (word >> (pos & 7)) & ((1u << W) - 1);
}

template <int W>
ATTNX_BODY float mask_body(float* s, const uint8_t* bits, int64_t pos, int64_t n) {
  const vf<W> ninf = splat<W>(NEG_INF);
  const vi<W> lane_bit = (vi<W>)(splatu<W>(1) << lanes<W>());
  vf<W> mx = ninf;
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const vi<W> keep = (vi<W>{} + static_cast<int32_t>(mask_word<W>(bits, pos + j))) & lane_bit;
    const vf<W> x = keep != 0 ? load<W>(s + j) : ninf;
    store<W>(s + j, x);
    mx = x > mx ? x : mx;
  }
  float tail = NEG_INF;
  for (; j < n; ++j) {
    if (!mask_bit(bits, pos + j)) s[j] = NEG_INF;
    tail = std::max(tail, s[j]);
  }
  return std::max(hmax<W>(mx), tail);
}

enum class Isa { baseline, avx2, avx512 };

#ifdef ATTNX_X86_DISPATCH
// AVX-512 or AVX2 as measured at first use, or as ATTNX_CPU_AVX512 fixes it (cpu_choice.h):
// ATTNX_CPU_AVX512=0 keeps the AVX2 bodies on a CPU that has AVX-512, so that what CPUs
// without it run can be tested and compared there.
Isa isa() {
  static const Isa chosen = [] {
    const std::string name = vector_choice().isa;
    return name == "avx512" ? Isa::avx512 : name == "avx2" ? Isa::avx2 : Isa::baseline;
  }();
  return chosen;
}
// name_avx2 and name_avx512: the body of `name` compiled for each, 8 and 16 lanes.
#define ATTNX_TARGETS(ret, name, params, ...)                                          \
  ATTNX_AVX2 ret name##_avx2 params { return name##_body<8>(__VA_ARGS__); }           \
  ATTNX_AVX512 ret name##_avx512 params { return name##_body<16>(__VA_ARGS__); }
ATTNX_TARGETS(float, row_max, (const float* x, int64_t n), x, n)
ATTNX_TARGETS(void, row_max4, (const float* const* x, int64_t n, float* out), x, n, out)
ATTNX_TARGETS(float, abs_max, (const float* x, int64_t n), x, n)
ATTNX_TARGETS(float, exp_sum, (float* x, int64_t n, float sub), x, n, sub)
ATTNX_TARGETS(void, exp_sum4,
              (float* const* x, int64_t n, const float* sub, float* sums, float* maxes,
               float* const* keep),
              x, n, sub, sums, maxes, keep)
ATTNX_TARGETS(void, dropout,
              (float* x, int64_t n, uint32_t key_row, uint32_t j0, uint32_t threshold,
               float inv_keep),
              x, n, key_row, j0, threshold, inv_keep)
ATTNX_TARGETS(void, softmax_grad, (float* ds, const float* p, int64_t n, float d), ds, p, n, d)
ATTNX_TARGETS(float, mask, (float* s, const uint8_t* bits, int64_t pos, int64_t n), s, bits,
              pos, n)
ATTNX_TARGETS(void, softcap, (float* s, int64_t n, float cap, float* dcap), s, n, cap, dcap)
ATTNX_TARGETS(void, alibi, (float* s, int64_t n, float slope, int64_t diag), s, n, slope, diag)
#undef ATTNX_TARGETS
// Returns from the calling function with the widest body this CPU runs, if it runs one.
#define ATTNX_PICK(name, ...)                                                 \
  switch (isa()) {                                                            \
    case Isa::avx512: return name##_avx512(__VA_ARGS__);                      \
    case Isa::avx2: return name##_avx2(__VA_ARGS__);                          \
    case Isa::baseline: break;                                                \
  }
#else
Isa isa() { return Isa::baseline; }
#define ATTNX_PICK(name, ...)
#endif

}  // namespace

bool vector_isa_is_avx512() { return isa() == Isa::avx512; }

const char* vector_isa() {
  switch (isa()) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    case Isa::baseline: break;
  }
  return "baseline";
}

float row_max(const float* x, int64_t n) {
  ATTNX_PICK(row_max, x, n);
  return row_max_body<8>(x, n);
}

void row_max4(const float* const* x, int64_t n, float* out) {
  ATTNX_PICK(row_max4, x, n, out);
  row_max4_body<8>(x, n, out);
}

float abs_max(const float* x, int64_t n) {
  ATTNX_PICK(abs_max, x, n);
  return abs_max_body<8>(x, n);
}

double abs_max(const double* x, int64_t n) {
  double top = 0.0;
  for (int64_t j = 0; j < n; ++j) top = std::max(top, std::abs(x[j]));
  return top;
}

float exp_sum(float* x, int64_t n, float sub) {
  ATTNX_PICK(exp_sum, x, n, sub);
  return exp_sum_body<8, false>(x, n, sub);
}

void exp_sum4(float* const* x, int64_t n, const float* sub, float* sums, float* maxes,
              float* const* keep) {
  ATTNX_PICK(exp_sum4, x, n, sub, sums, maxes, keep);
  exp_sum4_body<8, false>(x, n, sub, sums, maxes, keep);
}

float mask_bits(float* s, const uint8_t* bits, int64_t pos, int64_t n) {
  ATTNX_PICK(mask, s, bits, pos, n);
  return mask_body<8>(s, bits, pos, n);
}

double mask_bits(double* s, const uint8_t* bits, int64_t pos, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    if (!mask_bit(bits, pos + j)) s[j] = -std::numeric_limits<double>::infinity();
  }
  return row_max(s, n);
}

void scale_row(float* x, int64_t n, float a) {
  for (int64_t j = 0; j < n; ++j) x[j] *= a;
}

void dropout_row(float* x, int64_t n, uint32_t key_row, uint32_t j0, uint32_t threshold,
                 float inv_keep) {
  ATTNX_PICK(dropout, x, n, key_row, j0, threshold, inv_keep);
  dropout_body<8>(x, n, key_row, j0, threshold, inv_keep);
}

void softcap_row(float* s, int64_t n, float cap, float* dcap) {
  ATTNX_PICK(softcap, s, n, cap, dcap);
  softcap_body<8>(s, n, cap, dcap);
}

void alibi_row(float* s, int64_t n, float slope, int64_t diag) {
  if (std::abs(diag) < kAlibiInt32 && n < kAlibiInt32) {
    ATTNX_PICK(alibi, s, n, slope, diag);
    return alibi_body<8>(s, n, slope, diag);
  }
  for (int64_t j = 0; j < n; ++j) s[j] -= slope * static_cast<float>(std::abs(diag - j));
}

void alibi_row(double* s, int64_t n, double slope, int64_t diag) {
  for (int64_t j = 0; j < n; ++j) s[j] -= slope * static_cast<double>(std::abs(diag - j));
}

void softcap_row(double* s, int64_t n, double cap, double* dcap) {
  for (int64_t j = 0; j < n; ++j) {
    const double t = std::tanh(s[j] / cap);
    s[j] = cap * t;
    if (dcap != nullptr) dcap[j] = 1.0 - t * t;
  }
}

void softmax_grad_row(float* ds, const float* p, int64_t n, float d) {
  ATTNX_PICK(softmax_grad, ds, p, n, d);
  softmax_grad_body<8>(ds, p, n, d);
}

double row_max(const double* x, int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

double exp_sum(double* x, int64_t n, double sub) {
  double s = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] - sub);
    s += x[j];
  }
  return s;
}

void scale_row(double* x, int64_t n, double a) {
  for (int64_t j = 0; j < n; ++j) x[j] *= a;
}

void dropout_row(double* x, int64_t n, uint32_t key_row, uint32_t j0, uint32_t threshold,
                 double inv_keep) {
  for (int64_t j = 0; j < n; ++j) {
    const bool keep = dropout_hash(key_row, j0 + static_cast<uint32_t>(j)) >= threshold;
    x[j] = keep ? x[j] * inv_keep : 0.0;
  }
}

void softmax_grad_row(double* ds, const double* p, int64_t n, double d) {
  for (int64_t j = 0; j < n; ++j) ds[j] = p[j] * (ds[j] - d);
}

}  // namespace attnx::cpu
