// Fused additive (Bahdanau) attention on the CPU (conventions: csrc/ops.cpp).
//
// Each query row is handled whole: its scores against the admissible keys are computed into a
// row buffer of Lk values (the tanh terms are summed over A as they are made, never stored),
// then softmax, dropout and the value sum. So the working memory is O(Lk + Ev) per row and
// no (Lq, Lk, A) or (Lq, Lk) tensor exists unless the weights are asked for. The forward's
// tasks, taken from a shared queue (task_queue.h), are up to kSumRows consecutive rows of one
// (b, h), whose value sums share each value load, or with many small heads one whole head
// (per_head_tasks).
//
// float32 terms come from e^{2q} and e^{2k}, computed once per row of q and k (additive_terms.h:
// a reciprocal per term, no tanh): for the whole call before the kernels run, or by the task
// that takes a head; a row of q or k holding a value past kExpLimit, where the product could
// overflow, takes the exact tanh loops (additive_rows.h) for its pairs, as float64 does for all;
// so does a pair of two rows of small mean |x| (additive_terms.h kSmallMeanAbs), where the
// form's absolute error would be large against tanh's small values.
//
// The backward pass recomputes the row's scores, gets P from the saved lse and
// D_i = dO_i . out_i (= sum_j P_ij dP_ij, also with dropout; for float64, the 16-bit types and
// rows of huge lse, huge_lse.h, both are recomputed exactly from the scores), dS, then the terms again
// for dq, dk and dv, in units that leave out the factor 4 v[a] common to dq and dk (applied
// once at the end). dq rows belong to one thread; dk, dvalue and dv are sums over query rows,
// see `Slices` below for how threads share them deterministically.
//
// Inputs of any supported dtype are copied once into contiguous tensors of the accumulation
// type (float for float, bfloat16 and float16, double for double): O(L * (A + Ev)), the size of the
// inputs themselves.
// A float32 call that overflows (scores past the range: sum_a |v_a| huge; or sums of values
// or gradients past it) reruns in float64 (float64_rerun.h).
#include "additive_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "additive_rows.h"
#include "additive_terms.h"
#include "dropout.h"
#include "float64_rerun.h"
#include "huge_lse.h"
#include "kept_buffer.h"
#include "line_vector.h"
#include "sdpa_tile.h"
#include "task_queue.h"

namespace attnx::cpu {
namespace {

using additive::axpy;
using additive::dot;
using additive::grad_terms;
using additive::tanh_dot;
using additive::tanh_dot_keep;

// The mask read through its strides (broadcast dims have stride 0; it is never expanded).
struct MaskView {
  const void* data = nullptr;
  at::ScalarType dtype = at::kBool;
  int64_t sb = 0, sh = 0, si = 0, sj = 0;

  explicit MaskView(const std::optional<at::Tensor>& mask) {
    if (!mask.has_value()) return;
    data = mask->data_ptr();
    dtype = mask->scalar_type();
    sb = mask->stride(0);
    sh = mask->stride(1);
    si = mask->stride(2);
    sj = mask->stride(3);
  }

  // bias[j] for j in [j0, j1): 0 or -inf for a bool mask, the mask's value for a float one.
  template <typename acc_t>
  void fill(int64_t b, int64_t h, int64_t i, int64_t j0, int64_t j1, acc_t* bias) const {
    const acc_t ninf = -std::numeric_limits<acc_t>::infinity();
    if (data == nullptr) {
      std::fill(bias + j0, bias + j1, acc_t(0));
      return;
    }
    const int64_t base = b * sb + h * sh + i * si;
    if (dtype == at::kBool) {
      // bytes, nonzero = true (as torch reads a bool tensor holding other bytes than 1)
      const uint8_t* m = static_cast<const uint8_t*>(data) + base;
      for (int64_t j = j0; j < j1; ++j) bias[j] = m[j * sj] != 0 ? acc_t(0) : ninf;
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "attnx_additive_mask", [&] {
      const scalar_t* m = static_cast<const scalar_t*>(data) + base;
      for (int64_t j = j0; j < j1; ++j) bias[j] = static_cast<acc_t>(m[j * sj]);
    });
  }
};

// x in the accumulation type, contiguous: x itself where it already is, without a dispatcher
// call (see vpad below for why that matters at decoder sizes).
at::Tensor in_type(const at::Tensor& x, at::ScalarType acc) {
  return x.scalar_type() == acc && x.is_contiguous() ? x : x.to(acc).contiguous();
}

// One head's rows in the exponential form (float32; additive_terms.h): e^{2q} of its query
// row i at eq + i ap, e^{2k} of its key j at ek + j ap, and those rows' flags (xq, xk:
// additive::RowFlags). Empty (eq null: every pair exact) for float64.
struct HeadRows {
  const float *eq = nullptr, *ek = nullptr;
  const uint8_t *xq = nullptr, *xk = nullptr;
  int64_t ap = 0;
  // every pair of query row i takes the exact tanh
  bool exact_q(int64_t i) const { return eq == nullptr || (xq[i] & additive::kLarge); }
  bool small_q(int64_t i) const { return eq != nullptr && (xq[i] & additive::kSmall); }
  // pair (i, j) takes the exact tanh, for a row i with !exact_q(i) and small_i = small_q(i)
  bool exact_pair(bool small_i, int64_t j) const {
    return (xk[j] & additive::kLarge) || (small_i && (xk[j] & additive::kSmall));
  }
  const float* q_row(int64_t i) const { return eq + i * ap; }
  const float* k_row(int64_t j) const { return ek + j * ap; }
};

// What both passes read: contiguous accumulation-type copies of the inputs and the problem.
template <typename acc_t>
struct Problem {
  at::Tensor q, k, value, v;  // (B, H, Lq, A), (B, H, Lk, A), (B, H, Lk, Ev), (H, A)
  int64_t B, H, Lq, Lk, A, Ev;
  int64_t lo, hi;
  MaskView mask;
  Dropout drop;

