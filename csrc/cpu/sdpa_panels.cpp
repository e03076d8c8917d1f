// The micro-kernels and the GEMM over packed panels (sdpa_panels.h).
#include "sdpa_panels.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>

#include "cpu_choice.h"
#include "line_vector.h"
#include "sdpa_tile.h"

#ifdef ATTNX_PANELS_X86
#include <immintrin.h>
#endif

namespace attnx::cpu {

#ifdef ATTNX_PANELS_X86
namespace {

// ATTNX_CPU_PANELS=0 keeps the BLAS engine on a CPU that has AVX2: what machines without it
// run, so that path can be tested and compared here.
bool forced_off() {
  const char* v = std::getenv("ATTNX_CPU_PANELS");
  return v != nullptr && std::string(v) == "0";
}

// ROWS rows of C by one panel: 2 * ROWS accumulators in registers, B rows from the panel, A
// values broadcast straight from memory (the memory form of vbroadcastss costs no shuffle port,
// which GCC only emits through the intrinsic).
template <int ROWS>
__attribute__((target("avx2,fma"))) void micro_kernel(int64_t k, float alpha, const float* a,
                                                      int64_t ars, int64_t aks,
                                                      const float* panel, bool accumulate,
                                                      float* c, int64_t ldc) {
  __m256 lo[ROWS], hi[ROWS];
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m256 b0 = _mm256_loadu_ps(panel + kk * PANEL);
    const __m256 b1 = _mm256_loadu_ps(panel + kk * PANEL + 8);
    const float* ak = a + kk * aks;
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) {
      const __m256 x = _mm256_broadcast_ss(ak + r * ars);
      lo[r] = _mm256_fmadd_ps(x, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(x, b1, hi[r]);
    }
  }
  const __m256 s = _mm256_set1_ps(alpha);
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r) {
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

// The same over two adjacent panels (32 columns) in 512-bit registers. Each score is the same
// FMA chain as in micro_kernel, so both give bitwise the same C. Against micro_kernel on Zen 4
// (whose 512-bit units are two 256-bit ones), interleaved in one process, 2 threads: +2-4% on
// the forward and fwd+bwd at L = 1k-4k, D = 64 and 128; half the instructions to issue. On an
// Intel Xeon (Cascade Lake, two 512-bit FMA ports) 1.9x micro_kernel on one tile's products.
// ROWS = 12 (24 accumulators) where strips of 12 are chosen (cpu_choice.h): on that Xeon the
// 6-row loop issues 23 uops per 12 FMAs to a 4-wide front end, the 12-row one 41 per 24; the
// forward gained 7-15% at L = 2k-4k (interleaved processes, 2 threads).
template <int ROWS>
__attribute__((target("avx512f"))) void micro_kernel_x2(int64_t k, float alpha, const float* a,
                                                        int64_t ars, int64_t aks,
                                                        const float* panel, int64_t pstride,
                                                        bool accumulate, float* c,
                                                        int64_t ldc) {
  __m512 lo[ROWS], hi[ROWS];
#pragma GCC unroll 12
  for (int r = 0; r < ROWS; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    __m512 b0 = _mm512_loadu_ps(panel + kk * PANEL);
    __m512 b1 = _mm512_loadu_ps(panel + pstride + kk * PANEL);
    // in registers: for 1-3 rows GCC folded each load into every row's FMA (vector_body.h's
    // in_register), 9 loads per 6 FMAs at three rows
    asm("" : "+v"(b0), "+v"(b1));
    const float* ak = a + kk * aks;
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; ++r) {
      const __m512 x = _mm512_set1_ps(ak[r * ars]);
      lo[r] = _mm512_fmadd_ps(x, b0, lo[r]);
      hi[r] = _mm512_fmadd_ps(x, b1, hi[r]);
    }
  }
  const __m512 s = _mm512_set1_ps(alpha);
#pragma GCC unroll 12
  for (int r = 0; r < ROWS; ++r) {
    float* cr = c + r * ldc;
    if (accumulate) {
      _mm512_storeu_ps(cr, _mm512_fmadd_ps(s, lo[r], _mm512_loadu_ps(cr)));
      _mm512_storeu_ps(cr + PANEL, _mm512_fmadd_ps(s, hi[r], _mm512_loadu_ps(cr + PANEL)));
    } else {
      _mm512_storeu_ps(cr, _mm512_mul_ps(s, lo[r]));
      _mm512_storeu_ps(cr + PANEL, _mm512_mul_ps(s, hi[r]));
    }
  }
}

constexpr int64_t MR = 6;  // rows per strip (the 256-bit kernel's 12 accumulators fill 16 ymm)

// ROWS rows of C by PANELS (1 or 2) adjacent panels.
template <int PANELS, int ROWS>
void kernel(int64_t k, float alpha, const float* a, int64_t ars, int64_t aks, const float* panel,
            int64_t pstride, bool accumulate, float* c, int64_t ldc) {
  if constexpr (PANELS == 2) {
    micro_kernel_x2<ROWS>(k, alpha, a, ars, aks, panel, pstride, accumulate, c, ldc);
  } else {
    micro_kernel<ROWS>(k, alpha, a, ars, aks, panel, accumulate, c, ldc);
  }
}

// Every row of C by PANELS adjacent panels: strips of `tall` rows (12 or MR: cpu_choice.h),
// then one of MR if that many are left, then the last rows. Meanwhile the strips prefetch, a few
// lines each, the `ahead` panels of panel_gemm's next step (at `next`): packed K and V of a long
// sequence sit in L3 or memory, and the first strip over a panel would otherwise wait on every
// line (+4-7% on the forward at L = 4096, D = 128, nothing lost at L <= 2048; interleaved in one
// process, 2 threads; prefetching to L2 instead measured 1% slower). Every row's FMA chain is
// the same whatever strip holds it, so the strip heights never change C.
template <int PANELS>
void strips(int64_t m, int64_t k, float alpha, const float* a, int64_t ars, int64_t aks,
            const float* panel, int64_t pstride, bool accumulate, float* c, int64_t ldc,
            const float* next, int64_t ahead, int64_t tall) {
  static_assert(PANEL * sizeof(float) == 64, "a panel row is one cache line");
  const int64_t full = m / tall, rest = m - full * tall;
  const int64_t lines = ahead > 0 ? k : 0, count = std::max<int64_t>(1, full + rest / MR);
  const int64_t per_strip = (lines + count - 1) / count;
  int64_t r = 0, fetched = 0;
  const auto prefetch = [&] {
    for (const int64_t upto = std::min(lines, fetched + per_strip); fetched < upto; ++fetched) {
      for (int64_t q = 0; q < ahead; ++q) {
        _mm_prefetch(reinterpret_cast<const char*>(next + q * pstride + fetched * PANEL),
                     _MM_HINT_T0);
      }
    }
  };
  if constexpr (PANELS == 2) {
    for (; tall == 2 * MR && r + 2 * MR <= m; r += 2 * MR) {
      prefetch();
      kernel<PANELS, 2 * MR>(k, alpha, a + r * ars, ars, aks, panel, pstride, accumulate,
                             c + r * ldc, ldc);
    }
  }
  for (; r + MR <= m; r += MR) {
    prefetch();
    kernel<PANELS, MR>(k, alpha, a + r * ars, ars, aks, panel, pstride, accumulate,
                       c + r * ldc, ldc);
  }
  const float* ar = a + r * ars;
  float* cr = c + r * ldc;
  switch (m - r) {
    case 0: break;
    case 1: kernel<PANELS, 1>(k, alpha, ar, ars, aks, panel, pstride, accumulate, cr, ldc); break;
    case 2: kernel<PANELS, 2>(k, alpha, ar, ars, aks, panel, pstride, accumulate, cr, ldc); break;
    case 3: kernel<PANELS, 3>(k, alpha, ar, ars, aks, panel, pstride, accumulate, cr, ldc); break;
    case 4: kernel<PANELS, 4>(k, alpha, ar, ars, aks, panel, pstride, accumulate, cr, ldc); break;
    default: kernel<PANELS, 5>(k, alpha, ar, ars, aks, panel, pstride, accumulate, cr, ldc); break;
  }
}

// C = alpha A B (+ C) on the 512-bit micro-kernel (wide) or the 256-bit one, the wide one in
// strips of `tall` rows.
void panel_gemm_as(bool wide, int64_t tall, int64_t m, int64_t np, int64_t k, float alpha,
                   const float* a, int64_t ars, int64_t aks, const float* bp, int64_t pstride,
                   bool accumulate, float* c, int64_t ldc) {
  // Panel-outer: one or two panels (k x 16 each) stay in L1 while every row strip of A streams
  // past them (two panels of 256 keys fill a 32 KiB L1 alone; still faster than one at a time).
  const int64_t step = wide ? 2 : 1;
  const auto run = wide ? strips<2> : strips<1>;
  int64_t p = 0;
  for (; p + step <= np; p += step) {
    const int64_t ahead = std::min(step, np - p - step);
    run(m, k, alpha, a, ars, aks, bp + p * pstride, pstride, accumulate, c + p * PANEL, ldc,
        ahead > 0 ? bp + (p + step) * pstride : nullptr, ahead, wide ? tall : MR);
  }
  if (p < np) {  // the wide kernel's odd last panel
    strips<1>(m, k, alpha, a, ars, aks, bp + p * pstride, pstride, accumulate, c + p * PANEL,
              ldc, nullptr, 0, MR);
  }
}

}  // namespace

