// Let a * b + c become one FMA where the target has it (ISO -std modes turn contraction off).
#pragma GCC optimize("fp-contract=fast")
#include "decode_vectors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "sdpa_tile.h"

// Written once on GCC vector types of W lanes (vector_body.h), compiled for AVX2 (8) and
// AVX-512 (16), as sdpa_tile.cpp's row operations are; the same cached choice picks the body.
#include "vector_body.h"

#ifdef ATTNX_X86_DISPATCH
#include <immintrin.h>  // widen_f16_*
#endif

namespace attnx::cpu {
namespace {

// A vector of W keys' or values' entries as float32: a float32 row's own, or a bfloat16 row's
// widened in registers (bfloat16 is float32's upper half: each value's bits shifted into place).
template <int W>
ATTNX_BODY vf<W> load_kv(const float* p) {
  return load<W>(p);
}
template <int W>
ATTNX_BODY vf<W> load_kv(const c10::BFloat16* p) {
  typedef uint16_t vh __attribute__((vector_size(2 * W)));
  vh x;
  std::memcpy(&x, p, sizeof(x));
  return (vf<W>)(__builtin_convertvector(x, vu<W>) << 16);
}
ATTNX_BODY float to_float(float x) { return x; }
ATTNX_BODY float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// The lines of `ahead`'s rows fetched evenly over `steps` calls of step(), in order, without a
// division per step: a row at a time (8 lines at E = 128) overflows the CPU's queue of misses,
// the prefetch then stalls (13% of the four-row products' time at Lq = 1 before this).
// rest() fetches the lot where a loop made no step (dot_rows on fewer than 4 keys or e < W,
// add_rows with ev < U W).
struct Spread {
  const Ahead& ahead;
  const int64_t row_bytes, total, steps;
  int64_t acc = 0, row = 0, off = 0;
  Spread(const Ahead& a, int64_t steps_)
      : ahead(a), row_bytes(a.bytes),
        total(a.n * ((row_bytes + 63) / 64)), steps(std::max<int64_t>(1, steps_)) {}
  inline __attribute__((always_inline)) void fetch() {
    __builtin_prefetch(static_cast<const char*>(ahead.rows[row]) + off, 0, 2);
    if ((off += 64) >= row_bytes) off = 0, ++row;
  }
  // (a product calls it `steps` times at most: then `row` stays below ahead.n)
  inline __attribute__((always_inline)) void step() {
    for (acc += total; acc >= steps; acc -= steps) fetch();
  }
  void rest() {
    while (row < ahead.n) fetch();
  }
};

// Four keys at a time into four accumulators per row, summed across lanes together (hsum4x4,
// hsum4); a key's vector, once loaded, serves every row. Both orders below add each
// accumulator's terms in the same order (column by column): the results are bitwise the same.
// - AVX-512: each key's row read whole before the next, its cache lines in address order, so
//   that the hardware's stream prefetcher follows a block read from memory: 1.10-1.23x the bytes
//   a second at Lq = 1 from memory on a Zen 5 (one and two threads; the micro-benchmark and the
//   kernel) over the order below, 4-7% slower with the cache in L2/L3, where the query vectors,
//   reloaded for every key, take a load per key vector (5 per 4 FMAs).
// - AVX2: the four keys chunk by chunk (lines 0, 8, 16, 24, 1, ... of the block): each query
//   vector loaded once for the four keys (two rows: 6 loads per 8 FMAs). Key by key, AVX2 (on
//   the Zen 5) ran as fast from memory and 13-21% slower from L2/L3.
template <int W, int ROWS, typename KV>
ATTNX_BODY void dot_rows_body(const float* const* q, const KV* const* k, int64_t n, int64_t e,
                              float* const* s, const Ahead& ahead) {
  const int64_t ew = e - e % W;
  constexpr bool kInOrder = W == 16;
  Spread spread(ahead, n / 4 * (kInOrder ? 4 : 1) * (ew / W));
  // acc[rr] += q[rr] . key over the vector columns (a function per key, so that each key's
  // accumulators are named values: GCC kept an array indexed by the key on the stack)
  const auto key = [&](const KV* kt, vf<W>(&acc)[ROWS]) __attribute__((always_inline)) {
    for (int64_t c = 0; c < ew; c += W) {
      spread.step();
      const vf<W> x = load_kv<W>(kt + c);
#pragma GCC unroll 4
      for (int rr = 0; rr < ROWS; ++rr) acc[rr] += load<W>(q[rr] + c) * x;
    }
  };
  int64_t t = 0;
  for (; t + 4 <= n; t += 4) {
    vf<W> a0[ROWS] = {}, a1[ROWS] = {}, a2[ROWS] = {}, a3[ROWS] = {};
    if constexpr (kInOrder) {
      key(k[t], a0), key(k[t + 1], a1), key(k[t + 2], a2), key(k[t + 3], a3);
    } else {
      const KV *k0 = k[t], *k1 = k[t + 1], *k2 = k[t + 2], *k3 = k[t + 3];
      for (int64_t c = 0; c < ew; c += W) {
        spread.step();
        const vf<W> x0 = load_kv<W>(k0 + c), x1 = load_kv<W>(k1 + c), x2 = load_kv<W>(k2 + c),
                    x3 = load_kv<W>(k3 + c);
#pragma GCC unroll 4
        for (int rr = 0; rr < ROWS; ++rr) {
          const vf<W> qv = load<W>(q[rr] + c);
          a0[rr] += qv * x0, a1[rr] += qv * x1, a2[rr] += qv * x2, a3[rr] += qv * x3;
        }
      }
    }
    if constexpr (W == 16 && ROWS == 4) {
      const vf<W> a[4][4] = {{a0[0], a1[0], a2[0], a3[0]}, {a0[1], a1[1], a2[1], a3[1]},
                             {a0[2], a1[2], a2[2], a3[2]}, {a0[3], a1[3], a2[3], a3[3]}};
      hsum4x4(a, s, t);
    } else {
#pragma GCC unroll 4
      for (int rr = 0; rr < ROWS; ++rr) hsum4(a0[rr], a1[rr], a2[rr], a3[rr], s[rr] + t);
    }
#pragma GCC unroll 4
    for (int rr = 0; rr < ROWS; ++rr) {
      for (int64_t c = ew; c < e; ++c)
        for (int u = 0; u < 4; ++u) s[rr][t + u] += q[rr][c] * to_float(k[t + u][c]);
    }
  }
  spread.rest();
  for (; t < n; ++t) {
    for (int rr = 0; rr < ROWS; ++rr) {
      vf<W> a{};
      for (int64_t c = 0; c < ew; c += W) a += load<W>(q[rr] + c) * load_kv<W>(k[t] + c);
      float sum = hsum<W>(a);
      for (int64_t c = ew; c < e; ++c) sum += q[rr][c] * to_float(k[t][c]);
      s[rr][t] = sum;
    }
  }
}

// Columns [c, c + U W) of the ROWS output rows: the block's sum over its keys in registers,
// each value vector loaded once for every row, then added to o (read and written once per
// pass). A sum of the block's own, not o's running one: adding each key to a running sum over
// a slice of 2^20 keys lost its terms' low bits (uniform weights: 0.13% off, 49% at 2^28);
// block by block the running sum takes a sixteenth of the adds. `spread` (the first pass only)
// fetches the block after next as the keys go by.
template <int W, int ROWS, int U, bool REG, typename KV>
ATTNX_BODY void add_rows_pass(float* const* o, const float* const* p, const KV* const* v,
                              int64_t n, int64_t c, Spread* spread) {
  vf<W> acc[ROWS][U] = {};
  for (int64_t t = 0; t < n; ++t) {
    if (spread) spread->step();
    const KV* row = v[t] + c;
    vf<W> pt[ROWS];
#pragma GCC unroll 4
    for (int rr = 0; rr < ROWS; ++rr) pt[rr] = vf<W>{} + p[rr][t];
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const vf<W> x = in_register<REG, W>(load_kv<W>(row + u * W));
#pragma GCC unroll 4
      for (int rr = 0; rr < ROWS; ++rr) acc[rr][u] += pt[rr] * x;
    }
  }
#pragma GCC unroll 4
  for (int rr = 0; rr < ROWS; ++rr)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) store<W>(o[rr] + c + u * W, load<W>(o[rr] + c + u * W) + acc[rr][u]);
}

