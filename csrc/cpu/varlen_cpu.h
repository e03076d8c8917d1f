// Attention over packed variable-length sequences on the CPU (attnx::varlen_fwd / varlen_bwd;
// conventions: csrc/ops.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <optional>
#include <tuple>

namespace attnx::cpu {

std::tuple<at::Tensor, at::Tensor> varlen_fwd(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                                              const at::Tensor& cu_seqlens_k, double scale,
                                              int64_t window_lo, int64_t window_hi,
                                              double dropout_p,
                                              const std::optional<at::Tensor>& seed);

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, const at::Tensor& out,
    const at::Tensor& lse, double scale, int64_t window_lo, int64_t window_hi, double dropout_p,
    const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& grad_lse);

// The same with the score modifiers (csrc/ops.cpp: varlen_mod_fwd / varlen_mod_bwd).
std::tuple<at::Tensor, at::Tensor> varlen_mod_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, double scale,
    int64_t window_lo, int64_t window_hi, double dropout_p,
    const std::optional<at::Tensor>& seed, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_mod_bwd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, const at::Tensor& out,
    const at::Tensor& lse, double scale, int64_t window_lo, int64_t window_hi, double dropout_p,
    const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& grad_lse,
    double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, bool sinks_grad);

}  // namespace attnx::cpu
