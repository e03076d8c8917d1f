// Decoding attention against a KV cache (attnx::kvcache_fwd): a few queries (Lq = 1-16) against
// long cached keys, where the time goes into reading K and V once from memory. The SDPA
// forward of a few query rows against many keys runs here too (sdpa_decode_fwd: its mask read
// row by row, its band and ALiBi shifted to this kernel's bottom-right alignment).
//
// Split-K: each task is one (sequence b, kv head, slice of b's keys) and takes every query row
// of the kv head's group at once (G = Hq / Hkv query heads x Lq queries), so each K/V row is
// read from memory once per group. Keys go in blocks (BLOCK_KEYS, LANE_BLOCK_KEYS) whose rows'
// addresses are looked up first (contiguous or through the block table), so the block stays in
// L1/L2 while every row of the group uses it: scores, online softmax, then o += p V. A task
// leaves its unnormalized output with its rows' max and sum; a second pass merges a head's
// slices by log-sum-exp. Slots past a sequence's length are never read. float32 runs on the vector
// products of decode_vectors.h (many rows as the lanes of a vector, LaneTask; the others four
// at a time); bfloat16 and float16 on the same, each block widened to float32 as it is read;
// float64 on plain loops. Where float32 overflows on finite inputs (scores near its range), the
// call reruns in float64, as the SDPA kernels do.
#include "decode_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "decode_vectors.h"
#include "float64_rerun.h"
#include "line_vector.h"
#include "score_mods.h"
#include "sdpa_mask.h"
#include "sdpa_tile.h"
#include "task_queue.h"

namespace attnx::cpu {
namespace {

using at::Tensor;

// Keys per block: a block's K and V rows (2 x 16 x 512 bytes at E = 128, float32) stay in L1
// while the group's rows use them: the four-row products read each block's value rows once per
// two rows (32 keys: 9% slower at B = 8, Lq = 1 from memory, Zen 4). Rows of 64 values or
// fewer take 2x or 4x as many keys (run_with).
constexpr int64_t BLOCK_KEYS = 16;
// Where the lanes take every row in one group (LaneRows; Lq = 4 with Hq / Hkv = 4), no row of a
// block is read twice, and longer blocks only spread the per-block work (reloading the output
// columns, the softmax's max and rescale, the rows' lookups) over more keys: 7-11% faster at
// Lq = 4 from memory at 32 keys than at 16 (64: no faster than 32; one thread, Zen 4).
constexpr int64_t LANE_BLOCK_KEYS = 32;
// Fewest keys per slice: shorter slices cost more in the merge than they gain in balance.
constexpr int64_t MIN_SLICE = 512;
// Most keys per slice: a slice's output sums its blocks one after the other in float32
// (add_rows_pass), so its rounding grows with its length; longer caches take more slices,
// which the merge adds by log-sum-exp (one term a slice).
constexpr int64_t MAX_SLICE = 16384;

struct Shape {
  int64_t B, Hq, Hkv, G, Lq, E, Ev, R;  // R = G * Lq rows per task, row r = g * Lq + i
  int64_t kv_size;                      // bytes per value of the caches
};

// Where row p of (sequence b, kv head h) lies: strided, or paged through the block table.
template <typename T>
struct CacheRows {
  const T* base;
  int64_t s0, s1, s2;  // element strides of the cache's first three dims (the last is 1)
  const int32_t* table;  // nullptr for a contiguous cache
  int64_t table_stride, block_size;
  // rows[t] = the row of position p0 + t, t in [0, n): one division per call, not per row (a
  // 64-bit division a row cost paged reads 20-45% at Lq = 1). P: const T* or const void*.
  template <typename P>
  void rows(int64_t b, int64_t h, int64_t p0, int64_t n, P* out) const {
    if (table == nullptr) {
      for (int64_t t = 0; t < n; ++t) out[t] = base + b * s0 + h * s1 + (p0 + t) * s2;
      return;
    }
    const int32_t* blocks = table + b * table_stride;
    int64_t block = p0 / block_size, slot = p0 % block_size;
    for (int64_t t = 0; t < n; ++t) {
      out[t] = base + blocks[block] * s0 + h * s1 + slot * s2;
      if (++slot == block_size) slot = 0, ++block;
    }
  }
};

template <typename T>
CacheRows<T> cache_rows(const Tensor& cache, const Tensor& table) {
  const bool paged = table.defined();
  return CacheRows<T>{cache.data_ptr<T>(), cache.stride(0), cache.stride(1), cache.stride(2),
                      paged ? table.data_ptr<int32_t>() : nullptr, paged ? table.stride(0) : 0,
                      cache.size(2)};
}

// A block's n rows of len values as T (float32 or float64) for the products: the cache's own
// rows, or 16-bit ones widened into buf (one pass, in order, over what every row of the group
// then reads from L1; the cache is read at half float32's bytes).
template <typename T, typename KV>
void stage(const KV* const* raw, int64_t n, int64_t len, T* buf, const T** out) {
  if constexpr (std::is_same_v<T, KV>) {
    std::copy(raw, raw + n, out);
  } else {
    static_assert(std::is_same_v<T, float>, "16-bit caches compute in float32");
    for (int64_t t = 0; t < n; ++t) {
      widen(raw[t], len, buf + t * len);
      out[t] = buf + t * len;
    }
  }
}

// Keys [j0, j1) of sequence b, for every kv head.
struct Slice {
  int64_t b, j0, j1;
};

template <typename T>
constexpr T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// Whether a score of s[0, n) is -inf: from finite inputs only where q k or a partial sum of it
// passed T's range, which would drop its key silently (+inf and NaN show in the output).
template <typename T>
bool any_neg_inf(const T* s, int64_t n) {
  int found = 0;
  for (int64_t t = 0; t < n; ++t) found |= s[t] == neg_inf<T>();
  return found != 0;
}

// Rows computed as the lanes of a vector (float32, decode_vectors.h): rows [0, rows) in groups
// of W, whole groups and a last partial one where it fills more than half its lanes. The other
// rows (all of them at Lq = 1 with GQA groups of 4 on AVX-512) go through the four-row
// products, whose horizontal sums cost less than idle lanes there. At Lq = 4, Hq / Hkv = 4
// (R = 16) the lanes run the products at 2.2x the four-row path's rate (2 threads, Zen 4).
struct LaneRows {
  int64_t W = 0, rows = 0, groups = 0;
};

template <typename T>
LaneRows lane_rows(const Shape& d) {
  if constexpr (!std::is_same_v<T, float>) {
    return {};
  } else {
    const int64_t W = lane_width();
    const int64_t groups = d.R / W + (2 * (d.R % W) > W ? 1 : 0);
    return {W, std::min(d.R, groups * W), groups};
  }
}

// One thread's lane groups for its current task: the query rows as lane_pairs lays them out,
// each lane's running max and sum, and the tile of a key block's scores.
template <bool MODS>
class LaneTask {
 public:
  // keys: the most a block holds (BK)
  LaneTask(const Shape& d, const LaneRows& lr, int64_t keys)
      : d_(d), lr_(lr), qt_(static_cast<size_t>(lr.groups * d.E * lr.W)),
        ot_(static_cast<size_t>(lr.groups * d.Ev * lr.W)),
        st_(static_cast<size_t>(keys * lr.W)),
        m_(static_cast<size_t>(lr.groups * lr.W)),
        l_(m_.size()), alpha_(static_cast<size_t>(lr.W)), slope_(m_.size()),
        dist0_(static_cast<size_t>(lr.W)),
        i_lo_(static_cast<size_t>(lr.groups), d.Lq), i_hi_(i_lo_.size(), 0),
        query_(static_cast<size_t>(lr.rows)) {
    for (int64_t r = 0; r < lr.rows; ++r) query_[r] = r % d.Lq;  // no division per score
    // the range of the queries i = r % Lq of each group's rows (a group that wraps past
    // Lq - 1 holds both ends)
    for (int64_t r = 0; r < lr.rows; ++r) {
      const int64_t g = r / lr.W;
      i_lo_[g] = std::min(i_lo_[g], r % d.Lq), i_hi_[g] = std::max(i_hi_[g], r % d.Lq);
    }
  }

