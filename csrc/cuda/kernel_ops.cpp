// The attnx ops on the CUDA kernels (kernel_ops.h): checks, launch parameters and outputs.
#include "kernel_ops.h"

#include "decode.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include <c10/util/accumulate.h>

namespace attnx {
namespace cuda {
namespace {

using at::Tensor;

DType dtype_of(const Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              "attnx cuda kernels take float16 or bfloat16 tensors, got ", t.scalar_type());
  return t.scalar_type() == at::kHalf ? DType::Half : DType::BFloat16;
}

// A 4-D tensor on `like`'s device, of its dtype, with a contiguous last dim (copied only if it
// is not), as the kernels will read it.
Tensor rows(const Target& target, const Tensor& t, const Tensor& like, const char* name) {
  TORCH_CHECK(t.device().type() == target.device_type() && t.device() == like.device(), name,
              ": expected a tensor on ", like.device(), ", got ", t.device());
  TORCH_CHECK(t.dim() == 4, name, ": expected 4 dims, got ", t.dim());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, ": expected dtype ",
              like.scalar_type(), ", got ", t.scalar_type());
  return target.input(t.size(3) <= 1 || t.stride(3) == 1 ? t : t.contiguous());
}

Strides4 strides(const Tensor& t) {
  const auto addr = reinterpret_cast<uintptr_t>(t.data_ptr());
  const bool vec16 = addr % 16 == 0 && t.size(3) % 8 == 0 && t.stride(0) % 8 == 0 &&
                     t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0;
  return {t.stride(0), t.stride(1), t.stride(2), vec16};
}

// float32_ok: whether the kernels read a float32 mask with half q (MaskKind::Additive32): the
// additive ones do; the SDPA ones read a float mask as q's dtype only (a third instantiation of
// their masked tiles took up to 35 more registers in their variants' cubins: not taken
// unmeasured on a GPU; the triton backend serves those calls).
MaskView mask_view(const Target& target, const OptTensor& mask, Tensor& held, const Tensor& q,
                   int64_t H, int64_t Lq, int64_t Lk, bool float32_ok) {
  MaskView m;
  if (!mask.has_value() || !mask->defined()) return m;
  const Tensor& t = *mask;
  TORCH_CHECK(t.device() == q.device(), "mask: expected device ", q.device(), ", got ", t.device());
  TORCH_CHECK(t.dim() == 4 && t.size(0) == q.size(0) && t.size(1) == H && t.size(2) == Lq &&
                  t.size(3) == Lk,
              "mask: expected shape (", q.size(0), ", ", H, ", ", Lq, ", ", Lk, "), got ", t.sizes());
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kBool || dt == q.scalar_type() || (float32_ok && dt == at::kFloat),
              "mask: expected bool", float32_ok ? ", float32" : "", " or ", q.scalar_type(),
              ", got ", dt);
  held = target.input(t);
  m.ptr = held.data_ptr();
  m.kind = dt == at::kBool ? MaskKind::Bool
           : dt == q.scalar_type() ? MaskKind::Additive
                                   : MaskKind::Additive32;
  m.b = held.stride(0);
  m.h = held.stride(1);
  m.i = held.stride(2);
  m.j = held.stride(3);
  return m;
}

// A float mask's gradient is of the mask's dtype (additive attention's kernels).
at::TensorOptions mask_grad_options(const MaskView& m, const Tensor& q) {
  return q.options().dtype(m.kind == MaskKind::Additive32 ? at::kFloat : q.scalar_type());
}

Dropout dropout(double p, const OptTensor& seed) {
  Dropout d;
  if (p <= 0.0) return d;
  TORCH_CHECK(p < 1.0, "dropout_p: expected < 1, got ", p);
  TORCH_CHECK(seed.has_value() && seed->numel() == 2, "seed: expected an int64 (2,) tensor");
  const Tensor s = seed->to(at::kCPU, at::kLong).contiguous();
  d.on = true;
  d.seed0 = static_cast<uint32_t>(s.data_ptr<int64_t>()[0]);
  d.seed1 = static_cast<uint32_t>(s.data_ptr<int64_t>()[1]);
  // threshold = min(floor(p * 2**32), 2**32 - 1), as attnx/_rng.py computes it.
  const double t = std::floor(p * 4294967296.0);
  d.threshold = t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
  d.keep_scale = static_cast<float>(1.0 / (1.0 - p));
  return d;
}

// The kernels hold sizes in int and index the grid's y and z dims by head and batch: checked on
// the int64 sizes, before they are narrowed.
void check_grid(int64_t length, int64_t heads, int64_t batch) {
  TORCH_CHECK(length <= INT_MAX && heads <= 65535 && batch <= 65535,
              "attnx cuda kernels: sequence lengths below 2^31 and at most 65535 heads and ",
              "batches, got length ", length, ", ", heads, " heads and ", batch, " batches");
}

// A gradient in its input's dtype, contiguous whatever the input's strides: what the fake
// kernels (attnx._ops.contiguous_grads) promise and the CPU and Triton kernels return.
Tensor grad_for(const Tensor& grad, const Tensor& input) { return grad.to(input.scalar_type()); }

// The tensors an SDPA launch reads, kept alive while it runs.
struct SdpaInputs {
  Tensor q, k, v, mask;
};

// The tensors a launch's score modifiers read, kept alive while it runs.
struct ModInputs {
  Tensor alibi, sinks;
};

