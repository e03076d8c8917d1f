// Row operations on a tile of attention scores, and the dropout hash of attnx/_rng.py.
// The float versions are vectorized (AVX-512 or AVX2 when the CPU has it, chosen at run time);
// the double versions are plain loops (float64 is for gradcheck, not speed).
#pragma once
#include <cstdint>

#include "../dropout_hash.h"

namespace attnx::cpu {

// The instruction set the float versions run on: "avx512", "avx2" or "baseline" (measured at
// first use where the CPU has AVX-512, or fixed by ATTNX_CPU_AVX512: cpu_choice.h).
const char* vector_isa();
// Whether vector_isa() is "avx512" (the panel micro-kernel then takes 512-bit steps too).
bool vector_isa_is_avx512();

// Max over x[0, n); -inf for n == 0.
float row_max(const float* x, int64_t n);
double row_max(const double* x, int64_t n);

// row_max of four rows at once: out[r] = row_max(x[r], n), r < 4 (their chains interleave).
void row_max4(const float* const* x, int64_t n, float* out);

// Max of |x[t]| over x[0, n) (0 for n == 0; NaN skipped).
float abs_max(const float* x, int64_t n);
double abs_max(const double* x, int64_t n);

// x = exp(x - sub) in place (exp(-inf) = 0); returns the sum of the new values. Callers keep
// x <= sub, or within a few units above (a row's max, its lse with the scores clamped to it
// where they may not be the forward's own, or the forward's lagging lse, ulps under the max):
// the float version has no overflow clamp, which would cost 15% of its time, and gives garbage
// for x - sub above 88. Its terms carry a relative error of up to
// |sub| 2^-24 common to the call where |sub| <= 64 (sdpa_tile.cpp), as a float lse does.
float exp_sum(float* x, int64_t n, float sub);
double exp_sum(double* x, int64_t n, double sub);
// exp_sum of four rows at once: sums[r] = exp_sum(x[r], n, sub[r]), r < 4 (the same terms; the
// sums reduced in another order). The four rows' exponentials interleave and one tree reduces
// their sums: a decoding block's four query rows of 16 keys (decode_cpu.cpp), where four calls
// each waited on its own exponential and reduction. With maxes and keep, maxes[r] = row_max
// of x[r]'s values before the call and keep[r][0, n) a copy of them, and sub[r] may lie below
// them (terms over 1, right while x - sub stays under 88: the forward checks maxes after the
// call and takes rows too far above back from keep).
void exp_sum4(float* const* x, int64_t n, const float* sub, float* sums,
              float* maxes = nullptr, float* const* keep = nullptr);

void scale_row(float* x, int64_t n, float a);
void scale_row(double* x, int64_t n, double a);

// Dropout of row elements j0 .. j0 + n - 1 of a row whose hash key is key_row:
// x[t] *= inv_keep where dropout_hash(key_row, j0 + t) >= threshold, else x[t] = 0.
void dropout_row(float* x, int64_t n, uint32_t key_row, uint32_t j0, uint32_t threshold,
                 float inv_keep);
void dropout_row(double* x, int64_t n, uint32_t key_row, uint32_t j0, uint32_t threshold,
                 double inv_keep);

// A bool mask packed to bits (key k admitted iff bit k % 8 of bits[k / 8]; the byte after the
// last key's must be readable): s[t] = -inf where key pos + t is refused. Returns the max of the
// masked row (the same pass, so the forward need not read the row again for its running max).
float mask_bits(float* s, const uint8_t* bits, int64_t pos, int64_t n);
inline bool mask_bit(const uint8_t* bits, int64_t k) { return (bits[k >> 3] >> (k & 7)) & 1; }
double mask_bits(double* s, const uint8_t* bits, int64_t pos, int64_t n);

// Softmax backward on one row: ds = p * (ds - d).
void softmax_grad_row(float* ds, const float* p, int64_t n, float d);
void softmax_grad_row(double* ds, const double* p, int64_t n, double d);

}  // namespace attnx::cpu