  // exp_rows_now: every head's e^{2q}, e^{2k} rows made here (one parallel region), for
  // head_rows; false makes none: the task that takes a head makes its own (make_head_rows,
  // per_head_tasks).
  Problem(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& value_,
          const at::Tensor& v_, const std::optional<at::Tensor>& mask_, int64_t window_lo,
          int64_t window_hi, double dropout_p, const std::optional<at::Tensor>& seed,
          bool exp_rows_now = true)
      : mask(mask_), drop(dropout_p, seed) {
    const auto acc = c10::CppTypeToScalarType<acc_t>::value;
    q = in_type(q_, acc);
    k = in_type(k_, acc);
    value = in_type(value_, acc);
    v = in_type(v_, acc);
    B = q.size(0);
    H = q.size(1);
    Lq = q.size(2);
    A = q.size(3);
    Lk = k.size(2);
    Ev = value.size(3);
    // [-Lq, Lk] admits the same pairs and keeps i + lo, i + hi from overflowing
    lo = std::clamp<int64_t>(window_lo, -Lq, Lk);
    hi = std::clamp<int64_t>(window_hi, -Lq, Lk);
    ap = A;
    if constexpr (std::is_same_v<acc_t, float>) {
      ap = (A + additive::kPad - 1) / additive::kPad * additive::kPad;
      // v padded with zeros to ap, and each head's sum of v (in double), by plain loops over
      // the H x A values: ATen ops for them cost more than a decoder-sized attention once a
      // step's other work has flushed the caches
      vpad.assign(static_cast<size_t>(H * ap), 0.0f);
      vsum.resize(static_cast<size_t>(H));
      const float* v_p = v.data_ptr<float>();
      for (int64_t h = 0; h < H; ++h) {
        double sum = 0;
        for (int64_t a = 0; a < A; ++a) sum += vpad[h * ap + a] = v_p[h * A + a];
        vsum[h] = static_cast<float>(sum);
      }
      vpad_p = vpad.data();
      vsum_p = vsum.data();
      if (exp_rows_now) {
        // e^{2q}, e^{2k} and the guard's flags of every row, in one pass over the rows (one
        // parallel region: on a shared machine each region may wait for a descheduled thread)
        const int64_t nq = B * H * Lq, nk = B * H * Lk;
        // in the kept buffer (kept_buffer.h): fresh pages every call, faulted in by both
        // threads at once, cost 15% of the forward at B = 64, L = 32, A = 256 (2 threads)
        e_rows = std::make_unique<KeptBuffer>(static_cast<size_t>((nq + nk) * ap));
        exact_flags = std::make_unique<uint8_t[]>(static_cast<size_t>(nq + nk));
        float *e_q = e_rows->data(), *e_k = e_q + nq * ap;
        uint8_t *x_q = exact_flags.get(), *x_k = x_q + nq;
        const float *q_p = q.data_ptr<float>(), *k_p = k.data_ptr<float>();
        at::parallel_for(0, nq + nk, std::max<int64_t>(1, 16384 / ap), [&](int64_t b0, int64_t b1) {
          for (int64_t r = b0; r < b1; ++r) {
            if (r < nq) {
              x_q[r] = additive::exp2x_row(q_p + r * A, A, ap, e_q + r * ap);
            } else {
              x_k[r - nq] = additive::exp2x_row(k_p + (r - nq) * A, A, ap, e_k + (r - nq) * ap);
            }
          }
        });
        eq_p = e_q;
        ek_p = e_k;
        exact_q_p = x_q;
        exact_k_p = x_k;
      }
    }
  }

  // Head bh's rows as made by the constructor (exp_rows_now; float64: empty).
  HeadRows head_rows(int64_t bh) const {
    if (eq_p == nullptr) return {};
    return {eq_p + bh * Lq * ap, ek_p + bh * Lk * ap, exact_q_p + bh * Lq, exact_k_p + bh * Lk,
            ap};
  }
  // Head bh's rows made into e ((Lq + Lk) ap floats) and x (Lq + Lk flags): float32.
  HeadRows make_head_rows(int64_t bh, float* e, uint8_t* x) const {
    const float *q_p = q.data_ptr<float>() + bh * Lq * A, *k_p = k.data_ptr<float>() + bh * Lk * A;
    for (int64_t i = 0; i < Lq; ++i) x[i] = additive::exp2x_row(q_p + i * A, A, ap, e + i * ap);
    for (int64_t j = 0; j < Lk; ++j)
      x[Lq + j] = additive::exp2x_row(k_p + j * A, A, ap, e + (Lq + j) * ap);
    return {e, e + Lq * ap, x, x + Lq, ap};
  }

