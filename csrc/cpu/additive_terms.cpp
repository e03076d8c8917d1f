// Let a * b + c become one FMA where the target has it (ISO -std modes turn contraction off).
#pragma GCC optimize("fp-contract=fast")
#include "additive_terms.h"

#include <chrono>
#include <cmath>
#include <cstring>

#include "sdpa_tile.h"
#include "vector_body.h"


namespace attnx::cpu::additive {
namespace {

constexpr int kKeys = 4;  // keys per loaded query vector
static_assert(kSumRows == 4, "weighted_sums_any dispatches the remainders 1-3");

#ifdef ATTNX_X86_DISPATCH
// 1 / x from the hardware estimate (vrcp14ps: 14 bits; vrcpps: 12) and one Newton step, which
// squares the relative error: ~1 ulp, at 3 instructions where a division takes 3-5 times the
// issue slots. Inline asm, not intrinsics: an intrinsic must be called from a function compiled
// for its ISA, and these bodies are compiled for it only once inlined into the ATTNX_AVX512 /
// ATTNX_AVX2 functions below.
ATTNX_BODY vf<16> recip(vf<16> x) {
  vf<16> r;
  asm("vrcp14ps %1, %0" : "=v"(r) : "v"(x));
  return r + r * (1.0f - x * r);
}
ATTNX_BODY vf<8> recip(vf<8> x) {
  vf<8> r;
  asm("vrcpps %1, %0" : "=x"(r) : "x"(x));
  return r + r * (1.0f - x * r);
}
#endif

// kRcp: recip() above; otherwise a division (the baseline build has no estimate to refine).
template <int W, bool kRcp>
ATTNX_BODY vf<W> r_of(vf<W> eq, vf<W> ek) {
  const vf<W> d = eq * ek + 1.0f;
  if constexpr (kRcp) {
    return recip(d);
  } else {
    return 1.0f / d;
  }
}

// e^y for |y| <= 80: y = n ln2 + f with n an integer (rounded through the 1.5 * 2^23 shift)
// and |f| <= ln2 / 2 from a two-part ln2 (f exact to a few ulp), e^f by its degree-7 Taylor
// polynomial (truncation < 1e-8 relative), 2^n added to the exponent bits (|n| <= 116: normal).
template <int W>
ATTNX_BODY vf<W> exp_body(vf<W> y) {
  // (vector operands: GCC compares a vector with a scalar operand lane by lane, in scalar code)
  const vf<W> top = vf<W>{} + 80.0f;
  y = y > top ? top : y;
  y = y < -top ? -top : y;
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  const vf<W> t = y * 1.44269504088896341f + kShift;
  const vf<W> n = t - kShift;
  const vf<W> f = (y - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  vf<W> p = f * (1.0f / 5040) + 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  vi<W> bits, ti;
  std::memcpy(&bits, &p, sizeof(p));
  std::memcpy(&ti, &t, sizeof(t));
  bits += (ti - 0x4B400000) << 23;  // t's low mantissa bits hold n (0x4B400000: the shift's bits)
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

template <int W>
ATTNX_BODY uint8_t exp2x_row_body(const float* x, int64_t n, int64_t ap, float* e) {
  // |x| > kExpLimit or NaN without a comparison (GCC compiled the vector compares here lane by
  // lane, 32 scalar compares a vector: half the forward's time at B = 64, L = 32): |x|'s bits
  // plus 0x7FFFFFFF - kExpLimit's bits carry into the top bit exactly there (NaN's bits are the
  // largest), and no sum wraps.
  uint32_t limit_bits;
  std::memcpy(&limit_bits, &kExpLimit, sizeof(limit_bits));
  const vu<W> magnitude = vu<W>{} + 0x7FFFFFFFu, bias = vu<W>{} + (0x7FFFFFFFu - limit_bits);
  vu<W> over{};  // top bit set where some |x| > kExpLimit
  vf<W> magnitudes{};  // sum of |x|
  int64_t a = 0;
  for (; a + W <= n; a += W) {
    const vf<W> v = load<W>(x + a);
    over |= (((vu<W>)v) & magnitude) + bias;
    magnitudes += (vf<W>)(((vu<W>)v) & magnitude);
    store<W>(e + a, exp_body<W>(v + v));
  }
  bool exact = false;
  for (int l = 0; l < W; ++l) exact |= (over[l] >> 31) != 0;
  if (a < n) {
    vf<W> v = vf<W>{};
    std::memcpy(&v, x + a, (n - a) * sizeof(float));
    for (int64_t l = 0; l < n - a; ++l) exact |= !(std::abs(x[a + l]) <= kExpLimit);
    magnitudes += (vf<W>)(((vu<W>)v) & magnitude);  // (zeros past n)
    const vf<W> ev = exp_body<W>(v + v);
    std::memcpy(e + a, &ev, (n - a) * sizeof(float));
  }
  for (a = n; a < ap; ++a) e[a] = 1.0f;
  float sum = 0.0f;
  for (int l = 0; l < W; ++l) sum += magnitudes[l];
  // (a NaN sum is not small; such a row is kLarge anyway)
  const bool small = n > 0 && sum < kSmallMeanAbs * static_cast<float>(n);
  return (exact ? kLarge : 0) | (small ? kSmall : 0);
}

template <int W, bool kRcp>
ATTNX_BODY void exp_scores_body(const float* eq, const float* ek, const float* v, float vsum,
                                int64_t ap, int64_t n, float* s) {
  int64_t j = 0;
  for (; j + kKeys <= n; j += kKeys) {
    const float* k = ek + j * ap;
    vf<W> acc[kKeys] = {};
    for (int64_t a = 0; a < ap; a += W) {
      const vf<W> x = load<W>(eq + a), va = load<W>(v + a);
      for (int t = 0; t < kKeys; ++t) acc[t] += va * r_of<W, kRcp>(x, load<W>(k + t * ap + a));
    }
    static_assert(kKeys == 4, "hsum4 sums four keys");
    hsum4(acc[0], acc[1], acc[2], acc[3], s + j);
    for (int t = 0; t < kKeys; ++t) s[j + t] = vsum - 2.0f * s[j + t];
  }
  for (; j < n; ++j) {
    vf<W> acc = {};
    for (int64_t a = 0; a < ap; a += W) {
      acc += load<W>(v + a) * r_of<W, kRcp>(load<W>(eq + a), load<W>(ek + j * ap + a));
    }
    s[j] = vsum - 2.0f * hsum<W>(acc);
  }
}

template <int W, bool kRcp>
ATTNX_BODY void exp_grads_body(const float* eq, const float* ek, const float* ds, int64_t ap,
                               int64_t n, float* dq, float* dk, float* dvr) {
  for (int64_t j = 0; j < n; j += kKeys) {
    const int keys = static_cast<int>(n - j < kKeys ? n - j : kKeys);
    float c[kKeys] = {};
    bool any = false;
    for (int t = 0; t < keys; ++t) any |= (c[t] = ds[j + t]) != 0.0f;
    if (!any) continue;  // masked keys, or ones the caller handled on the exact path
    const float* k = ek + j * ap;
    float* dkj = dk + j * ap;
    if (keys == kKeys) {
      for (int64_t a = 0; a < ap; a += W) {
        const vf<W> x = load<W>(eq + a);
        vf<W> gq = load<W>(dq + a), gv = load<W>(dvr + a);
        for (int t = 0; t < kKeys; ++t) {
          const vf<W> r = r_of<W, kRcp>(x, load<W>(k + t * ap + a));
          const vf<W> cu = c[t] * (r - r * r);
          gq += cu;
          gv += c[t] * r;
          store<W>(dkj + t * ap + a, load<W>(dkj + t * ap + a) + cu);
        }
        store<W>(dq + a, gq);
        store<W>(dvr + a, gv);
      }
    } else {
      for (int t = 0; t < keys; ++t) {
        for (int64_t a = 0; a < ap; a += W) {
          const vf<W> r = r_of<W, kRcp>(load<W>(eq + a), load<W>(k + t * ap + a));
          const vf<W> cu = c[t] * (r - r * r);
          store<W>(dq + a, load<W>(dq + a) + cu);
          store<W>(dvr + a, load<W>(dvr + a) + c[t] * r);
          store<W>(dkj + t * ap + a, load<W>(dkj + t * ap + a) + cu);
        }
      }
    }
  }
}

// The probability rows of G query rows times the same value rows: each loaded value vector
// feeds G rows' sums (one row at a time re-read every value row per query row: at Lk = 32,
// Ev = 256 that is the whole 32 KiB block from L2 for every row). U vectors of each of the G
// output rows stay in registers across all n value rows (U = 4 in 32 AVX-512 registers: four
// lines of each value row per pass), then the next U, then the tail. A zero probability (a key
// outside the row's band, masked or dropped) is skipped, not multiplied: 0 * inf would make a
// row NaN for a value it never attends.
template <int W, int G>
ATTNX_BODY void weighted_sums_body(const float* p, int64_t ps, const float* rows, int64_t n,
                                   int64_t ev, float* out, int64_t os) {
  constexpr int U = W == 16 ? 4 : 2;
  int64_t e = 0;
  for (; e + U * W <= ev; e += U * W) {
    vf<W> acc[G][U] = {};
    for (int64_t j = 0; j < n; ++j) {
      vf<W> x[U];
      for (int u = 0; u < U; ++u) x[u] = load<W>(rows + j * ev + e + u * W);
      for (int g = 0; g < G; ++g) {
        const float pg = p[g * ps + j];
        if (pg == 0.0f) continue;
        for (int u = 0; u < U; ++u) acc[g][u] += pg * x[u];
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int u = 0; u < U; ++u) store<W>(out + g * os + e + u * W, acc[g][u]);
    }
  }
  for (; e + W <= ev; e += W) {
    vf<W> acc[G] = {};
    for (int64_t j = 0; j < n; ++j) {
      const vf<W> x = load<W>(rows + j * ev + e);
      for (int g = 0; g < G; ++g) {
        if (p[g * ps + j] != 0.0f) acc[g] += p[g * ps + j] * x;
      }
    }
    for (int g = 0; g < G; ++g) store<W>(out + g * os + e, acc[g]);
  }
  for (; e < ev; ++e) {
    float acc[G] = {};
    for (int64_t j = 0; j < n; ++j) {
      for (int g = 0; g < G; ++g) {
        if (p[g * ps + j] != 0.0f) acc[g] += p[g * ps + j] * rows[j * ev + e];
      }
    }
    for (int g = 0; g < G; ++g) out[g * os + e] = acc[g];
  }
}

template <int W>
ATTNX_BODY void weighted_sums_any(const float* p, int64_t ps, int64_t g, const float* rows,
                                  int64_t n, int64_t ev, float* out, int64_t os) {
  for (; g >= kSumRows; g -= kSumRows, p += kSumRows * ps, out += kSumRows * os) {
    weighted_sums_body<W, kSumRows>(p, ps, rows, n, ev, out, os);
  }
  switch (g) {
    case 3: return weighted_sums_body<W, 3>(p, ps, rows, n, ev, out, os);
    case 2: return weighted_sums_body<W, 2>(p, ps, rows, n, ev, out, os);
    case 1: return weighted_sums_body<W, 1>(p, ps, rows, n, ev, out, os);
    default: return;
  }
}

// exp_scores' inner loop without its loads: 2 query vectors by kKeys keys, as many chains as the
// kernel keeps in flight. The empty asm makes x "change" every iteration, so nothing is hoisted.
template <int W, bool kRcp>
ATTNX_BODY double term_seconds_body(int64_t terms) {
  vf<W> x0 = vf<W>{} + 0.75f, x1 = vf<W>{} + 1.25f, va = vf<W>{} + 0.01f;
  vf<W> y[kKeys], acc[2 * kKeys] = {};
  for (int t = 0; t < kKeys; ++t) y[t] = vf<W>{} + (0.5f + 0.25f * t);
  const int64_t iters = terms / (2 * kKeys * W) + 1;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    if constexpr (kRcp) {
      asm volatile("" : "+v"(x0), "+v"(x1));
    } else {  // the baseline build holds these vectors in pairs of SSE registers
      asm volatile("" : "+m"(x0), "+m"(x1));
    }
    for (int t = 0; t < kKeys; ++t) {
      acc[t] += va * r_of<W, kRcp>(x0, y[t]);
      acc[kKeys + t] += va * r_of<W, kRcp>(x1, y[t]);
    }
  }
  const auto t1 = std::chrono::steady_clock::now();
  float sink = 0.0f;
  for (int t = 0; t < 2 * kKeys; ++t) sink += hsum<W>(acc[t]);
  asm volatile("" : : "g"(sink));
  return std::chrono::duration<double>(t1 - t0).count() * double(terms) /
         double(iters * 2 * kKeys * W);
}

#ifdef ATTNX_X86_DISPATCH
ATTNX_AVX512 void exp_scores_avx512(const float* eq, const float* ek, const float* v, float vsum,
                                    int64_t ap, int64_t n, float* s) {
  exp_scores_body<16, true>(eq, ek, v, vsum, ap, n, s);
}
ATTNX_AVX2 void exp_scores_avx2(const float* eq, const float* ek, const float* v, float vsum,
                                int64_t ap, int64_t n, float* s) {
  exp_scores_body<8, true>(eq, ek, v, vsum, ap, n, s);
}
ATTNX_AVX512 void exp_grads_avx512(const float* eq, const float* ek, const float* ds, int64_t ap,
                                   int64_t n, float* dq, float* dk, float* dvr) {
  exp_grads_body<16, true>(eq, ek, ds, ap, n, dq, dk, dvr);
}
ATTNX_AVX2 void exp_grads_avx2(const float* eq, const float* ek, const float* ds, int64_t ap,
                               int64_t n, float* dq, float* dk, float* dvr) {
  exp_grads_body<8, true>(eq, ek, ds, ap, n, dq, dk, dvr);
}
ATTNX_AVX512 void weighted_sums_avx512(const float* p, int64_t ps, int64_t g, const float* rows,
                                       int64_t n, int64_t ev, float* out, int64_t os) {
  weighted_sums_any<16>(p, ps, g, rows, n, ev, out, os);
}
ATTNX_AVX2 void weighted_sums_avx2(const float* p, int64_t ps, int64_t g, const float* rows,
                                   int64_t n, int64_t ev, float* out, int64_t os) {
  weighted_sums_any<8>(p, ps, g, rows, n, ev, out, os);
}
ATTNX_AVX512 uint8_t exp2x_row_avx512(const float* x, int64_t n, int64_t ap, float* e) {
  return exp2x_row_body<16>(x, n, ap, e);
}
ATTNX_AVX2 uint8_t exp2x_row_avx2(const float* x, int64_t n, int64_t ap, float* e) {
  return exp2x_row_body<8>(x, n, ap, e);
}
ATTNX_AVX512 double term_seconds_avx512(int64_t terms) {
  return term_seconds_body<16, true>(terms);
}
ATTNX_AVX2 double term_seconds_avx2(int64_t terms) { return term_seconds_body<8, true>(terms); }

// 16, 8 (AVX2) or 0 (baseline): the vector width chosen for all CPU kernels (cpu_choice.h).
int width() {
  static const int w = vector_isa_is_avx512()                       ? 16
                       : std::strcmp(vector_isa(), "avx2") == 0 ? 8
                                                                    : 0;
  return w;
}
#define ATTNX_PICK(name, ...)                            \
  switch (width()) {                                     \
    case 16: return name##_avx512(__VA_ARGS__);          \
    case 8: return name##_avx2(__VA_ARGS__);             \
    default: break;                                      \
  }
#else
#define ATTNX_PICK(name, ...)
#endif

}  // namespace

uint8_t exp2x_row(const float* x, int64_t n, int64_t ap, float* e) {
  ATTNX_PICK(exp2x_row, x, n, ap, e);
  return exp2x_row_body<8>(x, n, ap, e);
}

void exp_scores(const float* eq, const float* ek, const float* v, float vsum, int64_t ap,
                int64_t n, float* s) {
  ATTNX_PICK(exp_scores, eq, ek, v, vsum, ap, n, s);
  exp_scores_body<8, false>(eq, ek, v, vsum, ap, n, s);
}

void exp_grads(const float* eq, const float* ek, const float* ds, int64_t ap, int64_t n,
               float* dq, float* dk, float* dvr) {
  ATTNX_PICK(exp_grads, eq, ek, ds, ap, n, dq, dk, dvr);
  exp_grads_body<8, false>(eq, ek, ds, ap, n, dq, dk, dvr);
}

void weighted_sums(const float* p, int64_t ps, int64_t g, const float* rows, int64_t n,
                   int64_t ev, float* out, int64_t os) {
  ATTNX_PICK(weighted_sums, p, ps, g, rows, n, ev, out, os);
  weighted_sums_any<8>(p, ps, g, rows, n, ev, out, os);
}

double term_seconds(int64_t terms) {
  ATTNX_PICK(term_seconds, terms);
  return term_seconds_body<8, false>(terms);
}

}  // namespace attnx::cpu::additive
