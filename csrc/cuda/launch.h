// The plain-C++ interface between the host code (register_cuda.cpp, torch headers) and the
// CUDA kernels (*.cu, CUDA headers only, so nvcc never parses torch). Everything a kernel needs
// is a raw pointer, a size or a stride counted in elements.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace attnx {
namespace cuda {

enum class DType : int { Half = 0, BFloat16 = 1 };
// A float mask is added to the scores: Additive in q's dtype, Additive32 in float32 with half
// q (torch's rule for masks: bool, float32 or q's dtype; the additive kernels read it, the SDPA
// kernels do not: kernel_ops.cpp mask_view). Its gradient has its dtype.
enum class MaskKind : int { None = 0, Bool = 1, Additive = 2, Additive32 = 3 };

// A (B, H, L, D) tensor whose last dim is contiguous. vec16: its data pointer is 16-byte
// aligned and b, h, l and D are multiples of 8 elements, so rows can be read 16 bytes at a time.
struct Strides4 {
  int64_t b, h, l;
  bool vec16;
};

// The (B, Hq, Lq, Lk) mask view, any strides (0 on broadcast dims).
struct MaskView {
  const void* ptr = nullptr;
  MaskKind kind = MaskKind::None;
  int64_t b = 0, h = 0, i = 0, j = 0;
};

// Dropout of attnx/_rng.py: keep iff hash(seed, b*Hq+h, i, j) >= threshold; kept values are
// multiplied by keep_scale = 1 / (1 - p).
struct Dropout {
  bool on = false;
  uint32_t seed0 = 0, seed1 = 0, threshold = 0;
  float keep_scale = 1.f;
};

// The score modifiers of API.md, read only by the kernels instantiated with kMods (the plain
// kernels keep their code): on the scaled score of query i and key j, before the mask,
// s <- softcap tanh(s / softcap) (softcap 0: none), then s <- s - alibi[b * Hq + h] |i - j|
// (top-left); sinks[h] joins every row's softmax denominator and its lse.
struct ScoreMods {
  float softcap = 0.f;
  const float* alibi = nullptr;  // (B, Hq) fp32 contiguous, or null
  const float* sinks = nullptr;  // (Hq) fp32, or null
  bool any() const { return softcap > 0.f || alibi != nullptr || sinks != nullptr; }
};

struct SdpaParams {
  DType dtype;
  int B, Hq, Hkv, Lq, Lk, E, Ev;
  float scale;
  int64_t window_lo, window_hi;  // key j admissible for query i iff lo <= j - i <= hi
  const void *q, *k, *v;
  Strides4 sq, sk, sv;
  MaskView mask;
  Dropout drop;
  ScoreMods mods;
  // forward outputs: out (B, Hq, Lq, Ev) and lse (B, Hq, Lq), both contiguous (backward
  // inputs too)
  void* out;
  float* lse;
  // The forward kernel's row-sums mode (the backward's first pass), when set: it reads lse
  // instead and writes row_sums (B, Hq, Lq), R_i = sum_j exp(s_ij - lse_i) on rows of huge lse
  // (common.cuh), 1 on the others, and no out. The backward kernels read them.
  float* row_sums;
  // backward inputs (contiguous): grad_out (B, Hq, Lq, Ev); grad_lse fp32 (B, Hq, Lq) or null
  const void* dout;
  const float* grad_lse;
  // backward outputs, contiguous: dq_acc fp32 (B, Hq, Lq, E) zeroed, dk (B, Hkv, Lk, E),
  // dv (B, Hkv, Lk, Ev) in the input dtype; dmask (B, Hq, Lq, Lk) zeroed or null; delta fp32
  // (B, Hq, Lq), written by sdpa_bwd_delta and read by the backward kernels.
  float* dq_acc;
  void *dk, *dv, *dmask;
  float* delta;
  // One float, zeroed; the key-block kernels set it to 1 where a dK or dV came out non-finite,
  // and sdpa_bwd_rerun (given rerun_max, as kernel_ops.cpp always gives) then computes dq_acc,
  // dk, dv, dmask and delta again in float64. Unset, sdpa_bwd_rerun's scan sets dq_nonfinite
  // (one float, zeroed) where dq_acc holds inf or NaN, and its query pass redoes those rows.
  float* overflowed = nullptr;
  float* dq_nonfinite = nullptr;
  // With it, where the sinks' gradient is asked for: (Hq) float64, zeroed; the rerun adds each
  // row's term -P_sink,i delta_i there (delta may pass float's range), or null.
  double* dsinks = nullptr;
  // The rerun's rows (as delta), from its query pass to its key pass, in float64: the scores'
  // max, 1 / the sum of exp(s - max), and delta; null: no rerun.
  double* rerun_max = nullptr;
  double* rerun_inv_r = nullptr;
  double* rerun_delta = nullptr;
  // Packed variable-length batches (varlen_attention), when cu_q is set: batch index b is
  // sequence n = b of B, whose queries are rows cu_q[n]..cu_q[n+1] - 1 of q (a (1, Hq, total_q,
  // E) view, sq.b = 0) and keys rows cu_k[n].. of k and v; Lq and Lk are the longest
  // sequence's (they size the grid), the sequence's own come from cu_q and cu_k (SeqView,
  // common.cuh). Its band and ALiBi distances are aligned bottom-right (window_lo, window_hi
  // relative to the diagonal j = i + Lk_n - Lq_n), its dropout is a batch-1 call's with the
  // sequence's seed (attnx/_rng.py sequence_seed), and the buffers indexed by query row (out,
  // lse, row sums, grad_out, grad_lse, delta, dq_acc) are (Hq, total_q, .), those indexed by
  // key row (dk, dv) (Hkv, total_k, .). No mask.
  const int* cu_q = nullptr;
  const int* cu_k = nullptr;
  int64_t total_q = 0, total_k = 0;
};

struct AdditiveParams {
  DType dtype;
  int B, H, Lq, Lk, A, Ev;
  int64_t window_lo, window_hi;
  const void *q, *k, *value, *v;  // v: (H, A) with strides vh, va
  Strides4 sq, sk, svalue;
  int64_t vh, va;
  MaskView mask;
  Dropout drop;
  void* out;  // (B, H, Lq, Ev) contiguous
  float* lse;  // (B, H, Lq)
  float* weights;  // (B, H, Lq, Lk) contiguous fp32 or null (the backward's D takes them unrounded)
  float* weight_max;  // with weights: (B, H, Lq, additive_key_tiles(Lk)) scratch
  // backward (all contiguous): dout (B, H, Lq, Ev); fp32 accumulators, zeroed:
  // dq (B, H, Lq, A), dk (B, H, Lk, A), dvalue (B, H, Lk, Ev), dv (B * additive_query_tiles(Lq),
  // H, A): each CTA's own partial sums of v's gradient, which the host adds up; dmask as in SDPA;
  // delta fp32 (B, H, Lq) = rowsum(dout * out) less grad_lse; dweights fp32 (B, H, Lq, Lk) or
  // null.
  const void* dout;
  const float* dweights;
  float *dq, *dk, *dvalue, *dv, *delta;
  void* dmask;
  // additive_bwd_rerun's inputs. overflowed: a device bool, set where v's gradient or dvalue came
  // out non-finite; grad_lse fp32 (or null), which its delta takes again; row_r fp32 and
  // row_delta float64 (B, H, Lq) scratch; dv64 (H, A) float64, zeroed.
  const bool* overflowed = nullptr;
  const float* grad_lse = nullptr;
  float* row_r = nullptr;
  double *row_delta = nullptr, *dv64 = nullptr;
};

// The SDPA kernels are built for head-dim families: family D serves every E, Ev <= D (the
// tiles are zero-filled past E and Ev). Each family lives in its own translation unit
// (sdpa_fwd_d64.cu, ...), so the families compile in parallel. The forward's and the
// backward's differ: the backward's dK and dV registers grow with D.
constexpr int kSdpaFwdFamilies[] = {32, 64, 96, 128, 160, 192, 256};

// The forward family serving head dims E, Ev up to `dim`, or 0 past the largest.
constexpr int sdpa_fwd_family_of(int dim) {
  for (int D : kSdpaFwdFamilies)
    if (dim <= D) return D;
  return 0;
}
template <int D>
cudaError_t sdpa_fwd_family(const SdpaParams& p, cudaStream_t stream);
// The backward's families, all on the mma.sync design (sdpa_bwd.cuh): the forward's, so
// padding wastes at most 25%; above 128 the dK and dV registers are split over twice the warps.
constexpr int kSdpaBwdFamilies[] = {32, 64, 96, 128, 160, 192, 256};
template <int D>
cudaError_t sdpa_bwd_family(const SdpaParams& p, cudaStream_t stream);
// The backward's pre-pass: p.delta from p.dout, p.out and p.grad_lse.
cudaError_t sdpa_bwd_delta(const SdpaParams& p, cudaStream_t stream);
// The backward's slow path, after the key-block kernels, for bf16 values near the dtype's
// largest, scores past float's range and fp16 dS past 65504 (sdpa_bwd_rerun.cu): everything
// where they set *p.overflowed, else the non-finite rows of dq_acc; nothing without
// p.rerun_max.
cudaError_t sdpa_bwd_rerun(const SdpaParams& p, cudaStream_t stream);
// The additive backward's (additive_bwd_rerun.cu): nothing unless *p.overflowed.
cudaError_t additive_bwd_rerun(const AdditiveParams& p, cudaStream_t stream);

// Shared memory the forward (backward) SDPA launch requests for head dims E, Ev up to `dim`
// (the serving family's Config::smem_bytes; 0 past the largest family). The backward's is its
// 64-key variant's, which every launch can fall back on; sdpa_bwd_kt2_smem_bytes: its 128-key
// variant's, which launches where the device holds it (sdpa_bwd.cuh; 0 outside families 64-128).
size_t sdpa_smem_bytes(bool backward, int dim);
size_t sdpa_bwd_kt2_smem_bytes(int dim);

// Each returns the cudaError_t of its launches (cudaSuccess when nothing had to run).
// Shared memory the additive kernels need for value dim Ev (the host checks it fits).
size_t additive_smem_bytes(int Ev);
// The additive kernels' query tiles per (batch, head): the CTAs of their grid's x dim.
int additive_query_tiles(int Lq);
// Their key tiles: the weights' scratch of row maxima holds one per query and key tile.
int additive_key_tiles(int Lk);
cudaError_t launch_additive_fwd(const AdditiveParams& p, cudaStream_t stream);
cudaError_t launch_additive_bwd(const AdditiveParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace attnx
