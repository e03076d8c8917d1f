// The CPU kernels' choices that depend on the CPU, made once per process at first use: by
// measurement where the CPU offers more than one, unless the environment fixes them. A same
// build runs on Zen 3 (AVX2), Zen 4 (AVX-512 on two 256-bit halves) and Intel Xeons (two
// 512-bit FMA units, or clocks that drop under 512-bit code): which micro-kernel width and
// which GEMM engine is faster differs between them, so it is timed, not assumed.
//
// - The vector width (AVX-512 or AVX2, with it the row operations' bodies): one attention
//   tile's two products (S = Q K^T and O += P V at D = 64, 96 query rows x 256 keys) on the
//   512-bit micro-kernel and on the 256-bit one, one thread, interleaved rounds, best of each;
//   AVX-512 unless AVX2 is at least kMargin faster. ATTNX_CPU_AVX512=0 / =1 fixes it.
// - The 512-bit micro-kernel's strip height (12 or 6 rows of C per pass over a B panel pair):
//   the same tile's products both ways, AVX-512 only; 12 unless 6 is at least kStripMargin
//   faster. 12 rows hold 24 of the 32 zmm registers as accumulators and issue 2 + 12 loads per
//   24 FMAs where 6 rows issue 2 + 6 per 12: on a 4-wide Intel front end the 6-row loop's 23
//   uops per 12 FMAs nearly starve two 512-bit FMA ports (12 rows 10% faster on a Cascade
//   Lake); on Zen 4, one 512-bit FMA a cycle, 6 rows are 4-5% faster (the tile and the forward
//   alike). The margin is small because both heights give bitwise the same results: a close
//   call that flips between processes changes no number. ATTNX_CPU_STRIP_ROWS=6 / =12 fixes it.
// - The float32 SDPA engine (attnx's panels or BLAS): a small forward and its backward (B 1,
//   H 4, L 512, D 64) through both, on the process's threads; the panels unless BLAS is at
//   least kMargin faster. ATTNX_CPU_PANELS=0 / =1 fixes it. The backward runs on the forward's
//   engine, so both are timed: on an Intel Xeon (family 6 model 207) a forward alone went to
//   BLAS by 12% in a targets run, whose forward+backward then ran at 1.05x torch's (geomean
//   of the cells) where the panels' ran at 1.21x; timed with the backward, the panels led by
//   12-20% in each of five processes.
// kMargin keeps the default where both are about as fast (Zen 4's widths), so a noisy
// machine does not flip between them from one process to the next; the rounds alternate, so a
// slow stretch of a shared machine hits both. The problem is L = 512, not smaller: the panels'
// lead grows with L (packing K and V once per head pays off over more queries), and at L = 256
// it was within the noise of a shared 2-core VM. The choices together cost 50-75 ms once, at
// the first float32 CPU call (2-core VM); `attnx info` and the results files show them and
// their times.
#pragma once
#include <cstdint>

namespace attnx::cpu {

constexpr double kMargin = 0.10, kStripMargin = 0.02;

struct VectorChoice {
  const char* isa;   // "avx512", "avx2" or "baseline"
  const char* how;   // "measured", the environment variable that fixed it, or why no choice
  double wide_s = 0, narrow_s = 0;  // the tile's products on 512-bit / 256-bit (measured only)
  int64_t strip_rows = 6;  // the 512-bit micro-kernel's strip height (12 or 6)
  const char* strip_how = "AVX-512 not chosen";
  double tall_s = 0, short_s = 0;  // the tile's products in 12- / 6-row strips (measured only)
};

struct EngineChoice {
  bool panels;
  const char* how;
  double panels_s = 0, blas_s = 0;  // the small step on each engine (measured only)
};

const VectorChoice& vector_choice();
const EngineChoice& engine_choice();

// Whether the float32 SDPA kernels run on the panels (else on BLAS): engine_choice().panels.
// The backward takes the forward's engine (the scores must match): it never changes within a
// process.
bool panels_available();

}  // namespace attnx::cpu
