// Flash-style scaled-dot-product attention on the CPU. Conventions: csrc/ops.cpp.
//
// Forward: for each (batch, query head, tile of BQ queries), walk the keys the band admits in
// blocks of BK: S = scale * Q K^T on the tile, mask and band, online softmax, O += P V. The
// products come from sdpa_products.h (the panel micro-kernel for float32 on AVX2, else BLAS).
// Extra memory: per thread one BQ x BK score tile and one BQ x Ev accumulator; on the panel
// engine, K and V packed for a round of kv heads, shared by the threads (at most KEPT_FLOATS,
// the kept buffer of kept_buffer.h, or what gives every thread a task). Backward recomputes P
// from the saved lse, tile by tile, with dK / dV of a block kept hot across the query tiles.
// bfloat16 and float16 run the float32 kernel on float32 copies (linear memory) and round once.
// Finite inputs never give NaN: where float32 may overflow (scores or sums past its range,
// which takes |q| |k| E near 1.7e38) the kernels say so and the call reruns in float64
// (float64_rerun.h).
#include "sdpa_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_choice.h"
#include "decode_cpu.h"
#include "dropout.h"
#include "float64_rerun.h"
#include "huge_lse.h"
#include "kept_buffer.h"
#include "score_mods.h"
#include "sdpa_mask.h"
#include "sdpa_products.h"
#include "sdpa_tile.h"
#include "task_queue.h"