// Passes of U W columns, then of 4 and 2 vectors where the rest still fills them, then single
// vectors: each value row is read as one run of the widest pass (the whole row at Ev = 128 on
// AVX-512 for one or two rows, and at Ev = 64, where passes of 8 vectors alone left every
// column to one-vector passes, one FMA chain per row and column: a block took 5-10% longer at
// D = 64 on a Zen 5): a row's first touch streams from memory in order. U keeps the
// accumulators within the ISA's registers (32 zmm, 16 ymm): three or four rows take 6 vectors a
// pass (24 accumulators), so a value row goes as 6 + 2 vectors at Ev = 128, each line loaded
// once for the four rows.
template <int W, int ROWS, bool REG, typename KV>
ATTNX_BODY void add_rows_body(float* const* o, const float* const* p, const KV* const* v,
                              int64_t n, int64_t ev, const Ahead& ahead) {
  constexpr int U = ROWS > 2 ? 6 : (ROWS == 2 && W == 8) ? 4 : 8;
  static_assert(ROWS <= 2 || W == 16, "three or four rows a pass need AVX-512's registers");
  Spread spread(ahead, ev < W ? 0 : n);  // over the keys of the first pass
  Spread* first = &spread;
  int64_t c = 0;
  for (; c + U * W <= ev; c += U * W, first = nullptr)
    add_rows_pass<W, ROWS, U, REG>(o, p, v, n, c, first);
  if (U > 4 && c + 4 * W <= ev) {
    add_rows_pass<W, ROWS, 4, REG>(o, p, v, n, c, first);
    c += 4 * W, first = nullptr;
  }
  if (c + 2 * W <= ev) {
    add_rows_pass<W, ROWS, 2, REG>(o, p, v, n, c, first);
    c += 2 * W, first = nullptr;
  }
  for (; c + W <= ev; c += W, first = nullptr)
    add_rows_pass<W, ROWS, 1, REG>(o, p, v, n, c, first);
  spread.rest();
  for (; c < ev; ++c) {
    for (int rr = 0; rr < ROWS; ++rr) {
      float acc = 0.f;
      for (int64_t t = 0; t < n; ++t) acc += p[rr][t] * to_float(v[t][c]);
      o[rr][c] += acc;
    }
  }
}

