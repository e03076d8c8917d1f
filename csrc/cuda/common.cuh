// Device helpers shared by the attnx CUDA kernels: element types, the admissibility test
// (band + mask), and the dropout hash of attnx/_rng.py in uint32 arithmetic.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../cpu/huge_lse.h"
#include "../dropout_hash.h"
#include "device.cuh"
#include "launch.h"

namespace attnx {
namespace cuda {

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Whether x is finite: |x| at most float's largest (NaN compares false). One compare, where
// isfinite costs more; the bf16 backward's overflow tests (sdpa_bwd.cuh, sdpa_bwd_rerun.cu).
__device__ __forceinline__ bool finite_float(float x) { return fabsf(x) <= 3.402823466e38f; }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ uint32_t dropout_key_bh(const Dropout& d, uint32_t bh) {
  return mix32(d.seed0 ^ mix32(bh ^ d.seed1));
}

// Whether element (i, j) of head key_bh is kept, with dropout on.
__device__ __forceinline__ bool dropout_keeps(const Dropout& d, uint32_t key_bh, uint32_t i,
                                              uint32_t j) {
  return dropout_hash(dropout_row_key(key_bh, i), j) >= d.threshold;
}

// The factor element (i, j) of head key_bh is multiplied by: 0 (dropped), 1/(1-p) (kept), or 1
// without dropout.
__device__ __forceinline__ float dropout_factor(const Dropout& d, uint32_t key_bh, uint32_t i,
                                                uint32_t j) {
  if (!d.on) return 1.f;
  return dropout_keeps(d, key_bh, i, j) ? d.keep_scale : 0.f;
}

// Whether key j is admissible for query i by the sizes and the band lo <= j - i <= hi, and
// where element (b, h, i, j) of the mask lies.
__device__ __forceinline__ bool in_band(int64_t lo, int64_t hi, int i, int j, int Lq, int Lk) {
  const int64_t d = int64_t(j) - int64_t(i);
  return i < Lq && j < Lk && d >= lo && d <= hi;
}
__device__ __forceinline__ int64_t mask_offset(const MaskView& m, int b, int h, int i, int j) {
  return b * m.b + h * m.h + i * m.i + j * m.j;
}

// An admitted score as the forward carries it: finite inputs give an infinite float32 score
// only by overflow (|q . k scale| past 3.4e38), which is NaN here rather than a masked key's
// -inf (P = 0: a masked row of such scores would read as empty) or a max of +inf: the NaN
// reaches the row's sum, where the past-range test (sdpa_fwd.cuh) sends the row to a float64
// rerun. (The backward's key-block kernel flags any score of -inf before the band and the mask,
// and a score past the range gives it P of NaN, or the forward's lse, saturated at float's
// lowest, gives it a row sum of 0, and each flags its rerun; a saved lse of +inf is flagged by
// sdpa_bwd_rerun.cu's scan.)
__device__ __forceinline__ float overflow_as_nan(float s) {
  return fabsf(s) == INFINITY ? NAN : s;
}

// The score of (b, h, i, j) after the band and the mask of kind K: `s` plus the additive mask,
// or -inf when the key is not admissible (out of range, out of the band, or masked out); with
// kNanOverflow (the forward), an admitted infinite `s` is NaN (overflow_as_nan).
// Without a branch: the mask element is read by a predicated load, so a caller's unrolled loop
// over its scores (under one branch on the kind) stays one basic block and its loads overlap.
// Bool masks are read as bytes: a byte other than 0 or 1 read through bool* is undefined.
template <typename T, MaskKind K, bool kNanOverflow = false>
__device__ __forceinline__ float admit_as(float s, const MaskView& m, int64_t lo, int64_t hi,
                                          int b, int h, int i, int j, int Lq, int Lk) {
  const bool ok = in_band(lo, hi, i, j, Lq, Lk);
  if constexpr (kNanOverflow) s = overflow_as_nan(s);
  if constexpr (K == MaskKind::None) {
    return ok ? s : -INFINITY;
  } else if constexpr (K == MaskKind::Bool) {
    const uint8_t* mask = static_cast<const uint8_t*>(m.ptr);
    return (ok ? mask[mask_offset(m, b, h, i, j)] : uint8_t(0)) != 0 ? s : -INFINITY;
  } else {
    const T* mask = static_cast<const T*>(m.ptr);
    if constexpr (kNanOverflow) {  // a finite score and bias whose sum overflowed: NaN
      const float bias = ok ? to_float(mask[mask_offset(m, b, h, i, j)]) : 0.f;
      const float x = s + bias;
      return ok ? (fabsf(x) == INFINITY && fabsf(bias) != INFINITY ? NAN : x) : -INFINITY;
    }
    return ok ? s + to_float(mask[mask_offset(m, b, h, i, j)]) : -INFINITY;
  }
}

// x, held back until `dep` is known: where a loop folds its results into dep (dep |= bits of
// each), the values computed from after(x, dep) wait for all of them. Within one basic block
// the compiler otherwise issues every iteration's loads (or hashes) at once, which can take more
// registers than there are (sdpa_fwd.cuh's two row tiles: spills from D = 64 up).
__device__ __forceinline__ int after(int x, uint32_t dep) {
  asm volatile("" : "+r"(x) : "r"(dep));
  return x;
}

// The same with a branch per score, on any kind and in float or float64 (S; the reruns' scores,
// which float32 may not hold): for kernels that test a few scores a thread outside such a loop,
// where the predicated form's registers would not fit (the additive backward's 128). Scores
// here are bounded (additive) or float64: no overflow to tell from a masked key.
template <typename T, typename S = float>
__device__ __forceinline__ S admit(S s, const MaskView& m, int64_t lo, int64_t hi, int b, int h,
                                   int i, int j, int Lq, int Lk) {
  // in_band written out: in this form the additive backward fits its 128 registers
  const int64_t d = int64_t(j) - int64_t(i);
  if (i >= Lq || j >= Lk || d < lo || d > hi) return -INFINITY;
  if (m.kind == MaskKind::None) return s;
  const int64_t off = mask_offset(m, b, h, i, j);
  if (m.kind == MaskKind::Bool) return static_cast<const uint8_t*>(m.ptr)[off] != 0 ? s : -INFINITY;
  if (m.kind == MaskKind::Additive32) return s + S(static_cast<const float*>(m.ptr)[off]);
  return s + S(to_float(static_cast<const T*>(m.ptr)[off]));
}

// Element idx of a float mask's gradient dmask (contiguous, the mask's dtype: kind).
template <typename T>
__device__ __forceinline__ void store_mask_grad(void* dmask, MaskKind kind, int64_t idx, float g) {
  if (kind == MaskKind::Additive32)
    static_cast<float*>(dmask)[idx] = g;
  else
    static_cast<T*>(dmask)[idx] = from_float<T>(g);
}

// tanh(t) in float32 of a float64 t (NaN kept).
__device__ __forceinline__ float softcap_tanh(double t) {
  return tanhf(float(t < -20.0 ? -20.0 : t > 20.0 ? 20.0 : t));
}

// The scaled score x of a query and a key `dist` = |i - j| apart (SDPA; the KV cache: from the
// query's bottom-right diagonal) after the score modifiers (ScoreMods), before the mask:
// soft-capped, then ALiBi's -slope dist subtracted (slope: alibi[b * Hq + h], 0 without ALiBi).
// With a softcap, tc receives tanh(x / softcap), whose 1 - tc^2 is the cap's derivative (the
// backward's factor on dS); without, tc is left alone. An infinite x is NaN here, as admit_as
// makes it: from finite inputs it is an overflow (of the score, or of a dot's partial sums,
// whose sign then need not be the true score's, and which may be ordinary), which the cap would
// take as +-softcap, finite, and which without one exp would drop (-inf) beside finite scores,
// the row's lse ordinary either way: nothing else would flag it for the float64 rerun.
__device__ __forceinline__ float modified_score(float x, const ScoreMods& m, float slope,
                                                float dist, float& tc) {
  x = overflow_as_nan(x);
  if (m.softcap > 0.f) {
    tc = tanhf(x / m.softcap);
    x = m.softcap * tc;
  }
  return x - slope * dist;
}

// The same in float64, for the reruns of scores past float32's range. The tanh takes float32
// (as the kernels' own; its argument clamped to +-20, where it is +-1 in float32): float64's
// tanh is a long sequence whose registers spilled the decode kernel.
__device__ __forceinline__ double modified_score_f64(double x, const ScoreMods& m, float slope,
                                                     double dist) {
  if (m.softcap > 0.f) x = double(m.softcap) * double(softcap_tanh(x / double(m.softcap)));
  return x - double(slope) * dist;
}

// The ALiBi slope of head bh = b * Hq + h (0 without ALiBi).
__device__ __forceinline__ float alibi_slope(const ScoreMods& m, int64_t bh) {
  return m.alibi != nullptr ? m.alibi[bh] : 0.f;
}

constexpr float kLog2e = 1.4426950408889634f;

// One tile's step of an online-softmax row kept normalised (o = sum_j P_j v_j / l: a convex
// combination of values, finite where the unnormalised sum of values near bf16's largest
// overflowed float32; decode.cu, additive.cu): the row sum l, rescaled by a, takes the tile's
// sum. Returns 1 / l_new (0 while the row admits no key), by which the tile's P are divided; the
// output so far is multiplied by *rescale = a l_old / l_new.
__device__ __forceinline__ float normalised_step(float& l, float a, float tile_sum,
                                                 float* rescale) {
  const float l_new = l * a + tile_sum;
  const float inv = l_new > 0.f ? 1.f / l_new : 0.f;
  *rescale = a * l * inv;
  l = l_new;
  return inv;
}

// exp(x) for x <= 0 or -inf, through the fast exp2 unit.
__device__ __forceinline__ float fast_exp(float x) { return exp2_approx(x * kLog2e); }

// Whether a row's saved lse is too large for exp(s - lse) to rebuild its probabilities
// (csrc/cpu/huge_lse.h): they come out R times too large, R = sum_j exp(s_j - lse), which the
// backward passes divide out.
__device__ __forceinline__ bool huge_lse(float lse) {
  return fabsf(lse) > float(cpu::HUGE_LSE) && fabsf(lse) != INFINITY;
}

__host__ __device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

// The most dynamic shared memory a block may opt in to on devices that run code of `arch`
// (__CUDA_ARCH__ / 10, or device.cuh code_arch): an H100's 227 KB from sm_90 on, an A100's 163
// KB below. Parts with less run such code too (sm_86/89: sm_80 code, 99 KB; sm_120: sm_90 PTX,
// 99 KB): launches that pick a variant by it check the device as well (device_smem_optin).
__host__ __device__ constexpr size_t arch_smem_optin(int arch) {
  return arch >= 90 ? 227 * 1024 : 163 * 1024;
}

// launch(std::true_type{}) when `flag`, else launch(std::false_type{}): picks one of a kernel's
// two instantiations on a bool template flag (the score modifiers' kMods, the merge's kSinks)
// with one launch expression, `decltype(flag)::value` in it.
template <typename Launch>
cudaError_t launch_on_flag(bool flag, Launch&& launch) {
  return flag ? launch(std::true_type{}) : launch(std::false_type{});
}

// What an SDPA kernel needs of its batch index b: SDPA's batch b (the params' sizes and band),
// or packed sequence b (SdpaParams::cu_q): its lengths, its band shifted to its bottom-right
// diagonal, and its first query and key rows.
struct SeqView {
  int Lq, Lk;
  int64_t lo, hi;  // key j admissible for query i iff lo <= j - i <= hi
  int q0, k0;      // the first row of q and of k, v
  int diag;        // ALiBi's distance is |i + diag - j|: 0 (SDPA, top-left) or Lk - Lq
};

__device__ __forceinline__ SeqView seq_view(const SdpaParams& p, int b) {
  if (p.cu_q == nullptr) return {p.Lq, p.Lk, p.window_lo, p.window_hi, 0, 0, 0};
  const int q0 = p.cu_q[b], k0 = p.cu_k[b];
  const int Lq = p.cu_q[b + 1] - q0, Lk = p.cu_k[b + 1] - k0, diag = Lk - Lq;
  return {Lq, Lk, p.window_lo + diag, p.window_hi + diag, q0, k0, diag};
}

// The first element's row of query head h of batch (sequence) b in the buffers indexed by query
// row: (B, Hq, Lq, .) or, packed, (Hq, total_q, .).
__device__ __forceinline__ int64_t query_rows(const SdpaParams& p, const SeqView& s, int b, int h) {
  return p.cu_q == nullptr ? (int64_t(b) * p.Hq + h) * p.Lq : int64_t(h) * p.total_q + s.q0;
}

// The same of kv head hk in dk and dv: (B, Hkv, Lk, .) or, packed, (Hkv, total_k, .).
__device__ __forceinline__ int64_t key_rows(const SdpaParams& p, const SeqView& s, int b, int hk) {
  return p.cu_q == nullptr ? (int64_t(b) * p.Hkv + hk) * p.Lk : int64_t(hk) * p.total_k + s.k0;
}

// The dropout key of query head h of batch b; of a packed sequence b, that of a batch-1 call
// with the sequence's seed (seed0, mix32(seed1 + b + 1)): attnx/_rng.py sequence_seed.
__device__ __forceinline__ uint32_t sdpa_dropout_key(const SdpaParams& p, int b, int h) {
  if (p.cu_q == nullptr) return dropout_key_bh(p.drop, uint32_t(int64_t(b) * p.Hq + h));
  Dropout d = p.drop;
  d.seed1 = mix32(p.drop.seed1 + uint32_t(b) + 1u);
  return dropout_key_bh(d, uint32_t(h));
}

// Key tiles [t0, t1] that hold an admissible key for some query in rows [i0, i1]; t1 < t0
// when there is none. Keys outside i + lo <= j <= i + hi are never read.
__device__ __forceinline__ void key_tile_range(int i0, int i1, int Lk, int64_t lo, int64_t hi,
                                               int tile, int& t0, int& t1) {
  const int64_t jlo = max(int64_t(0), int64_t(i0) + lo);
  const int64_t jhi = min(int64_t(Lk) - 1, int64_t(i1) + hi);
  t0 = int(jlo / tile);
  t1 = jhi < jlo ? t0 - 1 : int(jhi / tile);
}

}  // namespace cuda
}  // namespace attnx