  // q: the task's R query rows (scaled); b, h: its sequence and kv head.
  void start(const float* q, int64_t b, int64_t h, const Mods<float>& mods) {
    // group by group, stores in order (row by row, each store to a line of its own took a
    // fifth of a short cache's call at Lq = 4)
    const int64_t W = lr_.W, E = d_.E;
    for (int64_t g = 0; g < lr_.groups; ++g) {
      const int64_t r0 = g * W;
      lane_pairs(q + r0 * E, std::min(W, lr_.rows - r0), E, qt_.data() + g * E * W);
    }
    if constexpr (MODS) {
      if (mods.alibi != nullptr) {
        for (int64_t r = 0; r < lr_.rows; ++r)
          slope_[r] = mods.alibi[b * d_.Hq + h * d_.G + r / d_.Lq];
      }
    }
    std::fill(ot_.begin(), ot_.end(), 0.0f);
    std::fill(m_.begin(), m_.end(), neg_inf<float>());
    std::fill(l_.begin(), l_.end(), 0.0f);
  }

  // Keys [j0, j0 + n) (rows k, v) into every group; query i's diagonal is key i + diag, its
  // admitted keys those j with lo <= j - (i + diag) <= hi. share: rows of the task done so far,
  // over which the rows of the block after next (far) are fetched.
  void block(const float* const* k, const float* const* v, int64_t n, int64_t j0, int64_t diag,
             int64_t lo, int64_t hi, const void* const* k_far, const void* const* v_far,
             int64_t n_far, int64_t& share, const Mods<float>& mods, const MaskRows& mask,
             const MaskRows::Row* mask_rows) {
    const int64_t W = lr_.W;
    float* st = st_.data();
    for (int64_t g = 0; g < lr_.groups; ++g) {
      const int64_t r0 = g * W, rows = std::min(W, lr_.rows - r0);
      const int64_t a0 = share * n_far / d_.R;
      share += rows;
      const int64_t a1 = share * n_far / d_.R;
      const int64_t i_lo = i_lo_[g], i_hi = i_hi_[g];
      if (j0 + n - 1 < i_lo + diag + lo || j0 > i_hi + diag + hi) continue;  // none admitted
      overflow_ = lane_scores(qt_.data() + g * d_.E * W, k, n, d_.E, st,
                              {k_far + a0, a1 - a0, d_.E * d_.kv_size}) || overflow_;
      if constexpr (MODS) {
        if (mods.softcap > 0) softcap_row(st, n * W, mods.softcap, nullptr);  // elementwise
        if (mods.alibi != nullptr) {
          // lane r's diagonal key less j0 (lanes past `rows` have slope 0); in int32 lanes
          // where every distance fits (a scalar loop per lane and key took 1.2x the call's time)
          const int64_t base = diag + mods.alibi_offset - j0;
          const int64_t reach = std::max(std::abs(i_lo + base), std::abs(i_hi + base)) + n;
          if (reach < kAlibiInt32) {
            for (int64_t r = 0; r < W; ++r)
              dist0_[r] = static_cast<int32_t>(r < rows ? query_[r0 + r] + base : 0);
            lane_alibi(st, n, slope_.data() + r0, dist0_.data());
          } else {
            for (int64_t t = 0; t < n; ++t)
              for (int64_t r = 0; r < rows; ++r) {
                st[t * W + r] -= slope_[r0 + r] *
                                 static_cast<float>(std::abs(query_[r0 + r] + base - t));
              }
          }
        }
      }
      if (j0 < i_hi + diag + lo || j0 + n - 1 > i_lo + diag + hi) {  // some pair refused
        for (int64_t t = 0; t < n; ++t)
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t dj = j0 + t - (query_[r0 + r] + diag);
            if (dj < lo || dj > hi) st[t * W + r] = neg_inf<float>();
          }
      }
      for (int64_t r = 0; r < rows && mask.present(); ++r)
        mask.apply_strided(mask_rows[r0 + r], st + r, W, j0, n);
      lane_softmax(st, n, m_.data() + r0, l_.data() + r0, alpha_.data());
      lane_add(ot_.data() + g * d_.Ev * W, alpha_.data(), st, v, n, d_.Ev,
               {v_far + a0, a1 - a0, d_.Ev * d_.kv_size});
    }
  }

