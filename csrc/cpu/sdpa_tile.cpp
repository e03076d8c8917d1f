// Let a * b + c become one FMA where the target has it (ISO -std modes turn contraction off).
#pragma GCC optimize("fp-contract=fast")
#include "sdpa_tile.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

// The float bodies are written once on GCC vector types (8 lanes) and instantiated twice: for
// the baseline ISA and for AVX2, picked per call from a cached CPU check. Inlining a baseline
// body into an AVX2 function compiles it with AVX2, so no intrinsics are needed.
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define ATTNX_X86_DISPATCH 1
#define ATTNX_AVX2 __attribute__((target("avx2,fma")))
#else
#define ATTNX_AVX2
#endif
#define ATTNX_BODY static inline __attribute__((always_inline))

namespace attnx::cpu {
namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
constexpr int64_t W = 8;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

ATTNX_BODY v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
ATTNX_BODY v8u splatu(uint32_t x) { return v8u{x, x, x, x, x, x, x, x}; }
ATTNX_BODY v8f load(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
ATTNX_BODY void store(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
// The last n % W elements, padded with `fill`.
ATTNX_BODY v8f load_tail(const float* p, int64_t n, float fill) {
  float buf[W];
  for (int64_t t = 0; t < W; ++t) buf[t] = t < n ? p[t] : fill;
  return load(buf);
}
ATTNX_BODY void store_tail(float* p, int64_t n, v8f v) {
  float buf[W];
  store(buf, v);
  for (int64_t t = 0; t < n; ++t) p[t] = buf[t];
}

// exp(x) for x <= 0 as 2^(x log2(e)) (Cephes' exp2f polynomial on |f| <= 1/2: fewer
// operations than a Cody-Waite reduction). Relative error ~3e-7 for |x| <= 10, growing as
// |x| * 3e-8 from the rounding of x log2(e): harmless in a softmax, where such terms are below
// e^-10 of the row's largest. Exactly 0 below -86 (so exp(-inf) = 0). Softmax arguments are
// never positive, so there is no overflow clamp (one op of ~17).
ATTNX_BODY v8f exp8(v8f x) {
  x *= splat(1.44269504088896341f);
  // Below -125 the result is 0: the mask at the end discards whatever the rounding makes of
  // such x (-inf included), so they need no clamp (7% of exp_sum's time).
  const v8i dead = x < splat(-125.0f);
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer n
  const v8f t = x + splat(magic);
  const v8f f = x - (t - splat(magic));
  v8f p = splat(1.535336188319500e-4f);
  p = p * f + splat(1.339887440266574e-3f);
  p = p * f + splat(9.618437357674640e-3f);
  p = p * f + splat(5.550332471162809e-2f);
  p = p * f + splat(2.402264791363012e-1f);
  p = p * f + splat(6.931472028550421e-1f);
  p = p * f + splat(1.0f);
  // t's bits are magic's plus n, and magic's low 9 bits are 0: shifted by 23, they are n's.
  return (v8f)(((v8i)p + ((v8i)t << 23)) & ~dead);
}

ATTNX_BODY float hmax(v8f v) {
  float m = v[0];
  for (int t = 1; t < W; ++t) m = std::max(m, v[t]);
  return m;
}
ATTNX_BODY float hsum(v8f v) {
  float s = 0.0f;
  for (int t = 0; t < W; ++t) s += v[t];
  return s;
}

ATTNX_BODY float row_max_body(const float* x, int64_t n) {
  v8f m0 = splat(NEG_INF), m1 = m0;
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    const v8f a = load(x + j), b = load(x + j + W);
    m0 = a > m0 ? a : m0;
    m1 = b > m1 ? b : m1;
  }
  for (; j + W <= n; j += W) {
    const v8f a = load(x + j);
    m0 = a > m0 ? a : m0;
  }
  if (j < n) {
    const v8f a = load_tail(x + j, n - j, NEG_INF);
    m0 = a > m0 ? a : m0;
  }
  m0 = m1 > m0 ? m1 : m0;
  return hmax(m0);
}

ATTNX_BODY float abs_max_body(const float* x, int64_t n) {
  const v8i magnitude = (v8i){} + 0x7FFFFFFF;  // all bits but the sign
  v8f m = splat(0.0f);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const v8f a = (v8f)((v8i)load(x + j) & magnitude);
    m = a > m ? a : m;
  }
  float top = hmax(m);
  for (; j < n; ++j) top = std::max(top, std::abs(x[j]));
  return top;
}

ATTNX_BODY float exp_sum_body(float* x, int64_t n, float sub) {
  const v8f s = splat(sub);
  v8f acc = splat(0.0f);
  int64_t j = 0;
  for (; j + 2 * W <= n; j += 2 * W) {
    const v8f a = exp8(load(x + j) - s), b = exp8(load(x + j + W) - s);
    store(x + j, a);
    store(x + j + W, b);
    acc += a + b;  // one accumulator: a second spilled to the stack (5% slower)
  }
  for (; j + W <= n; j += W) {
    const v8f a = exp8(load(x + j) - s);
    store(x + j, a);
    acc += a;
  }
  if (j < n) {
    const v8f a = exp8(load_tail(x + j, n - j, NEG_INF) - s);
    store_tail(x + j, n - j, a);
    acc += a;
  }
  return hsum(acc);
}

ATTNX_BODY v8u mix8(v8u x) {
  x ^= x >> 16;
  x *= splatu(0x7FEB352Du);
  x ^= x >> 15;
  x *= splatu(0x846CA68Bu);
  x ^= x >> 16;
  return x;
}

ATTNX_BODY void dropout_body(float* x, int64_t n, uint32_t key_row, uint32_t j0,
                             uint32_t threshold, float inv_keep) {
  const v8u lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const v8u key = splatu(key_row), thr = splatu(threshold);
  const v8f inv = splat(inv_keep), zero = splat(0.0f);
  for (int64_t j = 0; j < n; j += W) {
    const v8u r = mix8(key ^ (splatu(j0 + static_cast<uint32_t>(j)) + lane));
    const v8i keep = (v8i)(r >= thr);
    if (j + W <= n) {
      store(x + j, keep ? load(x + j) * inv : zero);
    } else {
      store_tail(x + j, n - j, keep ? load_tail(x + j, n - j, 0.0f) * inv : zero);
    }
  }
}

ATTNX_BODY void softmax_grad_body(float* ds, const float* p, int64_t n, float d) {
  const v8f dv = splat(d);
  int64_t j = 0;
  for (; j + W <= n; j += W) store(ds + j, load(p + j) * (load(ds + j) - dv));
  for (; j < n; ++j) ds[j] = p[j] * (ds[j] - d);
}

// The 8 mask bits of keys pos .. pos + 7, from the two bytes that hold them.
ATTNX_BODY uint32_t bits8(const uint8_t* bits, int64_t pos) {
  uint16_t two;
  std::memcpy(&two, bits + (pos >> 3), sizeof(two));
  return (two >> (pos & 7)) & 0xFFu;
}

ATTNX_BODY float mask_body(float* s, const uint8_t* bits, int64_t pos, int64_t n) {
  const v8f ninf = splat(NEG_INF);
  const v8i lane_bit = {1, 2, 4, 8, 16, 32, 64, 128};
  v8f mx = ninf;
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const v8i keep = ((v8i){} + static_cast<int32_t>(bits8(bits, pos + j))) & lane_bit;
    const v8f x = keep != 0 ? load(s + j) : ninf;
    store(s + j, x);
    mx = x > mx ? x : mx;
  }
  float tail = NEG_INF;
  for (; j < n; ++j) {
    if (!mask_bit(bits, pos + j)) s[j] = NEG_INF;
    tail = std::max(tail, s[j]);
  }
  return std::max(hmax(mx), tail);
}

