// The float32 tanh terms of additive attention on exponentials, for pairs whose operands are
// at most kExpLimit in magnitude:
//   r = 1 / (e^{2q} e^{2k} + 1) = (1 - tanh(q + k)) / 2,  tanh = 1 - 2r,  1 - tanh^2 = 4r(1 - r)
// with e^{2q} and e^{2k} computed once per query row and key row (additive_cpu.cpp), so a term
// costs one FMA, one reciprocal (an approximate one refined by a Newton step: two FMAs) and one
// FMA into the sum. For |q|, |k| <= kExpLimit the product lies in [e^{-4 kExpLimit},
// e^{4 kExpLimit}], normal floats, never inf * 0; rows or columns holding a larger value take
// the exact path (additive_rows.h), as the CUDA kernel's chunks do (csrc/cuda/additive.cu).
//
// The form's error is absolute: a term's t = 1 - 2r is off by ~1 ulp of 1 whatever |t|, a score
// by ~eps sum_a |v_a|, where tanh of a rounded q + k errs by ~eps (|q| + |k|) |v_a|. Pairs whose
// query and key rows both have a mean |x| below kSmallMeanAbs (tanh near its linear part) take
// the exact path too: there the form was up to 500x torch's float32 error (|q|, |k| ~ 1e-3).
//
// Rows of exponentials have `ap` entries, A rounded up to kPad, the padding holding 1 (any
// finite value) with v = 0 there: no tails in the loops, no effect on the scores. Bodies are
// 16 lanes where the CPU has AVX-512, 8 with AVX2 (ATTNX_CPU_AVX512=0 picks those there too;
// sdpa_tile.h's vector_isa()), 8 of plain vector code elsewhere; each register-blocks four
// keys per loaded query vector.
#pragma once
#include <cstdint>

namespace attnx::cpu::additive {

constexpr float kExpLimit = 20.0f;
constexpr int64_t kPad = 16;
// The form's error over torch's goes as ~1 / (2 |q + k|): pairs of rows of RMS 0.1 were 7x it
// (out, float32), of RMS 1e-3 560x. Rows of models' projections are ~0.5 and more. A row's mean
// |x|, not its RMS, so that one large coordinate (a model's massive activation) does not take a
// row of small values onto the form: +5 and -5 among 255 coordinates of 1e-3 (RMS 0.31, mean
// 0.02) gave dv 60x torch's error. 0.2: an RMS of 0.25 for Gaussian rows (mean |x| = 0.8 RMS).
constexpr float kSmallMeanAbs = 0.2f;

// A row's flags: kLarge, every pair of the row takes the exact path (a value past kExpLimit, or
// NaN); kSmall, its mean |x| is below kSmallMeanAbs (a pair of two such rows takes the exact
// path).
enum RowFlags : uint8_t { kLarge = 1, kSmall = 2 };

// e[a] = e^{2 x[a]} for a < n (to ~2 ulp), e[a] = 1 for n <= a < ap; returns the row's flags.
uint8_t exp2x_row(const float* x, int64_t n, int64_t ap, float* e);

// s[j] = vsum - 2 sum_a v[a] r(eq[a], ek[j ap + a]) for j < n: the score of a query row
// against n key rows (vsum = sum_a v[a]).
void exp_scores(const float* eq, const float* ek, const float* v, float vsum, int64_t ap,
                int64_t n, float* s);

// The terms' part of the gradients of one query row's scores, with u = r (1 - r) and
// ds[j] = d(loss)/d(s_j): dq[a] += sum_j ds[j] u, dk[j ap + a] += ds[j] u,
// dvr[a] += sum_j ds[j] r. The caller scales: d/dq = d/dk = 4 v[a] (that sum), and
// d/dv[a] = sum_j ds[j] - 2 dvr[a].
void exp_grads(const float* eq, const float* ek, const float* ds, int64_t ap, int64_t n,
               float* dq, float* dk, float* dvr);

// Query rows whose value sums share each value load (the forward's task: a group of rows).
constexpr int64_t kSumRows = 4;

// out[r os + e] = sum_j p[r ps + j] rows[j ev + e] for r < g, e < ev: g query rows'
// probabilities times the values (with the same vector bodies; not a term, but at Ev ~ A as
// much work as the sum over them), kSumRows rows per pass over the values.
void weighted_sums(const float* p, int64_t ps, int64_t g, const float* rows, int64_t n,
                   int64_t ev, float* out, int64_t os);

// Seconds one thread takes for `terms` terms of exp_scores' instruction sequence on registers
// only (no loads): the vector limit the benchmarks compare exp_scores against.
double term_seconds(int64_t terms);

}  // namespace attnx::cpu::additive
