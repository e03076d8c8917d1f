// The CUDA kernels of the attnx ops (schemas: csrc/ops.cpp): argument checks, output
// allocation and the launch parameters. The kernels themselves (*.cu) see only launch.h.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "launch.h"

namespace attnx {
namespace cuda {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

DType dtype_of(const Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              "attnx cuda kernels take float16 or bfloat16 tensors, got ", t.scalar_type());
  return t.scalar_type() == at::kHalf ? DType::Half : DType::BFloat16;
}

// A 4-D CUDA tensor of `like`'s dtype with a contiguous last dim (copied only if it is not).
Tensor rows(const Tensor& t, const Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, ": expected a tensor on ",
              like.device(), ", got ", t.device());
  TORCH_CHECK(t.dim() == 4, name, ": expected 4 dims, got ", t.dim());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, ": expected dtype ",
              like.scalar_type(), ", got ", t.scalar_type());
  return t.size(3) <= 1 || t.stride(3) == 1 ? t : t.contiguous();
}

Strides4 strides(const Tensor& t) {
  const auto addr = reinterpret_cast<uintptr_t>(t.data_ptr());
  const bool vec16 = addr % 16 == 0 && t.size(3) % 8 == 0 && t.stride(0) % 8 == 0 &&
                     t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0;
  return {t.stride(0), t.stride(1), t.stride(2), vec16};
}