// The score modifiers' arguments (csrc/ops.cpp: softcap 0 for none, alibi_slopes float32
// (B, Hq), sinks (Hq)) of a call with q, checked, as the fp32 buffers the kernels read (held
// by `in`).
ScoreMods score_mods(const Target& target, ModInputs& in, const Tensor& q, double softcap,
                     const OptTensor& alibi, const OptTensor& sinks, int64_t B, int64_t Hq) {
  ScoreMods m;
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0, "softcap: expected >= 0 (0: none), got ",
              softcap);
  m.softcap = static_cast<float>(softcap);
  if (alibi.has_value()) {
    const Tensor& a = *alibi;
    TORCH_CHECK(a.device() == q.device() && a.scalar_type() == at::kFloat && a.dim() == 2 &&
                    a.size(0) == B && a.size(1) == Hq,
                "alibi_slopes: expected float32 (", B, ", ", Hq, ") on ", q.device(), ", got ",
                a.scalar_type(), " ", a.sizes(), " on ", a.device());
    in.alibi = target.input(a.contiguous());
    m.alibi = in.alibi.data_ptr<float>();
  }
  if (sinks.has_value()) {
    const Tensor& t = *sinks;
    TORCH_CHECK(t.device() == q.device() && t.is_floating_point() && t.dim() == 1 &&
                    t.size(0) == Hq,
                "sinks: expected a floating-point (", Hq, ",) tensor on ", q.device(),
                ", got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
    in.sinks = target.input(t.to(at::kFloat).contiguous());
    m.sinks = in.sinks.data_ptr<float>();
  }
  return m;
}

SdpaParams sdpa_params(const Target& target, SdpaInputs& in, const Tensor& q_in,
                       const Tensor& k_in, const Tensor& v_in, const OptTensor& mask,
                       double scale, int64_t lo, int64_t hi, double dropout_p,
                       const OptTensor& seed) {
  in.q = rows(target, q_in, q_in, "q");
  in.k = rows(target, k_in, q_in, "k");
  in.v = rows(target, v_in, q_in, "v");
  const Tensor &q = in.q, &k = in.k, &v = in.v;
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), E = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), Ev = v.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == Lk &&
                  k.size(3) == E,
              "sdpa: inconsistent shapes q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(Hkv > 0 ? Hq % Hkv == 0 : Hq == 0, "sdpa: Hq (", Hq,
              ") must be a multiple of Hkv (", Hkv, ")");
  check_grid(Lq, Hq, B);
  check_grid(Lk, Hkv, B);  // the backward's grid
  SdpaParams p{};
  p.dtype = dtype_of(q);
  p.B = int(B);
  p.Hq = int(Hq);
  p.Lq = int(Lq);
  p.Hkv = int(Hkv);
  p.Lk = int(Lk);
  TORCH_CHECK(sdpa_fwd_family_of(int(std::min<int64_t>(std::max(E, Ev), INT_MAX))) != 0,
              "attnx cuda sdpa: head dims up to 256, got (E, Ev) = (", E, ", ", Ev, ")");
  p.E = int(E);
  p.Ev = int(Ev);
  p.scale = static_cast<float>(scale);
  // [-Lq, Lk] admits the same pairs and keeps i + lo, i + hi from overflowing in the kernels
  p.window_lo = std::clamp<int64_t>(lo, -Lq, Lk);
  p.window_hi = std::clamp<int64_t>(hi, -Lq, Lk);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.sq = strides(q);
  p.sk = strides(k);
  p.sv = strides(v);
  p.mask = mask_view(target, mask, in.mask, q, Hq, Lq, Lk, false);
  p.drop = dropout(dropout_p, seed);
  return p;
}

// A backward reads grad_out, out (B, H, Lq, Ev) and lse (B, H, Lq) whole: a direct caller's
// other shapes or devices would be read out of bounds.
void check_saved(const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& q,
                 c10::IntArrayRef out_shape) {
  TORCH_CHECK(dout.sizes() == out_shape && out.sizes() == out_shape, "grad_out, out: expected ",
              "shape ", out_shape, ", got ", dout.sizes(), " and ", out.sizes());
  TORCH_CHECK(lse.sizes() == out_shape.slice(0, 3), "lse: expected shape ",
              out_shape.slice(0, 3), ", got ", lse.sizes());
  TORCH_CHECK(dout.device() == q.device() && out.device() == q.device() &&
                  lse.device() == q.device(),
              "grad_out, out, lse: expected q's device ", q.device(), ", got ", dout.device(),
              ", ", out.device(), " and ", lse.device());
}

// D_i = rowsum(dO * O) of the softmax backward, less the lse gradient (csrc/ops.cpp).
Tensor softmax_delta(const Tensor& dout, const Tensor& out, const Tensor& lse,
                     const OptTensor& grad_lse) {
  Tensor d = (dout.to(at::kFloat) * out.to(at::kFloat)).sum(-1);
  if (grad_lse.has_value()) {
    TORCH_CHECK(grad_lse->sizes() == lse.sizes() && grad_lse->device() == lse.device(),
                "grad_lse: expected lse's shape ", lse.sizes(), " on its device, got ",
                grad_lse->sizes());
    d = d - grad_lse->to(at::kFloat);
  }
  return d.contiguous();
}

// The inputs every backward reads besides q, k, v: grad_out in the input dtype, lse and delta.
struct Saved {
  Tensor dout, lse, delta;
};

Saved saved(const Tensor& grad_out, const Tensor& q, const Tensor& out, const Tensor& lse,
            const OptTensor& grad_lse, c10::IntArrayRef out_shape) {
  Tensor dout = grad_out.to(q.scalar_type()).contiguous();
  check_saved(dout, out, lse, q, out_shape);
  return {dout, lse.to(at::kFloat).contiguous(), softmax_delta(dout, out, lse, grad_lse)};
}

