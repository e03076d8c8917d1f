// The two products of decoding attention, on rows reached through pointers (a paged cache's
// rows are not evenly spaced). The float versions are vectorized (AVX-512 or AVX2, the ISA of
// vector_isa() in sdpa_tile.h); the double ones are plain loops (float64 is for checking).
#pragma once
#include <cstdint>

namespace attnx::cpu {

// Rows to fetch towards L2 while a product runs: rows[0, n) of `len` values each (n = 0: none),
// so that reading the next block from memory overlaps computing on this one. The caller
// spreads a block's rows over its products: a burst of prefetches at a block's start
// overflows the CPU's queue of misses and leaves memory idle for the rest of the block.
template <typename T>
struct Ahead {
  const T* const* rows = nullptr;
  int64_t n = 0, len = 0;
};

// For each of `rows` (1 or 2) query rows q[rr]: s[rr][t] = dot(q[rr], k[t][0, e)), t in [0, n).
// Two rows sharing the keys (two query heads of a GQA group) load each key once for both.
void dot_rows(int rows, const float* const* q, const float* const* k, int64_t n, int64_t e,
              float* const* s, Ahead<float> ahead = {});
void dot_rows(int rows, const double* const* q, const double* const* k, int64_t n, int64_t e,
              double* const* s, Ahead<double> ahead = {});

// For each of `rows` (1 or 2) rows: o[rr][0, ev) += sum over t in [0, n) of p[rr][t] v[t][0, ev).
void add_rows(int rows, float* const* o, const float* const* p, const float* const* v, int64_t n,
              int64_t ev, Ahead<float> ahead = {});
void add_rows(int rows, double* const* o, const double* const* p, const double* const* v,
              int64_t n, int64_t ev, Ahead<double> ahead = {});

}  // namespace attnx::cpu
