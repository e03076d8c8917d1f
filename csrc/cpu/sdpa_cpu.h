// Fused scaled-dot-product attention on the CPU (flash-style, online softmax).
// Conventions: csrc/ops.cpp.
#pragma once
#include <ATen/core/Tensor.h>
#include <optional>
#include <tuple>

#include "score_mods.h"

namespace attnx::cpu {

std::tuple<at::Tensor, at::Tensor> sdpa_fwd(const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v,
                                            const std::optional<at::Tensor>& mask, double scale,
                                            int64_t window_lo, int64_t window_hi,
                                            double dropout_p,
                                            const std::optional<at::Tensor>& seed);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sdpa_bwd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& mask, const at::Tensor& out, const at::Tensor& lse,
    double scale, int64_t window_lo, int64_t window_hi, double dropout_p,
    const std::optional<at::Tensor>& seed, bool mask_grad,
    const std::optional<at::Tensor>& grad_lse);

// The same with the score modifiers (csrc/ops.cpp): softcap (0: none), alibi_slopes float32
// (B, Hq), sinks (Hq); the backward also returns the sinks' gradient (Hq) when sinks_grad.
std::tuple<at::Tensor, at::Tensor> sdpa_mod_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& mask, double scale, int64_t window_lo, int64_t window_hi,
    double dropout_p, const std::optional<at::Tensor>& seed, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sdpa_mod_bwd(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& mask, const at::Tensor& out, const at::Tensor& lse,
    double scale, int64_t window_lo, int64_t window_hi, double dropout_p,
    const std::optional<at::Tensor>& seed, bool mask_grad,
    const std::optional<at::Tensor>& grad_lse, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    bool sinks_grad);

// The same without a mask, the modifiers given as checked ModArgs (varlen_cpu.cpp: one
// sequence's slopes and its ALiBi offset Lk - Lq). The backward returns (dq, dk, dv, dsinks in
// float64, or empty without sinks_grad).
std::tuple<at::Tensor, at::Tensor> sdpa_fwd_modified(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
    int64_t window_lo, int64_t window_hi, double dropout_p,
    const std::optional<at::Tensor>& seed, const ModArgs& mods);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sdpa_bwd_modified(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, double scale, int64_t window_lo,
    int64_t window_hi, double dropout_p, const std::optional<at::Tensor>& seed,
    const std::optional<at::Tensor>& grad_lse, const ModArgs& mods, bool sinks_grad);

// Seconds a small float32 forward and its backward (B 1, H 4, L 512, D 64) take on the panels
// or on BLAS, on the process's threads: what cpu_choice.h measures the engine by.
double sdpa_step_seconds(bool panels);

}  // namespace attnx::cpu