// The buffers the kernels read, dout 16-byte aligned for the vector loads.
Saved read_by_kernels(const Target& target, const Saved& s) {
  const bool aligned = reinterpret_cast<uintptr_t>(s.dout.data_ptr()) % 16 == 0;
  return {target.input(aligned ? s.dout : s.dout.clone()), target.input(s.lse),
          target.input(s.delta)};
}

cudaError_t run_sdpa_fwd(const SdpaParams& p, cudaStream_t stream) {
  switch (sdpa_fwd_family_of(std::max(p.E, p.Ev))) {  // sdpa_params checked E, Ev <= 256
    case 32: return sdpa_fwd_family<32>(p, stream);
    case 64: return sdpa_fwd_family<64>(p, stream);
    case 96: return sdpa_fwd_family<96>(p, stream);
    case 128: return sdpa_fwd_family<128>(p, stream);
    case 160: return sdpa_fwd_family<160>(p, stream);
    case 192: return sdpa_fwd_family<192>(p, stream);
    default: return sdpa_fwd_family<256>(p, stream);
  }
}

// R_i of the rows of huge lse (common.cuh), 1 on the others: the forward kernel's row-sums
// mode. The backward kernels divide exp(s - lse) by it, which gives those rows'
// probabilities back.
Tensor huge_row_sums(const Target& target, SdpaParams p, const Tensor& lse) {
  const Tensor r = target.empty(lse.sizes(), lse.options());
  p.lse = lse.data_ptr<float>();
  p.row_sums = r.data_ptr<float>();
  target.check(run_sdpa_fwd(p, target.stream()));
  return r;
}

cudaError_t run_sdpa_bwd(const SdpaParams& p, cudaStream_t stream) {
  for (int D : kSdpaBwdFamilies) {
    if (p.E > D || p.Ev > D) continue;
    switch (D) {
      case 32: return sdpa_bwd_family<32>(p, stream);
      case 64: return sdpa_bwd_family<64>(p, stream);
      case 96: return sdpa_bwd_family<96>(p, stream);
      case 128: return sdpa_bwd_family<128>(p, stream);
      case 160: return sdpa_bwd_family<160>(p, stream);
      case 192: return sdpa_bwd_family<192>(p, stream);
      default: return sdpa_bwd_family<256>(p, stream);
    }
  }
  TORCH_CHECK(false, "attnx cuda sdpa backward: head dims up to 256, got (E, Ev) = (", p.E, ", ",
              p.Ev, ")");
  return cudaErrorInvalidValue;
}

// The gradients the SDPA backward kernels produce: dq (fp32) and dk, dv in the layouts of
// SdpaParams (batched or packed), dmask when asked for, and dsinks (fp32, (Hq,)) when asked for.
struct Grads {
  Tensor dq_acc, dk, dv, dmask, dsinks;
};