  // The exponential form (float32 only; additive_terms.h): rows of ap values. Raw pointers, as
  // the kernels read them per row and per key.
  int64_t ap;
  std::unique_ptr<KeptBuffer> e_rows;  // e^{2q} rows, then e^{2k} rows
  std::unique_ptr<uint8_t[]> exact_flags;  // rows of q, then of k: additive::RowFlags
  std::vector<float> vpad, vsum;
  const float *eq_p = nullptr, *ek_p = nullptr, *vpad_p = nullptr, *vsum_p = nullptr;
  const uint8_t *exact_q_p = nullptr, *exact_k_p = nullptr;
  const float* vpad_row(int64_t bh) const { return vpad_p + (bh % H) * ap; }
  float v_sum(int64_t bh) const { return vsum_p[bh % H]; }

  const acc_t* q_row(int64_t bh, int64_t i) const { return q.data_ptr<acc_t>() + (bh * Lq + i) * A; }
  const acc_t* k_row(int64_t bh, int64_t j) const { return k.data_ptr<acc_t>() + (bh * Lk + j) * A; }
  const acc_t* value_row(int64_t bh, int64_t j) const {
    return value.data_ptr<acc_t>() + (bh * Lk + j) * Ev;
  }
  const acc_t* v_row(int64_t bh) const { return v.data_ptr<acc_t>() + (bh % H) * A; }

  // The admissible keys of row i lie in [j0, j1) (the band), narrowed further by the mask.
  std::pair<int64_t, int64_t> band(int64_t i) const {
    const int64_t j0 = std::max<int64_t>(0, i + lo);
    const int64_t j1 = std::min<int64_t>(Lk, i + hi + 1);
    return {j0, std::max(j0, j1)};
  }
};

void check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& value, const at::Tensor& v,
                  const std::optional<at::Tensor>& mask, double dropout_p,
                  const std::optional<at::Tensor>& seed) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && value.dim() == 4, op,
              ": expected 4-D q, k, value, got ", q.sizes(), ", ", k.sizes(), ", ", value.sizes());
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3), op,
              ": k ", k.sizes(), " does not match q ", q.sizes());
  TORCH_CHECK(value.size(0) == q.size(0) && value.size(1) == q.size(1) &&
                  value.size(2) == k.size(2),
              op, ": value ", value.sizes(), " does not match k ", k.sizes());
  TORCH_CHECK(v.dim() == 2 && v.size(0) == q.size(1) && v.size(1) == q.size(3), op,
              ": expected v of shape (H, A) = (", q.size(1), ", ", q.size(3), "), got ", v.sizes());
  for (const at::Tensor* t : {&k, &value}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), op, ": expected all inputs of dtype ",
                q.scalar_type(), ", got ", t->scalar_type());
  }
  // float32 v beside 16-bit q: a v shared by the heads (attnx/_validate.py additive_call);
  // float64 v beside any q: a shared v whose gradient is wanted (attnx/_backends/cpu.py
  // additive), read in the kernels' dtype, its gradient returned in float64
  TORCH_CHECK(v.scalar_type() == q.scalar_type() || v.scalar_type() == at::kDouble ||
                  (v.scalar_type() == at::kFloat && at::isReducedFloatingType(q.scalar_type())),
              op, ": expected v of dtype ", q.scalar_type(), ", float32 or float64, got ",
              v.scalar_type());
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 4 && mask->size(0) == q.size(0) && mask->size(1) == q.size(1) &&
                    mask->size(2) == q.size(2) && mask->size(3) == k.size(2),
                op, ": expected a (B, H, Lq, Lk) mask view, got ", mask->sizes());
    // torch's rule: a float32 mask goes with any q (MaskView reads every float dtype)
    TORCH_CHECK(mask->scalar_type() == at::kBool || mask->scalar_type() == q.scalar_type() ||
                    mask->scalar_type() == at::kFloat,
                op, ": expected a bool mask, a float32 one or one of dtype ", q.scalar_type(),
                ", got ", mask->scalar_type());
  }
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, ": expected 0 <= dropout_p < 1, got ",
              dropout_p);
  TORCH_CHECK(dropout_p == 0.0 || seed.has_value(), op, ": dropout_p > 0 needs a seed");
}

// s[j] += the score of row i against key j, for the keys in [j0, j1) that s does not already
// mask out with -inf. tmp: Lk values of scratch.
template <typename acc_t>
void add_scores(const Problem<acc_t>& pb, const HeadRows& er, int64_t bh, int64_t i, int64_t j0,
                int64_t j1, acc_t* s, acc_t* tmp) {
  const bool fast = !er.exact_q(i), small = er.small_q(i);
  if constexpr (std::is_same_v<acc_t, float>) {
    if (fast && j1 > j0) {
      additive::exp_scores(er.q_row(i), er.k_row(j0), pb.vpad_row(bh), pb.v_sum(bh), pb.ap,
                           j1 - j0, tmp + j0);
    }
  }
  const acc_t* qi = pb.q_row(bh, i);
  const acc_t* v = pb.v_row(bh);
  for (int64_t j = j0; j < j1; ++j) {
    if (s[j] == -std::numeric_limits<acc_t>::infinity()) continue;
    s[j] += fast && !er.exact_pair(small, j) ? tmp[j] : tanh_dot(qi, pb.k_row(bh, j), v, pb.A);
  }
}

// ---------------------------------------------------------------------------------- forward

