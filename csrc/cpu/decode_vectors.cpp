// Let a * b + c become one FMA where the target has it (ISO -std modes turn contraction off).
#pragma GCC optimize("fp-contract=fast")
#include "decode_vectors.h"

#include <cstring>
#include <string>

#include "sdpa_tile.h"

// Written once on GCC vector types of W lanes (vector_body.h), compiled for AVX2 (8) and
// AVX-512 (16), as sdpa_tile.cpp's row operations are; the same cached choice picks the body.
#include "vector_body.h"

namespace attnx::cpu {
namespace {

template <int W>
ATTNX_BODY float hsum(vf<W> v) {
  float s = 0.0f;
  for (int t = 0; t < W; ++t) s += v[t];
  return s;
}

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

// Row t of `ahead` (if any) towards L2, a cache line at a time.
template <typename T>
ATTNX_BODY void fetch_ahead(const Ahead<T>& ahead, int64_t t) {
  if (t >= ahead.n) return;
  const char* p = reinterpret_cast<const char*>(ahead.rows[t]);
  for (int64_t off = 0; off < ahead.len * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(p + off, 0, 2);
}

// Four keys per pass over the ROWS query rows: each key vector loaded once serves every row
// (two rows: 6 loads per 8 FMAs, not 10 — Zen 4 issues one 512-bit load a cycle), and the
// independent FMA chains hide the FMA latency.
template <int W, int ROWS>
ATTNX_BODY void dot_rows_body(const float* const* q, const float* const* k, int64_t n, int64_t e,
                              float* const* s, const Ahead<float>& ahead) {
  const int64_t ew = e - e % W;
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    for (int64_t u = t; u < t + 4; ++u) fetch_ahead(ahead, u);
    // (unrolled by hand into named values: GCC kept arrays of vectors on the stack)
    const float *k0 = k[t], *k1 = k[t + 1], *k2 = k[t + 2], *k3 = k[t + 3];
    vf<W> a[ROWS][4];
#pragma GCC unroll 2
    for (int rr = 0; rr < ROWS; ++rr) a[rr][0] = a[rr][1] = a[rr][2] = a[rr][3] = vf<W>{};
    for (int64_t c = 0; c < ew; c += W) {
      const vf<W> x0 = load<W>(k0 + c), x1 = load<W>(k1 + c), x2 = load<W>(k2 + c),
                  x3 = load<W>(k3 + c);
#pragma GCC unroll 2
      for (int rr = 0; rr < ROWS; ++rr) {
        const vf<W> qv = load<W>(q[rr] + c);
        a[rr][0] += qv * x0, a[rr][1] += qv * x1, a[rr][2] += qv * x2, a[rr][3] += qv * x3;
      }
    }
#pragma GCC unroll 2
    for (int rr = 0; rr < ROWS; ++rr) {
      hsum4(a[rr][0], a[rr][1], a[rr][2], a[rr][3], s[rr] + t);
      for (int64_t c = ew; c < e; ++c)
        for (int u = 0; u < 4; ++u) s[rr][t + u] += q[rr][c] * k[t + u][c];
    }
  }
  for (int64_t u = t; u < ahead.n; ++u) fetch_ahead(ahead, u);  // a block shorter than the next
  for (; t < n; ++t) {
    for (int rr = 0; rr < ROWS; ++rr) {
      vf<W> a{};
      for (int64_t c = 0; c < ew; c += W) a += load<W>(q[rr] + c) * load<W>(k[t] + c);
      float sum = hsum<W>(a);
      for (int64_t c = ew; c < e; ++c) sum += q[rr][c] * k[t][c];
      s[rr][t] = sum;
    }
  }
}

// The ROWS output rows are held in registers U vectors at a time while every key's value row
// adds to them: o is read and written once per call, each value vector loaded once for every
// row, and each value row read as one run of U W floats (the whole row at Ev = 128 on AVX-512,
// one row): a row's first touch streams from memory in order. U keeps the accumulators within
// the ISA's registers (32 zmm, 16 ymm).
template <int W, int ROWS>
ATTNX_BODY void add_rows_body(float* const* o, const float* const* p, const float* const* v,
                              int64_t n, int64_t ev, const Ahead<float>& ahead) {
  constexpr int U = (ROWS == 2 && W == 8) ? 4 : 8;
  int64_t c = 0;
  for (int64_t t = n; t < ahead.n; ++t) fetch_ahead(ahead, t);  // a block shorter than the next
  if (ev < U * W)
    for (int64_t t = 0; t < n; ++t) fetch_ahead(ahead, t);
  for (; c + U * W <= ev; c += U * W) {
    vf<W> acc[ROWS][U];
#pragma GCC unroll 2
    for (int rr = 0; rr < ROWS; ++rr)
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) acc[rr][u] = load<W>(o[rr] + c + u * W);
    for (int64_t t = 0; t < n; ++t) {
      if (c == 0) fetch_ahead(ahead, t);
      const float* row = v[t] + c;
      vf<W> pt[ROWS];
#pragma GCC unroll 2
      for (int rr = 0; rr < ROWS; ++rr) pt[rr] = vf<W>{} + p[rr][t];
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const vf<W> x = load<W>(row + u * W);
#pragma GCC unroll 2
        for (int rr = 0; rr < ROWS; ++rr) acc[rr][u] += pt[rr] * x;
      }
    }
#pragma GCC unroll 2
    for (int rr = 0; rr < ROWS; ++rr)
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) store<W>(o[rr] + c + u * W, acc[rr][u]);
  }
  for (; c + W <= ev; c += W) {
    for (int rr = 0; rr < ROWS; ++rr) {
      vf<W> acc = load<W>(o[rr] + c);
      for (int64_t t = 0; t < n; ++t) acc += (vf<W>{} + p[rr][t]) * load<W>(v[t] + c);
      store<W>(o[rr] + c, acc);
    }
  }
  for (; c < ev; ++c) {
    for (int rr = 0; rr < ROWS; ++rr) {
      float acc = o[rr][c];
      for (int64_t t = 0; t < n; ++t) acc += p[rr][t] * v[t][c];
      o[rr][c] = acc;
    }
  }
}

