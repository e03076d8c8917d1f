// Let a * b + c become one FMA where the target has it (ISO -std modes turn contraction off).
#pragma GCC optimize("fp-contract=fast")
#include "decode_vectors.h"

#include <cstring>
#include <string>

#include "sdpa_tile.h"

// Written once on GCC vector types of W lanes, compiled for AVX2 (8) and AVX-512 (16), as
// sdpa_tile.cpp's row operations are; the same cached choice (vector_isa()) picks the body.
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define ATTNX_X86_DISPATCH 1
#define ATTNX_AVX2 __attribute__((target("avx2,fma")))
#define ATTNX_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))
#endif
#define ATTNX_BODY static inline __attribute__((always_inline))
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace attnx::cpu {
namespace {

template <int W>
struct Vec {
  typedef float f __attribute__((vector_size(4 * W)));
};
template <int W>
using vf = typename Vec<W>::f;

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
ATTNX_BODY float hsum(vf<W> v) {
  float s = 0.0f;
  for (int t = 0; t < W; ++t) s += v[t];
  return s;
}

// Four keys per pass over q: q's vectors are loaded once for four products, and the four
// independent FMA chains hide the FMA latency.
template <int W>
ATTNX_BODY void dot_rows_body(const float* q, const float* const* k, int64_t n, int64_t e,
                              float* s) {
  const int64_t ew = e - e % W;
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    const float *k0 = k[t], *k1 = k[t + 1], *k2 = k[t + 2], *k3 = k[t + 3];
    vf<W> a0{}, a1{}, a2{}, a3{};
    for (int64_t c = 0; c < ew; c += W) {
      const vf<W> qv = load<W>(q + c);
      a0 += qv * load<W>(k0 + c);
      a1 += qv * load<W>(k1 + c);
      a2 += qv * load<W>(k2 + c);
      a3 += qv * load<W>(k3 + c);
    }
    float s0 = hsum<W>(a0), s1 = hsum<W>(a1), s2 = hsum<W>(a2), s3 = hsum<W>(a3);
    for (int64_t c = ew; c < e; ++c) {
      s0 += q[c] * k0[c], s1 += q[c] * k1[c], s2 += q[c] * k2[c], s3 += q[c] * k3[c];
    }
    s[t] = s0, s[t + 1] = s1, s[t + 2] = s2, s[t + 3] = s3;
  }
  for (; t < n; ++t) {
    vf<W> a{};
    for (int64_t c = 0; c < ew; c += W) a += load<W>(q + c) * load<W>(k[t] + c);
    float sum = hsum<W>(a);
    for (int64_t c = ew; c < e; ++c) sum += q[c] * k[t][c];
    s[t] = sum;
  }
}

// o is held in registers four vectors at a time while every key's row adds to it: o is read
// and written once per call, the n value rows (in L1/L2 from the caller's block) once each.
template <int W>
ATTNX_BODY void add_rows_body(float* o, const float* p, const float* const* v, int64_t n,
                              int64_t ev) {
  int64_t c = 0;
  for (; c + 4 * W <= ev; c += 4 * W) {
    vf<W> o0 = load<W>(o + c), o1 = load<W>(o + c + W), o2 = load<W>(o + c + 2 * W),
          o3 = load<W>(o + c + 3 * W);
    for (int64_t t = 0; t < n; ++t) {
      const vf<W> pt = vf<W>{} + p[t];
      const float* row = v[t] + c;
      o0 += pt * load<W>(row), o1 += pt * load<W>(row + W);
      o2 += pt * load<W>(row + 2 * W), o3 += pt * load<W>(row + 3 * W);
    }
    store<W>(o + c, o0), store<W>(o + c + W, o1), store<W>(o + c + 2 * W, o2);
    store<W>(o + c + 3 * W, o3);
  }
  for (; c + W <= ev; c += W) {
    vf<W> acc = load<W>(o + c);
    for (int64_t t = 0; t < n; ++t) acc += (vf<W>{} + p[t]) * load<W>(v[t] + c);
    store<W>(o + c, acc);
  }
  for (; c < ev; ++c) {
    float acc = o[c];
    for (int64_t t = 0; t < n; ++t) acc += p[t] * v[t][c];
    o[c] = acc;
  }
}

#ifdef ATTNX_X86_DISPATCH
ATTNX_AVX2 void dot_rows_avx2(const float* q, const float* const* k, int64_t n, int64_t e,
                              float* s) {
  dot_rows_body<8>(q, k, n, e, s);
}
ATTNX_AVX512 void dot_rows_avx512(const float* q, const float* const* k, int64_t n, int64_t e,
                                  float* s) {
  dot_rows_body<16>(q, k, n, e, s);
}
ATTNX_AVX2 void add_rows_avx2(float* o, const float* p, const float* const* v, int64_t n,
                              int64_t ev) {
  add_rows_body<8>(o, p, v, n, ev);
}
ATTNX_AVX512 void add_rows_avx512(float* o, const float* p, const float* const* v, int64_t n,
                                  int64_t ev) {
  add_rows_body<16>(o, p, v, n, ev);
}

enum class Isa { baseline, avx2, avx512 };
Isa isa() {
  static const Isa chosen = [] {
    const std::string name = vector_isa();
    return name == "avx512" ? Isa::avx512 : name == "avx2" ? Isa::avx2 : Isa::baseline;
  }();
  return chosen;
}
#endif

}  // namespace

void dot_rows(const float* q, const float* const* k, int64_t n, int64_t e, float* s) {
#ifdef ATTNX_X86_DISPATCH
  switch (isa()) {
    case Isa::avx512: return dot_rows_avx512(q, k, n, e, s);
    case Isa::avx2: return dot_rows_avx2(q, k, n, e, s);
    case Isa::baseline: break;
  }
#endif
  dot_rows_body<8>(q, k, n, e, s);
}

void add_rows(float* o, const float* p, const float* const* v, int64_t n, int64_t ev) {
#ifdef ATTNX_X86_DISPATCH
  switch (isa()) {
    case Isa::avx512: return add_rows_avx512(o, p, v, n, ev);
    case Isa::avx2: return add_rows_avx2(o, p, v, n, ev);
    case Isa::baseline: break;
  }
#endif
  add_rows_body<8>(o, p, v, n, ev);
}

void dot_rows(const double* q, const double* const* k, int64_t n, int64_t e, double* s) {
  for (int64_t t = 0; t < n; ++t) {
    double sum = 0.0;
    for (int64_t c = 0; c < e; ++c) sum += q[c] * k[t][c];
    s[t] = sum;
  }
}

void add_rows(double* o, const double* p, const double* const* v, int64_t n, int64_t ev) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < ev; ++c) o[c] += p[t] * v[t][c];
}

}  // namespace attnx::cpu
