// SDPA forward on FlashAttention-2's design: mma.sync m16n8k16 (fp32 accumulate) with S, P and O
// in registers, the online softmax on the accumulator fragments, ldmatrix from shared memory and
// cp.async double-buffered K/V tiles (mma.cuh documents the primitives and fragment layouts).
//
// One CTA per (query tile of kBM = 128 rows, query head, batch): 4 warps of two 16-row tiles
// each up to D = 128, 8 warps of one above (Config::MT); warp w owns rows 16 MT w .. 16 MT (w +
// 1) - 1, and in each m16n8 fragment lane (g = lane / 4, t = lane % 4) holds rows g and g+8 of
// its tile, columns 2t and 2t+1 of every 8-column block. Per key tile of BN keys:
//   S = Q K^T    A: Q from shared memory (ldmatrix.x4), B: K rows (ldmatrix.x4, two 8-key blocks)
//   softmax      row max over the thread's elements, then its lane quad (shuffles 1, 2); P =
//                exp2(v c - m c) is one FFMA + MUFU.EX2 per element, with c = scale log2(e)
//                folding the scale in (v the raw score); with an additive mask, scale <= 0 or
//                in the row-sums mode v is the scaled score plus the mask and P = exp2((v - m)
//                log2(e)); a warp whose row maxima pass kFoldLimit takes exp2((v - m) c)
//                (exp_diff)
//   O = O alpha + P V   P's accumulators repacked in registers as the A operand (the C layout
//                of two 8-key blocks is the A layout of one 16-key step), V through
//                ldmatrix.x4.trans
// The running row sum l stays per thread (each adds its own columns) and is reduced over the
// quad once at the end. While tile t is computed, tile t+1's K and V are in flight (cp.async,
// one commit group per tile, two shared-memory stages).
//
// Shared memory: Q (kBM x D) and two stages of K and V (BN x D), rows padded to D + 8 elements.
// D / 8 is even for every family, so a row spans an odd number of 16-byte chunks: the 8 rows an
// ldmatrix (or 8 lanes' cp.async) touch fall in 8 different bank quads, conflict-free. An XOR
// swizzle would need 8 chunks per row group, which families 32 and 96 (4 and 12 chunks) lack;
// the padding costs 16 bytes a row (3-25%) and keeps one addressing rule for all families.
//
// Layout assumptions: q, k, v have a contiguous last dim (the host guarantees it); E, Ev <= D;
// tiles are zero-filled past Lq, Lk, E and Ev (cp.async's zero-fill with 16-byte aligned rows,
// plain loads otherwise). Key tiles outside the band are skipped; tiles wholly inside it, within
// Lk and without a mask skip the per-element admissibility test. A row with no admissible key
// ends with l = 0 and is written as zeros with lse = -inf. Warps whose rows all lie past Lq
// only help load.
//
// Row-sums mode (p.row_sums set; the backward's first pass): the same scores and running m, l
// without P V, ending with R_i = sum_j exp(s_ij - lse_i) = l exp(m - lse_i) against the saved
// lse for rows of huge lse; query tiles with no such row write R = 1 and stop at once.
//
// Rows redone in float64 (rerun_row, once the tiles are done): rows whose scores passed
// float32's range (|q . k scale| past 3.4e38 from finite inputs, or a partial sum of it: a
// score of -inf before the band and mask; past_range), and bf16 rows whose O came out
// non-finite (values near bf16's largest).
//
// Score modifiers (p.mods, API.md; the kMods instantiation only, so the plain kernels keep their
// code and registers): each score is scaled, soft-capped (softcap tanh(s / softcap)) and ALiBi's
// -slope |i - j| subtracted before the band and the mask; P then takes exp_diff's unfolded
// path (natural units, as with a float mask). The sink joins at the end as one more score of no
// value: m and l absorb exp(sink - m) after the key tiles, so lse, the output's 1 / l and the
// row sums R include it, and a row without an admissible key gets zeros and lse = the sink.
//
// Packed sequences (p.cu_q set, launch.h; varlen_attention): blockIdx.z is a sequence, whose
// lengths, bottom-right band, ALiBi offset and first rows come from SeqView (common.cuh); the
// grid is sized by the longest sequence, and the CTAs of query tiles past a shorter one's end
// return at once. The kernel is the same: sizes that were parameters are SeqView's registers.
#pragma once

