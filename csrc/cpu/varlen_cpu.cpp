// Packed variable-length batches on the CPU: each sequence is a batch-1 call of the fused SDPA
// kernels (sdpa_cpu.cpp) on views of the packed tensors, with its band shifted to its
// bottom-right diagonal and its own dropout seed. No padding: a sequence costs what its own
// Lq x Lk costs, and the kernels spread each call's heads and query blocks over the threads.
#include "varlen_cpu.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "../dropout_hash.h"
#include "sdpa_cpu.h"

namespace attnx::cpu {
namespace {

using at::Tensor;

struct Sequence {
  int64_t q0, lq, k0, lk;
};

// The sequences of cu_seqlens_q / cu_seqlens_k (int32 prefix sums, validated by the caller
// and checked again here for direct callers of the op).
std::vector<Sequence> sequences(const char* op, const Tensor& cu_q, const Tensor& cu_k,
                                int64_t total_q, int64_t total_k) {
  TORCH_CHECK(cu_q.dim() == 1 && cu_k.dim() == 1 && cu_q.numel() == cu_k.numel() &&
                  cu_q.numel() >= 1,
              op, ": expected cu_seqlens_q and cu_seqlens_k of one shape (N + 1,)");
  TORCH_CHECK(cu_q.scalar_type() == at::kInt && cu_k.scalar_type() == at::kInt, op,
              ": expected int32 cu_seqlens");
  const Tensor cq = cu_q.to(at::kLong).contiguous(), ck = cu_k.to(at::kLong).contiguous();
  const int64_t* a = cq.data_ptr<int64_t>();
  const int64_t* b = ck.data_ptr<int64_t>();
  const int64_t n = cq.numel() - 1;
  TORCH_CHECK(a[0] == 0 && b[0] == 0 && a[n] == total_q && b[n] == total_k, op,
              ": expected cu_seqlens from 0 to the totals ", total_q, " and ", total_k);
  std::vector<Sequence> seqs(n);
  for (int64_t i = 0; i < n; ++i) {
    seqs[i] = {a[i], a[i + 1] - a[i], b[i], b[i + 1] - b[i]};
    TORCH_CHECK(seqs[i].lq >= 0 && seqs[i].lk >= 0, op, ": expected non-decreasing cu_seqlens");
  }
  return seqs;
}

// Rows [s.q0, s.q0 + s.lq) of a packed (total, H, D) tensor as a (1, H, L, D) view.
Tensor as_batch(const Tensor& packed, int64_t start, int64_t length) {
  return packed.narrow(0, start, length).transpose(0, 1).unsqueeze(0);
}

// The band of sequence s: the caller's, relative to the bottom-right diagonal, shifted by
// Lk - Lq (the validation keeps |window| within the longest sequences: no overflow).
std::pair<int64_t, int64_t> band_of(const Sequence& s, int64_t lo, int64_t hi) {
  const int64_t d = s.lk - s.lq;
  return {std::clamp(lo + d, -s.lq, s.lk), std::clamp(hi + d, -s.lq, s.lk)};
}

// Sequence n's dropout seed: attnx/_rng.py sequence_seed.
std::optional<Tensor> seed_of(const std::optional<Tensor>& seed, int64_t n) {
  if (!seed.has_value()) return std::nullopt;
  Tensor s = seed->to(at::kLong).contiguous().clone();
  int64_t* w = s.data_ptr<int64_t>();
  w[1] = int64_t(attnx::mix32(uint32_t((uint64_t(w[1]) + uint64_t(n) + 1) & 0xFFFFFFFFu)));
  return s;
}

// The modifiers of sequence n: its row of the slopes, its ALiBi aligned bottom-right.
ModArgs sequence_mods(const ModArgs& all, const Sequence& s, int64_t n) {
  ModArgs m = all;
  if (all.alibi.defined()) m.alibi = all.alibi.narrow(0, n, 1);
  m.alibi_offset = s.lk - s.lq;
  return m;
}

void check_packed(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op,
              ": expected 3-D q, k, v (total, heads, dim), got ", q.sizes(), ", ", k.sizes(),
              ", ", v.sizes());
  TORCH_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1) && k.size(2) == q.size(2), op,
              ": k or v has the wrong shape");
}