#ifdef ATTNX_X86_DISPATCH
bool use_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
ATTNX_AVX2 float row_max_avx2(const float* x, int64_t n) { return row_max_body(x, n); }
ATTNX_AVX2 float abs_max_avx2(const float* x, int64_t n) { return abs_max_body(x, n); }
ATTNX_AVX2 float exp_sum_avx2(float* x, int64_t n, float sub) {
  return exp_sum_body(x, n, sub);
}
ATTNX_AVX2 void dropout_avx2(float* x, int64_t n, uint32_t key_row, uint32_t j0,
                             uint32_t threshold, float inv_keep) {
  dropout_body(x, n, key_row, j0, threshold, inv_keep);
}
ATTNX_AVX2 void softmax_grad_avx2(float* ds, const float* p, int64_t n, float d) {
  softmax_grad_body(ds, p, n, d);
}
ATTNX_AVX2 float mask_avx2(float* s, const uint8_t* bits, int64_t pos, int64_t n) {
  return mask_body(s, bits, pos, n);
}
#define ATTNX_PICK(fast, ...) \
  if (use_avx2()) return fast(__VA_ARGS__)
#else
#define ATTNX_PICK(fast, ...)
#endif

}  // namespace

float row_max(const float* x, int64_t n) {
  ATTNX_PICK(row_max_avx2, x, n);
  return row_max_body(x, n);
}

float abs_max(const float* x, int64_t n) {
  ATTNX_PICK(abs_max_avx2, x, n);
  return abs_max_body(x, n);
}

double abs_max(const double* x, int64_t n) {
  double top = 0.0;
  for (int64_t j = 0; j < n; ++j) top = std::max(top, std::abs(x[j]));
  return top;
}

float exp_sum(float* x, int64_t n, float sub) {
  ATTNX_PICK(exp_sum_avx2, x, n, sub);
  return exp_sum_body(x, n, sub);
}

float mask_bits(float* s, const uint8_t* bits, int64_t pos, int64_t n) {
  ATTNX_PICK(mask_avx2, s, bits, pos, n);
  return mask_body(s, bits, pos, n);
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
  ATTNX_PICK(dropout_avx2, x, n, key_row, j0, threshold, inv_keep);
  dropout_body(x, n, key_row, j0, threshold, inv_keep);
}

void softmax_grad_row(float* ds, const float* p, int64_t n, float d) {
  ATTNX_PICK(softmax_grad_avx2, ds, p, n, d);
  softmax_grad_body(ds, p, n, d);
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
    const bool keep = mix32(key_row ^ (j0 + static_cast<uint32_t>(j))) >= threshold;
    x[j] = keep ? x[j] * inv_keep : 0.0;
  }
}

void softmax_grad_row(double* ds, const double* p, int64_t n, double d) {
  for (int64_t j = 0; j < n; ++j) ds[j] = p[j] * (ds[j] - d);
}

}  // namespace attnx::cpu