bool panels_supported() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          !forced_off();
  return yes;
}

void panel_gemm(int64_t m, int64_t np, int64_t k, float alpha, const float* a, int64_t ars,
                int64_t aks, const float* bp, int64_t pstride, bool accumulate, float* c,
                int64_t ldc) {
  static const bool wide = vector_isa_is_avx512();
  static const int64_t tall = vector_choice().strip_rows;
  panel_gemm_as(wide, tall, m, np, k, alpha, a, ars, aks, bp, pstride, accumulate, c, ldc);
}

double panel_gemm_seconds(bool wide, int64_t tall) {
  constexpr int64_t M = 96, D = 64, N = 256, REPS = 8;
  static thread_local line_vector<float> a(M * N), kp(D * N), vp(N * D), c(M * N);
  std::fill(a.begin(), a.end(), 0.01f);  // small values: no denormals, no overflow
  std::fill(kp.begin(), kp.end(), 0.02f);
  std::fill(vp.begin(), vp.end(), 0.03f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < REPS; ++r) {
    panel_gemm_as(wide, tall, M, N / PANEL, D, 1.0f, a.data(), D, 1, kp.data(), D * PANEL,
                  false, c.data(), N);  // S: A's first D columns as Q
    panel_gemm_as(wide, tall, M, D / PANEL, N, 1.0f, a.data(), N, 1, vp.data(), N * PANEL,
                  true, c.data(), N);  // O += P V into C's first D columns
  }
  const auto t1 = std::chrono::steady_clock::now();
  asm volatile("" : : "r"(c.data()) : "memory");  // C is used
  return std::chrono::duration<double>(t1 - t0).count() / REPS;
}
#else
bool panels_supported() { return false; }

double panel_gemm_seconds(bool, int64_t) { return 0.0; }

void panel_gemm(int64_t, int64_t, int64_t, float, const float*, int64_t, int64_t, const float*,
                int64_t, bool, float*, int64_t) {
  TORCH_CHECK(false, "attnx: panel_gemm needs x86 AVX2; callers check panels_available()");
}
#endif

}  // namespace attnx::cpu