#include <algorithm>

#include "common.cuh"
#include "float64_rerun.cuh"
#include "mma.cuh"
#include "tile_copy.cuh"

namespace attnx {
namespace cuda {
namespace sdpa_fwd_impl {

constexpr int kBM = 128;

// m16 row tiles per warp in code compiled for sm_90 or later (sm90) or below. Two up to D
// = 128 from sm_90 on (FA2's 4 warps x 32 rows): each K and V fragment read from shared memory
// then serves two MMAs (0.31-0.38 LDSM per HMMA in the main loop, was 0.56 with 8 warps x 16
// rows: shared-memory reads alone bound that near 450 TFLOP/s on an H200), and two CTAs per SM
// overlap one's softmax with the other's MMAs where one CTA of 8 warps moved in lockstep
// between its barriers. One tile otherwise: above 128, O alone would take D registers of a
// thread, and sm_80 code spills with two (8-300 bytes a kernel from the same source; ptxas
// 13.0).
constexpr int row_tiles(int D, bool sm90) { return sm90 && D <= 128 ? 2 : 1; }

template <int D, int MT>
struct Config {
  static_assert(D % 16 == 0 && D <= 256, "families are multiples of 16 up to 256");
  static_assert(MT == 1 || (MT == 2 && D <= 128), "two row tiles up to D = 128");
  static constexpr int kWarps = kBM / (16 * MT);
  static constexpr int kThreads = 32 * kWarps;
  // registers: S takes MT BN / 2 floats a thread, O MT D / 2 (64 keys spill from MT D = 192)
  static constexpr int BN = D * MT > 128 ? 32 : 64;
  static constexpr int LD = D + 8;  // padded rows (see above)
  // 255 registers a thread either way: two CTAs of 4 warps or one of 8 per SM (two of 8 would
  // cap them at 128, where every family spills; ptxas -v, tests/test_cuda_resources.py).
  static constexpr int kMinBlocks = MT == 2 ? 2 : 1;
  static constexpr size_t smem_bytes = 2 * (size_t(kBM) * LD + 2 * 2 * size_t(BN) * LD);
};

// The dynamic shared memory a launch of family D may request, on any device.
template <int D>
constexpr size_t smem_bytes() {
  return std::max(Config<D, row_tiles(D, false)>::smem_bytes,
                  Config<D, row_tiles(D, true)>::smem_bytes);
}

// exp(v - m) in the units of v, c = log2(e) times the scale v still needs (scale log2(e) for
// raw scores, log2(e) for scaled ones): with the scale folded in, one FFMA and EX2 (m c is
// common to a row's elements); else subtract first: v, m may be as large as the dtype's finite
// range (huge-bias rows), where v c would overflow, or m c so large that its rounding is not
// small (kFoldLimit).
template <bool kFold>
__device__ __forceinline__ float exp_diff(float v, float m, float c) {
  return kFold ? exp2_approx(fmaf(v, c, -__fmul_rn(m, c))) : exp2_approx((v - m) * c);
}

// log2 of a row's rescale alpha = 2^(R_old - R_new), R the reference its tiles' exponents
// subtract: fl(m c) in folded tiles (exp_diff<true>), m c exactly in the others (cs = c, or
// log2(e) for scaled scores). Taken as the tiles took them, a row's earlier terms stay in step
// with its new ones: the folded tiles' alpha was exp2(m_old c - fl(m c)), 2^(m c - fl(m c))
// rather than 1 while the max stood still, compounding tile after tile (up to 2^(T / 32) over T
// tiles just below kFoldLimit; 2^-20 over 1k tiles at scores near 10).
__device__ __forceinline__ float rescale_log2(float m_old, float mu, float c, float cs,
                                              bool was_folded, bool folded) {
  if (folded)
    return was_folded ? __fmul_rn(m_old, c) - __fmul_rn(mu, c) : fmaf(m_old, c, -__fmul_rn(mu, c));
  return was_folded ? fmaf(-mu, c, __fmul_rn(m_old, c)) : (m_old - mu) * cs;
}

// |m c| up to which the folded form is exact enough: exp2(v c - fl(m c)) gives a row's largest
// score 2^err, |err| <= ulp(m c) / 2, 2^-5 below 2^20. A huge scale or huge q and k (scaled
// scores of 1e6 and more) pass it, and the error grows with them: at 3e8, P of the largest
// score came out 2^-64, which fp16 flushed to zero (a zero output row); at 1e9, 2^+256 = inf
// (NaN). Tiles past it subtract first.
constexpr float kFoldLimit = 1048576.f;

// P = exp(v - mu) over a thread's score fragments (rows g and g + 8: e / 2), in place, and the
// row sums l += P, before dropout.
template <bool kFold, int NB>
__device__ __forceinline__ void exp_scores(float (&s)[NB][4], const float (&mu)[2], float c,
                                           float (&l)[2]) {
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nb][e] = exp_diff<kFold>(s[nb][e], mu[e / 2], c);
      l[e / 2] += s[nb][e];
    }
}

// bf16 rows whose O overflowed: O = sum_j P_j v_j with P <= 1 passes float32's largest for bf16
// values near theirs (3.4e38) over a few keys (inf out, or NaN after a rescale). fp16 values
// (at most 65504) cannot overflow O: its kernels skip the test.
template <typename T>
constexpr bool kMayOverflowO = std::is_same<T, __nv_bfloat16>::value;

// Whether a row's float32 scores passed float's range, from its final (quad-reduced) max m and
// sum l, before the sink: an overflowed score is +inf (m), or NaN (overflow_as_nan on the
// masked tiles; inf - inf in an MMA's sum) whose exponential reaches l. Unmasked tiles keep a
// -inf score as it is: a row whose every score overflowed to -inf ends with l = 0 though its
// band (without a mask, all it admits by) holds keys; a row with some such score beside finite
// ones gets l = NaN in the tiles' loop.
__device__ __forceinline__ bool past_range(float m, float l, const SdpaParams& p,
                                           const SeqView& seq, int i) {
  if (!(l >= 0.f) || m == INFINITY) return true;
  if (l != 0.f || p.mask.kind != MaskKind::None) return false;
  return max(int64_t(0), i + seq.lo) <= min(int64_t(seq.Lk) - 1, i + seq.hi);
}

// Row i's output and lse again, by one warp, in float64 (float64_rerun.cuh): each score as the
// tiles form it (scaled, modified, admitted by band and mask of any kind), an online softmax,
// dropout's factor on P V, the sink at the end. Key by key, lanes over the columns (scores
// reduced across the warp): a slow path with few registers, after the tiles' loop, which keeps
// its code and registers (a second pass through that loop spilled in the bf16 D = 64..256
// kernels, ptxas 13.0). Products of values up to 65504^2 or 3.4e38^2, scaled by up to 2.4e38,
// stay within float64's range.
template <typename T, int D, bool kMods>
__device__ __forceinline__ void rerun_row(const SdpaParams& p, const SeqView& seq, int b, int h,
                                          const T* q_row, const T* k, const T* v, int64_t row,
                                          int i, float slope, uint32_t key_bh) {
  constexpr int U = D / 32;  // columns a lane: every family is a multiple of 32
  const int lane = threadIdx.x % 32;
  float q[U];
  double o[U];
#pragma unroll
  for (int u = 0; u < U; ++u) q[u] = to_float(q_row[lane + 32 * u]), o[u] = 0.0;  // 0 past E
  RowSoftmax64 sm;
  const int64_t j_lo = max(int64_t(0), i + seq.lo), j_hi = min(int64_t(seq.Lk) - 1, i + seq.hi);
  for (int j = int(j_lo); j <= j_hi; ++j) {
    double x = 0.0;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = lane + 32 * u;
      if (c < p.E) x += double(q[u]) * double(to_float(k[j * p.sk.l + c]));
    }
#pragma unroll
    for (int w = 16; w >= 1; w /= 2) x += __shfl_xor_sync(0xffffffffu, x, w);
    x *= double(p.scale);
    if constexpr (kMods) x = modified_score_f64(x, p.mods, slope, fabs(double(i + seq.diag - j)));
    x = admit<T, double>(x, p.mask, seq.lo, seq.hi, b, h, i, j, seq.Lq, seq.Lk);
    if (x == -INFINITY) continue;  // warp-uniform: every lane holds the sum
    double a;
    const double w = sm.add(x, &a) * dropout_factor(p.drop, key_bh, i, j);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = lane + 32 * u;
      if (c < p.Ev) o[u] = o[u] * a + w * double(to_float(v[j * p.sv.l + c]));
    }
  }
  if (kMods && p.mods.sinks != nullptr && p.mods.sinks[h] != -INFINITY) {
    double a;
    sm.add(p.mods.sinks[h], &a);  // one more score, of no value
#pragma unroll
    for (int u = 0; u < U; ++u) o[u] *= a;
  }
  T* out = static_cast<T*>(p.out) + row * p.Ev;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = lane + 32 * u;
    if (c < p.Ev) out[c] = from_float<T>(sm.l != 0.0 ? saturated(o[u] / sm.l) : 0.f);
  }
  if (lane == 0) p.lse[row] = sm.lse();
}