// The backward of the launch parameters p (inputs, band, dropout and modifiers set) on grad_out
// and out (contiguous, q's dtype, p's query-row layout) and lse, grad_lse of shape `rows`
// ((B, Hq, Lq) or, packed, (Hq, total_q)); `key_rows` is dk's and dv's ((B, Hkv, Lk) or (Hkv,
// total_k)). Runs the row sums of huge-lse rows, the delta pre-pass and the key-block kernels.
// sinks32 (fp32 (Hq,), held by the caller) asks for dsinks; head_dim is the head's dim in rows.
Grads backward(const Target& target, SdpaParams& p, const Tensor& q, Tensor dout, const Tensor& o,
               const Tensor& lse, const OptTensor& grad_lse, at::IntArrayRef rows,
               at::IntArrayRef key_rows, bool want_dmask, const Tensor& sinks32, int head_dim) {
  // dQ sums over the key blocks by float32 atomics (sdpa_bwd.cuh): under
  // torch.use_deterministic_algorithms, torch's error (or warning, warn_only) as for its own
  // nondeterministic kernels
  at::globalContext().alertNotDeterministic(
      "attnx's cuda SDPA/varlen backward (dq is summed by float32 atomics)");
  const auto opts = q.options();
  const auto f32 = opts.dtype(at::kFloat);
  TORCH_CHECK(lse.sizes() == rows && lse.device() == q.device(), "lse: expected shape ", rows,
              " on q's device, got ", lse.sizes(), " on ", lse.device());
  if (reinterpret_cast<uintptr_t>(dout.data_ptr()) % 16 != 0) dout = dout.clone();  // vector loads
  const Tensor lse32 = target.input(lse.to(at::kFloat).contiguous());
  Tensor glse;
  if (grad_lse.has_value()) {
    TORCH_CHECK(grad_lse->sizes() == lse.sizes() && grad_lse->device() == lse.device(),
                "grad_lse: expected lse's shape ", lse.sizes(), " on its device, got ",
                grad_lse->sizes());
    glse = target.input(grad_lse->to(at::kFloat).contiguous());
  }
  const Tensor row_sums = huge_row_sums(target, p, lse32);
  const Tensor dout_in = target.input(dout), o_in = target.input(o);
  auto with = [](at::IntArrayRef head, int64_t last) {
    std::vector<int64_t> sizes(head.begin(), head.end());
    sizes.push_back(last);
    return sizes;
  };
  Grads g;
  Tensor delta = target.empty(rows, f32);
  // The overflow flags of the bf16 backward (launch.h) and dq_acc 16 bytes on (its pair atomics
  // need 8-byte alignment; its end stays at the harness's guard page): zeroed by one fill.
  const std::vector<int64_t> dq_shape = with(rows, p.E);
  const Tensor flag_and_dq = target.zeros({4 + c10::multiply_integers(dq_shape)}, f32);
  const Tensor overflowed = flag_and_dq.narrow(0, 0, 1);
  g.dq_acc = flag_and_dq.narrow(0, 4, flag_and_dq.size(0) - 4).view(dq_shape);
  g.dk = target.empty(with(key_rows, p.E), opts);
  g.dv = target.empty(with(key_rows, p.Ev), opts);
  g.dmask = want_dmask ? target.zeros({p.B, p.Hq, p.Lq, p.Lk}, opts) : q.new_empty({0});
  p.out = const_cast<void*>(o_in.data_ptr());
  p.dout = dout_in.data_ptr();
  p.grad_lse = glse.defined() ? glse.data_ptr<float>() : nullptr;
  p.lse = lse32.data_ptr<float>();
  p.row_sums = row_sums.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.dq_acc = g.dq_acc.data_ptr<float>();
  p.dk = g.dk.data_ptr();
  p.dv = g.dv.data_ptr();
  p.dmask = want_dmask ? g.dmask.data_ptr() : nullptr;
  p.overflowed = overflowed.data_ptr<float>();
  p.dq_nonfinite = p.overflowed + 1;
  // The float64 rerun (sdpa_bwd_rerun.cu) stands by for every dtype: bf16's values and scores
  // may pass float's range, fp16's scores at scales near the bound, and fp16's dS, cast to half
  // for the dS K and dS^T Q products, past 65504 (values ~3e4: dQ and dK NaN where ~200).
  // Its rows' max, 1 / sum and delta (launch.h), one after the other:
  const int64_t n_rows = c10::multiply_integers(rows);
  const Tensor rerun_rows = target.empty({3 * n_rows}, f32.dtype(at::kDouble));
  p.rerun_max = rerun_rows.data_ptr<double>();
  p.rerun_inv_r = p.rerun_max + n_rows;
  p.rerun_delta = p.rerun_inv_r + n_rows;
  const bool rerun_sinks = sinks32.defined();
  const Tensor dsinks64 = rerun_sinks ? target.zeros({p.Hq}, f32.dtype(at::kDouble)) : Tensor();
  p.dsinks = rerun_sinks ? dsinks64.data_ptr<double>() : nullptr;
  target.check(sdpa_bwd_delta(p, target.stream()));
  target.check(run_sdpa_bwd(p, target.stream()));
  target.check(sdpa_bwd_rerun(p, target.stream()));
  if (sinks32.defined()) {
    // d lse_i / d sink = exp(sink - lse_i) / R_i (the sink's probability; R_i the row sum of a
    // huge-lse row, 1 elsewhere), and the sink's value is 0: its score gradient is that
    // probability times (0 - delta_i), summed over every row of the head.
    std::vector<int64_t> view(rows.size(), 1), dims;
    view[head_dim] = p.Hq;
    for (int64_t d = 0; d < int64_t(rows.size()); ++d)
      if (d != head_dim) dims.push_back(d);
    // (0 under a sink of -inf, also on rows that admitted no key: lse -inf there too)
    const Tensor sink = sinks32.view(view);
    const Tensor p_sink = at::where(sink == -INFINITY, 0.0, at::exp(sink - lse32));
    g.dsinks = (-(p_sink / row_sums * delta)).sum(at::IntArrayRef(dims));
    // after the rerun (the flag set, read on the device: no synchronisation), its float64 sums
    if (rerun_sinks)
      g.dsinks = at::where(overflowed != 0, dsinks64.to(at::kFloat), g.dsinks);
  }
  return g;
}

// The prefix sums of a packed batch, checked (int32, 1-D, from 0, non-decreasing, ending at
// `total`) as a direct caller could pass them, as host values: the kernels trust them.
std::vector<int> prefix_sums(const Tensor& cu, const Tensor& q, int64_t total, const char* name) {
  TORCH_CHECK(cu.device() == q.device() && cu.scalar_type() == at::kInt && cu.dim() == 1 &&
                  cu.numel() >= 1,
              name, ": expected int32 (N + 1,) on ", q.device(), ", got ", cu.scalar_type(), " ",
              cu.sizes(), " on ", cu.device());
  const Tensor host = cu.to(at::kCPU).contiguous();
  const int* v = host.data_ptr<int>();
  std::vector<int> values(v, v + host.numel());
  TORCH_CHECK(values.front() == 0 && values.back() == total, name, ": expected prefix sums from 0 ",
              "to ", total, ", got ", values.front(), " to ", values.back());
  for (size_t n = 1; n < values.size(); ++n)
    TORCH_CHECK(values[n] >= values[n - 1], name, ": expected non-decreasing values, got ",
                values[n - 1], " then ", values[n]);
  return values;
}

// The tensors a packed launch reads besides q, k, v and the modifiers', kept alive while it runs.
struct VarlenInputs {
  SdpaInputs sdpa;
  Tensor cu_q, cu_k;
};

