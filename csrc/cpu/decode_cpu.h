// Decoding attention against a KV cache on the CPU (attnx::kvcache_fwd; conventions:
// csrc/ops.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <optional>
#include <tuple>

#include "score_mods.h"
#include "sdpa_mask.h"

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

// SDPA's forward (sdpa_cpu.cpp's `forward` routes a few query rows here) on this kernel: q
// (B, Hq, Lq, E), k and v (B, Hkv, Lk, .) float32, float64, bfloat16 or float16, checked by the
// caller; the band top-left (query i may attend keys i + band_lo .. i + band_hi), ALiBi's
// diagonal key i + mods.alibi_offset. Returns out in q's dtype and lse in float64 for float64,
// else float32, as the SDPA forward does.
std::tuple<at::Tensor, at::Tensor> sdpa_decode_fwd(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const MaskRows& mask,
                                                   double scale, int64_t band_lo,
                                                   int64_t band_hi, const ModArgs& mods);

}  // namespace attnx::cpu