// Returns whether an output or an lse came out NaN or +inf (float64_rerun.h), found as the rows
// are written: a separate isfinite pass over out cost a fifth of the call at B64 L32.
// A task is up to kSumRows consecutive query rows of one (b, h): their value sums share each
// load of a value row (additive_terms.h), over the keys any of them admits, each row's
// probabilities zero outside its own (and a zero probability adds nothing, even times a
// non-finite value). Fewer rows a task where that would leave threads without tasks.
// per_head (float32, a Problem made without its exponential rows): a task is one head (b, h),
// all its row groups, after the task has made the head's e^{2q}, e^{2k} rows in a buffer of its
// thread (make_head_rows), where they stay in L2 (per_head_tasks).
template <typename scalar_t, typename acc_t>
bool forward(const Problem<acc_t>& pb, scalar_t* out, float* lse, acc_t* weights,
             bool per_head = false) {
  constexpr acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  const int64_t rows = pb.B * pb.H * pb.Lq;
  const int64_t G = per_head ? additive::kSumRows
                             : std::clamp<int64_t>(rows / (4 * at::get_num_threads()), 1,
                                                   additive::kSumRows);
  const int64_t groups = (pb.Lq + G - 1) / G;
  TORCH_INTERNAL_ASSERT(!per_head || (std::is_same_v<acc_t, float>), "per-head tasks are float32's");
  std::atomic<bool> non_finite{false};
  parallel_tasks(pb.B * pb.H * (per_head ? 1 : groups), [&](Tasks& tasks) {
    // acc: the sums before they are rounded to scalar_t (float32 writes them into out)
    constexpr bool in_place = std::is_same_v<scalar_t, float>;
    std::vector<acc_t> s(G * pb.Lk), tmp(pb.Lk), acc(in_place ? 0 : G * pb.Ev);
    line_vector<float> head_e(per_head ? (pb.Lq + pb.Lk) * pb.ap : 0);
    std::unique_ptr<uint8_t[]> head_x(per_head ? new uint8_t[pb.Lq + pb.Lk] : nullptr);
    // rows [i0, i1) of head bh
    const auto group = [&](const HeadRows& er, int64_t bh, int64_t i0, int64_t i1) {
      const int64_t b = bh / pb.H, h = bh % pb.H;
      int64_t u0 = pb.Lk, u1 = 0;  // the keys some row of the group admits: [u0, u1)
      bool bad = false;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = bh * pb.Lq + i;
        acc_t* p = s.data() + (i - i0) * pb.Lk;
        const auto [j0, j1] = pb.band(i);
        pb.mask.fill(b, h, i, j0, j1, p);
        add_scores(pb, er, bh, i, j0, j1, p, tmp.data());
        const acc_t m = row_max(p + j0, j1 - j0);
        if (m == ninf) {  // no admissible key: zero probabilities, a zero output row
          std::fill(p + j0, p + j1, acc_t(0));
          lse[r] = -std::numeric_limits<float>::infinity();
          continue;
        }
        const acc_t sum = exp_sum(p + j0, j1 - j0, m);  // exp(-inf) = 0 for masked keys
        lse[r] = static_cast<float>(m + std::log(sum));
        bad |= std::isnan(lse[r]) || lse[r] == std::numeric_limits<float>::infinity();
        const acc_t inv = acc_t(1) / sum;
        const auto row_key = pb.drop.row_key(bh, i);
        acc_t* w = weights ? weights + r * pb.Lk : nullptr;
        for (int64_t j = j0; j < j1; ++j) {
          p[j] *= inv * static_cast<acc_t>(pb.drop.factor(row_key, j));
          if (w) w[j] = p[j];
        }
        u0 = std::min(u0, j0);
        u1 = std::max(u1, j1);
      }
      u1 = std::max(u0, u1);
      for (int64_t i = i0; i < i1; ++i) {  // each row's probabilities over [u0, u1)
        acc_t* p = s.data() + (i - i0) * pb.Lk;
        const auto [j0, j1] = pb.band(i);
        std::fill(p + u0, p + std::max(u0, std::min(j0, u1)), acc_t(0));
        std::fill(p + std::min(u1, std::max(j1, u0)), p + u1, acc_t(0));
      }
      scalar_t* o = out + (bh * pb.Lq + i0) * pb.Ev;
      const int64_t n_out = (i1 - i0) * pb.Ev;
      if constexpr (std::is_same_v<acc_t, float>) {
        float* sums = acc.data();
        if constexpr (in_place) sums = o;
        additive::weighted_sums(s.data() + u0, pb.Lk, i1 - i0, pb.value_row(bh, u0), u1 - u0,
                                pb.Ev, sums, pb.Ev);
      } else {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t i = i0; i < i1; ++i) {
          const acc_t* p = s.data() + (i - i0) * pb.Lk;
          for (int64_t j = u0; j < u1; ++j) {
            if (p[j] != acc_t(0)) {
              axpy(p[j], pb.value_row(bh, j), acc.data() + (i - i0) * pb.Ev, pb.Ev);
            }
          }
        }
      }
      if constexpr (in_place) {
        bad |= any_non_finite(o, n_out);
      } else {
        float zero = 0.0f;  // NaN once any value (as stored) is NaN or infinite
        for (int64_t e = 0; e < n_out; ++e) {
          o[e] = static_cast<scalar_t>(acc[e]);
          zero += static_cast<float>(o[e]) * 0.0f;
        }
        bad |= zero != 0.0f;
      }
      if (bad) non_finite.store(true, std::memory_order_relaxed);
    };
    for (int64_t task; tasks.next(task);) {
      if (!per_head) {
        const int64_t bh = task / groups, i0 = task % groups * G;
        group(pb.head_rows(bh), bh, i0, std::min(pb.Lq, i0 + G));
        continue;
      }
      if constexpr (std::is_same_v<acc_t, float>) {
        const HeadRows er = pb.make_head_rows(task, head_e.data(), head_x.get());
        for (int64_t i0 = 0; i0 < pb.Lq; i0 += G) group(er, task, i0, std::min(pb.Lq, i0 + G));
      }
    }
  });
  return non_finite.load();
}