// Launch parameters of a packed batch: q (total_q, Hq, E), k (total_k, Hkv, E), v (total_k,
// Hkv, Ev) read as (1, H, total, .) views, one grid z index per sequence (SdpaParams::cu_q).
SdpaParams varlen_params(const Target& target, VarlenInputs& in, const Tensor& q,
                         const Tensor& k, const Tensor& v, const Tensor& cu_q, const Tensor& cu_k,
                         double scale, int64_t lo, int64_t hi, double dropout_p,
                         const OptTensor& seed) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "varlen: expected q, k, v of 3 ",
              "dims (total, heads, dim), got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const std::vector<int> sq = prefix_sums(cu_q, q, q.size(0), "cu_seqlens_q");
  const std::vector<int> sk = prefix_sums(cu_k, q, k.size(0), "cu_seqlens_k");
  TORCH_CHECK(sq.size() == sk.size(), "cu_seqlens_k: expected ", sq.size(), " entries (as ",
              "cu_seqlens_q), got ", sk.size());
  int max_q = 0, max_k = 0;
  for (size_t n = 0; n + 1 < sq.size(); ++n) {
    max_q = std::max(max_q, sq[n + 1] - sq[n]);
    max_k = std::max(max_k, sk[n + 1] - sk[n]);
  }
  auto rows4 = [](const Tensor& t) { return t.unsqueeze(0).transpose(1, 2); };
  SdpaParams p = sdpa_params(target, in.sdpa, rows4(q), rows4(k), rows4(v), std::nullopt, scale,
                             lo, hi, dropout_p, seed);
  const int64_t N = int64_t(sq.size()) - 1;
  check_grid(max_q, p.Hq, N);
  p.B = int(N);
  p.Lq = max_q;
  p.Lk = max_k;
  p.total_q = q.size(0);
  p.total_k = k.size(0);
  p.sq.b = p.sk.b = p.sv.b = 0;  // sequences are offsets along the rows
  // relative to each sequence's bottom-right diagonal, every j - (i + d) of a sequence lies in
  // [-(Lk - 1), Lq - 1], within +-(Lk + Lq) of the longest: the same pairs, no overflow
  const int64_t bound = int64_t(max_q) + max_k;
  p.window_lo = std::clamp<int64_t>(lo, -bound, bound);
  p.window_hi = std::clamp<int64_t>(hi, -bound, bound);
  in.cu_q = target.input(cu_q.contiguous());
  in.cu_k = target.input(cu_k.contiguous());
  p.cu_q = in.cu_q.data_ptr<int>();
  p.cu_k = in.cu_k.data_ptr<int>();
  return p;
}

struct AdditiveInputs {
  Tensor q, k, value, v, mask;
};

AdditiveParams additive_params(const Target& target, AdditiveInputs& in, const Tensor& q_in,
                               const Tensor& k_in, const Tensor& value_in, const Tensor& v_in,
                               const OptTensor& mask, int64_t lo, int64_t hi, double dropout_p,
                               const OptTensor& seed) {
  in.q = rows(target, q_in, q_in, "q");
  in.k = rows(target, k_in, q_in, "k");
  in.value = rows(target, value_in, q_in, "value");
  const Tensor &q = in.q, &k = in.k, &value = in.value;
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), A = q.size(3);
  const int64_t Lk = k.size(2), Ev = value.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(1) == H && k.size(3) == A && value.size(0) == B &&
                  value.size(1) == H && value.size(2) == Lk,
              "additive: inconsistent shapes q ", q.sizes(), ", k ", k.sizes(), ", value ",
              value.sizes());
  // float32 v: one shared by the heads (attnx/_validate.py additive_call), widened from q's
  // dtype, so read as q's dtype exactly (a float32 v of other values, from a direct call of the
  // op, is rounded to it); its gradient comes back in float32 (additive_bwd's grad_for)
  TORCH_CHECK(v_in.device() == q.device() &&
                  (v_in.scalar_type() == q.scalar_type() || v_in.scalar_type() == at::kFloat) &&
                  v_in.dim() == 2 && v_in.size(0) == H && v_in.size(1) == A,
              "v: expected (", H, ", ", A, ") of q's dtype or float32 and q's device, got ",
              v_in.scalar_type(), " ", v_in.sizes());
  check_grid(Lq, H, B);
  TORCH_CHECK(Lk <= INT_MAX && A <= INT_MAX && Ev <= INT_MAX,
              "attnx cuda additive: sizes below 2^31, got Lk ", Lk, ", A ", A, ", Ev ", Ev);
  TORCH_CHECK(additive_smem_bytes(int(Ev)) <= target.smem_optin(), "attnx cuda additive: value ",
              "dim ", Ev, " needs more shared memory than this device has");
  in.v = target.input(v_in.to(q.scalar_type()));
  AdditiveParams p{};
  p.dtype = dtype_of(q);
  p.B = int(B);
  p.H = int(H);
  p.Lq = int(Lq);
  p.A = int(A);
  p.Lk = int(Lk);
  p.Ev = int(Ev);
  // [-Lq, Lk] admits the same pairs and keeps i + lo, i + hi from overflowing in the kernels
  p.window_lo = std::clamp<int64_t>(lo, -Lq, Lk);
  p.window_hi = std::clamp<int64_t>(hi, -Lq, Lk);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.value = value.data_ptr();
  p.v = in.v.data_ptr();
  p.sq = strides(q);
  p.sk = strides(k);
  p.svalue = strides(value);
  p.vh = in.v.stride(0);
  p.va = in.v.stride(1);
  p.mask = mask_view(target, mask, in.mask, q, H, Lq, Lk, true);
  p.drop = dropout(dropout_p, seed);
  return p;
}

}  // namespace

