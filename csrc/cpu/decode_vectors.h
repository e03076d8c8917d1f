// The two products of decoding attention, on rows reached through pointers (a paged cache's
// rows are not evenly spaced). The float versions are vectorized (AVX-512 or AVX2, the ISA of
// vector_isa() in sdpa_tile.h); the double ones are plain loops (float64 is for checking).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace attnx::cpu {

// Rows to fetch towards L2 while a product runs: rows[0, n) of `bytes` each (n = 0: none),
// so that reading the next block from memory overlaps computing on this one. The caller
// shares a block's rows out over its products, and each product spreads its share's lines
// evenly over its loop: a burst of prefetches overflows the CPU's queue of misses, stalls the
// product and leaves memory idle for the rest of the block.
struct Ahead {
  const void* const* rows = nullptr;
  int64_t n = 0, bytes = 0;  // rows, bytes per row
};

// For each of `rows` (1 to 4) query rows q[rr]: s[rr][t] = dot(q[rr], k[t][0, e)), t in [0, n).
// Rows sharing the keys (query heads of a GQA group) load each key once for all of them (AVX2:
// two rows per pass).
void dot_rows(int rows, const float* const* q, const float* const* k, int64_t n, int64_t e,
              float* const* s, Ahead ahead = {});
// The same on bfloat16 keys, widened in registers (Lq = 1: no float32 copy of the block).
void dot_rows(int rows, const float* const* q, const c10::BFloat16* const* k, int64_t n,
              int64_t e, float* const* s, Ahead ahead = {});
void dot_rows(int rows, const double* const* q, const double* const* k, int64_t n, int64_t e,
              double* const* s, Ahead ahead = {});

// For each of `rows` (1 to 4) rows: o[rr][0, ev) += sum over t in [0, n) of p[rr][t] v[t][0, ev).
void add_rows(int rows, float* const* o, const float* const* p, const float* const* v, int64_t n,
              int64_t ev, Ahead ahead = {});
void add_rows(int rows, float* const* o, const float* const* p, const c10::BFloat16* const* v,
              int64_t n, int64_t ev, Ahead ahead = {});
void add_rows(int rows, double* const* o, const double* const* p, const double* const* v,
              int64_t n, int64_t ev, Ahead ahead = {});

// Query rows as the lanes of a vector (float32 only), for groups of many rows (Hq / Hkv x Lq >
// W / 2): each key's score comes out for every row at once with no horizontal sums, and
// the online softmax runs down the lanes. A lane tile st holds n keys x lane_width() rows
// (st[t * W + r]); qt, a group's query rows as lane_pairs lays them out.
int lane_width();  // W: 16 on AVX-512, else 8

// qt[0, e W) = rows q[0, rows) (row r at q + r e; rows <= W, zero past them) for lane_scores:
// per pair of columns c, c + 1 (c even, c + 1 < e), 2 vectors, vector g's lanes 2 p, 2 p + 1
// holding row 4 (p / 2) + 2 g + p % 2's two values (the order that lane_scores' sums of the
// pairs leave in lane order); an odd last column transposed (qt[c W + r] = q[r][c]).
void lane_pairs(const float* q, int64_t rows, int64_t e, float* qt);

// o[r * ev + c] = ot[c * W + r] for r < rows (<= W), c < ev: a group's output rows from the
// lanes' transposed layout (ot: ev columns of W lanes).
void lanes_to_rows(const float* ot, int64_t rows, int64_t ev, float* o);

// st[t * W + r] = dot(q_r, k[t][0, e)) for t in [0, n); returns whether one of them is -inf
// (from finite inputs only where a sum passed float32's range: the caller reruns in float64).
bool lane_scores(const float* qt, const float* const* k, int64_t n, int64_t e, float* st,
                 Ahead ahead = {});

// ALiBi on a lane tile: st[t * W + r] -= slope[r] |dist0[r] - t| for t < n, r < W (dist0[r]:
// lane r's diagonal key less the tile's first key, |dist0[r]| + n below score_mods.h's
// kAlibiInt32).
void lane_alibi(float* st, int64_t n, const float* slope, const int32_t* dist0);

// The online softmax of a lane tile, per lane r: m[r] <- max(m[r], st[., r]); st <- exp(st -
// m[r]) (0 for -inf: masked keys); l[r] <- l[r] alpha[r] + the sum of the new st[., r], where
// alpha[r] = exp(old m[r] - new m[r]) is returned for the output rows (0 while a row has
// admitted no key).
void lane_softmax(float* st, int64_t n, float* m, float* l, float* alpha);

// ot[c * W + r] <- alpha[r] ot[c * W + r] + sum over t in [0, n) of st[t * W + r] v[t][c], c in
// [0, ev): the output rows held transposed, a vector over the rows per column.
void lane_add(float* ot, const float* alpha, const float* st, const float* const* v, int64_t n,
              int64_t ev, Ahead ahead = {});

// dst[0, n) = the bfloat16 values src[0, n) as float32, exactly.
void widen(const c10::BFloat16* src, int64_t n, float* dst);
// dst[0, n) = the float16 values src[0, n) as float32, exactly.
void widen(const c10::Half* src, int64_t n, float* dst);

}  // namespace attnx::cpu
