// The attnx ops on the CUDA kernels, wherever the kernels run: on a GPU (register_cuda.cpp) or
// on the CPU through the host harness (host/register_host.cpp). One place for the argument
// checks, the tensors -> launch parameters and the outputs; a Target says what differs.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "launch.h"

namespace attnx {
namespace cuda {

using OptTensor = std::optional<at::Tensor>;

// Where the kernels run.
class Target {
 public:
  virtual ~Target() = default;
  virtual at::DeviceType device_type() const = 0;  // the tensors' device type
  virtual size_t smem_optin() const = 0;  // shared memory a block may use, bytes
  virtual cudaStream_t stream() const = 0;
  virtual void check(cudaError_t err) const = 0;  // raises for a failed launch
  // The buffers the kernels read (a contiguous-last-dim input, as is) and write (outputs:
  // uninitialised, or zero-filled): the GPU uses the tensors themselves, the harness
  // bounds-checked copies.
  virtual at::Tensor input(const at::Tensor& t) const { return t; }
  virtual at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) const {
    return at::empty(sizes, options);
  }
  virtual at::Tensor zeros(at::IntArrayRef sizes, const at::TensorOptions& options) const {
    return at::zeros(sizes, options);
  }
};

// sdpa_fwd and, with the score modifiers (softcap 0: none), sdpa_mod_fwd.
std::tuple<at::Tensor, at::Tensor> sdpa_fwd(const Target& target, const at::Tensor& q,
                                            const at::Tensor& k, const at::Tensor& v,
                                            const OptTensor& mask, double scale,
                                            int64_t window_lo, int64_t window_hi,
                                            double dropout_p, const OptTensor& seed,
                                            double softcap = 0.0,
                                            const OptTensor& alibi_slopes = std::nullopt,
                                            const OptTensor& sinks = std::nullopt);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sdpa_bwd(
    const Target& target, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const OptTensor& mask, const at::Tensor& out, const at::Tensor& lse,
    double scale, int64_t window_lo, int64_t window_hi, double dropout_p, const OptTensor& seed,
    bool mask_grad, const OptTensor& grad_lse);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sdpa_mod_bwd(
    const Target& target, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const OptTensor& mask, const at::Tensor& out, const at::Tensor& lse,
    double scale, int64_t window_lo, int64_t window_hi, double dropout_p, const OptTensor& seed,
    bool mask_grad, const OptTensor& grad_lse, double softcap, const OptTensor& alibi_slopes,
    const OptTensor& sinks, bool sinks_grad);

std::tuple<at::Tensor, at::Tensor, at::Tensor> additive_fwd(
    const Target& target, const at::Tensor& q, const at::Tensor& k, const at::Tensor& value,
    const at::Tensor& v, const OptTensor& mask, int64_t window_lo, int64_t window_hi,
    double dropout_p, const OptTensor& seed, bool return_weights);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> additive_bwd(
    const Target& target, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& value, const at::Tensor& v, const OptTensor& mask, const at::Tensor& out,
    const at::Tensor& lse, int64_t window_lo, int64_t window_hi, double dropout_p,
    const OptTensor& seed, bool mask_grad, const OptTensor& grad_lse,
    const OptTensor& grad_weights);

// kvcache_fwd and, with the score modifiers (softcap 0: none), kvcache_mod_fwd.
std::tuple<at::Tensor, at::Tensor> kvcache_fwd(const Target& target, const at::Tensor& q,
                                               const at::Tensor& k_cache,
                                               const at::Tensor& v_cache,
                                               const at::Tensor& seqlens,
                                               const OptTensor& block_table, double scale,
                                               int64_t window_lo, int64_t window_hi,
                                               double softcap = 0.0,
                                               const OptTensor& alibi_slopes = std::nullopt,
                                               const OptTensor& sinks = std::nullopt);

// varlen_fwd / varlen_mod_fwd (packed sequences, csrc/ops.cpp; softcap 0: none).
std::tuple<at::Tensor, at::Tensor> varlen_fwd(
    const Target& target, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, double scale,
    int64_t window_lo, int64_t window_hi, double dropout_p, const OptTensor& seed,
    double softcap = 0.0, const OptTensor& alibi_slopes = std::nullopt,
    const OptTensor& sinks = std::nullopt);

// varlen_mod_bwd: (dq, dk, dv, dsinks); varlen_bwd is the same without modifiers.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_bwd(
    const Target& target, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    const at::Tensor& out, const at::Tensor& lse, double scale, int64_t window_lo,
    int64_t window_hi, double dropout_p, const OptTensor& seed, const OptTensor& grad_lse,
    double softcap = 0.0, const OptTensor& alibi_slopes = std::nullopt,
    const OptTensor& sinks = std::nullopt, bool sinks_grad = false);

}  // namespace cuda
}  // namespace attnx
