// The attnx operator schemas (their conventions: ops.cpp). The host harness registers the same
// schemas as the attnx_cuda_host library (csrc/cuda/host/register_host.cpp).
#pragma once

namespace attnx {

inline constexpr const char* kOpSchemas[] = {
    "sdpa_fwd(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, SymInt window_lo, "
        "SymInt window_hi, float dropout_p, Tensor? seed) -> (Tensor out, Tensor lse)",
    "sdpa_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor out, "
        "Tensor lse, float scale, SymInt window_lo, SymInt window_hi, float dropout_p, Tensor? seed, "
        "bool mask_grad, Tensor? grad_lse=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dmask)",
    // SDPA with the score modifiers of API.md (cpu and cuda kernels). On the scaled score s of
    // query i and key j, before the mask: s <- softcap tanh(s / softcap) (softcap 0: none),
    // then s <- s - alibi_slopes[b, h] |i - j| (float32 (B, Hq), top-left); sinks (Hq):
    // sink[h] joins every row's softmax denominator, and lse includes it. The backward returns
    // dsinks (Hq) in sinks' dtype when sinks_grad, else empty.
    "sdpa_mod_fwd(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, SymInt window_lo, "
        "SymInt window_hi, float dropout_p, Tensor? seed, float softcap, Tensor? alibi_slopes, "
        "Tensor? sinks) -> (Tensor out, Tensor lse)",
    "sdpa_mod_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor out, "
        "Tensor lse, float scale, SymInt window_lo, SymInt window_hi, float dropout_p, Tensor? seed, "
        "bool mask_grad, Tensor? grad_lse, float softcap, Tensor? alibi_slopes, Tensor? sinks, "
        "bool sinks_grad) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dmask, Tensor dsinks)",
    // Additive (Bahdanau): score[i, j] = sum_a v[h, a] * tanh(q[i, a] + k[j, a]); no scale, no
    // GQA (k and value have q's heads); v is (H, A). weights (B, H, Lq, Lk) are the
    // probabilities after dropout, float32 (float64 for float64 q) whatever q's dtype
    // (ops.cpp: grad_weights), returned only when return_weights, else empty.
    "additive_fwd(Tensor q, Tensor k, Tensor value, Tensor v, Tensor? mask, SymInt window_lo, "
        "SymInt window_hi, float dropout_p, Tensor? seed, bool return_weights) -> "
        "(Tensor out, Tensor lse, Tensor weights)",
    "additive_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor value, Tensor v, Tensor? mask, "
        "Tensor out, Tensor lse, SymInt window_lo, SymInt window_hi, float dropout_p, Tensor? seed, "
        "bool mask_grad, Tensor? grad_lse=None, Tensor? grad_weights=None) -> "
        "(Tensor dq, Tensor dk, Tensor dvalue, Tensor dv, Tensor dmask)",
    // Decoding against a KV cache (conventions: ops.cpp); no backward: an inference op.
    "kvcache_fwd(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seqlens, Tensor? block_table, "
        "float scale, SymInt window_lo, SymInt window_hi) -> (Tensor out, Tensor lse)",
    "kvcache_mod_fwd(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seqlens, "
        "Tensor? block_table, float scale, SymInt window_lo, SymInt window_hi, float softcap, "
        "Tensor? alibi_slopes, Tensor? sinks) -> (Tensor out, Tensor lse)",
    // Packed variable-length batches (conventions: ops.cpp), without and with the modifiers.
    "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "float scale, SymInt window_lo, SymInt window_hi, float dropout_p, Tensor? seed) -> "
        "(Tensor out, Tensor lse)",
    "varlen_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, Tensor out, Tensor lse, float scale, SymInt window_lo, SymInt window_hi, "
        "float dropout_p, Tensor? seed, Tensor? grad_lse=None) -> (Tensor dq, Tensor dk, Tensor dv)",
    "varlen_mod_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "float scale, SymInt window_lo, SymInt window_hi, float dropout_p, Tensor? seed, float softcap, "
        "Tensor? alibi_slopes, Tensor? sinks) -> (Tensor out, Tensor lse)",
    "varlen_mod_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, Tensor out, Tensor lse, float scale, SymInt window_lo, SymInt window_hi, "
        "float dropout_p, Tensor? seed, Tensor? grad_lse, float softcap, Tensor? alibi_slopes, "
        "Tensor? sinks, bool sinks_grad) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)",
};

}  // namespace attnx