// One body per row count, so that the row loops unroll. AVX-512's 32 registers hold four rows'
// accumulators, AVX2's 16 two: there, rows 3 and 4 go in a second call.
template <int W, typename KV>
ATTNX_BODY void dot_rows_any(int rows, const float* const* q, const KV* const* k, int64_t n,
                             int64_t e, float* const* s, const Ahead& ahead) {
  if constexpr (W == 16) {
    switch (rows) {
      case 4: return dot_rows_body<W, 4>(q, k, n, e, s, ahead);
      case 3: return dot_rows_body<W, 3>(q, k, n, e, s, ahead);
      case 2: return dot_rows_body<W, 2>(q, k, n, e, s, ahead);
      default: return dot_rows_body<W, 1>(q, k, n, e, s, ahead);
    }
  } else {
    if (rows == 1) return dot_rows_body<W, 1>(q, k, n, e, s, ahead);
    dot_rows_body<W, 2>(q, k, n, e, s, ahead);
    if (rows == 3) dot_rows_body<W, 1>(q + 2, k, n, e, s + 2, {});
    if (rows == 4) dot_rows_body<W, 2>(q + 2, k, n, e, s + 2, {});
  }
}
template <int W, bool REG, typename KV>
ATTNX_BODY void add_rows_any(int rows, float* const* o, const float* const* p,
                             const KV* const* v, int64_t n, int64_t ev,
                             const Ahead& ahead) {
  // AVX-512: the four rows in passes of 6 + 2 vectors at Ev = 128 (add_rows_body): each value
  // line loaded once for them; as fast from memory as two rows a pass, which read each value row
  // twice, and 15% faster from L2/L3 (Zen 5). Halves of the row (4 + 4) had lost 10-14% from
  // memory, the row's first touch then going in two strided sweeps. AVX2: two rows a pass.
  if constexpr (W == 16) {
    switch (rows) {
      case 4: return add_rows_body<W, 4, REG>(o, p, v, n, ev, ahead);
      case 3: return add_rows_body<W, 3, REG>(o, p, v, n, ev, ahead);
      case 2: return add_rows_body<W, 2, REG>(o, p, v, n, ev, ahead);
      default: return add_rows_body<W, 1, REG>(o, p, v, n, ev, ahead);
    }
  } else {
    if (rows == 1) return add_rows_body<W, 1, REG>(o, p, v, n, ev, ahead);
    add_rows_body<W, 2, REG>(o, p, v, n, ev, ahead);
    if (rows == 3) add_rows_body<W, 1, REG>(o + 2, p + 2, v, n, ev, {});
    if (rows == 4) add_rows_body<W, 2, REG>(o + 2, p + 2, v, n, ev, {});
  }
}

// Two columns of a key row, repeated over the vector: one 8-byte broadcast load. (x - 0 is x
// for every x, so it folds away; `splat`'s 0 + x is not, for x = -0: an add per use, and a
// lane-by-lane fill went to eight masked loads.)
template <int W>
struct PairVec {
  typedef double d __attribute__((vector_size(4 * W)));
};
template <int W>
ATTNX_BODY vf<W> load_pair(const float* p) {
  double x;
  std::memcpy(&x, p, sizeof(x));
  return (vf<W>)(x - typename PairVec<W>::d{});
}