  // The task's lane rows into its output rows o (R x Ev), max m and sum l.
  void finish(float* o, float* m, float* l) const {
    const int64_t W = lr_.W, Ev = d_.Ev;
    for (int64_t g = 0; g < lr_.groups; ++g)
      lanes_to_rows(ot_.data() + g * Ev * W, std::min(W, lr_.rows - g * W), Ev, o + g * W * Ev);
    std::copy(m_.begin(), m_.begin() + lr_.rows, m);
    std::copy(l_.begin(), l_.begin() + lr_.rows, l);
  }

 private:
  const Shape& d_;
  const LaneRows& lr_;
  line_vector<float> qt_, ot_, st_, m_, l_, alpha_;  // ot_: the output rows, transposed
  std::vector<float> slope_;
  std::vector<int32_t> dist0_;  // lane_alibi's distances at a block's first key
  std::vector<int64_t> i_lo_, i_hi_;
  std::vector<int64_t> query_;  // the query i of each lane row r: r % Lq

 public:
  bool overflow_ = false;  // some raw score came out -inf (lane_scores)
};

// T: the compute type (float or double); KV: the inputs' (T, or bfloat16 or float16 with T
// float). qs: the query rows, which the tasks multiply by q_scale as they copy them. mask:
// SDPA's attention mask (the caller's view, (B, Hq, Lq, keys)), or none; a task locates its
// rows once. out, lse in T. BK: keys per block (BLOCK_KEYS, more for short rows, or
// LANE_BLOCK_KEYS where the lanes take every row in one group). Returns whether some score
// overflowed to -inf (any_neg_inf) or an output came out NaN or +-inf (found as the merge
// writes it).
template <typename T, typename KV, bool MODS, int64_t BK>
bool run(const Shape& d, const Tensor& qs, T q_scale, const Tensor& k_cache,
         const Tensor& v_cache, const std::vector<int64_t>& lens, const Tensor& table, int64_t lo,
         int64_t hi, const Mods<T>& mods, const MaskRows& mask, const Tensor& out,
         const Tensor& lse) {
  const CacheRows<KV> krows = cache_rows<KV>(k_cache, table);
  const CacheRows<KV> vrows = cache_rows<KV>(v_cache, table);
  // Each sequence's keys that some query admits, cut into slices of about equal length.
  std::vector<Slice> slices;
  std::vector<int64_t> first_slice(d.B + 1, 0);
  int64_t admitted = 0;
  for (int64_t b = 0; b < d.B; ++b) {
    const int64_t diag = lens[b] - d.Lq;
    admitted += std::max<int64_t>(0, std::min(lens[b], diag + d.Lq + hi) - std::max<int64_t>(0, diag + lo));
  }
  // (so the split, and with it the merge's rounding, depends on the thread count: results are
  // the same from run to run at a given count, not across counts)
  const int64_t wanted = 4 * std::max<int64_t>(1, at::get_num_threads());
  int64_t slice_len =
      std::min(MAX_SLICE, std::max(MIN_SLICE, (admitted * d.Hkv + wanted - 1) / wanted));
  slice_len = (slice_len + BK - 1) / BK * BK;
  for (int64_t b = 0; b < d.B; ++b) {
    const int64_t diag = lens[b] - d.Lq;
    const int64_t begin = std::max<int64_t>(0, diag + lo);
    const int64_t end = std::min(lens[b], diag + d.Lq + hi);
    for (int64_t j = begin; j < end; j += slice_len) slices.push_back({b, j, std::min(end, j + slice_len)});
    first_slice[b + 1] = static_cast<int64_t>(slices.size());
  }

  // Per task (slice s, kv head h) = s * Hkv + h: unnormalized output rows, their max and sum.
  const int64_t tasks = static_cast<int64_t>(slices.size()) * d.Hkv;
  // (uninitialized: the lanes write their rows whole, and each task zeroes the rest)
  const Tensor part_o_t = at::empty({tasks * d.R * d.Ev}, k_cache.options().dtype(
                                                              c10::CppTypeToScalarType<T>::value));
  T* part_o = part_o_t.data_ptr<T>();
  std::vector<T> part_m(static_cast<size_t>(tasks * d.R), neg_inf<T>());
  std::vector<T> part_l(static_cast<size_t>(tasks * d.R), T(0));
  const KV* q_all = qs.data_ptr<KV>();
  const LaneRows lr = lane_rows<T>(d);
  std::atomic<bool> overflow{false};

  parallel_tasks(tasks, [&](Tasks& queue) {
    constexpr int ROWS = 4;  // rows per call of the products (decode_vectors.h)
    line_vector<T> s(static_cast<size_t>(ROWS * BK));
    line_vector<T> q_rows(static_cast<size_t>(d.R * d.E));  // the task's rows, scaled
    std::optional<LaneTask<MODS>> lanes;
    if constexpr (std::is_same_v<T, float>) {
      if (lr.groups > 0) lanes.emplace(d, lr, BK);
    }
    // the block's rows as the products read them (kp, vp), and as the caches hold them: this
    // block's, the next one's, and the one after (only fetched)
    const T *kp[BK], *vp[BK];
    const KV *kr[BK], *vr[BK], *kr_next[BK], *vr_next[BK];
    const void *kp_far[BK], *vp_far[BK];
    line_vector<T> kbuf, vbuf;  // 16-bit caches: the block widened (stage)
    if constexpr (!std::is_same_v<T, KV>) {
      kbuf.resize(static_cast<size_t>(BK * d.E));
      vbuf.resize(static_cast<size_t>(BK * d.Ev));
    }
    bool over = false;
    std::vector<MaskRows::Row> mask_rows(mask.present() ? static_cast<size_t>(d.R) : 0);
    for (int64_t task; queue.next(task);) {
      const Slice& sl = slices[task / d.Hkv];
      const int64_t h = task % d.Hkv, diag = lens[sl.b] - d.Lq;
      for (size_t r = 0; r < mask_rows.size(); ++r)  // row r: query head h G + r / Lq, query r % Lq
        mask_rows[r] = mask.row(sl.b, h * d.G + r / d.Lq, r % d.Lq);
      const KV* q_in = q_all + (sl.b * d.Hkv + h) * d.R * d.E;
      for (int64_t x = 0; x < d.R * d.E; ++x) q_rows[x] = static_cast<T>(q_in[x]) * q_scale;
      const T* q = q_rows.data();
      T* o = part_o + task * d.R * d.Ev;
      T* m = part_m.data() + task * d.R;
      T* l = part_l.data() + task * d.R;
      std::fill(o + lr.rows * d.Ev, o + d.R * d.Ev, T(0));  // the four-row products' rows
      if constexpr (std::is_same_v<T, float>) {
        if (lanes) lanes->start(q, sl.b, h, mods);
      }
      for (int64_t j0 = sl.j0; j0 < sl.j1; j0 += BK) {
        const int64_t n = std::min(BK, sl.j1 - j0);
        if (j0 == sl.j0) {  // later blocks' rows were looked up as the next block
          krows.rows(sl.b, h, j0, n, kr);
          vrows.rows(sl.b, h, j0, n, vr);
        }
        // The rows of the block after next, fetched a share per row of the group
        // (decode_vectors.h): the requests flow evenly while this block is computed, two
        // blocks ahead (one ahead left paged reads, 8 KB runs scattered by the block table,
        // 16-26% slower than contiguous at Lq = 1; two: 0.95-1.16x). The next block's rows are
        // looked up here too, to be the current ones next time.
        const int64_t n_next = std::clamp<int64_t>(sl.j1 - j0 - n, 0, BK);
        krows.rows(sl.b, h, j0 + n, n_next, kr_next);
        vrows.rows(sl.b, h, j0 + n, n_next, vr_next);
        const int64_t far0 = j0 + n + n_next;
        const int64_t n_far = std::clamp<int64_t>(sl.j1 - far0, 0, BK);
        krows.rows(sl.b, h, far0, n_far, kp_far);
        vrows.rows(sl.b, h, far0, n_far, vp_far);
        // bfloat16: the lanes read the block widened to float32 once; the four-row products
        // alone widen it as they load it (a copy through L1 cost them 15% at Lq = 1). float16
        // is widened once for both (its conversion takes an instruction the vector bodies,
        // written without intrinsics, cannot name: decode_vectors.cpp's widen_f16_*).
        const bool staged =
            std::is_same_v<T, KV> || std::is_same_v<KV, at::Half> || lanes.has_value();
        if (staged) {
          stage(kr, n, d.E, kbuf.data(), kp);
          stage(vr, n, d.Ev, vbuf.data(), vp);
        }
        int64_t share = 0;  // rows done, for spreading the far block's fetches
        if constexpr (std::is_same_v<T, float>) {
          if (lanes)
            lanes->block(kp, vp, n, j0, diag, lo, hi, kp_far, vp_far, n_far, share, mods, mask,
                         mask_rows.data());
        }
        // The other rows (r = g * Lq + i, query head g, query i) in fours of consecutive rows
        // that admit the same keys of the block (all of them, but near a band's edge): the
        // products load each K vector once for the four (AVX2: for two) and each V vector
        // once per two rows. (Grouped by head alone, Lq rows of one head, G = 1, took one row
        // a call: 2.5x the time the bytes take at Lq = 4.)
        const auto keys_of = [&](int64_t row) {  // the admitted keys [first, last) of the block
          const int64_t i = row % d.Lq;
          return std::pair<int64_t, int64_t>{std::clamp<int64_t>(i + diag + lo - j0, 0, n),
                                             std::clamp<int64_t>(i + diag + hi + 1 - j0, 0, n)};
        };
        for (int64_t r0 = lr.rows; r0 < d.R;) {
          const auto [first, last] = keys_of(r0);
          if (first >= last) {
            ++share, ++r0;
            continue;
          }
          int rows = 1;
          while (rows < ROWS && r0 + rows < d.R && keys_of(r0 + rows) == std::pair{first, last})
            ++rows;
          const int64_t cnt = last - first;
          const T* qr[ROWS];
          T *sr[ROWS], *orow[ROWS];
          for (int rr = 0; rr < rows; ++rr) {
            qr[rr] = q + (r0 + rr) * d.E, sr[rr] = s.data() + rr * BK;
            orow[rr] = o + (r0 + rr) * d.Ev;
          }
          const int64_t a0 = share * n_far / d.R;
          share += rows;
          const int64_t a1 = share * n_far / d.R;
          const Ahead k_ahead{kp_far + a0, a1 - a0, d.E * d.kv_size},
              v_ahead{vp_far + a0, a1 - a0, d.Ev * d.kv_size};
          if (staged) {
            dot_rows(rows, qr, kp + first, cnt, d.E, sr, k_ahead);
          } else if constexpr (std::is_same_v<KV, at::BFloat16>) {
            dot_rows(rows, qr, kr + first, cnt, d.E, sr, k_ahead);
          }
          T top[ROWS], sum[ROWS];
          int live = 0;  // rows that admit a key by now
          for (int rr = 0; rr < rows; ++rr) {
            const int64_t row = r0 + rr, i = row % d.Lq, head = h * d.G + row / d.Lq;
            over = over || any_neg_inf(sr[rr], cnt);
            if constexpr (MODS) {  // ALiBi bottom-right: query i's diagonal is key i + diag
              mods.apply(sr[rr], cnt, sl.b * d.Hq + head, i + diag, j0 + first, nullptr);
            }
            top[rr] = std::max(m[row], mask.present()
                                           ? mask.apply(mask_rows[row], sr[rr], j0 + first, cnt)
                                           : row_max(sr[rr], cnt));
            if (top[rr] == neg_inf<T>()) {  // no admitted key yet: exp(-inf - -inf) is NaN
              std::fill(sr[rr], sr[rr] + cnt, T(0));
            } else {
              ++live;
            }
          }
          // Four rows that all admit a key take their exponentials in one call, whose four
          // chains interleave (exp_sum4); others one row a call.
          bool summed = false;
          if constexpr (std::is_same_v<T, float>) {
            if (rows == ROWS && live == ROWS) exp_sum4(sr, cnt, top, sum), summed = true;
          }
          for (int rr = 0; rr < rows; ++rr) {
            const int64_t row = r0 + rr;
            if (top[rr] == neg_inf<T>()) continue;
            if (!summed) sum[rr] = exp_sum(sr[rr], cnt, top[rr]);
            if (top[rr] != m[row]) {  // rescale what earlier blocks added (nothing on the first)
              const T alpha = std::exp(m[row] - top[rr]);
              scale_row(orow[rr], d.Ev, alpha);
              l[row] *= alpha;
            }
            l[row] += sum[rr];
            m[row] = top[rr];
          }
          if (staged) {
            add_rows(rows, orow, sr, vp + first, cnt, d.Ev, v_ahead);
          } else if constexpr (std::is_same_v<KV, at::BFloat16>) {
            add_rows(rows, orow, sr, vr + first, cnt, d.Ev, v_ahead);
          }
          r0 += rows;
        }
        std::copy(kr_next, kr_next + n_next, kr);
        std::copy(vr_next, vr_next + n_next, vr);
      }
      if constexpr (std::is_same_v<T, float>) {
        if (lanes) lanes->finish(o, m, l);
      }
    }
    if (over || (lanes && lanes->overflow_)) overflow.store(true, std::memory_order_relaxed);
  });

  // Merge a head's slices: out = sum_s e^(m_s - M) o_s / L, L = sum_s e^(m_s - M) l_s.
  T* out_all = out.data_ptr<T>();
  T* lse_all = lse.data_ptr<T>();
  // Threads only when the merge is worth waking them for: it reads tasks * R * Ev values, a
  // few microseconds at decoding sizes, and a second parallel region on a busy machine waits
  // milliseconds for a descheduled thread.
  const int64_t merge_values = std::max<int64_t>(1, tasks * d.R * d.Ev);
  const int64_t grain = std::max<int64_t>(1, d.B * d.Hkv * (1 << 18) / merge_values);
  std::atomic<bool> out_bad{false};
  at::parallel_for(0, d.B * d.Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> acc(static_cast<size_t>(d.Ev));
    int bad = 0;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / d.Hkv, h = bh % d.Hkv;
      const int64_t s0 = first_slice[b], s1 = first_slice[b + 1];
      for (int64_t r = 0; r < d.R; ++r) {
        T top = neg_inf<T>(), total = 0;
        const T* sum = acc.data();  // the row's unnormalized output
        if (s1 - s0 == 1) {
          // one slice (a short cache): its row as it is, without the weight e^0 and the
          // copy into acc (the merge took 8% of a call at 16 keys, Lq = 4); a row that admits
          // no key takes zeros, not what its refused keys' values times p = 0 left (NaN where
          // one is inf)
          const int64_t row = (s0 * d.Hkv + h) * d.R + r;
          top = part_m[row];
          if (top != neg_inf<T>()) {
            total = part_l[row];
            sum = part_o + row * d.Ev;
          } else {
            std::fill(acc.begin(), acc.end(), T(0));
          }
        } else {
          for (int64_t s = s0; s < s1; ++s) top = std::max(top, part_m[(s * d.Hkv + h) * d.R + r]);
          std::fill(acc.begin(), acc.end(), T(0));
          if (top != neg_inf<T>()) {
            for (int64_t s = s0; s < s1; ++s) {
              const int64_t row = (s * d.Hkv + h) * d.R + r;
              const T w = std::exp(part_m[row] - top);  // 0 for a slice the row admits no key of
              if (w == 0) continue;
              total += w * part_l[row];
              const T* o = part_o + row * d.Ev;
              for (int64_t c = 0; c < d.Ev; ++c) acc[c] += w * o[c];
            }
          }
        }
        if constexpr (MODS) {
          if (mods.sinks != nullptr) {  // exp(sink) joins the denominator total exp(top)
            const T sink = mods.sinks[h * d.G + r / d.Lq], joined = std::max(top, sink);
            const T w = top == neg_inf<T>() ? T(0) : std::exp(top - joined);
            for (int64_t c = 0; c < d.Ev; ++c) acc[c] = sum[c] * w;
            sum = acc.data();
            total = total * w + std::exp(sink - joined);
            top = joined;
          }
        }
        // row r of kv head h's group is row (b, h * G + g, i) of out: (b * Hkv + h) * R + r
        const int64_t row = (b * d.Hkv + h) * d.R + r;
        // (a NaN total, from a NaN score, leaves NaN: the float64 rerun keeps it)
        const T inv = total > 0 ? T(1) / total : T(0);
        T* dst = out_all + row * d.Ev;
        for (int64_t c = 0; c < d.Ev; ++c) {
          dst[c] = sum[c] * inv;
          bad |= non_finite(dst[c]);
        }
        lse_all[row] = total > 0 ? top + std::log(total) : neg_inf<T>();
      }
    }
    if (bad) out_bad.store(true, std::memory_order_relaxed);
  });
  return overflow.load() || out_bad.load();
}

