// Packing B into the micro-kernel's 16-column panels (sdpa_panels.h): once per head for K and
// V in the forward, and for K, V, Q, dO in the backward.
#include "sdpa_panels.h"

#include <algorithm>
#include <cmath>

#ifdef ATTNX_PANELS_X86
#include <immintrin.h>
#endif

namespace attnx::cpu {
namespace {

// Columns [j0, j0 + w) of B into one panel, zero past w; returns the largest |value| seen.
float pack_scalar(const float* b, int64_t k, int64_t j0, int64_t w, int64_t bks, int64_t bns,
                  float* panel) {
  float top = 0.0f;
  for (int64_t kk = 0; kk < k; ++kk) {
    float* row = panel + kk * PANEL;
    const float* src = b + kk * bks + j0 * bns;
    for (int64_t t = 0; t < w; ++t) {
      row[t] = src[t * bns];
      top = std::max(top, std::abs(row[t]));
    }
    std::fill(row + w, row + PANEL, 0.0f);
  }
  return top;
}

#ifdef ATTNX_PANELS_X86
// Packing runs only where the micro-kernel does (AVX2). Against pack_scalar's strided copies,
// timed interleaved in one process (2 threads, D = 128): +4-5% on the causal forward at
// L = 1k-4k, where packing K and V per head weighs most (the products do half a square).
__attribute__((target("avx2"))) __m256 abs_max8(__m256 top, __m256 x) {
  // vmaxps returns its second operand when either is NaN: NaN is skipped.
  return _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x), top);
}

// A full panel whose source rows are contiguous (bns == 1): 16 values per row, copied.
__attribute__((target("avx2"))) __m256 pack_rows(const float* b, int64_t k, int64_t bks,
                                                 float* panel, __m256 top) {
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m256 x0 = _mm256_loadu_ps(b + kk * bks), x1 = _mm256_loadu_ps(b + kk * bks + 8);
    _mm256_storeu_ps(panel + kk * PANEL, x0);
    _mm256_storeu_ps(panel + kk * PANEL + 8, x1);
    top = abs_max8(abs_max8(top, x0), x1);
  }
  return top;
}

// A full panel whose source columns are contiguous (bks == 1, B^T stored by rows, as K is for
// K^T): 8 x 8 blocks transposed in registers; k % 8 rows are left to the caller.
__attribute__((target("avx2"))) __m256 pack_columns(const float* b, int64_t k, int64_t bns,
                                                    float* panel, __m256 top) {
  for (int64_t kk = 0; kk + 8 <= k; kk += 8) {
    for (int64_t h = 0; h < PANEL; h += 8) {
      __m256 r[8];
      for (int t = 0; t < 8; ++t) {
        r[t] = _mm256_loadu_ps(b + (h + t) * bns + kk);
        top = abs_max8(top, r[t]);
      }
      const __m256 a0 = _mm256_unpacklo_ps(r[0], r[1]), a1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 a2 = _mm256_unpacklo_ps(r[2], r[3]), a3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 a4 = _mm256_unpacklo_ps(r[4], r[5]), a5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 a6 = _mm256_unpacklo_ps(r[6], r[7]), a7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 c0 = _mm256_shuffle_ps(a0, a2, 0x44), c1 = _mm256_shuffle_ps(a0, a2, 0xEE);
      const __m256 c2 = _mm256_shuffle_ps(a1, a3, 0x44), c3 = _mm256_shuffle_ps(a1, a3, 0xEE);
      const __m256 c4 = _mm256_shuffle_ps(a4, a6, 0x44), c5 = _mm256_shuffle_ps(a4, a6, 0xEE);
      const __m256 c6 = _mm256_shuffle_ps(a5, a7, 0x44), c7 = _mm256_shuffle_ps(a5, a7, 0xEE);
      float* out = panel + kk * PANEL + h;
      _mm256_storeu_ps(out + 0 * PANEL, _mm256_permute2f128_ps(c0, c4, 0x20));
      _mm256_storeu_ps(out + 1 * PANEL, _mm256_permute2f128_ps(c1, c5, 0x20));
      _mm256_storeu_ps(out + 2 * PANEL, _mm256_permute2f128_ps(c2, c6, 0x20));
      _mm256_storeu_ps(out + 3 * PANEL, _mm256_permute2f128_ps(c3, c7, 0x20));
      _mm256_storeu_ps(out + 4 * PANEL, _mm256_permute2f128_ps(c0, c4, 0x31));
      _mm256_storeu_ps(out + 5 * PANEL, _mm256_permute2f128_ps(c1, c5, 0x31));
      _mm256_storeu_ps(out + 6 * PANEL, _mm256_permute2f128_ps(c2, c6, 0x31));
      _mm256_storeu_ps(out + 7 * PANEL, _mm256_permute2f128_ps(c3, c7, 0x31));
    }
  }
  return top;
}

__attribute__((target("avx2"))) float horizontal_max(__m256 v) {
  float x[8];
  _mm256_storeu_ps(x, v);
  return *std::max_element(x, x + 8);
}

// Full panels on the vector paths; returns the number of panels done and raises top.
__attribute__((target("avx2"))) int64_t pack_vectorized(const float* b, int64_t k, int64_t n,
                                                        int64_t bks, int64_t bns, float* dst,
                                                        float& top) {
  if (bns != 1 && bks != 1) return 0;
  const int64_t full = n / PANEL;
  __m256 t = _mm256_setzero_ps();
  for (int64_t p = 0; p < full; ++p) {
    const float* src = b + p * PANEL * bns;
    float* panel = dst + p * k * PANEL;
    if (bns == 1) {
      t = pack_rows(src, k, bks, panel, t);
    } else {  // bks == 1
      t = pack_columns(src, k, bns, panel, t);
      const int64_t done = k / 8 * 8;
      top = std::max(top, pack_scalar(src + done * bks, k - done, 0, PANEL, bks, bns,
                                      panel + done * PANEL));
    }
  }
  top = std::max(top, horizontal_max(t));
  return full;
}
#endif

}  // namespace

float pack_panels(const float* b, int64_t k, int64_t n, int64_t bks, int64_t bns, float* dst) {
  float top = 0.0f;
  int64_t done = 0;
#ifdef ATTNX_PANELS_X86
  if (panels_supported()) done = pack_vectorized(b, k, n, bks, bns, dst, top);
#endif
  for (int64_t p = done; p < panel_count(n); ++p) {
    const int64_t j0 = p * PANEL;
    top = std::max(top, pack_scalar(b, k, j0, std::min(PANEL, n - j0), bks, bns,
                                    dst + p * k * PANEL));
  }
  return top;
}

}  // namespace attnx::cpu