// kMods: the score modifiers (p.mods) are applied; the plain instantiation has none of their
// code. MT: row tiles per warp (Config).
template <typename T, int D, bool kMods, int MT>
__device__ __forceinline__ void sdpa_fwd_tiles(const SdpaParams& p) {
  using C = Config<D, MT>;
  constexpr int BN = C::BN, LD = C::LD, kThreads = C::kThreads;
  constexpr int NB = BN / 8;  // 8-key blocks of S
  constexpr int DB = D / 8;   // 8-column blocks of O
  ATTNX_DYNAMIC_SMEM(unsigned char, smem_raw, 128);
  T* const Qs = reinterpret_cast<T*>(smem_raw);
  T* const Ks = Qs + kBM * LD;      // stages 0 and 1
  T* const Vs = Ks + 2 * BN * LD;  // stages 0 and 1

  const int i0 = blockIdx.x * kBM, h = blockIdx.y, b = blockIdx.z;
  const SeqView seq = seq_view(p, b);
  if (i0 >= seq.Lq) return;  // a packed sequence shorter than the longest (the whole CTA)
  const int hk = h / (p.Hq / p.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int w0 = i0 + warp * 16 * MT;  // the warp's first row
  const int64_t bh = int64_t(b) * p.Hq + h;
  const int64_t rows = query_rows(p, seq, b, h);  // of out, lse and the row sums
  const bool sums = p.row_sums != nullptr;

  if (sums) {  // every thread reads the tile's lse, so all take the same branch
    bool any_huge = false;
    for (int r = i0; r < min(i0 + kBM, seq.Lq); ++r)
      any_huge = any_huge || huge_lse(p.lse[rows + r]);
    if (!any_huge) {
      for (int r = threadIdx.x; r < kBM; r += kThreads)
        if (i0 + r < seq.Lq) p.row_sums[rows + i0 + r] = 1.f;
      return;
    }
  }

  const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h + seq.q0 * p.sq.l;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + hk * p.sk.h + seq.k0 * p.sk.l;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + hk * p.sv.h + seq.k0 * p.sv.l;
  const uint32_t key_bh = sdpa_dropout_key(p, b, h);
  // The modifiers act on the scaled score (tanh, ALiBi's distances): no folding with them.
  const bool fold = !kMods && p.scale > 0.f && p.mask.kind != MaskKind::Additive && !sums;
  const float slope = kMods ? alibi_slope(p.mods, bh) : 0.f;
  const float c = p.scale * kLog2e;  // used when fold
  const bool active = w0 < seq.Lq;  // warp-uniform
  // The band in int for the edge tiles: clamped to [-Lq, Lk], it admits the same keys.
  const int lo_c = int(max(min(seq.lo, int64_t(seq.Lk)), -int64_t(seq.Lq)));
  const int hi_c = int(max(min(seq.hi, int64_t(seq.Lk)), -int64_t(seq.Lq)));

  int t0, t1;
  key_tile_range(i0, min(i0 + kBM, seq.Lq) - 1, seq.Lk, seq.lo, seq.hi, BN, t0, t1);
  auto load_kv = [&](int tile, int stage) {
    const int j0 = tile * BN;
    load_tile_async<T, BN, D, LD, kThreads>(Ks + stage * BN * LD, k, p.sk.l, j0, seq.Lk, p.E,
                                            p.sk.vec16);
    load_tile_async<T, BN, D, LD, kThreads>(Vs + stage * BN * LD, v, p.sv.l, j0, seq.Lk, p.Ev,
                                            p.sv.vec16);
  };
  if (t0 <= t1) {
    load_tile_async<T, kBM, D, LD, kThreads>(Qs, q, p.sq.l, i0, seq.Lq, p.E, p.sq.vec16);
    load_kv(t0, 0);
  }
  cp_async_commit();

  // Per row tile mt of the warp: O, and the running max and sum of rows g and g + 8.
  float o[MT][DB][4];
  float m[MT][2], l[MT][2];
  bool was_folded = false;  // whether the warp's last tile took the folded exponent (rescale)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int db = 0; db < DB; ++db)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][db][e] = 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) m[mt][r] = -INFINITY, l[mt][r] = 0.f;
  }

  // This lane's ldmatrix row addresses (mma.cuh): A of Q's 16x16 blocks, B of two 8-key blocks
  // of K (matrices keys 0-7 x k 0-7, keys 0-7 x k 8-15, keys 8-15 x ...), B of V .trans (keys
  // 0-7 x cols 0-7, keys 8-15 x cols 0-7, then cols 8-15).
  const int lrow = lane % 8, lm = lane / 8;
  const T* q_row = Qs + (w0 - i0 + lrow + (lm & 1) * 8) * LD + (lm >> 1) * 8;
  const int k_off = (lrow + (lm >> 1) * 8) * LD + (lm & 1) * 8;
  const int v_off = (lrow + (lm & 1) * 8) * LD + (lm >> 1) * 8;

  // The query row of element e (of O's or S's fragments) of row tile mt.
  auto row_of = [&](int mt, int e) { return w0 + mt * 16 + g + 8 * (e / 2); };

  for (int tile = t0; tile <= t1; ++tile) {
    const int stage = (tile - t0) & 1, j0 = tile * BN;
    // The key of element e of 8-key block nb of the S fragments (its row: row_of).
    auto key_of = [&](int nb, int e) { return j0 + nb * 8 + 2 * t + e % 2; };
    if (tile < t1) load_kv(tile + 1, stage ^ 1);  // its stage was released by the last barrier
    cp_async_commit();
    cp_async_wait<1>();  // this tile's group has landed (the next one may be in flight)
    __syncthreads();     // ... and every thread's copies with it
    const T* Kt = Ks + stage * BN * LD;
    const T* Vt = Vs + stage * BN * LD;

    if (active) {
      float s[MT][NB][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nb][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], q_row + mt * 16 * LD + kk * 16);
#pragma unroll
        for (int nb = 0; nb < NB; nb += 2) {
          uint32_t kb[4];
          ldmatrix_x4(kb, Kt + nb * 8 * LD + k_off + kk * 16);
          const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_m16n8k16<T>(s[mt][nb], a[mt], b0);
            mma_m16n8k16<T>(s[mt][nb + 1], a[mt], b1);
          }
        }
      }

      // Each score v of query i, key j replaced by f(v, i, j), a row tile after the other's
      // results (common.cuh after): the predicated loads of a mask, or dropout's hashes, of both
      // tiles in flight at once (with their 64-bit addresses) spill.
      auto each_in_turn = [&](auto f) {
        uint32_t done = 0;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const int w = after(w0 + mt * 16 + g, done);
#pragma unroll
          for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              s[mt][nb][e] = f(s[mt][nb][e], w + 8 * (e / 2), key_of(nb, e));
              if (MT > 1) done |= __float_as_uint(s[mt][nb][e]);
            }
        }
      };

      // v: the raw score (fold) or the scaled score plus the mask; -inf where not admissible.
      // Each pass below is one straight run over the thread's MT x NB x 4 scores under a
      // warp-uniform branch: a test per element (the compiler does not unswitch unrolled
      // loops) would put every exponential in a basic block of its own and serialise their
      // latencies (tests/test_cuda_resources.py checks the exponentials share one block).
      if (!fold) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nb][e] *= p.scale;
      }
      if constexpr (kMods) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = row_of(mt, e), j = key_of(nb, e);
              float tc;
              s[mt][nb][e] = modified_score(s[mt][nb][e], p.mods, slope,
                                            fabsf(float(i + seq.diag - j)), tc);
            }
      }
      // (j0 <= Lk - BN, not j0 + BN <= Lk: the sum wraps for Lk within BN of 2^31, which
      // would admit the zero-filled keys past Lk)
      const bool interior = p.mask.kind == MaskKind::None && j0 <= seq.Lk - BN &&
                            int64_t(j0) - i0 - (kBM - 1) >= seq.lo &&
                            int64_t(j0) + (BN - 1) - i0 <= seq.hi;
      if (!interior && p.mask.kind == MaskKind::None) {  // an edge tile: selects only
        // Row r admits the keys j0 + 2t + x for x in [x_lo[r], x_hi[r]]: its first and last
        // admissible keys less j0 + 2t, in int (i + lo_c is formed only where it is below Lk).
        const int jt = j0 + 2 * t;
        int x_lo[MT][2], x_hi[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int i = row_of(mt, 2 * r);
            const int room = seq.Lk - 1 - i;  // i + x <= Lk - 1 iff x <= room
            const int first = i >= seq.Lq || lo_c > room ? seq.Lk : max(0, i + lo_c);
            const int last = hi_c > room ? seq.Lk - 1 : max(-1, i + hi_c);
            x_lo[mt][r] = first - jt;
            x_hi[mt][r] = last - jt;
          }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nb = 0; nb < NB; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int x = nb * 8 + e % 2;
              // (an admitted -inf overflowed: NaN, as admit_as makes it on masked tiles and
              // modified_score in the modifier kernels)
              s[mt][nb][e] = x < x_lo[mt][e / 2] || x > x_hi[mt][e / 2] ? -INFINITY
                             : kMods                                   ? s[mt][nb][e]
                                                                       : overflow_as_nan(s[mt][nb][e]);
            }
      } else if (!interior) {  // a mask: its elements by predicated loads (admit_as)
        auto masked = [&](auto kind) {
          each_in_turn([&](float v, int i, int j) {
            return admit_as<T, decltype(kind)::value, true>(v, p.mask, seq.lo, seq.hi, b, h, i,
                                                            j, seq.Lq, seq.Lk);
          });
        };
        if (p.mask.kind == MaskKind::Bool)
          masked(std::integral_constant<MaskKind, MaskKind::Bool>{});
        else
          masked(std::integral_constant<MaskKind, MaskKind::Additive>{});
      }
      float alpha[MT][2], mu[MT][2], m_new[MT][2];
      bool past_fold = false;  // some row max of the warp's, times c, past kFoldLimit
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        // (lowest: a score of -inf in an interior tile overflowed: a product of q and k, a
        // partial sum of the MMA's or the scale passed float's range, for a key whose true
        // score may be the row's largest (true scores near 0 whose partial sums passed
        // -3.4e38). exp would drop it without a trace (l > 0 from the other keys): the row's
        // sum is made NaN, which survives the rescales and sends the row to its rerun
        // (past_range). One FMNMX a score, in the pass that takes the max (a pass of its own
        // spilled the D = 128 kernels on sm_90, at 255 registers); the edge tiles take an
        // admitted -inf as NaN as they select, the masked ones in admit_as, the modifier
        // kernels in modified_score, and skip this (it spilled their D = 64 on sm_90).)
        float mx[2] = {-INFINITY, -INFINITY}, lowest[2] = {INFINITY, INFINITY};
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            mx[e / 2] = fmaxf(mx[e / 2], s[mt][nb][e]);
            if constexpr (!kMods) lowest[e / 2] = fminf(lowest[e / 2], s[mt][nb][e]);
          }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (!kMods && interior && lowest[r] == -INFINITY) l[mt][r] = NAN;
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
          m_new[mt][r] = fmaxf(m[mt][r], mx[r]);
          // no admissible key yet: all p = 0
          mu[mt][r] = m_new[mt][r] == -INFINITY ? 0.f : m_new[mt][r];
          past_fold = past_fold || !(fabsf(mu[mt][r] * c) <= kFoldLimit);
        }
      }
      // warp-uniform: every row tile's exponentials under one branch, one run whose latencies
      // overlap
      const bool folded = fold && !__any_sync(0xffffffffu, past_fold);
      const float cs = fold ? c : kLog2e;  // what the scores in s still need
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          // (m = -inf gives alpha 0)
          alpha[mt][r] =
              exp2_approx(rescale_log2(m[mt][r], mu[mt][r], c, cs, was_folded, folded));
          m[mt][r] = m_new[mt][r];
          l[mt][r] *= alpha[mt][r];
        }
      was_folded = folded;
      if (folded) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) exp_scores<true>(s[mt], mu[mt], c, l[mt]);
      } else {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) exp_scores<false>(s[mt], mu[mt], cs, l[mt]);
      }
      if (p.drop.on) {
        each_in_turn([&](float v, int i, int j) {
          return v * dropout_factor(p.drop, key_bh, uint32_t(i), uint32_t(j));
        });
      }

      if (!sums) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int db = 0; db < DB; ++db)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][db][e] *= alpha[mt][e / 2];
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
          uint32_t a[MT][4];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
            a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
            a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
            a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
          }