namespace attnx::cpu {
namespace {

using at::Tensor;

template <typename T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// Query i may attend key j iff i + lo <= j <= i + hi.
struct Band {
  int64_t lo, hi;
  // Keys [first, last) of the block j0 .. j0 + n - 1 that row i may attend (first >= last: none).
  int64_t first(int64_t i, int64_t j0, int64_t n) const {
    return std::clamp<int64_t>(i + lo - j0, 0, n);
  }
  int64_t last(int64_t i, int64_t j0, int64_t n) const {
    return std::clamp<int64_t>(i + hi + 1 - j0, 0, n);
  }
  // Whether row i of a (b, h) head may attend some key at all, under the band and the mask.
  bool admits_any(const MaskRows& mask, int64_t b, int64_t h, int64_t i, int64_t lk) const {
    return mask.admits_any(b, h, i, first(i, 0, lk), last(i, 0, lk));
  }
  // Does some row of [i0, i0 + m) admit some key of [j0, j0 + n)?
  bool touches(int64_t i0, int64_t m, int64_t j0, int64_t n) const {
    return i0 + lo <= j0 + n - 1 && i0 + m - 1 + hi >= j0;
  }
};

// The same admissible pairs with bounds in [-Lq, Lk], so that i + lo and i + hi cannot overflow
// whatever a direct caller of the op passes.
Band clamped_band(int64_t lo, int64_t hi, const Dims& d) {
  return Band{std::clamp(lo, -d.Lq, d.Lk), std::clamp(hi, -d.Lq, d.Lk)};
}

// Threads take runs of consecutive tasks (task_queue.h). Under a causal band a query tile's work
// grows with its index, so the forward orders a head's tiles 0, n - 1, 1, n - 2, ...: neighbours
// pair light with heavy, and a run of tasks weighs about its length (with static halves in
// index order, the second thread got 3/4 of a single head's work).
int64_t zigzag(int64_t t, int64_t n) { return t % 2 == 0 ? t / 2 : n - 1 - t / 2; }

// Rows [r0, r1) of a query tile and the keys [c0, c1) of a key block that some of them admit.
struct RowGroup {
  int64_t r0, r1, c0, c1;
};

// The tile of mq queries from i0 against keys j0 .. j0 + nk - 1, cut into row groups so that
// the GEMMs skip what the band refuses: one group when the band admits the whole block.
template <typename F>
void for_row_groups(Band band, int64_t i0, int64_t mq, int64_t j0, int64_t nk, int64_t rows,
                    F&& f) {
  // first() and last() grow with the row, so the corners bound every row of a group.
  const bool whole = band.first(i0 + mq - 1, j0, nk) == 0 && band.last(i0, j0, nk) == nk;
  const int64_t step = whole ? mq : rows;
  for (int64_t r0 = 0; r0 < mq; r0 += step) {
    const int64_t r1 = std::min(mq, r0 + step);
    const int64_t c0 = band.first(i0 + r0, j0, nk), c1 = band.last(i0 + r1 - 1, j0, nk);
    if (c1 > c0) f(RowGroup{r0, r1, c0, c1});
  }
}

// Block sizes (measured on a 2-core AVX2 machine at L = 1k-4k, D = 64 and 128; within +-2%
// of each other from 96 to 256 rows and 256 to 512 keys): a ~128 x 256 score tile (128 KiB)
// stays in L2 and wastes little of the diagonal blocks under a band; row counts are multiples
// of the micro-kernel's 6 rows, so no GEMM ends on a slow short strip; sequences below 768
// take 66-row tiles (30-row tiles measured 5-10% slower at L = 64-256, where each task's fixed
// costs weigh). Key blocks are multiples of PANEL.
int64_t fwd_query_block(int64_t lq) {
  return lq >= 768 ? 132 : 66;
}
constexpr int64_t FWD_KEY_BLOCK = 256;
// How far a row's scores may pass its running max m before the forward takes a new one: past
// a row's first key block, four rows take their exponentials against m in the same pass that
// finds the block's max (and saves the scores), and keep m where that max stays within m +
// LAZY_MAX; a row past it gets its saved scores back and goes the exact way. Without it the
// max took its own pass over each score row, a quarter of the row operations' time. The bound
// is accuracy's: exp2's argument rounds to half an ulp of itself, so a term at y = 2 LAZY_MAX
// log2(e) carries ~8e-8 more relative error than at y = 0 (the max's own, exact path), as the
// exact path's terms e^-2 below the max do; at 8 the row's largest terms had 3.3e-7.
constexpr float LAZY_MAX = 2.0f;
// Rows per GEMM on a block the band cuts (a causal diagonal): the keys past the band of such
// a group are never multiplied, so a 132-row tile does ~1/8 of a square's waste, not 1/2.
constexpr int64_t FWD_EDGE_ROWS = 30;
// The backward's tiles: 192 x 192, multiples of 6 rows and of PANEL keys. Its five GEMMs per
// tile pair, timed in place against the forward's in the same run (one thread, D = 128, L =
// 1k-4k), took 1.11-1.32x the forward's time per flop at 128 x 128 and 1.07-1.14x at 192 x 192,
// likely because each key block streams the whole query side (Q, dO, their packs, dQ) from
// L3 again, and larger blocks do that fewer times (prefetching it did not help); 64 x 64 was
// worse still. At D = 64, and under a causal band, where diagonal tiles waste more, the two
// sizes measured alike.
constexpr int64_t BWD_QUERY_BLOCK = 192;
constexpr int64_t BWD_KEY_BLOCK = 192;
static_assert(FWD_KEY_BLOCK % PANEL == 0 && BWD_KEY_BLOCK % PANEL == 0,
              "key blocks start on panel boundaries: the panel engine indexes K by j0 / PANEL");

// Whether the scores of queries and keys up to these magnitudes may pass T's range: their
// partial sums are bounded by E max|q| max|k|, and `scale` multiplies them at the end (panels)
// or on the way (BLAS). Inputs that close to it are no model's; they rerun in float64.
template <typename T>
bool scores_may_overflow(T query_max, T key_max, T scale, int64_t e) {
  const double bound = static_cast<double>(query_max) * key_max * static_cast<double>(e) *
                       std::max(1.0, std::abs(static_cast<double>(scale)));
  return !(bound <= static_cast<double>(std::numeric_limits<T>::max()) / 2);
}

// Returns whether T overflowed on some row, which finite inputs cannot make it do in exact
// arithmetic: scores that may pass T's range (scores_may_overflow), a score with a float mask
// past it (the row's max +inf, or its sum NaN), every admitted score fallen to -inf (l = 0
// though the mask and band admit keys), or an output past the range (the unnormalized sum
// P V). The caller then reruns in float64, which holds every product and sum of float32 values.
template <typename T, typename Products, bool MODS>
bool forward_kernel(const T* q, const T* k, const T* v, const MaskRows& mask, T scale,
                    Band band, const Dropout& drop, const Mods<T>& mods, T* out, T* lse,
                    const Dims& d) {
  const int64_t BQ = fwd_query_block(d.Lq), BK = FWD_KEY_BLOCK;
  const int64_t nqt = (d.Lq + BQ - 1) / BQ;
  const T inv_keep = static_cast<T>(drop.inv_keep);
  std::atomic<bool> overflow{false};
  const int64_t kv_heads = d.B * d.Hkv, per_head = Products::Heads::floats_per_head(d);
  if (kv_heads == 0 || nqt == 0) return false;
  // Rounds of kv heads whose packed operands fit in the kept buffer (KEPT_FLOATS), so that the extra memory
  // stays bounded whatever the batch (one round for up to 16 heads at L = 4096, D = 128), but
  // with a task for every thread: the rounds run one after the other.
  const int64_t fill = (at::get_num_threads() + d.group() * nqt - 1) / (d.group() * nqt);
  const int64_t fits = per_head > 0 ? static_cast<int64_t>(KEPT_FLOATS) / per_head : kv_heads;
  const int64_t round = std::min(kv_heads, std::max({int64_t{1}, fits, fill}));
  typename Products::Heads heads(d, round);
  for (int64_t c0 = 0; c0 < kv_heads; c0 += round) {
    const int64_t c1 = std::min(kv_heads, c0 + round);
    heads.prepare(k, v, c0, c1);
    parallel_tasks((c1 - c0) * d.group() * nqt, [&](Tasks& tasks) {
      Products kv(d, heads);
      const int64_t ldo = kv.out_stride();
      // o accumulates P V unnormalized; it goes to `out` once divided by the row sums.
      line_vector<T> sbuf(BQ * BK), obuf(BQ * ldo), keep(4 * BK);  // keep: four rows' scores
      std::vector<T> m(BQ), l(BQ);
      T* s = sbuf.data();
      T* o = obuf.data();
      for (int64_t task; tasks.next(task);) {
        // Query tiles fastest: the query heads of kv heads [c0, c1) are [c0 group, c1 group).
        const int64_t qt = zigzag(task % nqt, nqt), bh = c0 * d.group() + task / nqt;
        const int64_t h = bh % d.Hq, b = bh / d.Hq, bhk = bh / d.group();
        const int64_t i0 = qt * BQ, mq = std::min(BQ, d.Lq - i0);
        kv.load(bhk);
        const T* qp = q + (bh * d.Lq + i0) * d.E;
        T* op = out + (bh * d.Lq + i0) * d.Ev;
        T* lp = lse + bh * d.Lq + i0;
        bool over = scores_may_overflow(abs_max(qp, mq * d.E), kv.key_max, scale, d.E);
        std::fill(m.begin(), m.end(), neg_inf<T>());
        std::fill(l.begin(), l.end(), T(0));
        std::fill(o, o + mq * ldo, T(0));
        const uint32_t key_bh = drop.on ? drop.key_bh(bh) : 0;
        // Only key blocks the band reaches are visited at all; they start on a panel boundary.
        const int64_t jlo = std::max<int64_t>(0, i0 + band.lo) / PANEL * PANEL;
        const int64_t jhi = std::min<int64_t>(d.Lk, i0 + mq + band.hi);
        for (int64_t j0 = jlo; j0 < jhi; j0 += BK) {
          const int64_t nk = std::min(BK, jhi - j0);
          // Entries of S outside a row's [first, last) are never read, so they need not exist.
          for_row_groups(band, i0, mq, j0, nk, FWD_EDGE_ROWS, [&](const RowGroup& g) {
            kv.scores(g.r1 - g.r0, qp + g.r0 * d.E, j0, g.c0, g.c1, scale, s + g.r0 * BK, BK);
          });
          // Row r's running max and sum take the block's max mnew and exp sum (terms relative
          // to mnew); its partial output follows.
          const auto advance = [&](int64_t r, T mnew, T sum) {
            // Past the first blocks a row's max rarely moves: skip the libm call for exp(0).
            const T alpha = m[r] == neg_inf<T>() ? T(0)
                            : m[r] == mnew       ? T(1)
                                                 : std::exp(m[r] - mnew);
            l[r] = l[r] * alpha + sum;
            m[r] = mnew;
            if (alpha != T(1)) scale_row(o + r * ldo, d.Ev, alpha);
          };
          const auto one_row = [&](int64_t r) {
            const int64_t i = i0 + r;
            T* sr = s + r * BK;
            const int64_t a = band.first(i, j0, nk), e = std::max(a, band.last(i, j0, nk));
            if constexpr (MODS) mods.apply(sr + a, e - a, bh, i, j0 + a, nullptr);
            const T mnew = std::max(m[r], mask.present() && e > a
                                              ? mask.apply(sr + a, b, h, i, j0 + a, e - a)
                                              : row_max(sr + a, e - a));
            std::fill(sr, sr + a, T(0));
            std::fill(sr + e, sr + nk, T(0));
            if (mnew == neg_inf<T>()) {  // nothing admitted yet: this block adds nothing
              std::fill(sr + a, sr + e, T(0));
              return;
            }
            advance(r, mnew, exp_sum(sr + a, e - a, mnew));
            if (drop.on) {
              dropout_row(sr + a, e - a, Dropout::key_row(key_bh, i),
                          static_cast<uint32_t>(j0 + a), drop.threshold, inv_keep);
            }
          };
          int64_t r = 0;
          if constexpr (!MODS && std::is_same_v<T, float>) {
            // Four rows that admit the whole block, with no mask or dropout (every block of a
            // plain forward, all but the diagonal ones of a causal forward), take their maxima
            // and exponentials together: row by row, each waited on its max's reduction, then
            // on its sum's, before the next row could start. Past a row's first block its
            // running max m need not be the true one (LAZY_MAX): the exponentials are taken
            // against m at once, the block's max found in the same pass.
            for (; !mask.present() && !drop.on && r + 4 <= mq; r += 4) {
              float* rows[4] = {s + r * BK, s + (r + 1) * BK, s + (r + 2) * BK, s + (r + 3) * BK};
              float top[4], sums[4];
              bool whole = band.first(i0 + r + 3, j0, nk) == 0 && band.last(i0 + r, j0, nk) == nk;
              bool lazy = whole;
              for (int64_t t = 0; t < 4; ++t) lazy = lazy && m[r + t] != neg_inf<T>();
              if (lazy) {
                float* saved[4] = {keep.data(), keep.data() + BK, keep.data() + 2 * BK,
                                   keep.data() + 3 * BK};
                exp_sum4(rows, nk, m.data() + r, sums, top, saved);
                for (int64_t t = 0; t < 4; ++t) {
                  if (top[t] - m[r + t] <= LAZY_MAX) {  // also NaN scores: l turns NaN
                    l[r + t] += sums[t];
                    continue;
                  }
                  // The row's scores passed m by more: they go back, and the exact way.
                  std::copy(saved[t], saved[t] + nk, rows[t]);
                  one_row(r + t);
                }
                continue;
              }
              if (whole) {
                row_max4(rows, nk, top);
                for (int64_t t = 0; t < 4; ++t) {
                  top[t] = std::max(m[r + t], top[t]);
                  whole = whole && top[t] != neg_inf<T>();
                }
              }
              if (!whole) {  // cut by the band, or nothing admitted yet
                for (int64_t t = 0; t < 4; ++t) one_row(r + t);
                continue;
              }
              exp_sum4(rows, nk, top, sums);
              for (int64_t t = 0; t < 4; ++t) advance(r + t, top[t], sums[t]);
            }
          }
          for (; r < mq; ++r) one_row(r);
          // P is 0 outside each row's band, so a group's product needs only its keys.
          for_row_groups(band, i0, mq, j0, nk, FWD_EDGE_ROWS, [&](const RowGroup& g) {
            kv.values(g.r1 - g.r0, s + g.r0 * BK, BK, j0, g.c0, g.c1, o + g.r0 * ldo);
          });
        }
        for (int64_t r = 0; r < mq; ++r) {
          T inv = l[r] > T(0) ? T(1) / l[r] : T(0);  // no admitted key: zeros
          lp[r] = l[r] > T(0) ? m[r] + std::log(l[r]) : neg_inf<T>();
          if constexpr (MODS) {
            // exp(sink) joins the denominator l exp(m) (a sink of -inf adds 0: an empty row
            // keeps zeros and lse -inf, not exp(-inf - -inf))
            if (mods.sinks != nullptr && mods.sinks[h] > neg_inf<T>()) {
              const T sink = mods.sinks[h];
              const T top = l[r] > T(0) ? std::max(m[r], sink) : sink;
              const T keys = l[r] > T(0) ? l[r] * std::exp(m[r] - top) : T(0);
              const T denom = keys + std::exp(sink - top);
              inv = l[r] > T(0) ? std::exp(m[r] - top) / denom : T(0);
              lp[r] = top + std::log(denom);
            }
          }
          int bad = 0;
          for (int64_t c = 0; c < d.Ev; ++c) {
            op[r * d.Ev + c] = o[r * ldo + c] * inv;
            bad |= non_finite(op[r * d.Ev + c]);
          }
          over = over || bad || std::isnan(l[r]) || m[r] == std::numeric_limits<T>::infinity() ||
                 (l[r] == T(0) && band.admits_any(mask, b, h, i0 + r, d.Lk));
        }
        if (over) overflow.store(true, std::memory_order_relaxed);
      }
    });
  }
  return overflow.load();
}

// The backward's tasks are (batch x head, key split): split s of a head takes one key block of
// each round of `splits` blocks, in snake order (s, 2 splits - 1 - s, 2 splits + s, ...), so
// that under a causal band the splits get like shares of the work; it writes dK, dV of those
// keys and its own partial dQ, which sdpa_bwd sums.
// Splits: the fewest that deal the tasks evenly among the threads (or make 4 per thread), e.g.
// 2 for 1, 3 or 5 heads on 2 threads, 1 for 8. A single head's backward ran on one thread at
// 0.6x torch's speed. Each extra split costs an Lq x E partial and repeats the head's packing:
// at 1 head on 2 threads, 2 and 4 splits measured alike and 8 up to 1.5x slower.
int64_t backward_key_splits(const Dims& d) {
  const int64_t threads = at::get_num_threads(), heads = d.B * d.Hq;
  const int64_t blocks = (d.Lk + BWD_KEY_BLOCK - 1) / BWD_KEY_BLOCK;
  int64_t splits = 1;
  while (threads > 1 && splits < blocks && (heads * splits) % threads != 0 &&
         heads * splits < 4 * threads) {
    ++splits;
  }
  return splits;
}

struct BwdOut {
  void* dq;  // (splits, B, Hq, Lq, E): each split's part of dQ
  int64_t splits;
  void* dk;  // (B, Hq, Lk, E): per query head, summed over the GQA group afterwards
  void* dv;
  void* dmask;  // (B, Hq, Lq, Lk) or null
  void* dsinks;  // (B, Hq): each head's sum over its rows, or null
};

// n values from src to dst; returns whether one was not finite.
template <typename T>
bool copy_checked(const T* src, int64_t n, T* dst) {
  int bad = 0;
  for (int64_t c = 0; c < n; ++c) {
    dst[c] = src[c];
    bad |= non_finite(src[c]);
  }
  return bad != 0;
}

// Returns whether T overflowed: scores that may pass its range (scores_may_overflow), a saved
// lse the forward could not have given from T's own range (NaN, +inf, or -inf on a row that
// admits keys: the forward's float64 rerun), or a gradient past the range.
template <typename T, typename Grads, bool MODS>
bool backward_kernel(const T* dout, const T* q, const T* k, const T* v, const T* out,
                     const T* lse, const MaskRows& mask, T scale, Band band,
                     const Dropout& drop, const Mods<T>& mods, const T* grad_lse,
                     const BwdOut& res, const Dims& d) {
  T* dq = static_cast<T*>(res.dq);
  T* dk = static_cast<T*>(res.dk);
  T* dv = static_cast<T*>(res.dv);
  T* dmask = static_cast<T*>(res.dmask);
  const int64_t BQ = BWD_QUERY_BLOCK, BK = BWD_KEY_BLOCK;
  const T inv_keep = static_cast<T>(drop.inv_keep);
  const int64_t splits = res.splits, blocks = (d.Lk + BK - 1) / BK;
  // f(jb) for each key block of the split, in snake order over rounds of `splits` blocks.
  const auto for_split_blocks = [splits, blocks](int64_t split, auto&& f) {
    for (int64_t round = 0; round * splits < blocks; ++round) {
      const int64_t jb = round * splits + (round % 2 == 0 ? split : splits - 1 - split);
      if (jb < blocks) f(jb);
    }
  };
  std::atomic<bool> overflow{false};
  parallel_tasks(d.B * d.Hq * splits, [&](Tasks& tasks) {
    Grads g(d);
    const int64_t ldq = g.q_stride(), ldv = g.v_stride();
    line_vector<T> pbuf(BQ * BK), dsbuf(BQ * BK), pdbuf(drop.on ? BQ * BK : 0);
    // the softcap's derivative per score of the tile (1 outside the band, where dS is 0)
    line_vector<T> dcapbuf(MODS && mods.softcap > T(0) ? BQ * BK : 0);
    T* dcap = dcapbuf.size() > 0 ? dcapbuf.data() : nullptr;
    line_vector<T> dq_acc(d.Lq * ldq), dk_acc(d.Lk * ldq), dv_acc(d.Lk * ldv);
    std::vector<T> dsum(d.Lq), renorm(d.Lq);
    std::vector<T> base(d.Lq);
    std::vector<uint8_t> huge_row(d.Lq);
    T* p = pbuf.data();
    T* ds = dsbuf.data();
    for (int64_t task; tasks.next(task);) {
      const int64_t split = task % splits, bh = task / splits;
      const int64_t h = bh % d.Hq, b = bh / d.Hq, bhk = b * d.Hkv + h / d.group();
      const T* doh = dout + bh * d.Lq * d.Ev;
      const T* lh = lse + bh * d.Lq;
      g.load(q + bh * d.Lq * d.E, k + bhk * d.Lk * d.E, v + bhk * d.Lk * d.Ev, doh);
      // Row i of the tile in p (scores of the key block at j0) becomes exp(s - base_i) inside
      // the band and 0 outside, base_i its lse, or for a huge row its own max (below).
      const auto probs_row = [&](int64_t i, T* pr, int64_t j0, int64_t nk, T* dcr) {
        const int64_t a = band.first(i, j0, nk), e = std::max(a, band.last(i, j0, nk));
        std::fill(pr, pr + a, T(0));
        std::fill(pr + e, pr + nk, T(0));
        if constexpr (MODS) {
          if (dcr != nullptr) std::fill(dcr, dcr + nk, T(1));
        }
        if (lh[i] == neg_inf<T>()) {
          std::fill(pr + a, pr + e, T(0));
          return;
        }
        if constexpr (MODS) mods.apply(pr + a, e - a, bh, i, j0 + a, dcr ? dcr + a : nullptr);
        if (mask.present() && e > a) mask.apply(pr + a, b, h, i, j0 + a, e - a);
        // exp_sum needs x <= base: true of the forward's own scores, but a score BLAS sums in
        // another order may land above (by a rounding, or far more under cancellation).
        if (!Grads::forward_scores) {
          for (int64_t j = a; j < e; ++j) pr[j] = std::min(pr[j], base[i]);
        }
        exp_sum(pr + a, e - a, base[i]);
      };
      bool huge = false, over = scores_may_overflow(g.query_max, g.key_max, scale, d.E);
      // BLAS picks its kernels, and with them each sum's order, by a call's shape, and the
      // backward's tiles are not the forward's: with MKL on an AVX-512 Xeon 8-83% of float32
      // scores differ by ulps between calls of 192 and 132 (or 30) rows. exp(s - lse) of such
      // scores sums to 1 only within those ulps, an error common to the row that adds up over
      // the queries in dV (2-5x PyTorch's own at scale 0.3, against ~1x on the panels, whose
      // scores are the forward's bit for bit). So in float32 every row of the BLAS engine
      // takes its max and sum from its own recomputed scores, as a huge row does (one more
      // score product per tile); in float64 those ulps are far below any test's bound.
      constexpr bool renorm_all = !Grads::forward_scores && std::is_same_v<T, float>;
      // A row whose sink holds nearly all its weight (its keys under 0.1%: lse within 1e-3 of
      // the sink) may have every key's exp(s - lse) below the vector exp's floor of 2^-64
      // (vector_body.h exp2v): P of all its keys would be 0, and dq, dk, dv with it. Such a row
      // takes its keys' own max and sum too, the sink's term joining the sum alone.
      const T row_sink = MODS && mods.sinks != nullptr ? mods.sinks[h] : neg_inf<T>();
      for (int64_t i = 0; i < d.Lq; ++i) {
        huge_row[i] = huge_lse(lh[i]) || (renorm_all && std::isfinite(lh[i])) ||
                      (std::isfinite(lh[i]) && lh[i] - row_sink <= T(1e-3));
        base[i] = huge_row[i] ? neg_inf<T>() : lh[i];
        renorm[i] = T(0);
        huge = huge || huge_row[i];
        over = over || !(lh[i] < std::numeric_limits<T>::infinity()) ||
               (lh[i] == neg_inf<T>() && band.admits_any(mask, b, h, i, d.Lk));
      }
      // A huge row (or any, renorm_all) takes the max m and the sum l of its own recomputed
      // scores, from a pass over its tiles before any gradient uses them: P = exp(s - m) / l.
      // Its saved lse has lost log(l) to rounding, and a score recomputed in another order
      // (BLAS) may sit ulps of |s| from the forward's, which at |s| ~ 1e18 is past exp's range.
      for (int64_t i0 = 0; huge && i0 < d.Lq; i0 += BQ) {
        const int64_t mq = std::min(BQ, d.Lq - i0);
        if (std::count(huge_row.begin() + i0, huge_row.begin() + i0 + mq, 1) == 0) continue;
        for (int64_t j0 = 0; j0 < d.Lk; j0 += BK) {
          const int64_t nk = std::min(BK, d.Lk - j0);
          if (!band.touches(i0, mq, j0, nk)) continue;
          g.scores(i0, mq, j0, nk, scale, p, BK);
          for (int64_t r = 0; r < mq; ++r) {
            const int64_t i = i0 + r, a = band.first(i, j0, nk), e = band.last(i, j0, nk);
            if (!huge_row[i] || e <= a) continue;
            T* pr = p + r * BK + a;
            if constexpr (MODS) mods.apply(pr, e - a, bh, i, j0 + a, nullptr);
            const T mt =
                mask.present() ? mask.apply(pr, b, h, i, j0 + a, e - a) : row_max(pr, e - a);
            if (!(mt > base[i])) continue;  // also -inf: nothing admitted in this block
            renorm[i] *= base[i] == neg_inf<T>() ? T(0) : std::exp(base[i] - mt);
            base[i] = mt;
          }
          for (int64_t r = 0; r < mq; ++r) {
            const int64_t i = i0 + r, a = band.first(i, j0, nk), e = band.last(i, j0, nk);
            if (huge_row[i] && e > a && base[i] > neg_inf<T>()) {
              renorm[i] += exp_sum(p + r * BK + a, e - a, base[i]);
            }
          }
        }
      }
      for (int64_t i = 0; huge && i < d.Lq; ++i) {
        if (!huge_row[i]) continue;
        if constexpr (MODS) {
          // the sink joins the recomputed sum as it did the lse, the keys' terms kept relative
          // to their own max (exp(sink - base) past T's range: the keys' P underflow to 0)
          if (mods.sinks != nullptr && mods.sinks[h] > neg_inf<T>()) {
            const T sink = mods.sinks[h];
            if (base[i] == neg_inf<T>()) {
              renorm[i] = T(1), base[i] = sink;  // no admitted key: the sink holds the row
            } else {
              renorm[i] += std::exp(sink - base[i]);
            }
          }
        }
        // the sum holds exp(m - m) = 1 for the row's largest score m, unless the scores overflowed
        renorm[i] = renorm[i] > T(0) ? T(1) / renorm[i] : T(0);
      }
      std::fill(dq_acc.begin(), dq_acc.end(), T(0));
      std::fill(dk_acc.begin(), dk_acc.end(), T(0));
      std::fill(dv_acc.begin(), dv_acc.end(), T(0));
      // D_i = rowsum(dO * O): with dropout O already holds the dropped probabilities, and
      // rowsum(dP_dropped * Z * P) is exactly dO . O.
      const T* oh = out + bh * d.Lq * d.Ev;
      for (int64_t i = 0; i < d.Lq; ++i) {
        T acc = 0;
        for (int64_t c = 0; c < d.Ev; ++c) acc += doh[i * d.Ev + c] * oh[i * d.Ev + c];
        // less the lse gradient, if any (csrc/ops.cpp)
        dsum[i] = grad_lse == nullptr ? acc : acc - grad_lse[bh * d.Lq + i];
      }
      if constexpr (MODS) {
        // d lse_i / d sink = P_sink,i and d O_i / d sink = -P_sink,i O_i: the sink's gradient
        // is -sum_i P_sink,i dsum_i (one split of the head sums it; all see the same rows)
        if (res.dsinks != nullptr && split == 0) {
          T acc = 0;
          const T sink = mods.sinks[h];
          for (int64_t i = 0; i < d.Lq; ++i) {
            if (!(base[i] > neg_inf<T>())) continue;
            // P_sink: exp(sink - lse), or on a huge row exp(sink - m) / l with its keys' max m
            // and sum l (the sink's included), 1 where exp(sink - m) passed T's range
            const T e = std::exp(sink - base[i]);
            const T p_sink = !huge_row[i] ? e : std::isinf(e) ? T(1) : e * renorm[i];
            acc -= p_sink * dsum[i];
          }
          static_cast<T*>(res.dsinks)[bh] = acc;
        }
      }
      const uint32_t key_bh = drop.on ? drop.key_bh(bh) : 0;
      for_split_blocks(split, [&](int64_t jb) {
        const int64_t j0 = jb * BK, nk = std::min(BK, d.Lk - j0);
        for (int64_t i0 = 0; i0 < d.Lq; i0 += BQ) {
          const int64_t mq = std::min(BQ, d.Lq - i0);
          if (!band.touches(i0, mq, j0, nk)) continue;
          g.scores(i0, mq, j0, nk, scale, p, BK);
          for (int64_t r = 0; r < mq; ++r) {
            probs_row(i0 + r, p + r * BK, j0, nk, dcap ? dcap + r * BK : nullptr);
            if (huge_row[i0 + r]) scale_row(p + r * BK, nk, renorm[i0 + r]);
          }
          // ds <- dP of the dropped probabilities = dO V^T
          g.dprobs(i0, mq, j0, nk, ds, BK);
          const T* pd = p;
          if (drop.on) {
            T* pdrop = pdbuf.data();
            for (int64_t r = 0; r < mq; ++r) {
              const uint32_t kr = Dropout::key_row(key_bh, i0 + r);
              std::copy(p + r * BK, p + r * BK + nk, pdrop + r * BK);
              dropout_row(pdrop + r * BK, nk, kr, static_cast<uint32_t>(j0), drop.threshold,
                          inv_keep);
              dropout_row(ds + r * BK, nk, kr, static_cast<uint32_t>(j0), drop.threshold,
                          inv_keep);
            }
            pd = pdrop;
          }
          g.add_dv(i0, mq, j0, nk, pd, BK, dv_acc.data());
          for (int64_t r = 0; r < mq; ++r) {
            softmax_grad_row(ds + r * BK, p + r * BK, nk, dsum[i0 + r]);
          }
          if (dmask != nullptr) {
            for (int64_t r = 0; r < mq; ++r) {
              std::copy(ds + r * BK, ds + r * BK + nk, dmask + (bh * d.Lq + i0 + r) * d.Lk + j0);
            }
          }
          if constexpr (MODS) {  // dS of the scores before the softcap
            for (int64_t r = 0; dcap != nullptr && r < mq; ++r) {
              for (int64_t j = 0; j < nk; ++j) ds[r * BK + j] *= dcap[r * BK + j];
            }
          }
          g.add_dq(i0, mq, j0, nk, scale, ds, BK, dq_acc.data());
          g.add_dk(i0, mq, j0, nk, scale, ds, BK, dk_acc.data());
        }
      });
      T* dq_part = dq + (split * d.B * d.Hq + bh) * d.Lq * d.E;
      for (int64_t i = 0; i < d.Lq; ++i) {
        over |= copy_checked(dq_acc.data() + i * ldq, d.E, dq_part + i * d.E);
      }
      for_split_blocks(split, [&](int64_t jb) {
        for (int64_t j = jb * BK; j < std::min(d.Lk, (jb + 1) * BK); ++j) {
          over |= copy_checked(dk_acc.data() + j * ldq, d.E, dk + (bh * d.Lk + j) * d.E);
          over |= copy_checked(dv_acc.data() + j * ldv, d.Ev, dv + (bh * d.Lk + j) * d.Ev);
        }
      });
      if (over) overflow.store(true, std::memory_order_relaxed);
    }
  });
  return overflow.load();
}

at::ScalarType compute_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

Tensor prepared(const Tensor& t, at::ScalarType ct) { return t.to(ct).contiguous(); }

Dims check_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                  const std::optional<Tensor>& mask, double dropout_p) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
              ": expected 4-D q, k, v, got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf,
              op, ": expected float32, float64, bfloat16 or float16, got ", dt);
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt, op,
              ": q, k, v must share a dtype");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), op,
              ": expected CPU tensors");
  Dims d{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  TORCH_CHECK(k.size(0) == d.B && v.size(0) == d.B, op, ": batch sizes differ");
  TORCH_CHECK(d.Hkv > 0 && d.Hq % d.Hkv == 0 && v.size(1) == d.Hkv, op,
              ": expected Hq a multiple of Hkv = value heads, got ", d.Hq, ", ", d.Hkv, ", ",
              v.size(1));
  TORCH_CHECK(k.size(3) == d.E && v.size(2) == d.Lk, op, ": k or v has the wrong shape");
  if (mask.has_value()) {
    const Tensor& m = *mask;
    TORCH_CHECK(m.device().is_cpu(), op, ": expected a CPU mask");
    TORCH_CHECK(m.dim() == 4 && m.size(0) == d.B && m.size(1) == d.Hq && m.size(2) == d.Lq &&
                    m.size(3) == d.Lk,
                op, ": expected a (B, Hq, Lq, Lk) mask view, got ", m.sizes());
    // torch's rule: a float32 mask goes with any q (MaskRows reads every float dtype)
    TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == dt ||
                    m.scalar_type() == at::kFloat,
                op, ": expected a bool mask, a float32 one or one of q's dtype, got ",
                m.scalar_type());
  }
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, ": expected 0 <= dropout_p < 1");
  return d;
}