void check_inputs(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                  const Tensor& seqlens, const Tensor& table) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "attnx::kvcache_fwd: expected 4-D q, k_cache and v_cache");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "attnx::kvcache_fwd: expected the caches in q's dtype");
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(2) && k_cache.size(3) == q.size(3),
              "attnx::kvcache_fwd: k_cache and v_cache do not match q or each other");
  TORCH_CHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0,
              "attnx::kvcache_fwd: expected q's head count to be a multiple of the cache's");
  TORCH_CHECK(seqlens.scalar_type() == at::kInt && seqlens.dim() == 1 && seqlens.size(0) == q.size(0),
              "attnx::kvcache_fwd: expected int32 seqlens of shape (B,)");
  if (table.defined()) {
    TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 2 && table.size(0) == q.size(0),
                "attnx::kvcache_fwd: expected an int32 block_table of shape (B, max_blocks)");
  } else {
    TORCH_CHECK(k_cache.size(0) == q.size(0), "attnx::kvcache_fwd: expected a cache of batch size B");
  }
}

// Whether an lse is NaN or +inf (-inf: a row that admits no key).
bool nan_or_posinf(const float* lse, int64_t n) {
  bool found = false;
  for (int64_t r = 0; r < n; ++r)
    found |= std::isnan(lse[r]) || lse[r] == std::numeric_limits<float>::infinity();
  return found;
}