// A key's score for every lane row from its two vectors of partial sums: a[g] holds two
// partials for each of W / 2 rows, its pair p (lanes 2 p, 2 p + 1) row 4 (p / 2) + 2 g + p % 2
// (lane_pairs), so that the pairs' sums, interleaved a block at a time, leave row r in lane r.
template <int W>
ATTNX_BODY vf<W> pair_sums(vf<W> a0, vf<W> a1) {
  if constexpr (W == 16) {
    return __builtin_shufflevector(a0, a1, 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
           __builtin_shufflevector(a0, a1, 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
  } else {
    static_assert(W == 8, "lanes: 8 or 16");
    return __builtin_shufflevector(a0, a1, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a0, a1, 1, 3, 9, 11, 5, 7, 13, 15);
  }
}

// Columns c, c + 1 of U keys into their accumulators: one broadcast of a key's two values
// serves two FMAs, one per vector of q pairs.
template <int W, int U>
ATTNX_BODY void lane_scores_columns(const float* qt, const float* const* key, int64_t c,
                                    vf<W> (&acc)[U][2]) {
  const vf<W> a0 = load<W>(qt + c * W), a1 = load<W>(qt + (c + 1) * W);
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u) {
    const vf<W> b = load_pair<W>(key[u] + c);
    acc[u][0] += a0 * b, acc[u][1] += a1 * b;
  }
}

// U keys' scores for every lane row, stored to st[0, U W). The columns go two at a time (E's
// first e2 = 2 floor(E / 2), lane_scores_columns). Where each FMA broadcast a single value (a
// load per FMA), the same scores ran at 0.65-0.7x this rate on data in L1 and L2 on an Intel
// Xeon (Emerald Rapids), whose loads, not its FMAs, were the limit. An odd last column goes
// alone, transposed as lane_pairs lays it out. Lowers `low` to each lane's smallest score.
template <int W, int U>
ATTNX_BODY void lane_scores_pass(const float* qt, const float* const* kr, int64_t e, float* st,
                                 vf<W>& low, Spread& spread) {
  const int64_t e2 = e / 2 * 2;
  vf<W> acc[U][2];
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u) acc[u][0] = acc[u][1] = vf<W>{};
  // The keys' row pointers held in locals and a run of 8 columns unrolled whole where it is
  // full: GCC otherwise reloaded the U pointers from kr every run and looped over the run's
  // pairs to an end it did not know (74 vs 56 TSC cycles a key at U = 8, E = 128, in L1, on the
  // Emerald Rapids: the loop then ran at 0.75 of the FMA ceiling, now at it).
  const float* key[U];
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u) key[u] = kr[u];
  for (int64_t c8 = 0; c8 < e2; c8 += 8) {
    spread.step();
    if (c8 + 8 <= e2) {
#pragma GCC unroll 4
      for (int64_t c = c8; c < c8 + 8; c += 2) lane_scores_columns<W, U>(qt, key, c, acc);
    } else {
      for (int64_t c = c8; c < e2; c += 2) lane_scores_columns<W, U>(qt, key, c, acc);
    }
  }
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u) {
    vf<W> s = pair_sums<W>(acc[u][0], acc[u][1]);
    if (e2 < e) s += load<W>(qt + e2 * W) * kr[u][e2];
    store<W>(st + u * W, s);
    low = s < low ? s : low;  // vminps (NaN keeps low: only -inf is looked for)
  }
  if (e2 < e && e2 % 8 == 0) spread.step();
}

// KB keys per pass: 2 KB accumulators, the 2 q vectors and the broadcast fill 19 of AVX-512's
// 32 registers (KB = 8), 11 of AVX2's 16 (KB = 4). Returns whether some score came out -inf,
// from the lanes' minimum, compared once a call: each pass's scores compared to -inf and OR-ed
// into a mask compiled to a scalar compare per lane (GCC 12), 128 a pass of 8 keys, 28% of the
// scores' samples; without them, Lq = 4, GQA 4, D = 128 calls on the Emerald Rapids ran 1.25x
// as fast from L2 (one thread) and 1.15x from memory (2 threads, after a 512 MiB read: 44-81%
// of the read bandwidth, was 41-72%; interleaved in one process).
template <int W, int KB>
ATTNX_BODY bool lane_scores_body(const float* qt, const float* const* k, int64_t n, int64_t e,
                                 float* st, const Ahead& ahead) {
  // fetches once per 8 columns, out of the loop that needs every general register: a step per
  // 8 columns of each pass of KB keys and of each key left over
  Spread spread(ahead, (n / KB + n % KB) * ((e + 7) / 8));
  vf<W> low = splat<W>(std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + KB <= n; t += KB) lane_scores_pass<W, KB>(qt, k + t, e, st + t * W, low, spread);
  for (; t < n; ++t) lane_scores_pass<W, 1>(qt, k + t, e, st + t * W, low, spread);
  bool found = false;
  for (int r = 0; r < W; ++r) found |= low[r] == -std::numeric_limits<float>::infinity();
  return found;
}