// Whether the float32 forward takes a head a task (forward's per_head): with many heads (8 a
// thread at least, so the queue still balances them) whose rows' e^{2q} and e^{2k}, (Lq + Lk)
// rows of A padded to kPad floats, stay in L2 between being made and read (at most 256 KiB: a
// quarter of the smallest L2 of the CPUs measured). Made per head in a thread's buffer, those
// rows never leave L2; made in one pass beforehand, a call's (4 MiB at B = 64, L = 32, A = 256)
// went to memory and came back (after a 256 MiB read between calls, 2 threads, Zen 5: the
// per-head tasks took 0.905-0.945x the time, interleaved in one process; the same warm).
bool per_head_tasks(int64_t B, int64_t H, int64_t Lq, int64_t Lk, int64_t A) {
  const int64_t ap = (A + additive::kPad - 1) / additive::kPad * additive::kPad;
  return B * H >= 8 * at::get_num_threads() && (Lq + Lk) * ap * 4 <= (256 << 10);
}

// --------------------------------------------------------------------------------- backward

// dk, dvalue and dv sum over query rows. The B*H*Lq rows are cut into one contiguous slice per
// thread; a slice accumulates straight into the output for the (b, h) blocks it owns whole, and
// into a private buffer for the at most two blocks it shares with its neighbours, which are
// added in slice order at the end. The result is deterministic for a given thread count and
// memory stays O(threads * Lk * (A + Ev)).
template <typename acc_t>
struct Slices {
  struct Shared {
    int64_t bh = -1;
    std::vector<acc_t> dk, dvalue, dv;
  };
  int64_t count, rows;
  std::vector<Shared> shared;  // 2 per slice: the slice's first and last block

  Slices(int64_t rows_, int64_t threads) : count(std::max<int64_t>(1, std::min(rows_, threads))),
                                           rows(rows_), shared(2 * count) {}
  int64_t begin(int64_t s) const { return s * rows / count; }
};

template <typename acc_t>
struct Grads {
  acc_t *dq, *dk, *dvalue, *dv;  // dv: (B*H, A), summed over B at the end
  acc_t* dmask;                  // (B, H, Lq, Lk) contiguous, or null; the mask's dtype after
};

// What the backward reads besides the inputs (contiguous, acc_t unless said): dout and out
// (B, H, Lq, Ev), the float32 lse and grad_lse (B, H, Lq), dweights (B, H, Lq, Lk); the last
// two may be null.
template <typename acc_t>
struct Upstream {
  const acc_t *dout, *out;
  const float* lse;
  const acc_t *grad_lse, *dweights;
};

// Per-thread scratch of the backward: row buffers of Lk and ap values.
template <typename acc_t>
struct RowScratch {
  std::vector<acc_t> s, tmp, ds, t, dvr, dvt;
  RowScratch(int64_t Lk, int64_t ap) : s(Lk), tmp(Lk), ds(Lk), t(ap), dvr(ap), dvt(ap) {}
};

