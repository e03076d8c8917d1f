// Let a * b + c become one FMA (ISO -std modes turn contraction off).
#pragma GCC optimize("fp-contract=fast")
#include "sdpa_panels.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define ATTNX_PANELS_X86 1
#endif

namespace attnx::cpu {
float pack_panels(const float* b, int64_t k, int64_t n, int64_t bks, int64_t bns, float* dst) {
  float top = 0.0f;
  for (int64_t p = 0; p < panel_count(n); ++p) {
    const int64_t j0 = p * PANEL, w = std::min(PANEL, n - j0);
    float* panel = dst + p * k * PANEL;
    for (int64_t kk = 0; kk < k; ++kk) {
      float* row = panel + kk * PANEL;
      const float* src = b + kk * bks + j0 * bns;
      for (int64_t t = 0; t < w; ++t) {
        row[t] = src[t * bns];
        top = std::max(top, std::abs(row[t]));
      }
      std::fill(row + w, row + PANEL, 0.0f);
    }
  }
  return top;
}

#ifdef ATTNX_PANELS_X86
namespace {

// ATTNX_CPU_PANELS=0 keeps the BLAS engine on a CPU that has AVX2: what machines without it
// run, so that path can be tested and compared here.
bool forced_off() {
  const char* v = std::getenv("ATTNX_CPU_PANELS");
  return v != nullptr && std::string(v) == "0";
}

// MR rows of C by one panel: 2 * MR accumulators in registers, B rows from the panel, A values
// broadcast straight from memory (the memory form of vbroadcastss costs no shuffle port, which
// GCC only emits through the intrinsic).
template <int MR>
__attribute__((target("avx2,fma"))) void micro_kernel(int64_t k, float alpha, const float* a,
                                                      int64_t ars, int64_t aks,
                                                      const float* panel, bool accumulate,
                                                      float* c, int64_t ldc) {
  __m256 lo[MR], hi[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m256 b0 = _mm256_loadu_ps(panel + kk * PANEL);
    const __m256 b1 = _mm256_loadu_ps(panel + kk * PANEL + 8);
    const float* ak = a + kk * aks;
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 x = _mm256_broadcast_ss(ak + r * ars);
      lo[r] = _mm256_fmadd_ps(x, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(x, b1, hi[r]);
    }
  }
  const __m256 s = _mm256_set1_ps(alpha);
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    float* cr = c + r * ldc;
    if (accumulate) {
      _mm256_storeu_ps(cr, _mm256_fmadd_ps(s, lo[r], _mm256_loadu_ps(cr)));
      _mm256_storeu_ps(cr + 8, _mm256_fmadd_ps(s, hi[r], _mm256_loadu_ps(cr + 8)));
    } else {
      _mm256_storeu_ps(cr, _mm256_mul_ps(s, lo[r]));
      _mm256_storeu_ps(cr + 8, _mm256_mul_ps(s, hi[r]));
    }
  }
}

constexpr int64_t MR = 6;

}  // namespace

bool panels_available() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          !forced_off();
  return yes;
}

void panel_gemm(int64_t m, int64_t np, int64_t k, float alpha, const float* a, int64_t ars,
                int64_t aks, const float* bp, int64_t pstride, bool accumulate, float* c,
                int64_t ldc) {
  // Panel-outer: one panel (k x 16) stays in L1 while every row strip of A streams past it.
  for (int64_t p = 0; p < np; ++p) {
    const float* panel = bp + p * pstride;
    float* cp = c + p * PANEL;
    int64_t r = 0;
    for (; r + MR <= m; r += MR) {
      micro_kernel<MR>(k, alpha, a + r * ars, ars, aks, panel, accumulate, cp + r * ldc, ldc);
    }
    const float* ar = a + r * ars;
    float* cr = cp + r * ldc;
    switch (m - r) {
      case 0: break;
      case 1: micro_kernel<1>(k, alpha, ar, ars, aks, panel, accumulate, cr, ldc); break;
      case 2: micro_kernel<2>(k, alpha, ar, ars, aks, panel, accumulate, cr, ldc); break;
      case 3: micro_kernel<3>(k, alpha, ar, ars, aks, panel, accumulate, cr, ldc); break;
      case 4: micro_kernel<4>(k, alpha, ar, ars, aks, panel, accumulate, cr, ldc); break;
      default: micro_kernel<5>(k, alpha, ar, ars, aks, panel, accumulate, cr, ldc); break;
    }
  }
}
#else
bool panels_available() { return false; }

void panel_gemm(int64_t, int64_t, int64_t, float, const float*, int64_t, int64_t, const float*,
                int64_t, bool, float*, int64_t) {
  TORCH_CHECK(false, "attnx: panel_gemm needs x86 AVX2; callers check panels_available()");
}
#endif

}  // namespace attnx::cpu