// ALiBi down the lanes: lane r's distance to key t is |dist0[r] - t|, in int32 lanes converted
// once each (as the scalar int64 loop converts them).
template <int W>
ATTNX_BODY void lane_alibi_body(float* st, int64_t n, const float* slope, const int32_t* dist0) {
  const vf<W> sl = load<W>(slope);
  vi<W> d;
  std::memcpy(&d, dist0, sizeof(d));
  for (int64_t t = 0; t < n; ++t, d -= 1) {
    const vf<W> dist = __builtin_convertvector(d < 0 ? -d : d, vf<W>);
    store<W>(st + t * W, load<W>(st + t * W) - sl * dist);
  }
}

template <int W>
ATTNX_BODY void lane_softmax_body(float* st, int64_t n, float* m, float* l, float* alpha) {
  const vf<W> ninf = splat<W>(-std::numeric_limits<float>::infinity());
  const vf<W> log2e = splat<W>(1.44269504088896341f);
  const vf<W> m_old = load<W>(m);
  vf<W> top = m_old;
  for (int64_t t = 0; t < n; ++t) {
    const vf<W> x = load<W>(st + t * W);
    top = x > top ? x : top;
  }
  // A lane with no admitted key yet keeps max -inf: subtracting 0 there keeps exp(-inf - -inf)
  // = NaN out (its terms and its alpha are exp(-inf) = 0).
  const vf<W> sub = top == ninf ? vf<W>{} : top;
  vf<W> sum{};
  for (int64_t t = 0; t < n; ++t) {
    const vf<W> p = exp2v<W>((load<W>(st + t * W) - sub) * log2e);
    store<W>(st + t * W, p);
    sum += p;
  }
  const vf<W> a = exp2v<W>((m_old - sub) * log2e);
  store<W>(alpha, a);
  store<W>(l, load<W>(l) * a + sum);
  store<W>(m, top);
}

// CB columns of the transposed output in registers per pass over the keys: per key, one load
// of its probabilities (a vector over the rows) and CB FMAs broadcasting its values from memory
// one at a time (measured in L1 at 0.77 of one core's FMA rate on the Emerald Rapids, where the
// scores' one-value broadcasts ran at 0.45-0.55: lane_scores_pass). The block's own sum, then
// added to the columns with the rows' alpha applied (add_rows_pass: why not the running sum).
template <int W, int CB, bool RESCALE>
ATTNX_BODY void lane_add_pass(float* ot, int64_t c0, vf<W> alpha, const float* st,
                              const float* const* v, int64_t n, Spread& spread) {
  vf<W> acc[CB] = {};
  for (int64_t t = 0; t < n; ++t) {
    spread.step();
    const vf<W> p = load<W>(st + t * W);
    const float* row = v[t] + c0;
    // Opaque to GCC, which otherwise keeps CB offsets c0 + u live across the keys (out of
    // general registers, shuffled through vector ones: 2x the loop's instructions).
    asm("" : "+r"(row));
#pragma GCC unroll 16
    for (int u = 0; u < CB; ++u) acc[u] += p * row[u];
  }
#pragma GCC unroll 16
  for (int u = 0; u < CB; ++u) {
    vf<W> o = load<W>(ot + (c0 + u) * W);
    if constexpr (RESCALE) o *= alpha;
    store<W>(ot + (c0 + u) * W, o + acc[u]);
  }
}

template <int W, int CB, bool RESCALE>
ATTNX_BODY void lane_add_columns(float* ot, vf<W> alpha, const float* st, const float* const* v,
                                 int64_t n, int64_t ev, Spread& spread) {
  int64_t c = 0;
  for (; c + CB <= ev; c += CB) lane_add_pass<W, CB, RESCALE>(ot, c, alpha, st, v, n, spread);
  for (; c < ev; ++c) lane_add_pass<W, 1, RESCALE>(ot, c, alpha, st, v, n, spread);
}

template <int W>
ATTNX_BODY void lane_add_body(float* ot, const float* alpha, const float* st,
                              const float* const* v, int64_t n, int64_t ev,
                              const Ahead& ahead) {
  // CB accumulators within the ISA's registers (32 zmm; 16 ymm, where AVX2 broadcasts into a
  // register of its own)
  constexpr int CB = W == 16 ? 16 : 8;
  Spread spread(ahead, ((ev / CB) + ev % CB) * n);
  const vf<W> a = load<W>(alpha);
  // Once the rows' maxima settle, most blocks raise none of them (alpha 1 in every lane): the
  // columns then go without the multiply (3-6% of a block at Lq = 4, one thread, Zen 4).
  bool rescale = false;
  for (int r = 0; r < W; ++r) rescale |= alpha[r] != 1.0f;
  if (rescale) {
    lane_add_columns<W, CB, true>(ot, a, st, v, n, ev, spread);
  } else {
    lane_add_columns<W, CB, false>(ot, a, st, v, n, ev, spread);
  }
}

