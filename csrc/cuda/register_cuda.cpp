// The CUDA kernels of the attnx ops (schemas: csrc/ops.cpp) on the current GPU and stream;
// everything but the device (checks, outputs, launch parameters) is kernel_ops.cpp's.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernel_ops.h"

namespace attnx {
namespace cuda {
namespace {

using at::Tensor;

class Gpu final : public Target {
 public:
  at::DeviceType device_type() const override { return at::kCUDA; }
  size_t smem_optin() const override {
    int device = 0, limit = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return size_t(limit);
  }
  cudaStream_t stream() const override { return c10::cuda::getCurrentCUDAStream(); }
  void check(cudaError_t err) const override {
    C10_CUDA_CHECK(err);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

const Gpu kGpu;

std::tuple<Tensor, Tensor> gpu_sdpa_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                        const OptTensor& mask, double scale, int64_t window_lo,
                                        int64_t window_hi, double dropout_p,
                                        const OptTensor& seed) {
  const c10::cuda::CUDAGuard guard(q.device());
  return sdpa_fwd(kGpu, q, k, v, mask, scale, window_lo, window_hi, dropout_p, seed);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> gpu_sdpa_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const OptTensor& mask, const Tensor& out, const Tensor& lse, double scale, int64_t window_lo,
    int64_t window_hi, double dropout_p, const OptTensor& seed, bool mask_grad,
    const OptTensor& grad_lse) {
  const c10::cuda::CUDAGuard guard(q.device());
  return sdpa_bwd(kGpu, grad_out, q, k, v, mask, out, lse, scale, window_lo, window_hi, dropout_p,
                  seed, mask_grad, grad_lse);
}

std::tuple<Tensor, Tensor> gpu_sdpa_mod_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const OptTensor& mask, double scale,
                                            int64_t window_lo, int64_t window_hi,
                                            double dropout_p, const OptTensor& seed,
                                            double softcap, const OptTensor& alibi_slopes,
                                            const OptTensor& sinks) {
  const c10::cuda::CUDAGuard guard(q.device());
  return sdpa_fwd(kGpu, q, k, v, mask, scale, window_lo, window_hi, dropout_p, seed, softcap,
                  alibi_slopes, sinks);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> gpu_sdpa_mod_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const OptTensor& mask, const Tensor& out, const Tensor& lse, double scale, int64_t window_lo,
    int64_t window_hi, double dropout_p, const OptTensor& seed, bool mask_grad,
    const OptTensor& grad_lse, double softcap, const OptTensor& alibi_slopes,
    const OptTensor& sinks, bool sinks_grad) {
  const c10::cuda::CUDAGuard guard(q.device());
  return sdpa_mod_bwd(kGpu, grad_out, q, k, v, mask, out, lse, scale, window_lo, window_hi,
                      dropout_p, seed, mask_grad, grad_lse, softcap, alibi_slopes, sinks,
                      sinks_grad);
}

std::tuple<Tensor, Tensor, Tensor> gpu_additive_fwd(const Tensor& q, const Tensor& k,
                                                    const Tensor& value, const Tensor& v,
                                                    const OptTensor& mask, int64_t window_lo,
                                                    int64_t window_hi, double dropout_p,
                                                    const OptTensor& seed, bool return_weights) {
  const c10::cuda::CUDAGuard guard(q.device());
  return additive_fwd(kGpu, q, k, value, v, mask, window_lo, window_hi, dropout_p, seed,
                      return_weights);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> gpu_additive_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& value,
    const Tensor& v, const OptTensor& mask, const Tensor& out, const Tensor& lse,
    int64_t window_lo, int64_t window_hi, double dropout_p, const OptTensor& seed,
    bool mask_grad, const OptTensor& grad_lse, const OptTensor& grad_weights) {
  const c10::cuda::CUDAGuard guard(q.device());
  return additive_bwd(kGpu, grad_out, q, k, value, v, mask, out, lse, window_lo, window_hi,
                      dropout_p, seed, mask_grad, grad_lse, grad_weights);
}

std::tuple<Tensor, Tensor> gpu_kvcache_fwd(const Tensor& q, const Tensor& k_cache,
                                           const Tensor& v_cache, const Tensor& seqlens,
                                           const OptTensor& block_table, double scale,
                                           int64_t window_lo, int64_t window_hi) {
  const c10::cuda::CUDAGuard guard(q.device());
  return kvcache_fwd(kGpu, q, k_cache, v_cache, seqlens, block_table, scale, window_lo,
                     window_hi);
}

std::tuple<Tensor, Tensor> gpu_kvcache_mod_fwd(const Tensor& q, const Tensor& k_cache,
                                               const Tensor& v_cache, const Tensor& seqlens,
                                               const OptTensor& block_table, double scale,
                                               int64_t window_lo, int64_t window_hi,
                                               double softcap, const OptTensor& alibi_slopes,
                                               const OptTensor& sinks) {
  const c10::cuda::CUDAGuard guard(q.device());
  return kvcache_fwd(kGpu, q, k_cache, v_cache, seqlens, block_table, scale, window_lo,
                     window_hi, softcap, alibi_slopes, sinks);
}

std::tuple<Tensor, Tensor> gpu_varlen_mod_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& cu_q, const Tensor& cu_k,
                                              double scale, int64_t window_lo, int64_t window_hi,
                                              double dropout_p, const OptTensor& seed,
                                              double softcap, const OptTensor& alibi_slopes,
                                              const OptTensor& sinks) {
  const c10::cuda::CUDAGuard guard(q.device());
  return varlen_fwd(kGpu, q, k, v, cu_q, cu_k, scale, window_lo, window_hi, dropout_p, seed,
                    softcap, alibi_slopes, sinks);
}

std::tuple<Tensor, Tensor> gpu_varlen_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& cu_q, const Tensor& cu_k, double scale,
                                          int64_t window_lo, int64_t window_hi, double dropout_p,
                                          const OptTensor& seed) {
  return gpu_varlen_mod_fwd(q, k, v, cu_q, cu_k, scale, window_lo, window_hi, dropout_p, seed,
                            0.0, std::nullopt, std::nullopt);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> gpu_varlen_mod_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
    const Tensor& cu_k, const Tensor& out, const Tensor& lse, double scale, int64_t window_lo,
    int64_t window_hi, double dropout_p, const OptTensor& seed, const OptTensor& grad_lse,
    double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks, bool sinks_grad) {
  const c10::cuda::CUDAGuard guard(q.device());
  return varlen_bwd(kGpu, grad_out, q, k, v, cu_q, cu_k, out, lse, scale, window_lo, window_hi,
                    dropout_p, seed, grad_lse, softcap, alibi_slopes, sinks, sinks_grad);
}

std::tuple<Tensor, Tensor, Tensor> gpu_varlen_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
    const Tensor& cu_k, const Tensor& out, const Tensor& lse, double scale, int64_t window_lo,
    int64_t window_hi, double dropout_p, const OptTensor& seed, const OptTensor& grad_lse) {
  auto [dq, dk, dv, dsinks] =
      gpu_varlen_mod_bwd(grad_out, q, k, v, cu_q, cu_k, out, lse, scale, window_lo, window_hi,
                         dropout_p, seed, grad_lse, 0.0, std::nullopt, std::nullopt, false);
  return {dq, dk, dv};
}

}  // namespace
}  // namespace cuda
}  // namespace attnx

TORCH_LIBRARY_IMPL(attnx, CUDA, m) {
  m.impl("sdpa_fwd", &attnx::cuda::gpu_sdpa_fwd);
  m.impl("sdpa_bwd", &attnx::cuda::gpu_sdpa_bwd);
  m.impl("sdpa_mod_fwd", &attnx::cuda::gpu_sdpa_mod_fwd);
  m.impl("sdpa_mod_bwd", &attnx::cuda::gpu_sdpa_mod_bwd);
  m.impl("additive_fwd", &attnx::cuda::gpu_additive_fwd);
  m.impl("additive_bwd", &attnx::cuda::gpu_additive_bwd);
  m.impl("kvcache_fwd", &attnx::cuda::gpu_kvcache_fwd);
  m.impl("kvcache_mod_fwd", &attnx::cuda::gpu_kvcache_mod_fwd);
  m.impl("varlen_fwd", &attnx::cuda::gpu_varlen_fwd);
  m.impl("varlen_bwd", &attnx::cuda::gpu_varlen_bwd);
  m.impl("varlen_mod_fwd", &attnx::cuda::gpu_varlen_mod_fwd);
  m.impl("varlen_mod_bwd", &attnx::cuda::gpu_varlen_mod_bwd);
}
