#include "sdpa_products.h"

#include <algorithm>

namespace attnx::cpu {

PanelProducts::Heads::Heads(const Dims& dims, int64_t count)
    : d(dims),
      store(count * (kt_size() + vp_size())),
      kt(store.data()),
      vp(kt + count * kt_size()),
      key_max(count) {}

int64_t PanelProducts::Heads::floats_per_head(const Dims& d) {
  return kt_size(d) + vp_size(d);
}

void PanelProducts::Heads::prepare(const float* k, const float* v, int64_t h0_, int64_t h1) {
  h0 = h0_;
  // Jobs of a head: K^T by blocks of KEYS keys, then V by panels; a job's max |K| in k_max.
  constexpr int64_t KEYS = 256;
  const int64_t k_jobs = (d.Lk + KEYS - 1) / KEYS, jobs = k_jobs + panel_count(d.Ev);
  std::vector<float> k_max((h1 - h0) * k_jobs);
  parallel_tasks((h1 - h0) * jobs, [&](Tasks& tasks) {
    for (int64_t t; tasks.next(t);) {
      const int64_t h = t / jobs, job = t % jobs;
      const float* kh = k + (h0 + h) * d.Lk * d.E;
      const float* vh = v + (h0 + h) * d.Lk * d.Ev;
      if (job < k_jobs) {
        const int64_t j0 = job * KEYS;
        k_max[h * k_jobs + job] =
            pack_panels(kh + j0 * d.E, d.E, std::min(KEYS, d.Lk - j0), 1, d.E,
                        kt + h * kt_size() + j0 * d.E);
      } else {
        const int64_t c0 = (job - k_jobs) * PANEL;
        pack_panels(vh + c0, d.Lk, std::min(PANEL, d.Ev - c0), d.Ev, 1,
                    vp + h * vp_size() + c0 * d.Lk);
      }
    }
  });
  for (int64_t h = 0; h < h1 - h0; ++h) {
    key_max[h] = 0.0f;
    for (int64_t job = 0; job < k_jobs; ++job) {
      key_max[h] = std::max(key_max[h], k_max[h * k_jobs + job]);
    }
  }
}

void PanelProducts::scores(int64_t m, const float* q, int64_t j0, int64_t c0, int64_t c1,
                           float alpha, float* s, int64_t lds) const {
  const int64_t p0 = (j0 + c0) / PANEL, p1 = panel_count(j0 + c1);
  panel_gemm(m, p1 - p0, d.E, alpha, q, d.E, 1, kt + p0 * d.E * PANEL, d.E * PANEL,
             false, s + p0 * PANEL - j0, lds);
}

void PanelProducts::values(int64_t m, const float* p, int64_t ldp, int64_t j0, int64_t c0,
                           int64_t c1, float* o) const {
  panel_gemm(m, panel_count(d.Ev), c1 - c0, 1.0f, p + c0, ldp, 1, vp + (j0 + c0) * PANEL,
             d.Lk * PANEL, true, o, out_stride());
}

PanelGrads::PanelGrads(const Dims& dims)
    : d(dims),
      kt(panel_count(d.Lk) * d.E * PANEL),
      vt(panel_count(d.Lk) * d.Ev * PANEL),
      kc(panel_count(d.E) * d.Lk * PANEL),
      qc(panel_count(d.E) * d.Lq * PANEL),
      dc(panel_count(d.Ev) * d.Lq * PANEL) {}

void PanelGrads::load(const float* q_, const float* k, const float* v, const float* dout_) {
  q = q_, dout = dout_;
  if (k != packed_k || v != packed_v) {  // GQA: the query heads of a group share K and V
    key_max = pack_panels(k, d.E, d.Lk, 1, d.E, kt.data());
    pack_panels(v, d.Ev, d.Lk, 1, d.Ev, vt.data());
    pack_panels(k, d.Lk, d.E, d.E, 1, kc.data());
    packed_k = k, packed_v = v;
  }
  query_max = pack_panels(q, d.Lq, d.E, d.E, 1, qc.data());
  pack_panels(dout, d.Lq, d.Ev, d.Ev, 1, dc.data());
}

// Same call as PanelProducts::scores on the same rows: bitwise the forward's scores.
void PanelGrads::scores(int64_t i0, int64_t mq, int64_t j0, int64_t nk, float alpha, float* s,
                        int64_t lds) const {
  panel_gemm(mq, panel_count(nk), d.E, alpha, q + i0 * d.E, d.E, 1,
             kt.data() + j0 / PANEL * d.E * PANEL, d.E * PANEL, false, s, lds);
}

void PanelGrads::dprobs(int64_t i0, int64_t mq, int64_t j0, int64_t nk, float* dp,
                        int64_t lds) const {
  panel_gemm(mq, panel_count(nk), d.Ev, 1.0f, dout + i0 * d.Ev, d.Ev, 1,
             vt.data() + j0 / PANEL * d.Ev * PANEL, d.Ev * PANEL, false, dp, lds);
}

// A = P^T: element (key c, query r) at p[r * lds + c], so rows step by 1 and k by lds.
void PanelGrads::add_dv(int64_t i0, int64_t mq, int64_t j0, int64_t nk, const float* p,
                        int64_t lds, float* dv) const {
  panel_gemm(nk, panel_count(d.Ev), mq, 1.0f, p, 1, lds, dc.data() + i0 * PANEL,
             d.Lq * PANEL, true, dv + j0 * v_stride(), v_stride());
}

void PanelGrads::add_dq(int64_t i0, int64_t mq, int64_t j0, int64_t nk, float alpha,
                        const float* ds, int64_t lds, float* dq) const {
  panel_gemm(mq, panel_count(d.E), nk, alpha, ds, lds, 1, kc.data() + j0 * PANEL, d.Lk * PANEL,
             true, dq + i0 * q_stride(), q_stride());
}

void PanelGrads::add_dk(int64_t i0, int64_t mq, int64_t j0, int64_t nk, float alpha,
                        const float* ds, int64_t lds, float* dk) const {
  panel_gemm(nk, panel_count(d.E), mq, alpha, ds, 1, lds, qc.data() + i0 * PANEL, d.Lq * PANEL,
             true, dk + j0 * q_stride(), q_stride());
}

}  // namespace attnx::cpu
