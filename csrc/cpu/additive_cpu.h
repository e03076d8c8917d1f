// Fused additive (Bahdanau) attention on the CPU: the (Lq, Lk, A) tanh tensor never exists.
// Conventions: csrc/ops.cpp.
#pragma once
#include <ATen/core/Tensor.h>
#include <optional>
#include <tuple>

namespace attnx::cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor> additive_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& value, const at::Tensor& v,
    const std::optional<at::Tensor>& mask, int64_t window_lo, int64_t window_hi,
    double dropout_p, const std::optional<at::Tensor>& seed, bool return_weights);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> additive_bwd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& value, const at::Tensor& v, const std::optional<at::Tensor>& mask,
    const at::Tensor& out, const at::Tensor& lse, int64_t window_lo, int64_t window_hi,
    double dropout_p, const std::optional<at::Tensor>& seed, bool mask_grad,
    const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& grad_weights);

}  // namespace attnx::cpu