// forward_kernel with the modifiers compiled in only when the call has some.
template <typename T, typename Products>
bool forward_with(const T* q, const T* k, const T* v, const MaskRows& rows, T scale, Band band,
                  const Dropout& drop, const ModArgs& mods, T* out, T* lse, const Dims& d) {
  if (mods.any()) {
    return forward_kernel<T, Products, true>(q, k, v, rows, scale, band, drop, mods.view<T>(),
                                             out, lse, d);
  }
  return forward_kernel<T, Products, false>(q, k, v, rows, scale, band, drop, Mods<T>{}, out,
                                            lse, d);
}

// The forward's out and lse in float64, on float64 copies of q, k, v.
std::tuple<Tensor, Tensor> forward_double(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const MaskRows& rows, double scale, Band band,
                                          const Dropout& drop, const ModArgs& mods,
                                          const Dims& d) {
  const auto opts = q.options().dtype(at::kDouble);
  const Tensor qc = prepared(q, at::kDouble), kc = prepared(k, at::kDouble),
               vc = prepared(v, at::kDouble);
  Tensor out = at::empty({d.B, d.Hq, d.Lq, d.Ev}, opts), lse = at::empty({d.B, d.Hq, d.Lq}, opts);
  const auto run = [&](const Tensor& values) {
    forward_with<double, BlasProducts<double>>(
        qc.data_ptr<double>(), kc.data_ptr<double>(), values.data_ptr<double>(), rows, scale,
        band, drop, mods, out.data_ptr<double>(), lse.data_ptr<double>(), d);
  };
  run(vc);
  if (any_non_finite({out})) {  // sums of values near float64's range (float64_rerun.h)
    run(vc * kShrinkValues);
    out.div_(kShrinkValues);
  }
  return {out, lse};
}