// Whether a row that admits some key came out empty (lse -inf): its scores were all NaN, or
// fell to -inf (huge float-mask values).
bool lost_rows(const Shape& d, const float* lse, const std::vector<int64_t>& lens, int64_t lo,
               int64_t hi, const MaskRows& mask) {
  for (int64_t b = 0; b < d.B; ++b) {
    const int64_t diag = lens[b] - d.Lq;
    for (int64_t i = 0; i < d.Lq; ++i) {
      const int64_t j0 = std::max<int64_t>(0, i + diag + lo);
      const int64_t j1 = std::min(lens[b], i + diag + hi + 1);
      for (int64_t h = 0; h < d.Hq && j0 < j1; ++h) {
        if (lse[(b * d.Hq + h) * d.Lq + i] == -std::numeric_limits<float>::infinity() &&
            mask.admits_any(b, h, i, j0, j1))
          return true;
      }
    }
  }
  return false;
}

// The lengths, checked against the cache (and the block ids a sequence uses against the number
// of blocks) so that no read leaves the cache, whoever calls the op.
std::vector<int64_t> checked_lengths(const Tensor& seqlens, const Tensor& table, const Tensor& cache) {
  const int64_t B = seqlens.size(0), depth = cache.size(2);
  const int64_t capacity = table.defined() ? table.size(1) * depth : depth;
  std::vector<int64_t> lens(static_cast<size_t>(B));
  const int32_t* raw = seqlens.data_ptr<int32_t>();
  const int32_t* ids = table.defined() ? table.data_ptr<int32_t>() : nullptr;
  for (int64_t b = 0; b < B; ++b) {
    lens[b] = raw[b];
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= capacity, "attnx::kvcache_fwd: seqlens[", b, "] = ",
                lens[b], " outside [0, ", capacity, "]");
    if (!table.defined()) continue;
    for (int64_t p = 0; p * depth < lens[b]; ++p) {
      const int32_t block = ids[b * table.stride(0) + p];
      TORCH_CHECK(block >= 0 && block < cache.size(0), "attnx::kvcache_fwd: block_table[", b, ", ",
                  p, "] = ", block, " outside [0, ", cache.size(0), ")");
    }
  }
  return lens;
}