std::tuple<Tensor, Tensor> forward(const char* op, const Tensor& q, const Tensor& k,
                                   const Tensor& v, const Tensor& cu_seqlens_q,
                                   const Tensor& cu_seqlens_k, double scale, int64_t window_lo,
                                   int64_t window_hi, double dropout_p,
                                   const std::optional<Tensor>& seed, const ModArgs& mods) {
  check_packed(op, q, k, v);
  const auto seqs = sequences(op, cu_seqlens_q, cu_seqlens_k, q.size(0), k.size(0));
  const int64_t hq = q.size(1);
  const auto lse_type = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // Rows of sequences without keys keep these: zero output, lse -inf (the sink, with sinks).
  Tensor out = at::zeros({q.size(0), hq, v.size(2)}, q.options());
  // (a buffer of its own: to() and contiguous() return the sinks themselves for one float64
  // row, and the rows' lse were then written into the caller's sinks)
  Tensor lse = at::full({hq, q.size(0)}, -INFINITY, q.options().dtype(lse_type));
  if (mods.sinks_d.defined()) lse.copy_(mods.sinks_d.view({hq, 1}).expand({hq, q.size(0)}));
  for (size_t n = 0; n < seqs.size(); ++n) {
    const Sequence& s = seqs[n];
    if (s.lq == 0 || s.lk == 0) continue;
    const auto [lo, hi] = band_of(s, window_lo, window_hi);
    const Tensor qs = as_batch(q, s.q0, s.lq), ks = as_batch(k, s.k0, s.lk),
                 vs = as_batch(v, s.k0, s.lk);
    const auto [o, l] =
        mods.any() ? sdpa_fwd_modified(qs, ks, vs, scale, lo, hi, dropout_p,
                                       seed_of(seed, int64_t(n)), sequence_mods(mods, s, n))
                   : sdpa_fwd(qs, ks, vs, std::nullopt, scale, lo, hi, dropout_p,
                              seed_of(seed, int64_t(n)));
    out.narrow(0, s.q0, s.lq).copy_(o[0].transpose(0, 1));
    lse.narrow(1, s.q0, s.lq).copy_(l[0]);
  }
  return {out, lse};
}

struct Grads {
  Tensor dq, dk, dv, dsinks;
};

Grads backward(const char* op, const Tensor& grad_out, const Tensor& q, const Tensor& k,
               const Tensor& v, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
               const Tensor& out, const Tensor& lse, double scale, int64_t window_lo,
               int64_t window_hi, double dropout_p, const std::optional<Tensor>& seed,
               const std::optional<Tensor>& grad_lse, const ModArgs& mods, bool sinks_grad) {
  check_packed(op, q, k, v);
  TORCH_CHECK(grad_out.sizes() == out.sizes() && out.dim() == 3 && out.size(0) == q.size(0) &&
                  out.size(1) == q.size(1) && out.size(2) == v.size(2),
              op, ": expected grad_out and out of shape (total_q, Hq, Ev)");
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == q.size(1) && lse.size(1) == q.size(0), op,
              ": expected lse of shape (Hq, total_q)");
  TORCH_CHECK(!grad_lse.has_value() || grad_lse->sizes() == lse.sizes(), op,
              ": expected grad_lse of lse's shape");
  TORCH_CHECK(!sinks_grad || mods.sinks_d.defined(), op, ": sinks_grad needs sinks");
  const auto seqs = sequences(op, cu_seqlens_q, cu_seqlens_k, q.size(0), k.size(0));
  Grads g{at::zeros(q.sizes(), q.options()), at::zeros(k.sizes(), k.options()),
          at::zeros(v.sizes(), v.options()), Tensor()};
  if (sinks_grad) g.dsinks = at::zeros({q.size(1)}, q.options().dtype(at::kDouble));
  for (size_t n = 0; n < seqs.size(); ++n) {
    const Sequence& s = seqs[n];
    if (s.lq == 0) continue;
    std::optional<Tensor> gl;
    if (grad_lse.has_value()) gl = grad_lse->narrow(1, s.q0, s.lq).unsqueeze(0);
    if (s.lk == 0) {  // lse = the sink, out = 0: d lse / d sink = 1 on every row
      if (sinks_grad && gl.has_value()) g.dsinks += (*gl)[0].to(at::kDouble).sum(1);
      continue;
    }
    const auto [lo, hi] = band_of(s, window_lo, window_hi);
    const Tensor go = as_batch(grad_out, s.q0, s.lq), qs = as_batch(q, s.q0, s.lq),
                 ks = as_batch(k, s.k0, s.lk), vs = as_batch(v, s.k0, s.lk),
                 os = as_batch(out, s.q0, s.lq), ls = lse.narrow(1, s.q0, s.lq).unsqueeze(0);
    Tensor gq, gk, gv;
    if (mods.any()) {
      Tensor gs;
      std::tie(gq, gk, gv, gs) =
          sdpa_bwd_modified(go, qs, ks, vs, os, ls, scale, lo, hi, dropout_p,
                            seed_of(seed, int64_t(n)), gl, sequence_mods(mods, s, n), sinks_grad);
      if (sinks_grad) g.dsinks += gs;
    } else {
      std::tie(gq, gk, gv, std::ignore) =
          sdpa_bwd(go, qs, ks, vs, std::nullopt, os, ls, scale, lo, hi, dropout_p,
                   seed_of(seed, int64_t(n)), false, gl);
    }
    g.dq.narrow(0, s.q0, s.lq).copy_(gq[0].transpose(0, 1));
    g.dk.narrow(0, s.k0, s.lk).copy_(gk[0].transpose(0, 1));
    g.dv.narrow(0, s.k0, s.lk).copy_(gv[0].transpose(0, 1));
  }
  return g;
}

}  // namespace