struct GradResult {
  Tensor dq, dk, dv, dmask, dsinks;
  bool overflow = false;
};

// The backward in T on operands already in T and contiguous (glc undefined: no lse gradient).
template <typename T, typename Engine>
GradResult backward_in(const Tensor& doc, const Tensor& qc, const Tensor& kc, const Tensor& vc,
                       const Tensor& oc, const Tensor& lc, const MaskRows& rows, double scale,
                       Band band, const Dropout& drop, const ModArgs& mods, const Tensor& glc,
                       bool mask_grad, bool sinks_grad, const Dims& d) {
  const auto opts = qc.options();
  const int64_t splits = backward_key_splits(d);
  Tensor dq = at::empty({splits, d.B, d.Hq, d.Lq, d.E}, opts);
  Tensor dk = at::empty({d.B, d.Hq, d.Lk, d.E}, opts);
  Tensor dv = at::empty({d.B, d.Hq, d.Lk, d.Ev}, opts);
  Tensor dmask = mask_grad ? at::zeros({d.B, d.Hq, d.Lq, d.Lk}, opts) : Tensor();
  Tensor dsinks = sinks_grad ? at::zeros({d.B, d.Hq}, opts) : Tensor();
  const BwdOut res{dq.data_ptr(), splits, dk.data_ptr(), dv.data_ptr(),
                   mask_grad ? dmask.data_ptr() : nullptr, sinks_grad ? dsinks.data_ptr() : nullptr};
  const T* gl = glc.defined() ? glc.data_ptr<T>() : nullptr;
  const bool overflow =
      mods.any() ? backward_kernel<T, Engine, true>(
                       doc.data_ptr<T>(), qc.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(),
                       oc.data_ptr<T>(), lc.data_ptr<T>(), rows, static_cast<T>(scale), band,
                       drop, mods.view<T>(), gl, res, d)
                 : backward_kernel<T, Engine, false>(
                       doc.data_ptr<T>(), qc.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(),
                       oc.data_ptr<T>(), lc.data_ptr<T>(), rows, static_cast<T>(scale), band,
                       drop, Mods<T>{}, gl, res, d);
  // Partial sums in float64: parts checked finite may still sum past float32's range, and in
  // opposite directions (inf - inf) unless the sum is exact enough.
  const auto sum = [](const Tensor& t, int64_t dim) {
    return t.sum(dim, /*keepdim=*/false, at::kDouble).to(t.scalar_type());
  };
  dq = splits > 1 ? sum(dq, 0) : dq[0];
  if (d.group() > 1) {  // dK, dV of a kv head: the sum over the query heads that read it
    dk = sum(dk.view({d.B, d.Hkv, d.group(), d.Lk, d.E}), 2);
    dv = sum(dv.view({d.B, d.Hkv, d.group(), d.Lk, d.Ev}), 2);
  }
  if (sinks_grad) dsinks = sum(dsinks, 0);  // (Hq): a head's sink serves every batch
  return {dq, dk, dv, dmask, dsinks, overflow};
}