// One body per row count, so that the row loops unroll.
template <int W>
ATTNX_BODY void dot_rows_any(int rows, const float* const* q, const float* const* k, int64_t n,
                             int64_t e, float* const* s, const Ahead<float>& ahead) {
  if (rows == 2) return dot_rows_body<W, 2>(q, k, n, e, s, ahead);
  dot_rows_body<W, 1>(q, k, n, e, s, ahead);
}
template <int W>
ATTNX_BODY void add_rows_any(int rows, float* const* o, const float* const* p,
                             const float* const* v, int64_t n, int64_t ev,
                             const Ahead<float>& ahead) {
  if (rows == 2) return add_rows_body<W, 2>(o, p, v, n, ev, ahead);
  add_rows_body<W, 1>(o, p, v, n, ev, ahead);
}

#ifdef ATTNX_X86_DISPATCH
ATTNX_AVX2 void dot_rows_avx2(int rows, const float* const* q, const float* const* k, int64_t n,
                              int64_t e, float* const* s, const Ahead<float>& ahead) {
  dot_rows_any<8>(rows, q, k, n, e, s, ahead);
}
ATTNX_AVX512 void dot_rows_avx512(int rows, const float* const* q, const float* const* k,
                                  int64_t n, int64_t e, float* const* s,
                                  const Ahead<float>& ahead) {
  dot_rows_any<16>(rows, q, k, n, e, s, ahead);
}
ATTNX_AVX2 void add_rows_avx2(int rows, float* const* o, const float* const* p,
                              const float* const* v, int64_t n, int64_t ev,
                              const Ahead<float>& ahead) {
  add_rows_any<8>(rows, o, p, v, n, ev, ahead);
}
ATTNX_AVX512 void add_rows_avx512(int rows, float* const* o, const float* const* p,
                                  const float* const* v, int64_t n, int64_t ev,
                                  const Ahead<float>& ahead) {
  add_rows_any<16>(rows, o, p, v, n, ev, ahead);
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

void dot_rows(int rows, const float* const* q, const float* const* k, int64_t n, int64_t e,
              float* const* s, Ahead<float> ahead) {
#ifdef ATTNX_X86_DISPATCH
  switch (isa()) {
    case Isa::avx512: return dot_rows_avx512(rows, q, k, n, e, s, ahead);
    case Isa::avx2: return dot_rows_avx2(rows, q, k, n, e, s, ahead);
    case Isa::baseline: break;
  }
#endif
  dot_rows_any<8>(rows, q, k, n, e, s, ahead);
}

void add_rows(int rows, float* const* o, const float* const* p, const float* const* v, int64_t n,
              int64_t ev, Ahead<float> ahead) {
#ifdef ATTNX_X86_DISPATCH
  switch (isa()) {
    case Isa::avx512: return add_rows_avx512(rows, o, p, v, n, ev, ahead);
    case Isa::avx2: return add_rows_avx2(rows, o, p, v, n, ev, ahead);
    case Isa::baseline: break;
  }
#endif
  add_rows_any<8>(rows, o, p, v, n, ev, ahead);
}

void dot_rows(int rows, const double* const* q, const double* const* k, int64_t n, int64_t e,
              double* const* s, Ahead<double>) {
  for (int rr = 0; rr < rows; ++rr)
    for (int64_t t = 0; t < n; ++t) {
      double sum = 0.0;
      for (int64_t c = 0; c < e; ++c) sum += q[rr][c] * k[t][c];
      s[rr][t] = sum;
    }
}

void add_rows(int rows, double* const* o, const double* const* p, const double* const* v,
              int64_t n, int64_t ev, Ahead<double>) {
  for (int rr = 0; rr < rows; ++rr)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < ev; ++c) o[rr][c] += p[rr][t] * v[t][c];
}

}  // namespace attnx::cpu