std::tuple<Tensor, Tensor> varlen_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                      double scale, int64_t window_lo, int64_t window_hi,
                                      double dropout_p, const std::optional<Tensor>& seed) {
  return forward("attnx::varlen_fwd", q, k, v, cu_seqlens_q, cu_seqlens_k, scale, window_lo,
                 window_hi, dropout_p, seed, ModArgs{});
}

std::tuple<Tensor, Tensor> varlen_mod_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                          double scale, int64_t window_lo, int64_t window_hi,
                                          double dropout_p, const std::optional<Tensor>& seed,
                                          double softcap,
                                          const std::optional<Tensor>& alibi_slopes,
                                          const std::optional<Tensor>& sinks) {
  const char* op = "attnx::varlen_mod_fwd";
  const ModArgs mods = mod_args(op, softcap, alibi_slopes, sinks, cu_seqlens_q.numel() - 1,
                                q.dim() == 3 ? q.size(1) : -1);
  return forward(op, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, window_lo, window_hi,
                 dropout_p, seed, mods);
}

std::tuple<Tensor, Tensor, Tensor> varlen_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, const Tensor& out, const Tensor& lse,
    double scale, int64_t window_lo, int64_t window_hi, double dropout_p,
    const std::optional<Tensor>& seed, const std::optional<Tensor>& grad_lse) {
  const Grads g = backward("attnx::varlen_bwd", grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k,
                           out, lse, scale, window_lo, window_hi, dropout_p, seed, grad_lse,
                           ModArgs{}, false);
  return {g.dq, g.dk, g.dv};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> varlen_mod_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, const Tensor& out, const Tensor& lse,
    double scale, int64_t window_lo, int64_t window_hi, double dropout_p,
    const std::optional<Tensor>& seed, const std::optional<Tensor>& grad_lse, double softcap,
    const std::optional<Tensor>& alibi_slopes, const std::optional<Tensor>& sinks,
    bool sinks_grad) {
  const char* op = "attnx::varlen_mod_bwd";
  const ModArgs mods = mod_args(op, softcap, alibi_slopes, sinks, cu_seqlens_q.numel() - 1,
                                q.dim() == 3 ? q.size(1) : -1);
  const Grads g = backward(op, grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, scale,
                           window_lo, window_hi, dropout_p, seed, grad_lse, mods, sinks_grad);
  return {g.dq, g.dk, g.dv,
          sinks_grad ? g.dsinks.to(sinks->scalar_type()) : at::empty({0}, q.options())};
}

}  // namespace attnx::cpu