#pragma unroll
          for (int db = 0; db < DB; db += 2) {
            uint32_t vb[4];
            ldmatrix_x4_trans(vb, Vt + kk * 16 * LD + v_off + db * 8);
            const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              mma_m16n8k16<T>(o[mt][db], a[mt], b0);
              mma_m16n8k16<T>(o[mt][db + 1], a[mt], b1);
            }
          }
        }
      }
    }
    __syncthreads();  // this stage is read by all before the next iteration's loads refill it
  }

  // bit 2 mt + r: row g + 8 r of tile mt is redone in float64 (rerun_row): its scores passed
  // float's range, or its O is non-finite (bf16). Never in the row-sums mode, which writes no
  // output (the backward's rerun redoes such rows: sdpa_bwd_rerun.cu).
  uint32_t redo = 0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[mt][r] += __shfl_xor_sync(0xffffffffu, l[mt][r], 1);
      l[mt][r] += __shfl_xor_sync(0xffffffffu, l[mt][r], 2);
      const int i = row_of(mt, 2 * r);
      bool bad = !sums && past_range(m[mt][r], l[mt][r], p, seq, i);
      if constexpr (kMayOverflowO<T>) {  // the row's O lies across the lane quad
        int nonfinite = 0;
#pragma unroll
        for (int db = 0; db < DB; ++db)
#pragma unroll
          for (int e = 0; e < 2; ++e) nonfinite |= !(fabsf(o[mt][db][2 * r + e]) < INFINITY);
        nonfinite |= __shfl_xor_sync(0xffffffffu, nonfinite, 1);
        nonfinite |= __shfl_xor_sync(0xffffffffu, nonfinite, 2);
        bad = bad || nonfinite;
      }
      // (rows past Lq admit every key of the interior tiles: never written, never redone)
      if (bad && i < seq.Lq) redo |= 1u << (2 * mt + r);
    }
    if constexpr (kMods) {
      // The sink joins the denominator (and the lse, and the row sums R) as one more score, of
      // no value: a row that admitted no key ends with l = 1, m = the sink, zeros out. A sink
      // of -inf joins nothing: such a row keeps l = 0 (zeros, lse -inf), taking exponentials
      // against 0, not exp(-inf - -inf).
      if (p.mods.sinks != nullptr) {
        const float sink = p.mods.sinks[h];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float m_new = fmaxf(m[mt][r], sink);
          const float ref = m_new == -INFINITY ? 0.f : m_new;
          const float alpha = fast_exp(m[mt][r] - ref);  // 0 when m = -inf
          l[mt][r] = l[mt][r] * alpha + fast_exp(sink - ref);
          m[mt][r] = m_new;
#pragma unroll
          for (int db = 0; db < DB; ++db)
#pragma unroll
            for (int e = 0; e < 2; ++e) o[mt][db][2 * r + e] *= alpha;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = row_of(mt, 2 * r);
      if (i >= seq.Lq) continue;
      if (sums) {  // m is the natural-log scaled score here (fold is off)
        const float lse = p.lse[rows + i];
        if (t == 0)
          p.row_sums[rows + i] = huge_lse(lse) ? l[mt][r] * fast_exp(m[mt][r] - lse) : 1.f;
        continue;
      }
      if (redo >> (2 * mt + r) & 1) continue;  // rerun_row writes it
      const float inv_l = l[mt][r] > 0.f ? 1.f / l[mt][r] : 0.f;
      T* out = static_cast<T*>(p.out) + (rows + i) * p.Ev;
#pragma unroll
      for (int db = 0; db < DB; ++db)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = db * 8 + 2 * t + e;
          if (col < p.Ev) out[col] = from_float<T>(o[mt][db][2 * r + e] * inv_l);
        }
      const float m_nat = fold ? m[mt][r] * p.scale : m[mt][r];  // the scaled scores' row max
      // (saturated at float's lowest as rerun_row's: a folded row's raw max times a huge scale
      // may pass it, and -inf would tell the backward the row has no key, P = 0 unflagged)
      if (t == 0)
        p.lse[rows + i] = l[mt][r] > 0.f ? fmaxf(m_nat + logf(l[mt][r]), -3.402823466e38f)
                                         : -INFINITY;
    }
  }

  if (__syncthreads_or(redo != 0)) {
    // The rows to redo through shared memory (the key tiles' stages are free); then each warp
    // reruns rows of the tile, one at a time.
    int* const row_redo = reinterpret_cast<int*>(Ks);
    for (int r = threadIdx.x; r < kBM; r += kThreads) row_redo[r] = 0;
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (t == 0 && (redo >> (2 * mt + r) & 1)) row_redo[row_of(mt, 2 * r) - i0] = 1;
    __syncthreads();
    for (int x = warp; x < kBM; x += C::kWarps)
      if (row_redo[x])
        rerun_row<T, D, kMods>(p, seq, b, h, Qs + x * LD, k, v, rows + i0 + x, i0 + x, slope,
                               key_bh);
  }
}

