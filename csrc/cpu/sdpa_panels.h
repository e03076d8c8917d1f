// A small GEMM for the attention tiles: B packed once into 16-column panels
// (sdpa_panel_pack.cpp), A read in place, a 6 x 16 AVX2 FMA micro-kernel, or 12 x 32 (or 6 x 32,
// as measured: cpu_choice.h) over two panels in 512-bit registers where the CPU has AVX-512
// (sdpa_panels.cpp). Packing K, V once
// per head (not once per GEMM call, as BLAS does) and writing C without a separate beta pass
// is what makes the CPU kernels faster than the same loops on MKL's sgemm.
#pragma once
#include <cstdint>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define ATTNX_PANELS_X86 1  // where the micro-kernels and vectorized packing are compiled
#endif

namespace attnx::cpu {

constexpr int64_t PANEL = 16;
inline int64_t panel_count(int64_t n) { return (n + PANEL - 1) / PANEL; }

// Whether this CPU can run the micro-kernel: x86 with AVX2 and FMA, unless the environment has
// ATTNX_CPU_PANELS=0 at the first call.
bool panels_supported();

// Seconds one thread takes for one attention tile's two products (S = Q K^T: 96 x 64 by
// 64 x 256; O = P V: 96 x 256 by 256 x 64), on the 512-bit micro-kernel (wide, AVX-512 only)
// in strips of `tall` (6 or 12) rows, or on the 256-bit one (6 rows): what cpu_choice.h
// measures the vector width and the strip height by.
double panel_gemm_seconds(bool wide, int64_t tall);

// Packs B (k x n, element (kk, j) at b[kk * bks + j * bns]) into panel_count(n) panels of
// k x PANEL values, panel p at dst + p * k * PANEL, columns past n zero (dst 64-byte aligned,
// line_vector.h, puts each panel row on one cache line). Returns the largest
// |value| packed (callers bound their products' range with it; NaN is skipped).
float pack_panels(const float* b, int64_t k, int64_t n, int64_t bks, int64_t bns, float* dst);

// C (m x np * PANEL, row stride ldc) = alpha * A * B (+ C when accumulate), where A (m x k) has
// element (r, kk) at a[r * ars + kk * aks] and B is np panels of k rows, panel p at
// bp + p * pstride (16 values per row).
void panel_gemm(int64_t m, int64_t np, int64_t k, float alpha, const float* a, int64_t ars,
                int64_t aks, const float* bp, int64_t pstride, bool accumulate, float* c,
                int64_t ldc);

}  // namespace attnx::cpu
