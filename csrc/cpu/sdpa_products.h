// The matrix products of the CPU SDPA kernels, behind one interface with two engines: BLAS on
// the operands as they are (float64, and float on CPUs without AVX2), or the panel
// micro-kernel on operands packed once (float). Both passes take their scores from the same
// engine; with panels they come out bitwise the same (one FMA chain per score, whatever the
// tile), which keeps the backward's recomputed probabilities consistent with the saved lse.
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kept_buffer.h"
#include "line_vector.h"
#include "sdpa_blas.h"
#include "sdpa_panels.h"
#include "sdpa_tile.h"
#include "task_queue.h"

namespace attnx::cpu {

struct Dims {
  int64_t B, Hq, Hkv, Lq, Lk, E, Ev;
  int64_t group() const { return Hq / Hkv; }
};

// gemm_rm (sdpa_blas.h) with alpha applied where no intermediate leaves the range. Where BLAS
// applies alpha is its own choice (MKL's dgemm folds it into an operand for some shapes,
// scales the products for others), and float64 results in range came out NaN where either
// passed its range (float32's such results rerun in float64). So float64 takes the plain
// products, scaled after, and where those overflow, the products of alpha op(A) (a tiny
// scale on huge operands).
template <typename T>
void gemm_scaled_rm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                    int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if constexpr (std::is_same_v<T, double>) {
    std::vector<T> t(static_cast<size_t>(m * n));
    gemm_rm(ta, tb, m, n, k, T(1), a, lda, b, ldb, T(0), t.data(), n);
    bool finite = true;
    for (const T x : t) finite &= std::abs(x) <= std::numeric_limits<T>::max();
    if (finite) {
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < n; ++j) {
          T& cr = c[r * ldc + j];
          cr = beta == T(0) ? alpha * t[r * n + j] : alpha * t[r * n + j] + beta * cr;
        }
    } else {  // A as stored: m x k (row stride lda), or k x m when ta
      const int64_t rows = ta ? k : m, cols = ta ? m : k;
      std::vector<T> as(static_cast<size_t>(rows * cols));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) as[r * cols + j] = alpha * a[r * lda + j];
      gemm_rm(ta, tb, m, n, k, T(1), as.data(), cols, b, ldb, beta, c, ldc);
    }
  } else {
    gemm_rm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

// Forward products. Engine::Heads holds what every thread reads of a round of kv heads
// [h0, h1) (h = b * Hkv + hk), prepared by all threads together before the round's tasks; an
// Engine is one thread's view of it: load(h) picks head h, then scores S = alpha Q K^T and
// O += P V on the keys [c0, c1) of the block at j0 (a multiple of PANEL). O rows have
// out_stride() elements. key_max: max |K| of the loaded head.
template <typename T>
struct BlasProducts {
  // K and V read in place; only their max |K| per head is computed.
  struct Heads {
    Dims d;
    const T* k = nullptr;  // the whole tensors
    const T* v = nullptr;
    int64_t h0 = 0;
    std::vector<T> key_max;

    Heads(const Dims& dims, int64_t) : d(dims) {}
    static int64_t floats_per_head(const Dims&) { return 0; }
    void prepare(const T* k_, const T* v_, int64_t h0_, int64_t h1) {
      k = k_, v = v_, h0 = h0_;
      key_max.assign(h1 - h0, T(0));
      parallel_tasks(h1 - h0, [&](Tasks& tasks) {
        for (int64_t t; tasks.next(t);) key_max[t] = abs_max(k + (h0 + t) * d.Lk * d.E, d.Lk * d.E);
      });
    }
  };

  Dims d;
  const Heads& heads;
  const T* k = nullptr;
  const T* v = nullptr;
  T key_max = 0;

  BlasProducts(const Dims& dims, const Heads& h) : d(dims), heads(h) {}
  void load(int64_t h) {
    k = heads.k + h * d.Lk * d.E, v = heads.v + h * d.Lk * d.Ev;
    key_max = heads.key_max[h - heads.h0];
  }
  int64_t out_stride() const { return d.Ev; }
  // S[r][c0, c1) of m rows (row stride lds), q the first query row.
  void scores(int64_t m, const T* q, int64_t j0, int64_t c0, int64_t c1, T alpha, T* s,
              int64_t lds) const {
    gemm_scaled_rm(false, true, m, c1 - c0, d.E, alpha, q, d.E, k + (j0 + c0) * d.E, d.E, T(0),
                   s + c0, lds);
  }
  // o (m rows) += P[:, c0, c1) V[j0 + c0, j0 + c1).
  void values(int64_t m, const T* p, int64_t ldp, int64_t j0, int64_t c0, int64_t c1,
              T* o) const {
    gemm_rm(false, false, m, d.Ev, c1 - c0, T(1), p + c0, ldp, v + (j0 + c0) * d.Ev, d.Ev, T(1),
            o, d.Ev);
  }
};

struct PanelProducts {
  // K^T and V as panels, each head packed once per call. When each thread packed the heads of
  // the tasks it took, 2 threads packed 8 heads 12 times (B = 1, L = 4096); packed once by all
  // threads together, the causal forward ran 1% faster at L = 4096 and 2-7% at L = 512-1024
  // (interleaved in one process, 2 threads).
  struct Heads {
    Dims d;
    int64_t h0 = 0;
    KeptBuffer store;  // kt, then vp: written in full by prepare()
    float* kt;
    float* vp;
    std::vector<float> key_max;

    Heads(const Dims& dims, int64_t count);  // room for `count` heads
    static int64_t floats_per_head(const Dims& d);
    void prepare(const float* k, const float* v, int64_t h0_, int64_t h1);  // whole tensors
    static int64_t kt_size(const Dims& d) { return panel_count(d.Lk) * d.E * PANEL; }
    static int64_t vp_size(const Dims& d) { return panel_count(d.Ev) * d.Lk * PANEL; }
    int64_t kt_size() const { return kt_size(d); }
    int64_t vp_size() const { return vp_size(d); }
  };

  Dims d;
  const Heads& heads;
  const float* kt = nullptr;  // K^T as panels of 16 keys
  const float* vp = nullptr;  // V as panels of 16 value columns
  float key_max = 0;

  PanelProducts(const Dims& dims, const Heads& h) : d(dims), heads(h) {}
  void load(int64_t h) {
    kt = heads.kt + (h - heads.h0) * heads.kt_size();
    vp = heads.vp + (h - heads.h0) * heads.vp_size();
    key_max = heads.key_max[h - heads.h0];
  }
  int64_t out_stride() const { return panel_count(d.Ev) * PANEL; }
  // Whole panels: S also gets columns [c0 rounded down, c0) and [c1, c1 rounded up).
  void scores(int64_t m, const float* q, int64_t j0, int64_t c0, int64_t c1, float alpha,
              float* s, int64_t lds) const;
  void values(int64_t m, const float* p, int64_t ldp, int64_t j0, int64_t c0, int64_t c1,
              float* o) const;
};

// Backward products on one query head, loaded with load(): the query tile at i0 (mq rows)
// against the key block at j0 (nk keys, j0 a multiple of PANEL). Gradient accumulators have
// rows of q_stride() (dQ, dK) and v_stride() (dV) elements. query_max, key_max: max |Q|, |K|
// of the head.
template <typename T>
struct BlasGrads {
  Dims d;
  const T *q = nullptr, *k = nullptr, *v = nullptr, *dout = nullptr;
  T query_max = 0, key_max = 0;

  // BLAS may sum a score in another order than the forward's call did (other tile shapes).
  static constexpr bool forward_scores = false;

  explicit BlasGrads(const Dims& dims) : d(dims) {}
  void load(const T* q_, const T* k_, const T* v_, const T* dout_) {
    if (q_ != q) query_max = abs_max(q_, d.Lq * d.E);
    if (k_ != k) key_max = abs_max(k_, d.Lk * d.E);
    q = q_, k = k_, v = v_, dout = dout_;
  }
  int64_t q_stride() const { return d.E; }
  int64_t v_stride() const { return d.Ev; }
  // s = alpha Q K^T and dp = dO V^T, nk columns of row stride lds.
  void scores(int64_t i0, int64_t mq, int64_t j0, int64_t nk, T alpha, T* s, int64_t lds) const {
    gemm_scaled_rm(false, true, mq, nk, d.E, alpha, q + i0 * d.E, d.E, k + j0 * d.E, d.E, T(0), s,
                   lds);
  }
  void dprobs(int64_t i0, int64_t mq, int64_t j0, int64_t nk, T* dp, int64_t lds) const {
    gemm_rm(false, true, mq, nk, d.Ev, T(1), dout + i0 * d.Ev, d.Ev, v + j0 * d.Ev, d.Ev, T(0),
            dp, lds);
  }
  // dv += P^T dO, dq += alpha dS K, dk += alpha dS^T Q (accumulators for the whole head).
  void add_dv(int64_t i0, int64_t mq, int64_t j0, int64_t nk, const T* p, int64_t lds,
              T* dv) const {
    gemm_rm(true, false, nk, d.Ev, mq, T(1), p, lds, dout + i0 * d.Ev, d.Ev, T(1),
            dv + j0 * d.Ev, d.Ev);
  }
  void add_dq(int64_t i0, int64_t mq, int64_t j0, int64_t nk, T alpha, const T* ds, int64_t lds,
              T* dq) const {
    gemm_scaled_rm(false, false, mq, d.E, nk, alpha, ds, lds, k + j0 * d.E, d.E, T(1),
                   dq + i0 * d.E, d.E);
  }
  void add_dk(int64_t i0, int64_t mq, int64_t j0, int64_t nk, T alpha, const T* ds, int64_t lds,
              T* dk) const {
    gemm_scaled_rm(true, false, nk, d.E, mq, alpha, ds, lds, q + i0 * d.E, d.E, T(1),
                   dk + j0 * d.E, d.E);
  }
};

struct PanelGrads {
  Dims d;
  // The head's operands as panels: K^T and V^T by keys (for S, dP), K by columns (dQ), Q and
  // dO by columns (dK, dV). Linear in the sequence lengths (about 3 Lk + 2 Lq rows of the head
  // dims per thread), reused by every tile pair; K and V repacked only when the kv head changes.
  line_vector<float> kt, vt, kc, qc, dc;
  float query_max = 0, key_max = 0;

  // scores() is bitwise PanelProducts::scores(): the forward's very values.
  static constexpr bool forward_scores = true;

  explicit PanelGrads(const Dims& dims);
  void load(const float* q, const float* k, const float* v, const float* dout);
  int64_t q_stride() const { return panel_count(d.E) * PANEL; }
  int64_t v_stride() const { return panel_count(d.Ev) * PANEL; }
  void scores(int64_t i0, int64_t mq, int64_t j0, int64_t nk, float alpha, float* s,
              int64_t lds) const;
  void dprobs(int64_t i0, int64_t mq, int64_t j0, int64_t nk, float* dp, int64_t lds) const;
  void add_dv(int64_t i0, int64_t mq, int64_t j0, int64_t nk, const float* p, int64_t lds,
              float* dv) const;
  void add_dq(int64_t i0, int64_t mq, int64_t j0, int64_t nk, float alpha, const float* ds,
              int64_t lds, float* dq) const;
  void add_dk(int64_t i0, int64_t mq, int64_t j0, int64_t nk, float alpha, const float* ds,
              int64_t lds, float* dk) const;

 private:
  const float* q = nullptr;  // the query rows themselves, broadcast by scores()
  const float* dout = nullptr;
  const float* packed_k = nullptr;  // the K and V that kt, vt, kc hold
  const float* packed_v = nullptr;
};

}  // namespace attnx::cpu