// dk (rows of ap values) and dq hold sums of ds u (additive_terms.h): the factor 4 v[a] is
// applied at the end; dv (rows of A values) gets its sum over j of ds_ij tanh_ija here.
template <typename scalar_t, typename acc_t>
void backward_rows(const Problem<acc_t>& pb, const Upstream<acc_t>& up, int64_t bh, int64_t i0,
                   int64_t i1, acc_t* dk, acc_t* dvalue, acc_t* dv, const Grads<acc_t>& g,
                   RowScratch<acc_t>& w) {
  constexpr acc_t ninf = -std::numeric_limits<acc_t>::infinity();
  const float* lse = up.lse;
  const int64_t b = bh / pb.H, h = bh % pb.H;
  const HeadRows er = pb.head_rows(bh);
  acc_t* s = w.s.data();
  acc_t* ds = w.ds.data();
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t r = bh * pb.Lq + i;
    // Rows with no admissible key pass no gradient; dq and dmask start at zero. (A float32 lse
    // of -inf is such a row, except for float64 inputs, whose lse may just overflow float32.)
    if (std::is_same_v<acc_t, float> && lse[r] == -std::numeric_limits<float>::infinity()) {
      continue;
    }
    const auto [j0, j1] = pb.band(i);
    pb.mask.fill(b, h, i, j0, j1, s);
    add_scores(pb, er, bh, i, j0, j1, s, w.tmp.data());
    const acc_t* doi = up.dout + r * pb.Ev;
    const acc_t* dwi = up.dweights != nullptr ? up.dweights + r * pb.Lk : nullptr;
    const auto row_key = pb.drop.row_key(bh, i);
    acc_t D, c, f;  // P_ij = exp(s_ij - c) * f
    if (std::is_same_v<scalar_t, float> && !huge_lse(lse[r])) {
      D = dot(doi, up.out + r * pb.Ev, pb.Ev);
      c = static_cast<acc_t>(lse[r]);
      f = acc_t(1);
    } else {
      // float32 lse and an out rounded to a low dtype would cost these dtypes their accuracy
      // (double: gradcheck; bfloat16, float16: the float32 reference), and a huge lse may have lost its
      // log(l) (huge_lse.h): recompute the row's max, sum and D exactly.
      acc_t m = ninf;
      for (int64_t j = j0; j < j1; ++j) m = std::max(m, s[j]);
      if (m == ninf) continue;
      acc_t sum = 0;
      for (int64_t j = j0; j < j1; ++j) sum += std::exp(s[j] - m);
      c = m;
      f = acc_t(1) / sum;
      D = 0;
      for (int64_t j = j0; j < j1; ++j) {
        const acc_t pd = std::exp(s[j] - c) * f * static_cast<acc_t>(pb.drop.factor(row_key, j));
        if (pd != acc_t(0)) D += pd * dot(doi, pb.value_row(bh, j), pb.Ev);
      }
    }
    // grad_lse carries the weights' part of D too (csrc/ops.cpp)
    if (up.grad_lse != nullptr) D -= up.grad_lse[r];
    for (int64_t j = j0; j < j1; ++j) {
      ds[j] = 0;
      if (s[j] == ninf) continue;
      const acc_t p = std::exp(s[j] - c) * f;
      const acc_t keep = static_cast<acc_t>(pb.drop.factor(row_key, j));
      const acc_t pd = p * keep;  // the probability after dropout, as out used it
      const acc_t dp =
          dot(doi, pb.value_row(bh, j), pb.Ev) + (dwi != nullptr ? dwi[j] : acc_t(0));
      ds[j] = p * (keep * dp - D);
      if (pd != acc_t(0)) axpy(pd, doi, dvalue + j * pb.Ev, pb.Ev);
      if (g.dmask) g.dmask[r * pb.Lk + j] = ds[j];
    }
    // the terms' gradients: exact pairs first (their ds then cleared; dv's part summed as
    // ds t in dvt), the rest at once (dv's part sum ds - 2 sum ds r, from dvr)
    acc_t* dqi = g.dq + r * pb.ap;
    acc_t *dvr = w.dvr.data(), *dvt = w.dvt.data();
    std::fill(w.dvr.begin(), w.dvr.end(), acc_t(0));
    std::fill(w.dvt.begin(), w.dvt.end(), acc_t(0));
    const acc_t* qi = pb.q_row(bh, i);
    const acc_t* v = pb.v_row(bh);
    const bool fast = !er.exact_q(i), small = er.small_q(i);
    for (int64_t j = j0; j < j1; ++j) {
      if (ds[j] == acc_t(0) || (fast && !er.exact_pair(small, j))) continue;
      tanh_dot_keep(qi, pb.k_row(bh, j), v, w.t.data(), pb.A);
      grad_terms(w.t.data(), ds[j], dqi, dk + j * pb.ap, dvt, pb.A);
      ds[j] = 0;
    }
    acc_t ds_sum = 0;  // of the pairs left to the exponential form
    for (int64_t j = j0; j < j1; ++j) ds_sum += ds[j];
    if constexpr (std::is_same_v<acc_t, float>) {
      if (fast && j1 > j0) {
        additive::exp_grads(er.q_row(i), er.k_row(j0), ds + j0, pb.ap, j1 - j0, dqi,
                            dk + j0 * pb.ap, dvr);
      }
    }
    for (int64_t a = 0; a < pb.A; ++a) dv[a] += ds_sum - 2 * dvr[a] + dvt[a];
  }
}

