// The attnx operator library, its schemas (op_schemas.h) declared once. Each device registers its kernels in its own
// TORCH_LIBRARY_IMPL (csrc/cpu/register_cpu.cpp, csrc/cuda/register_cuda.cpp); fake kernels and
// autograd are registered from Python (attnx/_ops.py).
//
// Conventions shared by every kernel:
//   q (B, Hq, Lq, E), k (B, Hkv, Lk, E), v (B, Hkv, Lk, Ev), Hq % Hkv == 0 (GQA: head h reads
//   key/value head h / (Hq / Hkv)). mask: None, or a (B, Hq, Lq, Lk) view of dtype bool (true =
//   may attend), q's dtype or float32 (added to the scaled scores; the CUDA SDPA kernels take
//   q's dtype only; a float mask's gradient has its dtype), read through its strides (size-1
//   dims broadcast with stride 0). Key j is admissible for query i iff
//   i + window_lo <= j <= i + window_hi (and the mask allows it); the bounds are SymInts in the
//   schemas (a lower-right causal offset Lk - Lq stays symbolic under torch.compile; the
//   kernels take them as int64_t, the dispatcher passing concrete values). lse is (B, Hq, Lq), float32
//   (float64 for sdpa on float64 inputs, so that gradcheck-grade backward stays exact), -inf
//   for rows with no admissible key, whose output is zero. seed: int64 (2,) on the CPU,
//   the dropout hash key of attnx/_rng.py. A gradient that is not asked for comes back empty.
//   grad_lse (backward ops): the gradient of lse, or None. Since d lse_i / d s_ij = P_ij, it
//   only turns the softmax backward's D_i = rowsum(dO * O) into D_i - grad_lse_i.
//   grad_weights (additive_bwd): the gradient of the weights output W = P * z (z: the dropout
//   factor), or None. It adds z_ij * grad_weights_ij to dP_ij; its part of D_i,
//   rowsum(W * grad_weights), the caller folds into grad_lse (it has W, the kernel does not).
//   So additive_fwd returns W float32 (float64 for float64 inputs) whatever q's dtype, the
//   public function rounding it to q's: rowsum(W * grad_weights) must see the W the kernel's
//   P * z makes, not one rounded to 16 bits (on a one-hot row, fp16's rounding of 1 / (1 - p)
//   times grad_weights, times v, came back in dq where the truth is 0).
#include <torch/library.h>

#include "op_schemas.h"

TORCH_LIBRARY(attnx, m) {
  for (const char* schema : attnx::kOpSchemas) m.def(schema);
  // kvcache_fwd (in kOpSchemas): decoding against a KV cache. k_cache (B, Hkv, Lmax, E), or
  // paged (num_blocks, Hkv, block_size, E) with block_table int32 (B, max_blocks): position p
  // of sequence b is slot p % block_size of block block_table[b, p // block_size]. seqlens
  // int32 (B,): keys 0 .. seqlens[b] - 1 are attended, slots past them never read. The band is
  // aligned bottom-right: query i admits key j iff i + d + window_lo <= j <= i + d + window_hi,
  // d = seqlens[b] - Lq. out (B, Hq, Lq, Ev) in q's dtype, lse (B, Hq, Lq) float32.
  // kvcache_mod_fwd (in kOpSchemas): with the score modifiers of sdpa_mod_fwd, ALiBi aligned
  // bottom-right: -alibi_slopes[b, h] |i + d - j|.
  // varlen_fwd / varlen_bwd (in kOpSchemas): packed variable-length batches, q (total_q, Hq,
  // E), k (total_k, Hkv, E), v (total_k, Hkv, Ev); cu_seqlens_q/k int32 (N + 1,) prefix sums:
  // sequence n is rows cu[n]:cu[n+1] and attends only to itself, its query i admitting key j
  // iff i + d + window_lo <= j <= i + d + window_hi, d = Lk_n - Lq_n (bottom-right). out
  // (total_q, Hq, Ev), lse (Hq, total_q) (float64 for float64 inputs, as sdpa_fwd). Sequence
  // n's dropout seed: attnx/_rng.py sequence_seed. varlen_mod_fwd / varlen_mod_bwd: with the
  // score modifiers of sdpa_mod_fwd, alibi_slopes float32 (N, Hq), one row per sequence,
  // aligned bottom-right in each (-alibi_slopes[n, h] |i + d - j|); sinks (Hq). A sequence
  // without keys gives its rows lse = the sink. The backward returns dsinks (Hq) in sinks'
  // dtype when sinks_grad, else empty.
}