template <int W>
ATTNX_BODY void widen_bf16_body(const c10::BFloat16* src, int64_t n, float* dst) {
  int64_t t = 0;
  for (; t + W <= n; t += W) store<W>(dst + t, load_kv<W>(src + t));
  for (; t < n; ++t) dst[t] = to_float(src[t]);
}

#ifdef ATTNX_X86_DISPATCH
ATTNX_AVX2 void widen_bf16_avx2(const c10::BFloat16* src, int64_t n, float* dst) {
  widen_bf16_body<8>(src, n, dst);
}
ATTNX_AVX512 void widen_bf16_avx512(const c10::BFloat16* src, int64_t n, float* dst) {
  widen_bf16_body<16>(src, n, dst);
}
// float16 needs the conversion instruction (F16C's vcvtph2ps, or AVX-512's): GCC 12 converts a
// vector of _Float16 element by element, so these are written with intrinsics. The tail goes
// through c10::Half's own conversion.
__attribute__((target("avx2,fma,f16c"))) void widen_f16_f16c(const c10::Half* src, int64_t n,
                                                             float* dst) {
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + t));
    _mm256_storeu_ps(dst + t, _mm256_cvtph_ps(h));
  }
  for (; t < n; ++t) dst[t] = static_cast<float>(src[t]);
}
ATTNX_AVX512 void widen_f16_avx512(const c10::Half* src, int64_t n, float* dst) {
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + t));
    // (the maskz form: the plain one trips GCC 12's -Wmaybe-uninitialized on its undefined source)
    _mm512_storeu_ps(dst + t, _mm512_maskz_cvtph_ps(static_cast<__mmask16>(0xFFFF), h));
  }
  for (; t < n; ++t) dst[t] = static_cast<float>(src[t]);
}
template <typename KV>
ATTNX_AVX2 void dot_rows_avx2(int rows, const float* const* q, const KV* const* k, int64_t n,
                              int64_t e, float* const* s, const Ahead& ahead) {
  dot_rows_any<8>(rows, q, k, n, e, s, ahead);
}
template <typename KV>
ATTNX_AVX512 void dot_rows_avx512(int rows, const float* const* q, const KV* const* k,
                                  int64_t n, int64_t e, float* const* s,
                                  const Ahead& ahead) {
  dot_rows_any<16>(rows, q, k, n, e, s, ahead);
}
template <typename KV>
ATTNX_AVX2 void add_rows_avx2(int rows, float* const* o, const float* const* p,
                              const KV* const* v, int64_t n, int64_t ev,
                              const Ahead& ahead) {
  add_rows_any<8, true>(rows, o, p, v, n, ev, ahead);
}
template <typename KV>
ATTNX_AVX512 void add_rows_avx512(int rows, float* const* o, const float* const* p,
                                  const KV* const* v, int64_t n, int64_t ev,
                                  const Ahead& ahead) {
  add_rows_any<16, true>(rows, o, p, v, n, ev, ahead);
}