// Each arch's code holds the variant row_tiles gives it; the other is a stub, never launched.
template <typename T, int D, bool kMods, int MT>
__global__ void __launch_bounds__(Config<D, MT>::kThreads, Config<D, MT>::kMinBlocks)
    sdpa_fwd_kernel(const SdpaParams p) {
#if defined(__CUDA_ARCH__)
  if constexpr (MT != row_tiles(D, __CUDA_ARCH__ >= 900)) {
    __trap();
  } else
#endif
  {
    sdpa_fwd_tiles<T, D, kMods, MT>(p);
  }
}

template <typename T, int D, int MT>
cudaError_t launch_tiles(const SdpaParams& p, cudaStream_t stream) {
  const dim3 grid(ceil_div(p.Lq, kBM), p.Hq, p.B);
  return launch_on_flag(p.mods.any(), [&](auto mods) {
    return launch_kernel(sdpa_fwd_kernel<T, D, decltype(mods)::value, MT>, grid,
                         dim3(Config<D, MT>::kThreads), Config<D, MT>::smem_bytes, stream, p);
  });
}

template <typename T, int D>
cudaError_t launch(const SdpaParams& p, cudaStream_t stream) {
  if constexpr (row_tiles(D, true) != row_tiles(D, false)) {
    // the variant of the code the device runs (an sm_90 device may run sm_80 PTX)
    const void* probe = reinterpret_cast<const void*>(sdpa_fwd_kernel<T, D, false, 1>);
    if (code_arch(probe) >= 90) return launch_tiles<T, D, row_tiles(D, true)>(p, stream);
  }
  return launch_tiles<T, D, row_tiles(D, false)>(p, stream);
}

}  // namespace sdpa_fwd_impl

// Instantiated once per family by sdpa_fwd_d<D>.cu.
template <int D>
cudaError_t sdpa_fwd_family(const SdpaParams& p, cudaStream_t stream) {
  if (p.B == 0 || p.Hq == 0 || p.Lq == 0) return cudaSuccess;
  return p.dtype == DType::Half ? sdpa_fwd_impl::launch<__half, D>(p, stream)
                                : sdpa_fwd_impl::launch<__nv_bfloat16, D>(p, stream);
}

}  // namespace cuda
}  // namespace attnx