// run with the modifiers compiled in only when the call has some.
template <typename T, typename KV, int64_t BK>
bool run_blocks(const Shape& d, const Tensor& qs, T q_scale, const Tensor& k_cache,
                const Tensor& v_cache, const std::vector<int64_t>& lens, const Tensor& table,
                int64_t lo, int64_t hi, const ModArgs& mods, const MaskRows& mask,
                const Tensor& out, const Tensor& lse) {
  if (mods.any()) {
    return run<T, KV, true, BK>(d, qs, q_scale, k_cache, v_cache, lens, table, lo, hi,
                                mods.view<T>(), mask, out, lse);
  }
  return run<T, KV, false, BK>(d, qs, q_scale, k_cache, v_cache, lens, table, lo, hi, Mods<T>{},
                               mask, out, lse);
}

template <typename T, typename KV>
bool run_with(const Shape& d, const Tensor& qs, double q_scale, const Tensor& k_cache,
              const Tensor& v_cache, const std::vector<int64_t>& lens, const Tensor& table,
              int64_t lo, int64_t hi, const ModArgs& mods, const MaskRows& mask,
              const Tensor& out, const Tensor& lse) {
  const T s = static_cast<T>(q_scale);  // (float32: what q * scale computes in float32)
  if constexpr (std::is_same_v<T, float>) {
    const LaneRows lr = lane_rows<T>(d);
    if (lr.groups == 1 && lr.rows == d.R) {
      return run_blocks<T, KV, LANE_BLOCK_KEYS>(d, qs, s, k_cache, v_cache, lens, table, lo, hi,
                                                mods, mask, out, lse);
    }
  }
  // Shorter rows, longer blocks, so that a block's K and V bytes stay the same (the per-block
  // work, a max and a rescale per row and the rows' lookups, spread over more keys): 1.1-1.3x
  // at D = 64 and 1.2-1.45x at D = 32 (Lq = 1-4, 2 threads, the Emerald Rapids).
  const int64_t widest = std::max(d.E, d.Ev);
  if (widest <= 32) {
    return run_blocks<T, KV, 4 * BLOCK_KEYS>(d, qs, s, k_cache, v_cache, lens, table, lo, hi,
                                             mods, mask, out, lse);
  }
  if (widest <= 64) {
    return run_blocks<T, KV, 2 * BLOCK_KEYS>(d, qs, s, k_cache, v_cache, lens, table, lo, hi,
                                             mods, mask, out, lse);
  }
  return run_blocks<T, KV, BLOCK_KEYS>(d, qs, s, k_cache, v_cache, lens, table, lo, hi, mods,
                                       mask, out, lse);
}