// Whether the forward of these shapes runs on the decoding kernel (decode_cpu.h), which splits
// the keys across threads and reads each kv head's K and V once for all the rows of its group:
// one query row, or up to 8 against 64 keys or more, 16 against 256, 32 against 512, where the
// tile engine's packing of K and V for a few rows costs more than their products. Measured
// against the tiles on the Emerald Rapids (2 threads, float32, D 64 and 128, GQA 1 and 4, B 1-8,
// a lower-right causal bool mask), in one process: 0.94-1.6x at 2-4 rows and 64-128 keys
// (most above 1.1), 0.96-2.5x at 8-16 rows and 256-512 keys, 0.92-1.6x at 32 rows and 512
// keys; 32 rows against 64-256 keys 0.78-1.0x, so they stay on the tiles. float32, bfloat16
// and float16 only: float64 runs the kernel's plain loops, 3-4x slower than the tiles' BLAS at
// 16-32 rows.
bool decoding_rows(const Dims& d, at::ScalarType dtype) {
  const bool few_rows = d.Lq == 1 || (d.Lq <= 8 && d.Lk >= 64) || (d.Lq <= 16 && d.Lk >= 256) ||
                        (d.Lq <= 32 && d.Lk >= 512);
  return (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) && few_rows;
}

// The tile kernels' forward (float32, bfloat16, float16 and float64).
std::tuple<Tensor, Tensor> tile_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const std::optional<Tensor>& mask, const MaskRows& rows,
                                        double scale, Band band, const Dropout& drop,
                                        const Dims& d, const ModArgs& mods) {
  // lse in the accumulation dtype: float64 inputs keep a float64 lse so that their backward
  // recomputes probabilities to float64 accuracy.
  if (compute_type(q.scalar_type()) == at::kDouble) {
    return forward_double(q, k, v, rows, scale, band, drop, mods, d);
  }
  const Tensor qc = prepared(q, at::kFloat), kc = prepared(k, at::kFloat),
               vc = prepared(v, at::kFloat);
  const auto opts = q.options().dtype(at::kFloat);
  Tensor out = at::empty({d.B, d.Hq, d.Lq, d.Ev}, opts), lse = at::empty({d.B, d.Hq, d.Lq}, opts);
  const auto kernel = panels_available() ? forward_with<float, PanelProducts>
                                         : forward_with<float, BlasProducts<float>>;
  const bool overflow =
      kernel(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), rows,
             static_cast<float>(scale), band, drop, mods, out.data_ptr<float>(),
             lse.data_ptr<float>(), d);
  if (overflow && finite_inputs({q, k, v}, mask)) {
    std::tie(out, lse) = forward_double(q, k, v, rows, scale, band, drop, mods, d);
    lse = lse.to(at::kFloat);  // past float32's range: +-inf, as rounding gives
  }
  return {out.to(q.scalar_type()), lse};
}