MaskView mask_view(const OptTensor& mask, const Tensor& q, int64_t H, int64_t Lq, int64_t Lk) {
  MaskView m;
  if (!mask.has_value() || !mask->defined()) return m;
  const Tensor& t = *mask;
  TORCH_CHECK(t.device() == q.device(), "mask: expected device ", q.device(), ", got ", t.device());
  TORCH_CHECK(t.dim() == 4 && t.size(0) == q.size(0) && t.size(1) == H && t.size(2) == Lq &&
                  t.size(3) == Lk,
              "mask: expected shape (", q.size(0), ", ", H, ", ", Lq, ", ", Lk, "), got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kBool || t.scalar_type() == q.scalar_type(),
              "mask: expected bool or ", q.scalar_type(), ", got ", t.scalar_type());
  m.ptr = t.data_ptr();
  m.kind = t.scalar_type() == at::kBool ? MaskKind::Bool : MaskKind::Additive;
  m.b = t.stride(0);
  m.h = t.stride(1);
  m.i = t.stride(2);
  m.j = t.stride(3);
  return m;
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

void check_grid(int64_t tiles, int64_t heads, int64_t batch) {
  TORCH_CHECK(tiles < (int64_t(1) << 31) && heads <= 65535 && batch <= 65535,
              "attnx cuda kernels: at most 65535 heads and batches, got ", heads, " and ", batch);
}

int family(int64_t E, int64_t Ev) {
  for (int D : kSdpaFamilies)
    if (E <= D && Ev <= D) return D;
  TORCH_CHECK(false, "attnx cuda sdpa: head dims up to 256, got (E, Ev) = (", E, ", ", Ev, ")");
  return 0;
}

template <typename F64, typename F128, typename F256>
cudaError_t by_family(int D, F64 f64, F128 f128, F256 f256) {
  return D == 64 ? f64() : D == 128 ? f128() : f256();
}

// A gradient in its input's dtype, contiguous whatever the input's strides: what the fake
// kernels (attnx._ops.contiguous_grads) promise and the CPU and Triton kernels return.
Tensor grad_for(const Tensor& grad, const Tensor& input) { return grad.to(input.scalar_type()); }

void check_launch(cudaError_t err) {
  C10_CUDA_CHECK(err);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

SdpaParams sdpa_params(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& mask,
                       double scale, int64_t lo, int64_t hi, double dropout_p,
                       const OptTensor& seed) {
  SdpaParams p{};
  p.dtype = dtype_of(q);
  p.B = q.size(0);
  p.Hq = q.size(1);
  p.Lq = q.size(2);
  p.E = q.size(3);
  p.Hkv = k.size(1);
  p.Lk = k.size(2);
  p.Ev = v.size(3);
  TORCH_CHECK(k.size(0) == p.B && v.size(0) == p.B && v.size(1) == p.Hkv && v.size(2) == p.Lk &&
                  k.size(3) == p.E,
              "sdpa: inconsistent shapes q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(p.Hkv > 0 ? p.Hq % p.Hkv == 0 : p.Hq == 0, "sdpa: Hq (", p.Hq,
              ") must be a multiple of Hkv (", p.Hkv, ")");
  check_grid(p.Lq, p.Hq, p.B);
  p.scale = static_cast<float>(scale);
  // [-Lq, Lk] admits the same pairs and keeps i + lo, i + hi from overflowing in the kernels
  p.window_lo = std::clamp<int64_t>(lo, -p.Lq, p.Lk);
  p.window_hi = std::clamp<int64_t>(hi, -p.Lq, p.Lk);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.sq = strides(q);
  p.sk = strides(k);
  p.sv = strides(v);
  p.mask = mask_view(mask, q, p.Hq, p.Lq, p.Lk);
  p.drop = dropout(dropout_p, seed);
  return p;
}

std::tuple<Tensor, Tensor> sdpa_fwd(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                    const OptTensor& mask, double scale, int64_t window_lo,
                                    int64_t window_hi, double dropout_p, const OptTensor& seed) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = rows(q_in, q_in, "q"), k = rows(k_in, q_in, "k"), v = rows(v_in, q_in, "v");
  SdpaParams p = sdpa_params(q, k, v, mask, scale, window_lo, window_hi, dropout_p, seed);
  const int D = family(p.E, p.Ev);
  Tensor out = at::empty({p.B, p.Hq, p.Lq, p.Ev}, q.options());
  Tensor lse = at::empty({p.B, p.Hq, p.Lq}, q.options().dtype(at::kFloat));
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_launch(by_family(
      D, [&] { return sdpa_fwd_family<64>(p, stream); },
      [&] { return sdpa_fwd_family<128>(p, stream); },
      [&] { return sdpa_fwd_family<256>(p, stream); }));
  return {out, lse};
}

// A backward reads grad_out, out (B, H, Lq, Ev) and lse (B, H, Lq) whole: a direct caller's
// other shapes or devices would be read out of bounds.
void check_saved(const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& q,
                 c10::IntArrayRef out_shape) {
  TORCH_CHECK(dout.sizes() == out_shape && out.sizes() == out_shape, "grad_out, out: expected ",
              "shape ", out_shape, ", got ", dout.sizes(), " and ", out.sizes());
  TORCH_CHECK(lse.sizes() == out_shape.slice(0, 3), "lse: expected shape ",
              out_shape.slice(0, 3), ", got ", lse.sizes());
  TORCH_CHECK(out.device() == q.device() && lse.device() == q.device(),
              "out, lse: expected q's device ", q.device(), ", got ", out.device(), " and ",
              lse.device());
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

std::tuple<Tensor, Tensor, Tensor, Tensor> sdpa_bwd(
    const Tensor& grad_out, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
    const OptTensor& mask, const Tensor& out, const Tensor& lse, double scale, int64_t window_lo,
    int64_t window_hi, double dropout_p, const OptTensor& seed, bool mask_grad,
    const OptTensor& grad_lse) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = rows(q_in, q_in, "q"), k = rows(k_in, q_in, "k"), v = rows(v_in, q_in, "v");
  SdpaParams p = sdpa_params(q, k, v, mask, scale, window_lo, window_hi, dropout_p, seed);
  const int D = family(p.E, p.Ev);
  Tensor dout = grad_out.to(q.scalar_type()).contiguous();
  if (reinterpret_cast<uintptr_t>(dout.data_ptr()) % 16 != 0) dout = dout.clone();  // vec16 loads
  check_saved(dout, out, lse, q, {p.B, p.Hq, p.Lq, p.Ev});
  const Tensor lse_c = lse.to(at::kFloat).contiguous();
  const Tensor delta = softmax_delta(dout, out, lse, grad_lse);
  Tensor dq_acc = at::zeros({p.B, p.Hq, p.Lq, p.E}, q.options().dtype(at::kFloat));
  Tensor dk = at::empty({p.B, p.Hkv, p.Lk, p.E}, q.options());
  Tensor dv = at::empty({p.B, p.Hkv, p.Lk, p.Ev}, q.options());
  const bool want_dmask = mask_grad && p.mask.kind == MaskKind::Additive;
  Tensor dmask = want_dmask ? at::zeros({p.B, p.Hq, p.Lq, p.Lk}, q.options()) : q.new_empty({0});
  p.dout = dout.data_ptr();
  p.lse = lse_c.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.dq_acc = dq_acc.data_ptr<float>();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dmask = want_dmask ? dmask.data_ptr() : nullptr;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_launch(by_family(
      D, [&] { return sdpa_bwd_family<64>(p, stream); },
      [&] { return sdpa_bwd_family<128>(p, stream); },
      [&] { return sdpa_bwd_family<256>(p, stream); }));
  return {grad_for(dq_acc, q_in), grad_for(dk, k_in), grad_for(dv, v_in), dmask};
}

AdditiveParams additive_params(const Tensor& q, const Tensor& k, const Tensor& value,
                               const Tensor& v, const OptTensor& mask, int64_t lo, int64_t hi,
                               double dropout_p, const OptTensor& seed) {
  AdditiveParams p{};
  p.dtype = dtype_of(q);
  p.B = q.size(0);
  p.H = q.size(1);
  p.Lq = q.size(2);
  p.A = q.size(3);
  p.Lk = k.size(2);
  p.Ev = value.size(3);
  TORCH_CHECK(k.size(0) == p.B && k.size(1) == p.H && k.size(3) == p.A &&
                  value.size(0) == p.B && value.size(1) == p.H && value.size(2) == p.Lk,
              "additive: inconsistent shapes q ", q.sizes(), ", k ", k.sizes(), ", value ",
              value.sizes());
  TORCH_CHECK(v.is_cuda() && v.scalar_type() == q.scalar_type() && v.dim() == 2 &&
                  v.size(0) == p.H && v.size(1) == p.A,
              "v: expected (", p.H, ", ", p.A, ") of q's dtype and device, got ", v.sizes());
  const size_t smem = additive_smem_bytes(p.Ev);
  int dev = 0, limit = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  TORCH_CHECK(smem <= size_t(limit), "attnx cuda additive: value dim ", p.Ev,
              " needs more shared memory than this device has");
  check_grid(p.Lq, p.H, p.B);
  // [-Lq, Lk] admits the same pairs and keeps i + lo, i + hi from overflowing in the kernels
  p.window_lo = std::clamp<int64_t>(lo, -p.Lq, p.Lk);
  p.window_hi = std::clamp<int64_t>(hi, -p.Lq, p.Lk);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.value = value.data_ptr();
  p.v = v.data_ptr();
  p.sq = strides(q);
  p.sk = strides(k);
  p.svalue = strides(value);
  p.vh = v.stride(0);
  p.va = v.stride(1);
  p.mask = mask_view(mask, q, p.H, p.Lq, p.Lk);
  p.drop = dropout(dropout_p, seed);
  return p;
}

std::tuple<Tensor, Tensor, Tensor> additive_fwd(const Tensor& q_in, const Tensor& k_in,
                                                const Tensor& value_in, const Tensor& v,
                                                const OptTensor& mask, int64_t window_lo,
                                                int64_t window_hi, double dropout_p,
                                                const OptTensor& seed, bool return_weights) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = rows(q_in, q_in, "q"), k = rows(k_in, q_in, "k");
  const Tensor value = rows(value_in, q_in, "value");
  AdditiveParams p = additive_params(q, k, value, v, mask, window_lo, window_hi, dropout_p, seed);
  Tensor out = at::empty({p.B, p.H, p.Lq, p.Ev}, q.options());
  Tensor lse = at::empty({p.B, p.H, p.Lq}, q.options().dtype(at::kFloat));
  Tensor weights = return_weights ? at::zeros({p.B, p.H, p.Lq, p.Lk}, q.options())
                                  : q.new_empty({0});
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.weights = return_weights ? weights.data_ptr() : nullptr;
  check_launch(launch_additive_fwd(p, c10::cuda::getCurrentCUDAStream()));
  return {out, lse, weights};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> additive_bwd(
    const Tensor& grad_out, const Tensor& q_in, const Tensor& k_in, const Tensor& value_in,
    const Tensor& v, const OptTensor& mask, const Tensor& out, const Tensor& lse,
    int64_t window_lo, int64_t window_hi, double dropout_p, const OptTensor& seed,
    bool mask_grad, const OptTensor& grad_lse, const OptTensor& grad_weights) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = rows(q_in, q_in, "q"), k = rows(k_in, q_in, "k");
  const Tensor value = rows(value_in, q_in, "value");
  AdditiveParams p = additive_params(q, k, value, v, mask, window_lo, window_hi, dropout_p, seed);
  const Tensor dout = grad_out.to(q.scalar_type()).contiguous();
  check_saved(dout, out, lse, q, {p.B, p.H, p.Lq, p.Ev});
  const Tensor lse_c = lse.to(at::kFloat).contiguous();
  const Tensor delta = softmax_delta(dout, out, lse, grad_lse);
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor dq = at::zeros({p.B, p.H, p.Lq, p.A}, f32);
  Tensor dk = at::zeros({p.B, p.H, p.Lk, p.A}, f32);
  Tensor dvalue = at::zeros({p.B, p.H, p.Lk, p.Ev}, f32);
  Tensor dv = at::zeros({p.H, p.A}, f32);
  const bool want_dmask = mask_grad && p.mask.kind == MaskKind::Additive;
  Tensor dmask = want_dmask ? at::zeros({p.B, p.H, p.Lq, p.Lk}, q.options()) : q.new_empty({0});
  p.dout = dout.data_ptr();
  p.lse = lse_c.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  p.dq = dq.data_ptr<float>();
  p.dk = dk.data_ptr<float>();
  p.dvalue = dvalue.data_ptr<float>();
  p.dv = dv.data_ptr<float>();
  p.dmask = want_dmask ? dmask.data_ptr() : nullptr;
  Tensor dw;
  if (grad_weights.has_value()) {
    TORCH_CHECK(grad_weights->sizes() == at::IntArrayRef({p.B, p.H, p.Lq, p.Lk}) &&
                    grad_weights->device() == q.device(),
                "grad_weights: expected shape (B, H, Lq, Lk) on q's device, got ",
                grad_weights->sizes());
    dw = grad_weights->to(q.scalar_type()).contiguous();
  }
  p.dweights = dw.defined() ? dw.data_ptr() : nullptr;
  check_launch(launch_additive_bwd(p, c10::cuda::getCurrentCUDAStream()));
  // v may have been a broadcast (A,) vector: its gradient has v's own (H, A) shape here, the
  // autograd of the expand sums it back.
  return {grad_for(dq, q_in), grad_for(dk, k_in), grad_for(dvalue, value_in),
          grad_for(dv, v), dmask};
}

}  // namespace
}  // namespace cuda
}  // namespace attnx

TORCH_LIBRARY_IMPL(attnx, CUDA, m) {
  m.impl("sdpa_fwd", &attnx::cuda::sdpa_fwd);
  m.impl("sdpa_bwd", &attnx::cuda::sdpa_bwd);
  m.impl("additive_fwd", &attnx::cuda::additive_fwd);
  m.impl("additive_bwd", &attnx::cuda::additive_bwd);
}