// out and lse in the compute type (float64 for float64 q, else float32), and whether a score
// overflowed or an output came out non-finite (run).
std::tuple<Tensor, Tensor, bool> attend(const Shape& d, const Tensor& q, const Tensor& k_cache,
                                  const Tensor& v_cache, const std::vector<int64_t>& lens,
                                  const Tensor& table, double scale, int64_t lo, int64_t hi,
                                  const ModArgs& mods, const MaskRows& mask) {
  // Rows of a kv head's group consecutive: (B, Hkv, G * Lq, E) is q's own order. float32: the
  // tasks scale their rows as they copy them (the products take no scale), not an ATen op per
  // call: in a model's decoding step, whose weights have just flushed the caches, each op costs
  // tens of microseconds, more than a short cache's attention. float64 (for checking) is
  // scaled here, where its overflow is looked for.
  Tensor qs = q.contiguous();
  double q_scale = scale;
  Tensor keys = k_cache;
  if (q.scalar_type() == at::kDouble) {
    qs = (qs * scale).contiguous();
    q_scale = 1.0;
    if (any_non_finite({qs}) && !any_non_finite({q})) {
      // |q| scale past float64's range though the scores need not be (a huge scale on small
      // keys): the scale split between q and a copy of the keys, each side's largest value
      // sqrt(scale max|q| max|k|) (what a score may reach anyway, up to E); slots no query reads
      // (which may hold anything) count as 0.
      const double q_max = q.abs().max().item<double>();
      const double k_max = k_cache.nan_to_num(0.0, 0.0, 0.0).abs().max().item<double>();
      if (k_max == 0.0) {
        qs = at::zeros_like(qs);  // every read score is 0 exactly
      } else {
        const double f =
            std::exp(0.5 * (std::log(std::abs(scale)) + std::log(q_max) - std::log(k_max)));
        qs = (q.contiguous() * (scale / f)).contiguous();
        keys = k_cache * f;
      }
    }
  }
  const auto opts = q.options().dtype(q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  Tensor out = at::empty({d.B, d.Hq, d.Lq, d.Ev}, opts);
  Tensor lse = at::empty({d.B, d.Hq, d.Lq}, opts);
  bool overflow;
  if (q.scalar_type() == at::kDouble) {
    overflow = run_with<double, double>(d, qs, q_scale, keys, v_cache, lens, table, lo, hi, mods,
                                        mask, out, lse);
  } else if (q.scalar_type() == at::kBFloat16) {
    overflow = run_with<float, at::BFloat16>(d, qs, q_scale, keys, v_cache, lens, table, lo, hi,
                                             mods, mask, out, lse);
  } else if (q.scalar_type() == at::kHalf) {
    overflow = run_with<float, at::Half>(d, qs, q_scale, keys, v_cache, lens, table, lo, hi,
                                         mods, mask, out, lse);
  } else {
    overflow = run_with<float, float>(d, qs, q_scale, keys, v_cache, lens, table, lo, hi, mods,
                                      mask, out, lse);
  }
  return {out, lse, overflow};
}

// attend, float32 rerun in float64 where it overflowed (out float32, lse float64 then), float64
// rerun on shrunk values where a sum of values passed its range.
std::tuple<Tensor, Tensor> attend_checked(const Shape& d, const Tensor& q, const Tensor& k_cache,
                                          const Tensor& v_cache, const std::vector<int64_t>& lens,
                                          const Tensor& table, double scale, int64_t lo,
                                          int64_t hi, const ModArgs& mods,
                                          const MaskRows& mask) {
  auto [out, lse, overflow] =
      attend(d, q, k_cache, v_cache, lens, table, scale, lo, hi, mods, mask);
  if (q.scalar_type() == at::kDouble && any_non_finite({out})) {
    // sums of values near float64's range (float64_rerun.h); slots no query reads stay unread
    auto [shrunk, lse64, ignored] =
        attend(d, q, k_cache, v_cache * kShrinkValues, lens, table, scale, lo, hi, mods, mask);
    return {shrunk.div_(kShrinkValues), lse64};
  }
  if (q.scalar_type() != at::kDouble && (overflow ||
                                        nan_or_posinf(lse.data_ptr<float>(), lse.numel()) ||
                                        lost_rows(d, lse.data_ptr<float>(), lens, lo, hi, mask))) {
    // float32 overflowed (q scale or scores past its range: NaN scores, which the softmax
    // drops, leave a row that admits keys empty) or the inputs hold non-finite values (the
    // lanes multiply a refused key's value row by p = 0: an inf there lands here too); float64
    // holds every product of float32 values, and keeps the inputs' own non-finite values.
    auto [out64, lse64, ignored] =
        attend(d, q.to(at::kDouble), k_cache.to(at::kDouble), v_cache.to(at::kDouble), lens,
               table, scale, lo, hi, mods, mask);
    return {out64.to(at::kFloat), lse64};
  }
  return {out, lse};
}

std::tuple<Tensor, Tensor> decode(const Tensor& q, const Tensor& k_cache_in,
                                  const Tensor& v_cache_in, const Tensor& seqlens,
                                  const std::optional<Tensor>& block_table, double scale,
                                  int64_t window_lo, int64_t window_hi, const ModArgs& mods) {
  const Tensor table = block_table.has_value() ? block_table->contiguous() : Tensor();
  check_inputs(q, k_cache_in, v_cache_in, seqlens, table);
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble ||
                  q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "attnx::kvcache_fwd (CPU): expected float32, float64, bfloat16 or float16, got ",
              q.scalar_type());
  // Rows are read as runs of E values: a cache whose last dim is strided (never one a model
  // keeps) is copied.
  const Tensor k_cache = k_cache_in.stride(3) == 1 ? k_cache_in : k_cache_in.contiguous();
  const Tensor v_cache = v_cache_in.stride(3) == 1 ? v_cache_in : v_cache_in.contiguous();
  const std::vector<int64_t> lens = checked_lengths(seqlens.contiguous(), table, k_cache);
  const int64_t capacity = table.defined() ? table.size(1) * k_cache.size(2) : k_cache.size(2);
  const int64_t lq = q.size(2);
  // Bounds that hold every j - (i + diag) keep i + diag + lo from overflowing.
  const int64_t lo = std::clamp(window_lo, -capacity - lq, capacity + lq);
  const int64_t hi = std::clamp(window_hi, -capacity - lq, capacity + lq);
  Shape d{q.size(0), q.size(1), k_cache.size(1), q.size(1) / k_cache.size(1), lq, q.size(3),
          v_cache.size(3), 0, static_cast<int64_t>(k_cache.element_size())};
  d.R = d.G * d.Lq;
  auto [out, lse] = attend_checked(d, q, k_cache, v_cache, lens, table, scale, lo, hi, mods,
                                   MaskRows(std::nullopt));
  // out in q's dtype (16-bit rounded once, from float32); the op's lse is float32 whatever q's
  return {out.to(q.scalar_type()), lse.to(at::kFloat)};
}

}  // namespace