std::tuple<Tensor, Tensor> forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const std::optional<Tensor>& mask, double scale,
                                   int64_t window_lo, int64_t window_hi, double dropout_p,
                                   const std::optional<Tensor>& seed, const Dims& d,
                                   const ModArgs& mods) {
  const Dropout drop(dropout_p, seed);
  const MaskRows rows(mask);
  const Band band = clamped_band(window_lo, window_hi, d);
  if (!drop.on && decoding_rows(d, q.scalar_type())) {
    return sdpa_decode_fwd(q, k, v, rows, scale, band.lo, band.hi, mods);
  }
  return tile_forward(q, k, v, mask, rows, scale, band, drop, d, mods);
}

GradResult backward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                    const std::optional<Tensor>& mask, const Tensor& out, const Tensor& lse,
                    double scale, int64_t window_lo, int64_t window_hi, double dropout_p,
                    const std::optional<Tensor>& seed, bool mask_grad,
                    const std::optional<Tensor>& grad_lse, const Dims& d, const ModArgs& mods,
                    bool sinks_grad) {
  const char* op = "attnx::sdpa_bwd";
  const std::vector<int64_t> out_shape{d.B, d.Hq, d.Lq, d.Ev};
  TORCH_CHECK(grad_out.sizes() == out_shape && out.sizes() == out_shape, op,
              ": expected grad_out and out of shape (B, Hq, Lq, Ev), got ", grad_out.sizes(),
              " and ", out.sizes());
  TORCH_CHECK(grad_out.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              op, ": grad_out and out must have q's dtype");
  TORCH_CHECK(lse.scalar_type() == compute_type(q.scalar_type()) &&
                  lse.sizes() == std::vector<int64_t>({d.B, d.Hq, d.Lq}),
              op, ": expected a (B, Hq, Lq) lse of the forward's dtype, got ",
              lse.scalar_type(), " ", lse.sizes());
  TORCH_CHECK(!mask_grad || (mask.has_value() && mask->scalar_type() != at::kBool), op,
              ": mask_grad needs a float mask");
  TORCH_CHECK(!sinks_grad || mods.sinks_f.defined(), op, ": sinks_grad needs sinks");
  TORCH_CHECK(!grad_lse.has_value() || (grad_lse->sizes() == lse.sizes() && grad_lse->is_cpu()),
              op, ": expected a CPU grad_lse of lse's shape ", lse.sizes());
  const Dropout drop(dropout_p, seed);
  const MaskRows rows(mask);
  const Band band = clamped_band(window_lo, window_hi, d);
  const Tensor gl = grad_lse.has_value() ? *grad_lse : Tensor();
  const auto in = [](const Tensor& t, at::ScalarType ct) {
    return t.defined() ? prepared(t, ct) : Tensor();
  };
  const auto double_grads = [&](const Tensor& o64, const Tensor& l64) {
    return backward_in<double, BlasGrads<double>>(
        in(grad_out, at::kDouble), in(q, at::kDouble), in(k, at::kDouble), in(v, at::kDouble),
        o64, l64, rows, scale, band, drop, mods, in(gl, at::kDouble), mask_grad, sinks_grad, d);
  };
  if (compute_type(q.scalar_type()) == at::kDouble) {
    return double_grads(in(out, at::kDouble), lse.contiguous());
  }
  // The probabilities exp(s - lse) need the lse of the backward's own scores: the normalization
  // then cancels most of a score's rounding error where one key dominates a row. The decoding
  // kernel sums its scores in another order than the tiles' (their last bits differ), so for
  // the shapes it took the tiles' forward runs again for its lse (dV at 8x PyTorch's error
  // before, 16 queries against 256 keys, E = 128, scores near 15): these rows are renormalized
  // by their own scores, as the BLAS engine's all are. D = rowsum(dO O) stays the caller's:
  // where the keys are a block of the row (a ring step, attnx/distributed/blocks.py), O is the
  // whole row's and the block's own would make D, and every gradient, the block's alone.
  // grad_lse still reaches the lse the caller got, whose value differs from this one in its
  // last bits only.
  Tensor l = lse;
  if (!drop.on && decoding_rows(d, q.scalar_type()))
    l = std::get<1>(tile_forward(q, k, v, mask, rows, scale, band, drop, d, mods));
  // The engine the forward used (panels_available() does not change), so the scores match.
  const auto run = panels_available() ? backward_in<float, PanelGrads>
                                      : backward_in<float, BlasGrads<float>>;
  GradResult g = run(in(grad_out, at::kFloat), in(q, at::kFloat), in(k, at::kFloat),
                     in(v, at::kFloat), in(out, at::kFloat), l.contiguous(), rows, scale, band,
                     drop, mods, in(gl, at::kFloat), mask_grad, sinks_grad, d);
  // The float32 forward's overflow rows come back with an lse rounded out of range, or the
  // gradients overflow: float64 from the forward on, as the forward itself fell back. D takes
  // the rerun's float64 O where it lies within 64 of out's ulps of the caller's out (the same
  // rows, more precisely: dP - D may cancel to a few of those ulps), else the caller's (keys
  // that are a block of a row, as above, given the whole row's out).
  if (g.overflow && finite_inputs({grad_out, q, k, v, gl}, mask)) {
    const auto [o64, l64] = forward_double(q, k, v, rows, scale, band, drop, mods, d);
    const Tensor o = in(out, at::kDouble);
    const at::ScalarType ot = out.scalar_type();
    const double ulps = 64 * (ot == at::kHalf ? 0x1p-10 : ot == at::kBFloat16 ? 0x1p-7 : 0x1p-23);
    g = double_grads(at::where((o64 - o).abs() <= o.abs() * ulps, o64, o), l64);
  }
  return g;
}

}  // namespace