template <typename scalar_t, typename acc_t>
void backward(const Problem<acc_t>& pb, const Upstream<acc_t>& up, const Grads<acc_t>& g) {
  const int64_t BH = pb.B * pb.H, rows = BH * pb.Lq;
  Slices<acc_t> slices(rows, at::get_num_threads());
  at::parallel_for(0, slices.count, 1, [&](int64_t s_begin, int64_t s_end) {
    RowScratch<acc_t> scratch(pb.Lk, pb.ap);
    for (int64_t s = s_begin; s < s_end; ++s) {
      const int64_t r0 = slices.begin(s), r1 = slices.begin(s + 1);
      for (int64_t bh = r0 / pb.Lq; bh * pb.Lq < r1; ++bh) {
        const int64_t i0 = std::max(r0 - bh * pb.Lq, int64_t(0));
        const int64_t i1 = std::min(r1 - bh * pb.Lq, pb.Lq);
        acc_t* dk = g.dk + bh * pb.Lk * pb.ap;
        acc_t* dvalue = g.dvalue + bh * pb.Lk * pb.Ev;
        acc_t* dv = g.dv + bh * pb.A;
        if (i0 > 0 || i1 < pb.Lq) {  // a block shared with a neighbouring slice
          auto& sh = slices.shared[2 * s + (bh * pb.Lq < r0 ? 0 : 1)];
          sh.bh = bh;
          sh.dk.assign(pb.Lk * pb.ap, acc_t(0));
          sh.dvalue.assign(pb.Lk * pb.Ev, acc_t(0));
          sh.dv.assign(pb.A, acc_t(0));
          dk = sh.dk.data();
          dvalue = sh.dvalue.data();
          dv = sh.dv.data();
        }
        backward_rows<scalar_t>(pb, up, bh, i0, i1, dk, dvalue, dv, g, scratch);
      }
    }
  });
  for (const auto& sh : slices.shared) {
    if (sh.bh < 0) continue;
    axpy(acc_t(1), sh.dk.data(), g.dk + sh.bh * pb.Lk * pb.ap, pb.Lk * pb.ap);
    axpy(acc_t(1), sh.dvalue.data(), g.dvalue + sh.bh * pb.Lk * pb.Ev, pb.Lk * pb.Ev);
    axpy(acc_t(1), sh.dv.data(), g.dv + sh.bh * pb.A, pb.A);
  }
}

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Whether a float32 call overflowed (float64_rerun.h). |score| <= sum_a |v_a|, tanh being
// bounded, so up to 1e30 neither a score nor a score plus a finite mask leaves float32's range
// (half its ulp at the top is 1e31); past that the call reruns whatever came out. Otherwise a
// value or gradient sum past the range shows as a non-finite result, or as an lse of NaN or
// +inf. (The forward's value sums are normalized as they go, so they overflow only there.)
bool overflowed(const at::Tensor& v, bool non_finite_results) {
  if (non_finite_results) return true;
  // a plain loop over the H x A values (the ATen reduction chain it replaced cost tens of
  // microseconds a call with cold caches); NaN counts as past
  const at::Tensor vc = v.contiguous();
  const int64_t A = vc.dim() > 0 ? vc.size(-1) : 0, H = A > 0 ? vc.numel() / A : 0;
  bool past = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, vc.scalar_type(),
                                  "attnx_additive_v_range", [&] {
    const scalar_t* p = vc.data_ptr<scalar_t>();
    for (int64_t h = 0; h < H; ++h) {
      double sum = 0;
      for (int64_t a = 0; a < A; ++a) sum += std::abs(static_cast<double>(p[h * A + a]));
      past |= !(sum <= 1e30);
    }
  });
  return past;
}

at::Tensor f64(const at::Tensor& t) { return t.to(at::kDouble); }