std::tuple<Tensor, Tensor> sdpa_decode_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                           const MaskRows& mask, double scale, int64_t band_lo,
                                           int64_t band_hi, const ModArgs& mods) {
  Shape d{q.size(0), q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2), q.size(3),
          v.size(3), 0, static_cast<int64_t>(k.element_size())};
  d.R = d.G * d.Lq;
  const int64_t lk = k.size(2), diag = lk - d.Lq;
  // SDPA's band and ALiBi diagonal are top-left (query i at key i), the kernel's relative to
  // query i's diagonal key i + diag
  ModArgs shifted = mods;
  shifted.alibi_offset -= diag;
  const std::vector<int64_t> lens(static_cast<size_t>(d.B), lk);
  auto [out, lse] = attend_checked(d, q, k.stride(3) == 1 ? k : k.contiguous(),
                                   v.stride(3) == 1 ? v : v.contiguous(), lens, Tensor(), scale,
                                   band_lo - diag, band_hi - diag, shifted, mask);
  // SDPA's: out in q's dtype, lse in the compute type
  return {out.to(q.scalar_type()), q.scalar_type() == at::kDouble ? lse : lse.to(at::kFloat)};
}

std::tuple<Tensor, Tensor> kvcache_fwd(const Tensor& q, const Tensor& k_cache,
                                       const Tensor& v_cache, const Tensor& seqlens,
                                       const std::optional<Tensor>& block_table, double scale,
                                       int64_t window_lo, int64_t window_hi) {
  return decode(q, k_cache, v_cache, seqlens, block_table, scale, window_lo, window_hi,
                ModArgs{});
}

std::tuple<Tensor, Tensor> kvcache_mod_fwd(const Tensor& q, const Tensor& k_cache,
                                           const Tensor& v_cache, const Tensor& seqlens,
                                           const std::optional<Tensor>& block_table,
                                           double scale, int64_t window_lo, int64_t window_hi,
                                           double softcap,
                                           const std::optional<Tensor>& alibi_slopes,
                                           const std::optional<Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 4, "attnx::kvcache_mod_fwd: expected a 4-D q");
  const ModArgs mods = mod_args("attnx::kvcache_mod_fwd", softcap, alibi_slopes, sinks,
                                q.size(0), q.size(1));
  return decode(q, k_cache, v_cache, seqlens, block_table, scale, window_lo, window_hi, mods);
}

}  // namespace attnx::cpu