std::tuple<Tensor, Tensor> sdpa_fwd(const Target& target, const Tensor& q_in, const Tensor& k_in,
                                    const Tensor& v_in, const OptTensor& mask, double scale,
                                    int64_t window_lo, int64_t window_hi, double dropout_p,
                                    const OptTensor& seed, double softcap,
                                    const OptTensor& alibi_slopes, const OptTensor& sinks) {
  SdpaInputs in;
  SdpaParams p =
      sdpa_params(target, in, q_in, k_in, v_in, mask, scale, window_lo, window_hi, dropout_p, seed);
  ModInputs mods;
  p.mods = score_mods(target, mods, in.q, softcap, alibi_slopes, sinks, p.B, p.Hq);
  const auto opts = in.q.options();
  Tensor out = target.empty({p.B, p.Hq, p.Lq, p.Ev}, opts);
  Tensor lse = target.empty({p.B, p.Hq, p.Lq}, opts.dtype(at::kFloat));
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  target.check(run_sdpa_fwd(p, target.stream()));
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> sdpa_mod_bwd(
    const Target& target, const Tensor& grad_out, const Tensor& q_in, const Tensor& k_in,
    const Tensor& v_in, const OptTensor& mask, const Tensor& out, const Tensor& lse, double scale,
    int64_t window_lo, int64_t window_hi, double dropout_p, const OptTensor& seed, bool mask_grad,
    const OptTensor& grad_lse, double softcap, const OptTensor& alibi_slopes,
    const OptTensor& sinks, bool sinks_grad) {
  SdpaInputs in;
  SdpaParams p =
      sdpa_params(target, in, q_in, k_in, v_in, mask, scale, window_lo, window_hi, dropout_p, seed);
  ModInputs mods;
  p.mods = score_mods(target, mods, in.q, softcap, alibi_slopes, sinks, p.B, p.Hq);
  TORCH_CHECK(!sinks_grad || sinks.has_value(), "sinks_grad: needs sinks");
  // grad_out and out in the input dtype (the delta pre-pass reads both, the kernels grad_out)
  const Tensor dout = grad_out.to(in.q.scalar_type()).contiguous();
  const Tensor o = out.to(in.q.scalar_type()).contiguous();
  check_saved(dout, o, lse, in.q, {p.B, p.Hq, p.Lq, p.Ev});
  const bool want_dmask = mask_grad && p.mask.kind == MaskKind::Additive;
  Grads g = backward(target, p, in.q, dout, o, lse, grad_lse, {p.B, p.Hq, p.Lq},
                     {p.B, p.Hkv, p.Lk}, want_dmask, sinks_grad ? mods.sinks : Tensor(), 1);
  const Tensor dsinks = sinks_grad ? g.dsinks.to(sinks->scalar_type()) : in.q.new_empty({0});
  return {grad_for(g.dq_acc, q_in), grad_for(g.dk, k_in), grad_for(g.dv, v_in), g.dmask, dsinks};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> sdpa_bwd(
    const Target& target, const Tensor& grad_out, const Tensor& q, const Tensor& k,
    const Tensor& v, const OptTensor& mask, const Tensor& out, const Tensor& lse, double scale,
    int64_t window_lo, int64_t window_hi, double dropout_p, const OptTensor& seed, bool mask_grad,
    const OptTensor& grad_lse) {
  auto [dq, dk, dv, dmask, dsinks] =
      sdpa_mod_bwd(target, grad_out, q, k, v, mask, out, lse, scale, window_lo, window_hi,
                   dropout_p, seed, mask_grad, grad_lse, 0.0, std::nullopt, std::nullopt, false);
  return {dq, dk, dv, dmask};
}

std::tuple<Tensor, Tensor, Tensor> additive_fwd(const Target& target, const Tensor& q_in,
                                                const Tensor& k_in, const Tensor& value_in,
                                                const Tensor& v, const OptTensor& mask,
                                                int64_t window_lo, int64_t window_hi,
                                                double dropout_p, const OptTensor& seed,
                                                bool return_weights) {
  AdditiveInputs in;
  AdditiveParams p = additive_params(target, in, q_in, k_in, value_in, v, mask, window_lo,
                                     window_hi, dropout_p, seed);
  const auto opts = in.q.options();
  Tensor out = target.empty({p.B, p.H, p.Lq, p.Ev}, opts);
  Tensor lse = target.empty({p.B, p.H, p.Lq}, opts.dtype(at::kFloat));
  Tensor weights =
      return_weights ? target.zeros({p.B, p.H, p.Lq, p.Lk}, opts.dtype(at::kFloat))
                     : in.q.new_empty({0});
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.weights = return_weights ? weights.data_ptr<float>() : nullptr;
  const Tensor weight_max =
      return_weights ? target.empty({p.B, p.H, p.Lq, additive_key_tiles(p.Lk)}, opts.dtype(at::kFloat))
                     : Tensor();
  p.weight_max = return_weights ? weight_max.data_ptr<float>() : nullptr;
  target.check(launch_additive_fwd(p, target.stream()));
  return {out, lse, weights};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> additive_bwd(
    const Target& target, const Tensor& grad_out, const Tensor& q_in, const Tensor& k_in,
    const Tensor& value_in, const Tensor& v, const OptTensor& mask, const Tensor& out,
    const Tensor& lse, int64_t window_lo, int64_t window_hi, double dropout_p,
    const OptTensor& seed, bool mask_grad, const OptTensor& grad_lse,
    const OptTensor& grad_weights) {
  AdditiveInputs in;
  AdditiveParams p = additive_params(target, in, q_in, k_in, value_in, v, mask, window_lo,
                                     window_hi, dropout_p, seed);
  at::globalContext().alertNotDeterministic(
      "attnx's cuda additive backward (dk and dvalue are summed by float32 atomics)");
  const Saved s =
      read_by_kernels(target, saved(grad_out, in.q, out, lse, grad_lse, {p.B, p.H, p.Lq, p.Ev}));
  const auto f32 = in.q.options().dtype(at::kFloat);
  Tensor dq = target.zeros({p.B, p.H, p.Lq, p.A}, f32);
  Tensor dk = target.zeros({p.B, p.H, p.Lk, p.A}, f32);
  Tensor dvalue = target.zeros({p.B, p.H, p.Lk, p.Ev}, f32);
  Tensor dv_parts = target.zeros({int64_t(p.B) * additive_query_tiles(p.Lq), p.H, p.A}, f32);
  const bool want_dmask =
      mask_grad && (p.mask.kind == MaskKind::Additive || p.mask.kind == MaskKind::Additive32);
  Tensor dmask = want_dmask ? target.zeros({p.B, p.H, p.Lq, p.Lk}, mask_grad_options(p.mask, in.q))
                            : in.q.new_empty({0});
  p.dout = s.dout.data_ptr();
  p.lse = s.lse.data_ptr<float>();
  p.delta = s.delta.data_ptr<float>();
  p.dq = dq.data_ptr<float>();
  p.dk = dk.data_ptr<float>();
  p.dvalue = dvalue.data_ptr<float>();
  p.dv = dv_parts.data_ptr<float>();
  p.dmask = want_dmask ? dmask.data_ptr() : nullptr;
  Tensor dw;
  if (grad_weights.has_value()) {
    TORCH_CHECK(grad_weights->sizes() == at::IntArrayRef({p.B, p.H, p.Lq, p.Lk}) &&
                    grad_weights->device() == in.q.device(),
                "grad_weights: expected shape (B, H, Lq, Lk) on q's device, got ",
                grad_weights->sizes());
    dw = target.input(grad_weights->to(at::kFloat).contiguous());
  }
  p.dweights = dw.defined() ? dw.data_ptr<float>() : nullptr;
  target.check(launch_additive_bwd(p, target.stream()));
  // The CTAs' partial sums, added up here rather than by atomics on v's H x A addresses.
  Tensor dv = dv_parts.sum(0);
  // Values near bf16's largest, or an output past fp16's (saved as inf, so delta is): a dS
  // that overflowed reaches v's gradient, a dO near the largest dvalue's sums; then dq, dk,
  // dvalue, dv and dmask again in float64 (additive_bwd_rerun.cu). The flag stays on the
  // device.
  const Tensor overflowed = target.input(
      at::logical_not(at::logical_and(at::isfinite(dv).all(), at::isfinite(dvalue).all())));
  Tensor glse;
  if (grad_lse.has_value()) glse = target.input(grad_lse->to(at::kFloat).contiguous());
  const Tensor row_r = target.empty({p.B, p.H, p.Lq}, f32);
  const Tensor row_delta = target.empty({p.B, p.H, p.Lq}, f32.dtype(at::kDouble));
  const Tensor dv64 = target.zeros({p.H, p.A}, f32.dtype(at::kDouble));
  p.overflowed = overflowed.data_ptr<bool>();
  p.grad_lse = glse.defined() ? glse.data_ptr<float>() : nullptr;
  p.row_r = row_r.data_ptr<float>();
  p.row_delta = row_delta.data_ptr<double>();
  p.dv64 = dv64.data_ptr<double>();
  target.check(additive_bwd_rerun(p, target.stream()));
  dv = at::where(overflowed, dv64.to(at::kFloat), dv);
  // v may have been a broadcast (A,) vector: its gradient has v's own (H, A) shape here, the
  // autograd of the expand sums it back.
  return {grad_for(dq, q_in), grad_for(dk, k_in), grad_for(dvalue, value_in), grad_for(dv, v),
          dmask};
}

// The cache's lengths and block ids stay on the device (no synchronisation per decoded token):
// the kernel clamps and skips what would leave the cache (decode.cu); attnx's functions check
// them before any kernel runs.
std::tuple<Tensor, Tensor> kvcache_fwd(const Target& target, const Tensor& q_in,
                                       const Tensor& k_cache_in, const Tensor& v_cache_in,
                                       const Tensor& seqlens_in, const OptTensor& block_table,
                                       double scale, int64_t window_lo, int64_t window_hi,
                                       double softcap, const OptTensor& alibi_slopes,
                                       const OptTensor& sinks) {
  const Tensor q = rows(target, q_in, q_in, "q");
  const Tensor k = rows(target, k_cache_in, q_in, "k_cache");
  const Tensor v = rows(target, v_cache_in, q_in, "v_cache");
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), E = q.size(3);
  const int64_t slots = k.size(0), Hkv = k.size(1), depth = k.size(2), Ev = v.size(3);
  TORCH_CHECK(k.size(3) == E && v.size(0) == slots && v.size(1) == Hkv && v.size(2) == depth,
              "kvcache: inconsistent shapes q ", q.sizes(), ", k_cache ", k.sizes(),
              ", v_cache ", v.sizes());
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "kvcache: Hq (", Hq, ") must be a multiple of Hkv (",
              Hkv, ")");
  TORCH_CHECK(E <= kDecodeMaxHeadDim && Ev <= kDecodeMaxHeadDim, "attnx cuda kvcache: head ",
              "dims up to ", kDecodeMaxHeadDim, ", got (E, Ev) = (", E, ", ", Ev, ")");
  check_grid(Lq * Hq / Hkv, Hkv, B);  // the group's rows, the grid's y and z dims
  TORCH_CHECK(seqlens_in.device() == q.device() && seqlens_in.scalar_type() == at::kInt &&
                  seqlens_in.dim() == 1 && seqlens_in.size(0) == B,
              "seqlens: expected int32 (", B, ",) on ", q.device(), ", got ",
              seqlens_in.scalar_type(), " ", seqlens_in.sizes());
  const Tensor seqlens = target.input(seqlens_in.contiguous());
  Tensor table;
  if (block_table.has_value()) {
    const Tensor& t = *block_table;
    TORCH_CHECK(t.device() == q.device() && t.scalar_type() == at::kInt && t.dim() == 2 &&
                    t.size(0) == B,
                "block_table: expected int32 (", B, ", max_blocks) on ", q.device(), ", got ",
                t.scalar_type(), " ", t.sizes());
    TORCH_CHECK(depth > 0, "k_cache: expected a block size >= 1");
    table = target.input(t.contiguous());
  } else {
    TORCH_CHECK(slots == B, "k_cache: expected batch size ", B, " for a contiguous cache, got ",
                slots);
  }
  KvcacheParams p{};
  p.dtype = dtype_of(q);
  p.B = int(B);
  p.Hq = int(Hq);
  p.Hkv = int(Hkv);
  p.Lq = int(Lq);
  p.E = int(E);
  p.Ev = int(Ev);
  p.capacity = table.defined() ? table.size(1) * depth : depth;
  p.block_size = table.defined() ? depth : 0;
  p.num_blocks = slots;
  p.scale = static_cast<float>(scale);
  // every j - (i + diag) lies in [-capacity - Lq, capacity + Lq]: the same pairs, no overflow
  p.window_lo = std::clamp<int64_t>(window_lo, -p.capacity - Lq, p.capacity + Lq);
  p.window_hi = std::clamp<int64_t>(window_hi, -p.capacity - Lq, p.capacity + Lq);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.sq = strides(q);
  p.sk = strides(k);
  p.sv = strides(v);
  p.seqlens = seqlens.data_ptr<int32_t>();
  p.table = table.defined() ? table.data_ptr<int32_t>() : nullptr;
  p.table_stride = table.defined() ? table.stride(0) : 0;
  ModInputs mods;
  p.mods = score_mods(target, mods, q, softcap, alibi_slopes, sinks, B, Hq);
  kvcache_splits(p);
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor out = target.empty({B, Hq, Lq, Ev}, q.options());
  Tensor lse = target.empty({B, Hq, Lq}, f32);
  const bool split = p.splits > 1;
  const Tensor o_part = split ? target.empty({B, Hq, Lq, p.splits, Ev}, f32) : Tensor();
  const Tensor lse_part = split ? target.empty({B, Hq, Lq, p.splits}, f32) : Tensor();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.o_part = split ? o_part.data_ptr<float>() : nullptr;
  p.lse_part = split ? lse_part.data_ptr<float>() : nullptr;
  target.check(launch_kvcache_fwd(p, target.stream()));
  return {out, lse};
}

std::tuple<Tensor, Tensor> varlen_fwd(const Target& target, const Tensor& q, const Tensor& k,
                                      const Tensor& v, const Tensor& cu_seqlens_q,
                                      const Tensor& cu_seqlens_k, double scale,
                                      int64_t window_lo, int64_t window_hi, double dropout_p,
                                      const OptTensor& seed, double softcap,
                                      const OptTensor& alibi_slopes, const OptTensor& sinks) {
  VarlenInputs in;
  SdpaParams p = varlen_params(target, in, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, window_lo,
                               window_hi, dropout_p, seed);
  ModInputs mods;
  p.mods = score_mods(target, mods, q, softcap, alibi_slopes, sinks, p.B, p.Hq);
  const auto opts = q.options();
  // The kernels write (Hq, total_q, Ev) rows; the op returns (total_q, Hq, Ev).
  Tensor out = target.empty({p.Hq, p.total_q, p.Ev}, opts);
  Tensor lse = target.empty({p.Hq, p.total_q}, opts.dtype(at::kFloat));
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  target.check(run_sdpa_fwd(p, target.stream()));
  return {out.transpose(0, 1).contiguous(), lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> varlen_bwd(
    const Target& target, const Tensor& grad_out, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, const Tensor& out,
    const Tensor& lse, double scale, int64_t window_lo, int64_t window_hi, double dropout_p,
    const OptTensor& seed, const OptTensor& grad_lse, double softcap,
    const OptTensor& alibi_slopes, const OptTensor& sinks, bool sinks_grad) {
  VarlenInputs in;
  SdpaParams p = varlen_params(target, in, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, window_lo,
                               window_hi, dropout_p, seed);
  ModInputs mods;
  p.mods = score_mods(target, mods, q, softcap, alibi_slopes, sinks, p.B, p.Hq);
  TORCH_CHECK(!sinks_grad || sinks.has_value(), "sinks_grad: needs sinks");
  const std::vector<int64_t> shape{p.total_q, p.Hq, p.Ev};
  const at::IntArrayRef out_shape(shape);
  TORCH_CHECK(grad_out.sizes() == out_shape && out.sizes() == out_shape &&
                  grad_out.device() == q.device() && out.device() == q.device(),
              "grad_out, out: expected shape ", out_shape, " on ", q.device(), ", got ",
              grad_out.sizes(), " and ", out.sizes());
  // grad_out and out as (Hq, total_q, Ev) rows in the input dtype, as the kernels read them
  auto rows_of = [&](const Tensor& t) {
    return t.to(q.scalar_type()).transpose(0, 1).contiguous();
  };
  Grads g = backward(target, p, q, rows_of(grad_out), rows_of(out), lse, grad_lse,
                     {p.Hq, p.total_q}, {p.Hkv, p.total_k}, false,
                     sinks_grad ? mods.sinks : Tensor(), 0);
  auto packed = [](const Tensor& t, const Tensor& like) {
    return t.transpose(0, 1).to(like.scalar_type()).contiguous();
  };
  const Tensor dsinks = sinks_grad ? g.dsinks.to(sinks->scalar_type()) : q.new_empty({0});
  return {packed(g.dq_acc, q), packed(g.dk, k), packed(g.dv, v), dsinks};
}

}  // namespace cuda
}  // namespace attnx
