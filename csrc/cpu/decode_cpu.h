// Decoding attention against a KV cache on the CPU (attnx::kvcache_fwd; conventions:
// csrc/ops.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <optional>
#include <tuple>

namespace attnx::cpu {

std::tuple<at::Tensor, at::Tensor> kvcache_fwd(const at::Tensor& q, const at::Tensor& k_cache,
                                               const at::Tensor& v_cache,
                                               const at::Tensor& seqlens,
                                               const std::optional<at::Tensor>& block_table,
                                               double scale, int64_t window_lo,
                                               int64_t window_hi);

// The same with the score modifiers (csrc/ops.cpp): softcap (0: none), alibi_slopes float32
// (B, Hq) aligned bottom-right, sinks (Hq).
std::tuple<at::Tensor, at::Tensor> kvcache_mod_fwd(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& seqlens, const std::optional<at::Tensor>& block_table, double scale,
    int64_t window_lo, int64_t window_hi, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks);

}  // namespace attnx::cpu