std::optional<at::Tensor> f64(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || t->scalar_type() == at::kBool) return t;
  return t->to(at::kDouble);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> additive_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& value, const at::Tensor& v,
    const std::optional<at::Tensor>& mask, int64_t window_lo, int64_t window_hi,
    double dropout_p, const std::optional<at::Tensor>& seed, bool return_weights) {
  check_inputs("attnx::additive_fwd", q, k, value, v, mask, dropout_p, seed);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2);
  at::Tensor out = at::empty({B, H, Lq, value.size(3)}, q.options());
  at::Tensor lse = at::empty({B, H, Lq}, q.options().dtype(at::kFloat));
  // float32 weights for 16-bit q: the backward's rowsum(W * dW) takes them (csrc/ops.cpp)
  const auto weights_dtype = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor weights = return_weights ? at::zeros({B, H, Lq, Lk}, q.options().dtype(weights_dtype))
                                      : at::empty({0}, q.options());
  bool non_finite = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attnx_additive_fwd",
                                  [&] {
    using acc_t = acc_type<scalar_t>;
    const bool per_head = std::is_same_v<acc_t, float> && per_head_tasks(B, H, Lq, Lk, q.size(3));
    const Problem<acc_t> pb(q, k, value, v, mask, window_lo, window_hi, dropout_p, seed,
                            !per_head);
    non_finite = forward<scalar_t, acc_t>(pb, out.data_ptr<scalar_t>(), lse.data_ptr<float>(),
                             return_weights ? weights.data_ptr<acc_t>() : nullptr, per_head);
  });
  if (q.scalar_type() != at::kDouble && overflowed(v, non_finite) &&
      finite_inputs({q, k, value, v}, mask)) {
    const auto [o, l, w] = additive_fwd(f64(q), f64(k), f64(value), f64(v), f64(mask), window_lo,
                                        window_hi, dropout_p, seed, return_weights);
    return {o.to(q.scalar_type()), l, return_weights ? w.to(weights_dtype) : weights};
  }
  return {out, lse, weights};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> additive_bwd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& value, const at::Tensor& v, const std::optional<at::Tensor>& mask,
    const at::Tensor& out, const at::Tensor& lse, int64_t window_lo, int64_t window_hi,
    double dropout_p, const std::optional<at::Tensor>& seed, bool mask_grad,
    const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& grad_weights) {
  check_inputs("attnx::additive_bwd", q, k, value, v, mask, dropout_p, seed);
  TORCH_CHECK(!mask_grad || (mask.has_value() && mask->scalar_type() != at::kBool),
              "attnx::additive_bwd: mask_grad needs a float mask");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2);
  const int64_t A = q.size(3), Ev = value.size(3);
  const std::vector<int64_t> out_shape{B, H, Lq, Ev};
  TORCH_CHECK(grad_out.sizes() == out_shape && out.sizes() == out_shape,
              "attnx::additive_bwd: expected grad_out and out of shape (B, H, Lq, Ev) = ",
              out_shape, ", got ", grad_out.sizes(), " and ", out.sizes());
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.sizes() == std::vector<int64_t>({B, H, Lq}),
              "attnx::additive_bwd: expected a float32 (B, H, Lq) lse, got ", lse.scalar_type(),
              " ", lse.sizes());
  TORCH_CHECK(!grad_lse.has_value() || (grad_lse->sizes() == lse.sizes() && grad_lse->is_cpu()),
              "attnx::additive_bwd: expected a CPU grad_lse of lse's shape ", lse.sizes());
  TORCH_CHECK(!grad_weights.has_value() ||
                  (grad_weights->sizes() == std::vector<int64_t>({B, H, Lq, Lk}) &&
                   grad_weights->is_cpu()),
              "attnx::additive_bwd: expected a CPU grad_weights of shape (B, H, Lq, Lk), got ",
              grad_weights.has_value() ? grad_weights->sizes() : at::IntArrayRef{});
  at::Tensor dq, dk, dvalue, dv, dmask;
  bool grads_non_finite = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attnx_additive_bwd",
                                  [&] {
    using acc_t = acc_type<scalar_t>;
    const Problem<acc_t> pb(q, k, value, v, mask, window_lo, window_hi, dropout_p, seed);
    const auto acc_opts = q.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
    const at::Tensor dout_acc = grad_out.to(acc_opts.dtype()).contiguous();
    const at::Tensor out_acc = out.to(acc_opts.dtype()).contiguous();
    const at::Tensor lse_c = lse.contiguous();
    const at::Tensor glse =
        grad_lse.has_value() ? grad_lse->to(acc_opts.dtype()).contiguous() : at::Tensor();
    const at::Tensor dw =
        grad_weights.has_value() ? grad_weights->to(acc_opts.dtype()).contiguous() : at::Tensor();
    at::Tensor dq_acc = at::zeros({B, H, Lq, pb.ap}, acc_opts);
    at::Tensor dk_acc = at::zeros({B, H, Lk, pb.ap}, acc_opts);
    at::Tensor dvalue_acc = at::zeros({B, H, Lk, Ev}, acc_opts);
    at::Tensor dv_acc = at::zeros({B, H, A}, acc_opts);
    dmask = mask_grad ? at::zeros({B, H, Lq, Lk}, acc_opts) : at::empty({0}, q.options());
    const Grads<acc_t> g{dq_acc.data_ptr<acc_t>(), dk_acc.data_ptr<acc_t>(),
                         dvalue_acc.data_ptr<acc_t>(), dv_acc.data_ptr<acc_t>(),
                         mask_grad ? dmask.data_ptr<acc_t>() : nullptr};
    const Upstream<acc_t> up{dout_acc.data_ptr<acc_t>(), out_acc.data_ptr<acc_t>(),
                             lse_c.data_ptr<float>(),
                             glse.defined() ? glse.data_ptr<acc_t>() : nullptr,
                             dw.defined() ? dw.data_ptr<acc_t>() : nullptr};
    backward<scalar_t, acc_t>(pb, up, g);
    const at::Tensor four_v = pb.v.mul(4).view({1, H, 1, A});
    const at::Tensor dq_f = dq_acc.narrow(-1, 0, A).mul(four_v);
    const at::Tensor dk_f = dk_acc.narrow(-1, 0, A).mul(four_v);
    const at::Tensor dv_f = dv_acc.sum(0);
    // float32 sums past the range show as non-finite gradients: checked serially (on a shared
    // machine each of ATen's parallel isfinite passes may wait for a descheduled thread)
    if constexpr (std::is_same_v<acc_t, float>) {
      for (const at::Tensor& t : {dq_f, dk_f, dvalue_acc, dv_f}) {
        grads_non_finite |= any_non_finite(t.data_ptr<float>(), t.numel());
      }
      grads_non_finite |= mask_grad && at::isfinite(dmask).logical_not().any().item<bool>();
      grads_non_finite |= (at::isnan(lse) | at::isposinf(lse)).any().item<bool>();
    }
    dq = dq_f.to(q.scalar_type());
    dk = dk_f.to(q.scalar_type());
    dvalue = dvalue_acc.to(q.scalar_type());
    dv = dv_f.to(v.scalar_type());
    if (mask_grad) dmask = dmask.to(mask->scalar_type());
  });
  const auto gl = grad_lse.value_or(at::Tensor()), gw = grad_weights.value_or(at::Tensor());
  if (q.scalar_type() != at::kDouble && overflowed(v, grads_non_finite) &&
      finite_inputs({grad_out, q, k, value, v, gl, gw}, mask)) {
    const auto opt64 = [](const at::Tensor& t) {
      return t.defined() ? std::optional<at::Tensor>(f64(t)) : std::nullopt;
    };
    auto grads = additive_bwd(f64(grad_out), f64(q), f64(k), f64(value), f64(v), f64(mask),
                              f64(out), lse, window_lo, window_hi, dropout_p, seed, mask_grad,
                              opt64(gl), opt64(gw));
    const auto dt = q.scalar_type();
    return {std::get<0>(grads).to(dt), std::get<1>(grads).to(dt), std::get<2>(grads).to(dt),
            std::get<3>(grads).to(v.scalar_type()),
            mask_grad ? std::get<4>(grads).to(mask->scalar_type()) : std::get<4>(grads).to(dt)};
  }
  return {dq, dk, dvalue, dv, dmask};
}

}  // namespace attnx::cpu