ATTNX_AVX2 bool lane_scores_avx2(const float* qt, const float* const* k, int64_t n, int64_t e,
                                 float* st, const Ahead& ahead) {
  return lane_scores_body<8, 4>(qt, k, n, e, st, ahead);
}
ATTNX_AVX512 bool lane_scores_avx512(const float* qt, const float* const* k, int64_t n,
                                     int64_t e, float* st, const Ahead& ahead) {
  return lane_scores_body<16, 8>(qt, k, n, e, st, ahead);
}
ATTNX_AVX2 void lane_alibi_avx2(float* st, int64_t n, const float* slope, const int32_t* dist0) {
  lane_alibi_body<8>(st, n, slope, dist0);
}
ATTNX_AVX512 void lane_alibi_avx512(float* st, int64_t n, const float* slope,
                                    const int32_t* dist0) {
  lane_alibi_body<16>(st, n, slope, dist0);
}
ATTNX_AVX2 void lane_softmax_avx2(float* st, int64_t n, float* m, float* l, float* alpha) {
  lane_softmax_body<8>(st, n, m, l, alpha);
}
ATTNX_AVX512 void lane_softmax_avx512(float* st, int64_t n, float* m, float* l, float* alpha) {
  lane_softmax_body<16>(st, n, m, l, alpha);
}
ATTNX_AVX2 void lane_add_avx2(float* ot, const float* alpha, const float* st,
                              const float* const* v, int64_t n, int64_t ev,
                              const Ahead& ahead) {
  lane_add_body<8>(ot, alpha, st, v, n, ev, ahead);
}
ATTNX_AVX512 void lane_add_avx512(float* ot, const float* alpha, const float* st,
                                  const float* const* v, int64_t n, int64_t ev,
                                  const Ahead& ahead) {
  lane_add_body<16>(ot, alpha, st, v, n, ev, ahead);
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

namespace {

template <typename KV>
void dot_rows_of(int rows, const float* const* q, const KV* const* k, int64_t n, int64_t e,
                 float* const* s, const Ahead& ahead) {
#ifdef ATTNX_X86_DISPATCH
  switch (isa()) {
    case Isa::avx512: return dot_rows_avx512(rows, q, k, n, e, s, ahead);
    case Isa::avx2: return dot_rows_avx2(rows, q, k, n, e, s, ahead);
    case Isa::baseline: break;
  }
#endif
  dot_rows_any<8>(rows, q, k, n, e, s, ahead);
}

template <typename KV>
void add_rows_of(int rows, float* const* o, const float* const* p, const KV* const* v, int64_t n,
                 int64_t ev, const Ahead& ahead) {
#ifdef ATTNX_X86_DISPATCH
  switch (isa()) {
    case Isa::avx512: return add_rows_avx512(rows, o, p, v, n, ev, ahead);
    case Isa::avx2: return add_rows_avx2(rows, o, p, v, n, ev, ahead);
    case Isa::baseline: break;
  }
#endif
  add_rows_any<8, false>(rows, o, p, v, n, ev, ahead);
}

}  // namespace

void dot_rows(int rows, const float* const* q, const float* const* k, int64_t n, int64_t e,
              float* const* s, Ahead ahead) {
  dot_rows_of(rows, q, k, n, e, s, ahead);
}
void dot_rows(int rows, const float* const* q, const c10::BFloat16* const* k, int64_t n,
              int64_t e, float* const* s, Ahead ahead) {
  dot_rows_of(rows, q, k, n, e, s, ahead);
}

void add_rows(int rows, float* const* o, const float* const* p, const float* const* v, int64_t n,
              int64_t ev, Ahead ahead) {
  add_rows_of(rows, o, p, v, n, ev, ahead);
}
void add_rows(int rows, float* const* o, const float* const* p, const c10::BFloat16* const* v,
              int64_t n, int64_t ev, Ahead ahead) {
  add_rows_of(rows, o, p, v, n, ev, ahead);
}

int lane_width() {
#ifdef ATTNX_X86_DISPATCH
  if (isa() == Isa::avx512) return 16;
#endif
  return 8;
}

void lane_pairs(const float* q, int64_t rows, int64_t e, float* qt) {
  const int64_t W = lane_width(), e2 = e / 2 * 2;
  // qt's pair s of each column pair holds row 4 (p / 2) + 2 g + p % 2 (s = g W / 2 + p)
  const auto row_of = [&](int64_t s) {
    const int64_t g = s / (W / 2), p = s % (W / 2);
    return 4 * (p / 2) + 2 * g + p % 2;
  };
  float* out = qt;  // written in order: a store per line of its own was slow (decode_cpu.cpp)
  if (rows == W) {
    // Every lane a row: one 8-byte move per pair from the rows' pointers (a branch and the
    // lane arithmetic per value made this 17% of a call at Lq = 4 against 16 keys).
    const float* src[16];
    for (int64_t s = 0; s < W; ++s) src[s] = q + row_of(s) * e;
    for (int64_t c = 0; c < e2; c += 2)
      for (int64_t s = 0; s < W; ++s, out += 2) std::memcpy(out, src[s] + c, 2 * sizeof(float));
  } else {
    const auto at = [&](int64_t r, int64_t c) { return r < rows ? q[r * e + c] : 0.0f; };
    for (int64_t c = 0; c < e2; c += 2)
      for (int64_t s = 0; s < W; ++s)
        for (int64_t i = 0; i < 2; ++i) *out++ = at(row_of(s), c + i);
  }
  for (int64_t r = 0; r < W && e2 < e; ++r) *out++ = r < rows ? q[r * e + e2] : 0.0f;
}

void lanes_to_rows(const float* ot, int64_t rows, int64_t ev, float* o) {
  const int64_t W = lane_width();
  typedef float v4 __attribute__((vector_size(16)));
  const auto load = [](const float* p) {
    v4 x;
    std::memcpy(&x, p, sizeof(x));
    return x;
  };
  int64_t r = 0;
  // 4 x 4 blocks through registers: 4 loads, 8 shuffles and 4 stores for 16 values (one at a
  // time, a strided load each, this was 10% of a call at Lq = 4 against 16 keys)
  for (; r + 4 <= rows; r += 4) {
    int64_t c = 0;
    for (; c + 4 <= ev; c += 4) {
      const v4 a = load(ot + c * W + r), b = load(ot + (c + 1) * W + r),
               x = load(ot + (c + 2) * W + r), y = load(ot + (c + 3) * W + r);
      const v4 ab_lo = __builtin_shufflevector(a, b, 0, 4, 1, 5),
               ab_hi = __builtin_shufflevector(a, b, 2, 6, 3, 7),
               xy_lo = __builtin_shufflevector(x, y, 0, 4, 1, 5),
               xy_hi = __builtin_shufflevector(x, y, 2, 6, 3, 7);
      const v4 r0 = __builtin_shufflevector(ab_lo, xy_lo, 0, 1, 4, 5),
               r1 = __builtin_shufflevector(ab_lo, xy_lo, 2, 3, 6, 7),
               r2 = __builtin_shufflevector(ab_hi, xy_hi, 0, 1, 4, 5),
               r3 = __builtin_shufflevector(ab_hi, xy_hi, 2, 3, 6, 7);
      std::memcpy(o + r * ev + c, &r0, sizeof(r0));
      std::memcpy(o + (r + 1) * ev + c, &r1, sizeof(r1));
      std::memcpy(o + (r + 2) * ev + c, &r2, sizeof(r2));
      std::memcpy(o + (r + 3) * ev + c, &r3, sizeof(r3));
    }
    for (; c < ev; ++c)
      for (int64_t i = 0; i < 4; ++i) o[(r + i) * ev + c] = ot[c * W + r + i];
  }
  for (; r < rows; ++r)
    for (int64_t c = 0; c < ev; ++c) o[r * ev + c] = ot[c * W + r];
}

bool lane_scores(const float* qt, const float* const* k, int64_t n, int64_t e, float* st,
                 Ahead ahead) {
#ifdef ATTNX_X86_DISPATCH
  switch (isa()) {
    case Isa::avx512: return lane_scores_avx512(qt, k, n, e, st, ahead);
    case Isa::avx2: return lane_scores_avx2(qt, k, n, e, st, ahead);
    case Isa::baseline: break;
  }
#endif
  return lane_scores_body<8, 4>(qt, k, n, e, st, ahead);
}

void lane_alibi(float* st, int64_t n, const float* slope, const int32_t* dist0) {
#ifdef ATTNX_X86_DISPATCH
  switch (isa()) {
    case Isa::avx512: return lane_alibi_avx512(st, n, slope, dist0);
    case Isa::avx2: return lane_alibi_avx2(st, n, slope, dist0);
    case Isa::baseline: break;
  }
#endif
  lane_alibi_body<8>(st, n, slope, dist0);
}

void lane_softmax(float* st, int64_t n, float* m, float* l, float* alpha) {
#ifdef ATTNX_X86_DISPATCH
  switch (isa()) {
    case Isa::avx512: return lane_softmax_avx512(st, n, m, l, alpha);
    case Isa::avx2: return lane_softmax_avx2(st, n, m, l, alpha);
    case Isa::baseline: break;
  }
#endif
  lane_softmax_body<8>(st, n, m, l, alpha);
}

void lane_add(float* ot, const float* alpha, const float* st, const float* const* v, int64_t n,
              int64_t ev, Ahead ahead) {
#ifdef ATTNX_X86_DISPATCH
  switch (isa()) {
    case Isa::avx512: return lane_add_avx512(ot, alpha, st, v, n, ev, ahead);
    case Isa::avx2: return lane_add_avx2(ot, alpha, st, v, n, ev, ahead);
    case Isa::baseline: break;
  }
#endif
  lane_add_body<8>(ot, alpha, st, v, n, ev, ahead);
}

void widen(const c10::BFloat16* src, int64_t n, float* dst) {
#ifdef ATTNX_X86_DISPATCH
  switch (isa()) {
    case Isa::avx512: return widen_bf16_avx512(src, n, dst);
    case Isa::avx2: return widen_bf16_avx2(src, n, dst);
    case Isa::baseline: break;
  }
#endif
  widen_bf16_body<8>(src, n, dst);
}

void widen(const c10::Half* src, int64_t n, float* dst) {
#ifdef ATTNX_X86_DISPATCH
  static const bool f16c = __builtin_cpu_supports("f16c");
  switch (isa()) {
    case Isa::avx512: return widen_f16_avx512(src, n, dst);
    case Isa::avx2:
      if (f16c) return widen_f16_f16c(src, n, dst);
      break;
    case Isa::baseline: break;
  }
#endif
  for (int64_t t = 0; t < n; ++t) dst[t] = static_cast<float>(src[t]);
}

void dot_rows(int rows, const double* const* q, const double* const* k, int64_t n, int64_t e,
              double* const* s, Ahead) {
  for (int rr = 0; rr < rows; ++rr)
    for (int64_t t = 0; t < n; ++t) {
      double sum = 0.0;
      for (int64_t c = 0; c < e; ++c) sum += q[rr][c] * k[t][c];
      s[rr][t] = sum;
    }
}

void add_rows(int rows, double* const* o, const double* const* p, const double* const* v,
              int64_t n, int64_t ev, Ahead) {
  for (int rr = 0; rr < rows; ++rr)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < ev; ++c) o[rr][c] += p[rr][t] * v[t][c];
}

}  // namespace attnx::cpu