double sdpa_step_seconds(bool panels) {
  constexpr int64_t H = 4, L = 512, E = 64;
  // fixed values, not torch's generator: a first call must not move the user's random stream
  const Tensor x = at::arange(3 * H * L * E, at::kFloat).mul_(0.37f).sin_();
  const Tensor q = x.narrow(0, 0, H * L * E).view({1, H, L, E});
  const Tensor k = x.narrow(0, H * L * E, H * L * E).view({1, H, L, E});
  const Tensor v = x.narrow(0, 2 * H * L * E, H * L * E).view({1, H, L, E});
  const Dims d = check_inputs("attnx cpu_choice", q, k, v, std::nullopt, 0.0);
  Tensor out = at::empty({1, H, L, E}, q.options()), lse = at::empty({1, H, L}, q.options());
  const MaskRows rows(std::nullopt);
  const Band band = clamped_band(-L, L, d);
  const Dropout drop(0.0, std::nullopt);
  const auto forward = panels ? forward_with<float, PanelProducts>
                              : forward_with<float, BlasProducts<float>>;
  const auto backward = panels ? backward_in<float, PanelGrads>
                               : backward_in<float, BlasGrads<float>>;
  const auto t0 = std::chrono::steady_clock::now();
  forward(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), rows, 0.125f, band,
          drop, ModArgs{}, out.data_ptr<float>(), lse.data_ptr<float>(), d);
  backward(/*doc=*/v, q, k, v, out, lse, rows, 0.125, band, drop, ModArgs{}, Tensor(),
           /*mask_grad=*/false, /*sinks_grad=*/false, d);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::tuple<Tensor, Tensor> sdpa_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const std::optional<Tensor>& mask, double scale,
                                    int64_t window_lo, int64_t window_hi, double dropout_p,
                                    const std::optional<Tensor>& seed) {
  const Dims d = check_inputs("attnx::sdpa_fwd", q, k, v, mask, dropout_p);
  return forward(q, k, v, mask, scale, window_lo, window_hi, dropout_p, seed, d, ModArgs{});
}

std::tuple<Tensor, Tensor> sdpa_mod_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const std::optional<Tensor>& mask, double scale,
                                        int64_t window_lo, int64_t window_hi, double dropout_p,
                                        const std::optional<Tensor>& seed, double softcap,
                                        const std::optional<Tensor>& alibi_slopes,
                                        const std::optional<Tensor>& sinks) {
  const Dims d = check_inputs("attnx::sdpa_mod_fwd", q, k, v, mask, dropout_p);
  const ModArgs mods = mod_args("attnx::sdpa_mod_fwd", softcap, alibi_slopes, sinks, d.B, d.Hq);
  return forward(q, k, v, mask, scale, window_lo, window_hi, dropout_p, seed, d, mods);
}

std::tuple<Tensor, Tensor> sdpa_fwd_modified(const Tensor& q, const Tensor& k, const Tensor& v,
                                             double scale, int64_t window_lo, int64_t window_hi,
                                             double dropout_p, const std::optional<Tensor>& seed,
                                             const ModArgs& mods) {
  const Dims d = check_inputs("attnx::varlen_mod_fwd", q, k, v, std::nullopt, dropout_p);
  return forward(q, k, v, std::nullopt, scale, window_lo, window_hi, dropout_p, seed, d, mods);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> sdpa_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const std::optional<Tensor>& mask, const Tensor& out, const Tensor& lse, double scale,
    int64_t window_lo, int64_t window_hi, double dropout_p, const std::optional<Tensor>& seed,
    bool mask_grad, const std::optional<Tensor>& grad_lse) {
  const Dims d = check_inputs("attnx::sdpa_bwd", q, k, v, mask, dropout_p);
  const GradResult g = backward(grad_out, q, k, v, mask, out, lse, scale, window_lo, window_hi,
                                dropout_p, seed, mask_grad, grad_lse, d, ModArgs{}, false);
  const auto dt = q.scalar_type();
  return {g.dq.to(dt), g.dk.to(dt), g.dv.to(dt),
          mask_grad ? g.dmask.to(mask->scalar_type()) : at::empty({0}, q.options())};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sdpa_mod_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const std::optional<Tensor>& mask, const Tensor& out, const Tensor& lse, double scale,
    int64_t window_lo, int64_t window_hi, double dropout_p, const std::optional<Tensor>& seed,
    bool mask_grad, const std::optional<Tensor>& grad_lse, double softcap,
    const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks,
    bool sinks_grad) {
  const Dims d = check_inputs("attnx::sdpa_mod_bwd", q, k, v, mask, dropout_p);
  const ModArgs mods = mod_args("attnx::sdpa_mod_bwd", softcap, alibi_slopes, sinks, d.B, d.Hq);
  const GradResult g = backward(grad_out, q, k, v, mask, out, lse, scale, window_lo, window_hi,
                                dropout_p, seed, mask_grad, grad_lse, d, mods, sinks_grad);
  const auto dt = q.scalar_type();
  return {g.dq.to(dt), g.dk.to(dt), g.dv.to(dt),
          mask_grad ? g.dmask.to(mask->scalar_type()) : at::empty({0}, q.options()),
          sinks_grad ? g.dsinks.to(sinks->scalar_type()) : at::empty({0}, q.options())};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> sdpa_bwd_modified(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, double scale, int64_t window_lo, int64_t window_hi, double dropout_p,
    const std::optional<Tensor>& seed, const std::optional<Tensor>& grad_lse,
    const ModArgs& mods, bool sinks_grad) {
  const Dims d = check_inputs("attnx::varlen_mod_bwd", q, k, v, std::nullopt, dropout_p);
  const GradResult g = backward(grad_out, q, k, v, std::nullopt, out, lse, scale, window_lo,
                                window_hi, dropout_p, seed, false, grad_lse, d, mods, sinks_grad);
  const auto dt = q.scalar_type();
  // dsinks in float64 (sequences add theirs up; the caller casts to the sinks' dtype)
  return {g.dq.to(dt), g.dk.to(dt), g.dv.to(dt),
          sinks_grad ? g.dsinks.to(at::kDouble) : at::empty({0}, q.options())};
}

}  // namespace attnx::cpu
