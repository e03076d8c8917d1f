// SDPA backward on FlashAttention-2's design (flash_bwd_kernel.h of Dao-AILab/flash-attention:
// one CTA per key block looping over query blocks, dK and dV in registers, dQ by atomics), on
// mma.sync m16n8k16 with fp32 accumulate (mma.cuh), for every head-dim family up to 256.
//
// Two variants (Config<D, KT>), by the key tiles KT of 16 keys each warp holds:
//   KT = 2, sm_90 code at D = 64..128 (with softcap or ALiBi: 96..128) where the device holds
//     its shared memory (two_key_tiles, launch below): FA2's 128-key block on 8 warps. Warp w owns
//     keys 32(w % 4).. +31 and head dims [w / 4 * D/2, +D/2) of their dK and dV rows, and
//     computes S^T, dP^T of its 32 keys and half w / 4 of the step's BM queries (32 x 32 a
//     warp at BM = 64: each ldmatrix x4 of Q or dO feeds four MMAs, two n8 tiles for each of
//     the two key tiles). P and dS go through shared memory to the warps owning the other
//     columns.
//   KT = 1 (everywhere else: the fallback, which 99 KB parts take up to D = 160): 64-key blocks,
//     warp w owning keys 16(w % 4)..; up to D = 128 on 4 warps, each holding its keys' whole
//     dK and dV rows (16 x D each, fp32) and S^T, dP^T over all BM queries, so that P^T and dS^T
//     feed dV and dK from registers; above, where those rows would take 2D > 255 registers, on
//     8 warps split by head dims and queries as KT = 2 is (flash_bwd_kernel.h's d256 tiles).
// The split variants (both KT = 2 and KT = 1 above D = 128) are the "wide" ones below. The CTA
// loops over the query heads of its GQA group (reading q and grad_out of each, nothing copied)
// and, per head, over the query blocks of BM rows that can see its keys (the band decides which:
// causal and window tiles outside it are never visited). Per step, with Q and dO of the step in
// shared memory:
//   S^T  = K_w Q^T                       warp w's keys x its queries, registers
//   P^T  = exp(scale*S^T + mask - lse) / R   (R: 1, or the row sum of a huge-lse row, below)
//   dV_w += (P^T * z) dO                  P^T's accumulator fragments are the A operand as is
//   dP^T = V_w dO^T,  dS^T = P^T * (dP^T * z - delta)   (z: dropout factor, 0 or 1/(1-p))
//   dK_w += dS^T Q                        dS^T from registers again
//   dQ   += dS K                          dS^T through shared memory (key-major: the
//                                         fragments' query pairs stored as 32-bit words; read
//                                         back by transposing ldmatrix), all warps;
//   (wide: dV_w += (P z)^T dO and dK_w += dS^T Q read P^T z and dS^T back from shared memory,
//    after the barrier that completes them)
//                                         fp32 atomics into dq_acc (pairs by one vector
//                                         reduction from sm_90): other CTAs (key blocks) add
//                                         to the same rows, in no fixed order
// dK and dQ get the factor `scale` when written. dQ's atomics make the backward
// nondeterministic in the last bits of dq; no deterministic mode is offered.
//
// Shared memory: K, V of the block once; Q and dO in two stages, the next step's loaded by
// cp.async while this one computes; dS^T (BN x BM), and P^T z (BN x BM) in the wide variants
// (KT = 2 at D = 128: 174 KB, more than sm_80's 163). All 16-bit tiles have rows padded by 16
// bytes instead of a swizzle: ldmatrix reads 8 rows of 16 bytes per phase, and a row stride
// that is an odd multiple of 16 bytes puts those 8 rows in 8 distinct 16-byte bank groups
// (conflict-free), as does cp.async's 16-byte store of consecutive chunks and the 32-bit stores
// of dS^T (a warp's 8 key rows by 4 query pairs: 32 banks); it costs 8 / D (8 / BM) of a tile.
//
// delta = rowsum(dO * O) - grad_lse comes from the pre-pass kernel sdpa_bwd_delta.cu. Rows of
// huge lse (common.cuh): exp(s - lse) is R_i times the probability there, R_i the row sum the
// forward kernel's row-sums mode computes (1 on every other row); multiplying by 1/R_i gives
// the probabilities back, whatever the rounding of lse. A float mask's gradient is dS itself
// (the mask is added to the scaled scores), written for every element of the visited tiles;
// the host zero-fills the rest.
//
// Layout: q, k, v with contiguous last dims and any other strides; grad_out, out, dq_acc, dk,
// dv, dmask, lse, delta and row sums contiguous. Loads are bounds-checked and zero-filled past
// Lq, Lk, E, Ev, so any sizes work; fully masked rows (lse = -inf) give zero gradients.
//
// Packed sequences (p.cu_q set, launch.h): blockIdx.z is a sequence (SeqView, common.cuh, as in
// the forward); key blocks past a shorter sequence's end return at once.
#pragma once

#include "common.cuh"
#include "mma.cuh"
#include "tile_copy.cuh"

namespace attnx {
namespace cuda {
namespace sdpa_bwd_impl {

constexpr int kKeyWarps = 4;  // warps along the key block
constexpr int kDqCols = 32;   // dQ is computed in column chunks of this width

template <int D, int KT>
struct Config {
  static_assert(D % kDqCols == 0 && D <= 256, "families 32, 64, 96, 128, 160, 192, 256");
  static_assert(KT == 1 || (KT == 2 && D <= 128), "two key tiles a warp up to D = 128");
  // Warps per key group: 2 (the wide variants) with two key tiles, and where one warp's dK and
  // dV rows (2D fp32 registers) would not fit beside S^T and dP^T.
  static constexpr int kSplit = KT == 2 || D > 128 ? 2 : 1;
  static constexpr int kWarps = kKeyWarps * kSplit;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int BN = kKeyWarps * 16 * KT;  // keys per CTA
  static constexpr int DW = D / kSplit;           // dK, dV columns per warp
  // Query rows per step. KT = 1: 64 keeps S^T and dP^T at 32 fp32 registers each, which beside
  // the D fp32 registers of dK and dV fits 255 up to D = 64; 32 rows above (and, split, 16 per
  // warp: two stages of Q and dO at D = 256 then fit sm_80's 163 KB). KT = 2: 64, 32 a warp
  // (S^T and dP^T 32 registers each beside dK and dV's 2 * 2 * 16 * D/2 / 32 = D); 128 at
  // D = 64 (64 a warp: 0.45 ldmatrix per MMA in its main loop where 64 rows take 0.55).
  static constexpr int BM = KT == 2 && D == 64 ? 128 : KT == 2 || D <= 64 ? 64 : 32;
  static constexpr int BMW = BM / kSplit;  // S^T, dP^T queries per warp
  // dQ's tasks: QT m16 row tiles by kDqCols columns, two where that still gives every warp one
  // (each ldmatrix of K then feeds two MMAs).
  static constexpr int QT = (BM / 32) * (D / kDqCols) >= kWarps ? 2 : 1;
  static constexpr int LDH = D + 8;   // 16-bit tile rows, padded (see above)
  static constexpr int LDT = BM + 8;  // rows of the key-major dS^T (and P^T z)
  static constexpr int kRowValues = 3;  // per query row and stage: lse, delta, 1 / R
  static constexpr size_t smem_bytes =
      2 * (2 * size_t(BN) * LDH + 2 * 2 * size_t(BM) * LDH + kSplit * size_t(BN) * LDT) +
      4 * (2 * kRowValues * size_t(BM));
};

// The A operand (16 x 16) at (row0, col0) of a row-major tile, each lane giving its row's
// address to ldmatrix x4.
template <int LD, typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* tile, int row0, int col0,
                                       int lane) {
  ldmatrix_x4(a, tile + (row0 + lane % 16) * LD + col0 + (lane / 16) * 8);
}

// The same A operand from the transposed tile (stored row col0 + k, column row0 + m), by
// transposing ldmatrix: matrix i holds rows (i % 2) * 8.., k columns (i / 2) * 8.. of A.
template <int LD, typename T>
__device__ __forceinline__ void load_a_t(uint32_t (&a)[4], const T* tile, int row0, int col0,
                                         int lane) {
  ldmatrix_x4_trans(a, tile + (col0 + (lane / 16) * 8 + lane % 8) * LD + row0 + ((lane / 8) % 2) * 8);
}

// B operands of two n8 tiles (n0, n0 + 8) over k16 from a tile stored n-major (row n, col k):
// b[0..1] the first, b[2..3] the second.
template <int LD, typename T>
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const T* tile, int n0, int k0,
                                          int lane) {
  ldmatrix_x4(b, tile + (n0 + lane % 8 + (lane / 16) * 8) * LD + k0 + ((lane / 8) % 2) * 8);
}

// The same from a tile stored k-major (row k, col n), transposed by ldmatrix.
template <int LD, typename T>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const T* tile, int k0, int n0,
                                          int lane) {
  ldmatrix_x4_trans(b, tile + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * LD + n0 + (lane / 16) * 8);
}

// acc[n], acc[n + 1] += a * (the two n8 tiles of b).
template <typename T>
__device__ __forceinline__ void mma_pair(float (&acc0)[4], float (&acc1)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[4]) {
  const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
  mma_m16n8k16<T>(acc0, a, b0);
  mma_m16n8k16<T>(acc1, a, b1);
}

// acc (16 R x 8 N, R m16 row tiles) += tile A (rows a_row0.., all D columns) times tile B^T
// (rows 0..8N-1 of b_tile, n-major): the S^T = K Q^T and dP^T = V dO^T products of a warp. Each
// B fragment read serves the R row tiles.
template <typename T, int D, int R, int N, int LD>
__device__ __forceinline__ void product_nt(float (&acc)[R][N][4], const T* a_tile, int a_row0,
                                           const T* b_tile, int lane) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) load_a<LD>(a[r], a_tile, a_row0 + 16 * r, kk * 16, lane);
#pragma unroll
    for (int n = 0; n < N; n += 2) {
      uint32_t b[4];
      load_b_nk<LD>(b, b_tile, n * 8, kk * 16, lane);
#pragma unroll
      for (int r = 0; r < R; ++r) mma_pair<T>(acc[r][n], acc[r][n + 1], a[r], b);
    }
  }
}

// acc (16 R x 8N) += a (a k16 A fragment per m16 row tile of the warp) times rows k0.. k0 + 15,
// columns c0.. c0 + 8N - 1 of tile B (k-major).
template <typename T, int R, int N, int LD>
__device__ __forceinline__ void mma_rows_k16(float (&acc)[R][N][4], const uint32_t (&a)[R][4],
                                             const T* b_tile, int k0, int c0, int lane) {
#pragma unroll
  for (int n = 0; n < N; n += 2) {
    uint32_t b[4];
    load_b_kn<LD>(b, b_tile, k0, c0 + n * 8, lane);
#pragma unroll
    for (int r = 0; r < R; ++r) mma_pair<T>(acc[r][n], acc[r][n + 1], a[r], b);
  }
}

// acc (16 x D) += X (16 x BM, register fragments x[0][BM / 8][4] as mma accumulators, taken as the
// A operand: two n8 accumulator tiles are one k16 A fragment) times tile B (BM x D, k-major):
// dV += (P^T z) dO and dK += dS^T Q of the variant that is not wide (one key tile a warp).
template <typename T, int BM, int D, int LD>
__device__ __forceinline__ void product_rk(float (&acc)[1][D / 8][4],
                                           const float (&x)[1][BM / 8][4], const T* b_tile,
                                           int lane) {
#pragma unroll
  for (int kq = 0; kq < BM / 16; ++kq) {
    const float(&lo)[4] = x[0][2 * kq];
    const float(&hi)[4] = x[0][2 * kq + 1];
    const uint32_t a[1][4] = {{pack2<T>(lo[0], lo[1]), pack2<T>(lo[2], lo[3]),
                               pack2<T>(hi[0], hi[1]), pack2<T>(hi[2], hi[3])}};
    mma_rows_k16<T, 1, D / 8, LD>(acc, a, b_tile, kq * 16, 0, lane);
  }
}

// acc (16 R x DW) += X (rows row0.. row0 + 16 R - 1 of X, a BN x BM key-major tile in shared
// memory: P^T z or dS^T) times columns c0.. c0 + DW - 1 of tile B (BM x D, k-major): the wide
// variants' dV and dK, whose P z and dS columns other warps computed.
template <typename T, int R, int BM, int DW, int LDX, int LD>
__device__ __forceinline__ void product_sk(float (&acc)[R][DW / 8][4], const T* x_tile, int row0,
                                           const T* b_tile, int c0, int lane) {
#pragma unroll
  for (int kq = 0; kq < BM / 16; ++kq) {
    uint32_t a[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) load_a<LDX>(a[r], x_tile, row0 + 16 * r, kq * 16, lane);
    mma_rows_k16<T, R, DW / 8, LD>(acc, a, b_tile, kq * 16, c0, lane);
  }
}

// kMods: the score modifiers (p.mods) are applied; the plain instantiation has none of their
// code. The sinks need nothing here: they are in lse and the row sums, and their gradient is
// the host's (from delta). KT: key tiles a warp (Config).
template <typename T, int D, bool kMods, int KT>
__device__ __forceinline__ void sdpa_bwd_tiles(const SdpaParams& p) {
  using C = Config<D, KT>;
  constexpr int BM = C::BM, BN = C::BN, LDH = C::LDH, LDT = C::LDT, DW = C::DW, QT = C::QT;
  constexpr int kWarps = C::kWarps, kThreads = C::kThreads;
  constexpr bool wide = C::kSplit > 1;
  constexpr int NQ = C::BMW / 8;  // n8 tiles of queries in a warp's S^T, dP^T
  constexpr int ND = DW / 8;      // n8 tiles of head dims in a warp's dK, dV
  ATTNX_DYNAMIC_SMEM(unsigned char, smem_raw, 128);
  T* Ks = reinterpret_cast<T*>(smem_raw);
  T* Vs = Ks + BN * LDH;
  T* Qs = Vs + BN * LDH;       // [stage][BM][LDH]
  T* dOs = Qs + 2 * BM * LDH;  // [stage][BM][LDH]
  T* dSt = dOs + 2 * BM * LDH;  // dS^T, key-major [BN][LDT]
  T* Pt = dSt + BN * LDT;       // P^T z, key-major: the wide variants only
  // [stage][lse, delta, 1/R][BM]
  float* row_vals = reinterpret_cast<float*>(dSt + C::kSplit * BN * LDT);

  const int j0 = blockIdx.x * BN, hk = blockIdx.y, b = blockIdx.z;
  const SeqView seq = seq_view(p, b);
  if (j0 >= seq.Lk) return;  // a packed sequence shorter than the longest (the whole CTA)
  const int group = p.Hq / p.Hkv;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;          // the fragments' row group and column pair
  const int kr0 = (warp % kKeyWarps) * 16 * KT;  // this warp's first key in the block
  const int half = warp / kKeyWarps;             // its part of the split (0 unless wide)
  const int qw0 = half * C::BMW, c0 = half * DW;  // its first S^T query and dK/dV column
  // grad_out is contiguous and 16-byte aligned (the host makes it so): only its rows matter.
  const bool dout_vec16 = p.Ev % (16 / sizeof(T)) == 0;

  // Query rows that can see a key of [j0, j0 + BN): j - hi <= i <= j - lo.
  const int64_t ilo = max(int64_t(0), int64_t(j0) - seq.hi);
  const int64_t ihi = min(int64_t(seq.Lq) - 1, int64_t(min(j0 + BN, seq.Lk) - 1) - seq.lo);
  const int qt0 = int(ilo / BM), nqt = ihi < ilo ? 0 : int(ihi / BM) - qt0 + 1;
  const int steps = group * nqt;  // (head of the group, query block) pairs

  float dk[KT][ND][4] = {}, dv[KT][ND][4] = {};

  // Step s: query head hk * group + s / nqt, query block qt0 + s % nqt.
  auto load_step = [&](int s, int stage) {
    const int h = hk * group + s / nqt, i0 = (qt0 + s % nqt) * BM;
    const int64_t rows = query_rows(p, seq, b, h);
    const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h + seq.q0 * p.sq.l;
    const T* dout = static_cast<const T*>(p.dout) + rows * p.Ev;
    load_tile_async<T, BM, D, LDH, kThreads>(Qs + stage * BM * LDH, q, p.sq.l, i0, seq.Lq, p.E,
                                             p.sq.vec16);
    load_tile_async<T, BM, D, LDH, kThreads>(dOs + stage * BM * LDH, dout, p.Ev, i0, seq.Lq,
                                             p.Ev, dout_vec16);
    float* vals = row_vals + stage * C::kRowValues * BM;
    for (int r = threadIdx.x; r < BM; r += kThreads) {
      const bool in = i0 + r < seq.Lq;
      const int64_t at = rows + i0 + r;
      // lse, +inf for rows without probabilities (lse -inf, or past Lq): s - lse is then -inf
      // whatever s is (the exp pass below)
      const float lse = in ? p.lse[at] : -INFINITY;
      vals[r] = lse == -INFINITY ? INFINITY : lse;
      vals[BM + r] = in ? p.delta[at] : 0.f;
      vals[2 * BM + r] = in ? 1.f / p.row_sums[at] : 1.f;
    }
  };

  if (steps > 0) {
    const T* k = static_cast<const T*>(p.k) + b * p.sk.b + hk * p.sk.h + seq.k0 * p.sk.l;
    const T* v = static_cast<const T*>(p.v) + b * p.sv.b + hk * p.sv.h + seq.k0 * p.sv.l;
    load_tile_async<T, BN, D, LDH, kThreads>(Ks, k, p.sk.l, j0, seq.Lk, p.E, p.sk.vec16);
    load_tile_async<T, BN, D, LDH, kThreads>(Vs, v, p.sv.l, j0, seq.Lk, p.Ev, p.sv.vec16);
    load_step(0, 0);
    cp_async_commit();
  }

  // The key of element e of key tile kt, within the block: in the S^T and dP^T fragments and
  // in the dK and dV accumulators alike (keys are their rows).
  auto key_of = [&](int kt, int e) { return kr0 + 16 * kt + g + (e >= 2 ? 8 : 0); };
  // f(kt, n, e) for each of the warp's S^T (and dP^T) fragment elements: key tile kt, n8 query
  // tile n, element e.
  auto each = [](auto&& f) {
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
#pragma unroll
      for (int n = 0; n < NQ; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) f(kt, n, e);
  };
  // f(kt, n, e) for each pair of those elements e, e + 1 (e = 0, 2): a fragment row's two
  // adjacent queries.
  auto each_pair = [](auto&& f) {
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
#pragma unroll
      for (int n = 0; n < NQ; ++n)
#pragma unroll
        for (int e = 0; e < 4; e += 2) f(kt, n, e);
  };

  // The least score of the warp's steps before the band and the mask: -inf where one overflowed
  // (below).
  float lowest = INFINITY;
  for (int s = 0; s < steps; ++s) {
    const int stage = s % 2;
    cp_async_wait<0>();  // this step's group (and K, V) has landed
    __syncthreads();     // ... for every thread, and every warp is done with step s - 1
    // Prefetch the next step into the other stage, whose last readers (step s - 1's products)
    // are behind the barrier above; it lands while this step computes.
    if (s + 1 < steps) load_step(s + 1, stage ^ 1);
    cp_async_commit();

    const int h = hk * group + s / nqt, i0 = (qt0 + s % nqt) * BM;
    const int64_t bh = int64_t(b) * p.Hq + h;
    const uint32_t key_bh = sdpa_dropout_key(p, b, h);
    const T* Q = Qs + stage * BM * LDH;
    const T* dO = dOs + stage * BM * LDH;
    const float* lse_s = row_vals + stage * C::kRowValues * BM;  // +inf for -inf
    const float* delta_s = lse_s + BM;
    const float* inv_r_s = delta_s + BM;
    // the query of element e of n8 tile n of the S^T fragments, within the step
    auto query_of = [&](int n, int e) { return qw0 + n * 8 + 2 * t + (e & 1); };
    // The step's dropout pattern over the warp's elements, hashed once for both dV's P z and
    // dS's dP z: bit (kt NQ + n) 4 + e set where element (kt, n, e) is kept.
    static_assert(KT * NQ * 4 <= 64, "a bit per element");
    uint64_t kept = 0;
    if (p.drop.on)
      each([&](int kt, int n, int e) {
        kept |= uint64_t(dropout_keeps(p.drop, key_bh, uint32_t(i0 + query_of(n, e)),
                                       uint32_t(j0 + key_of(kt, e))))
                << ((kt * NQ + n) * 4 + e);
      });
    auto factor = [&](int kt, int n, int e) {  // the dropout factor z of the element
      return (kept >> ((kt * NQ + n) * 4 + e)) & 1 ? p.drop.keep_scale : 0.f;
    };
    // x^T (S^T-shaped fragments, times z with `dropped`) into a key-major shared tile, the two
    // queries of a fragment pair in one 32-bit store.
    auto store_t = [&](T* tile, const float(&x)[KT][NQ][4], auto dropped) {
      each_pair([&](int kt, int n, int e) {
        float lo = x[kt][n][e], hi = x[kt][n][e + 1];
        if constexpr (decltype(dropped)::value) {
          lo *= factor(kt, n, e);
          hi *= factor(kt, n, e + 1);
        }
        *reinterpret_cast<uint32_t*>(tile + key_of(kt, e) * LDT + query_of(n, e)) =
            pack2<T>(lo, hi);
      });
    };

    // A block wholly inside the sizes and the band, without a mask, admits every pair: its
    // scores skip the per-element test (the bulk of a long sequence's blocks).
    // (i0 <= Lq - BM, not i0 + BM <= Lq: the sum wraps for lengths within BM of 2^31)
    const bool interior = p.mask.kind == MaskKind::None && i0 <= seq.Lq - BM &&
                          j0 <= seq.Lk - BN && int64_t(j0) - i0 - (BM - 1) >= seq.lo &&
                          int64_t(j0) + (BN - 1) - i0 <= seq.hi;

    // P^T, in the S^T fragments; with a softcap, the cap's derivative 1 - tanh^2 of each score
    // in dcap, two to a register in fp16 (in [0, 1], 2^-11 apart: no more than the rounding dS
    // takes to T for the MMAs; as floats, KT = 2's 32 more registers spilled). As in the
    // forward, each pass is one straight run under a warp-uniform branch (a per-element test
    // would give every exponential a basic block of its own).
    float pt[KT][NQ][4] = {};
    uint32_t dcap[kMods ? KT : 1][kMods ? NQ : 1][2];
    const float slope = kMods ? alibi_slope(p.mods, bh) : 0.f;
    product_nt<T, D, KT, NQ, LDH>(pt, Ks, kr0, Q + qw0 * LDH, lane);
    each([&](int kt, int n, int e) { pt[kt][n][e] *= p.scale; });
    if constexpr (kMods) {
      each_pair([&](int kt, int n, int e) {
        float tc[2] = {0.f, 0.f};  // tanh(score / softcap); left alone without a softcap
#pragma unroll
        for (int x = 0; x < 2; ++x)
          pt[kt][n][e + x] = modified_score(
              pt[kt][n][e + x], p.mods, slope,
              fabsf(float(i0 + query_of(n, e + x) + seq.diag - j0 - key_of(kt, e + x))), tc[x]);
        dcap[kt][n][e / 2] = pack2<__half>(fmaf(-tc[0], tc[0], 1.f), fmaf(-tc[1], tc[1], 1.f));
      });
    }
    // A score of -inf here overflowed (a product of q and k, an MMA's partial sum, the scale or
    // ALiBi's term past float's range; or an input is -inf): its P would come out 0 where the
    // forward's float64 rerun (sdpa_fwd.cuh) found it the row's largest. It flags the float64
    // rerun below; the band and the mask set -inf on purpose after this.
    each([&](int kt, int n, int e) { lowest = fminf(lowest, pt[kt][n][e]); });
    if (!interior) {  // one straight run per mask kind (admit_as: predicated mask loads)
      auto edge = [&](auto kind) {
        each([&](int kt, int n, int e) {
          pt[kt][n][e] = admit_as<T, decltype(kind)::value>(
              pt[kt][n][e], p.mask, seq.lo, seq.hi, b, h, i0 + query_of(n, e), j0 + key_of(kt, e),
              seq.Lq, seq.Lk);
        });
      };
      if (p.mask.kind == MaskKind::Bool)
        edge(std::integral_constant<MaskKind, MaskKind::Bool>{});
      else if (p.mask.kind == MaskKind::Additive)
        edge(std::integral_constant<MaskKind, MaskKind::Additive>{});
      else
        edge(std::integral_constant<MaskKind, MaskKind::None>{});
    }
    // exp(s - lse) / R: 0 for masked scores (-inf) and for rows without probabilities (+inf
    // subtracted), without a test. The difference is formed before the factor log2(e): lse and
    // the scores may be near the float range (huge finite biases).
    each([&](int kt, int n, int e) {
      const int il = query_of(n, e);
      pt[kt][n][e] = fast_exp(pt[kt][n][e] - lse_s[il]) * inv_r_s[il];
    });

    // dV += (P^T z) dO: the dropped-out probabilities, as the forward multiplied them with V.
    // Wide: P^T z to shared memory, multiplied after the barrier below.
    if constexpr (wide) {
      if (p.drop.on)
        store_t(Pt, pt, std::true_type{});
      else
        store_t(Pt, pt, std::false_type{});
    } else if (p.drop.on) {
      float pz[KT][NQ][4];
      each([&](int kt, int n, int e) { pz[kt][n][e] = pt[kt][n][e] * factor(kt, n, e); });
      product_rk<T, BM, D, LDH>(dv, pz, dO, lane);
    } else {
      product_rk<T, BM, D, LDH>(dv, pt, dO, lane);
    }

    // dS^T = P^T (dP^T z - delta), in the dP^T fragments; to shared memory for dQ.
    float ds[KT][NQ][4] = {};
    product_nt<T, D, KT, NQ, LDH>(ds, Vs, kr0, dO + qw0 * LDH, lane);
    if (p.drop.on) each([&](int kt, int n, int e) { ds[kt][n][e] *= factor(kt, n, e); });
    each([&](int kt, int n, int e) {
      ds[kt][n][e] = pt[kt][n][e] * (ds[kt][n][e] - delta_s[query_of(n, e)]);
    });
    // A float mask's gradient is dS before the cap's derivative (the mask is added after the
    // cap).
    if (p.dmask != nullptr) {
      each([&](int kt, int n, int e) {
        const int i = i0 + query_of(n, e), j = j0 + key_of(kt, e);
        if (i < p.Lq && j < p.Lk)
          static_cast<T*>(p.dmask)[(bh * p.Lq + i) * p.Lk + j] = from_float<T>(ds[kt][n][e]);
      });
    }
    if constexpr (kMods) {
      if (p.mods.softcap > 0.f) {
        each([&](int kt, int n, int e) {
          const float2 f = unpack2_half(dcap[kt][n][e / 2]);
          ds[kt][n][e] *= e % 2 == 0 ? f.x : f.y;
        });
      }
    }
    store_t(dSt, ds, std::false_type{});

    // dK += dS^T Q.
    if constexpr (!wide) product_rk<T, BM, D, LDH>(dk, ds, Q, lane);
    __syncthreads();  // dS^T (and P^T z) complete
    if constexpr (wide) {
      product_sk<T, KT, BM, DW, LDT, LDH>(dv, Pt, kr0, dO, c0, lane);
      product_sk<T, KT, BM, DW, LDT, LDH>(dk, dSt, kr0, Q, c0, lane);
    }

    // dQ (BM x D) += dS K, by tasks of 16 QT rows x kDqCols columns, added into dq_acc at once.
    float* dq = p.dq_acc + query_rows(p, seq, b, h) * p.E;
    constexpr int kChunks = D / kDqCols, kTaskRows = 16 * QT;
    // pairs (even E: 8-byte aligned) by one vector reduction each
    const bool pairs = p.E % 2 == 0;
    for (int task = warp; task < (BM / kTaskRows) * kChunks; task += kWarps) {
      const int r0 = (task / kChunks) * kTaskRows, dc0 = (task % kChunks) * kDqCols;
      float acc[QT][kDqCols / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[QT][4];
#pragma unroll
        for (int r = 0; r < QT; ++r) load_a_t<LDT>(a[r], dSt, r0 + 16 * r, kk * 16, lane);
        mma_rows_k16<T, QT, kDqCols / 8, LDH>(acc, a, Ks, kk * 16, dc0, lane);
      }
#pragma unroll
      for (int r = 0; r < QT; ++r) {
        // Rows g and g + 8 of the row tile, from column dc0 + 2t: whole tiles within Lq and E
        // add without a test per element.
        const int i = i0 + r0 + 16 * r + g;
        float* const row[2] = {dq + int64_t(i) * p.E + dc0 + 2 * t,
                               dq + int64_t(i + 8) * p.E + dc0 + 2 * t};
        // (i0 + r0 + 16 r <= Lq - 16: no sum that wraps)
        if (pairs && i0 + r0 + 16 * r <= seq.Lq - 16 && dc0 <= p.E - kDqCols) {
#pragma unroll
          for (int n = 0; n < kDqCols / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; e += 2)
              red_add_f32x2(row[e / 2] + n * 8, acc[r][n][e] * p.scale,
                            acc[r][n][e + 1] * p.scale);
        } else {
#pragma unroll
          for (int n = 0; n < kDqCols / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (i + 8 * (e / 2) < seq.Lq && dc0 + n * 8 + 2 * t + (e & 1) < p.E)
                atomicAdd(row[e / 2] + n * 8 + (e & 1), acc[r][n][e] * p.scale);
        }
      }
    }
  }

  // A non-finite dK (any dS that overflowed, float's or fp16's as it is cast for the products,
  // or a score past float's range, reaches its key's dK) or dV (a bf16 dO near the largest
  // overflows its sums where dP and delta may not), or a score that overflowed to -inf, sends
  // the backward to its float64 rerun (sdpa_bwd_rerun.cu), tested here after the loop.
  {
    bool finite = lowest != -INFINITY;
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
#pragma unroll
      for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          finite &= finite_float(dk[kt][n][e]) & finite_float(dv[kt][n][e]);
    if (!finite) *p.overflowed = 1.f;
  }

  // dK (times scale) and dV of this warp's keys and columns, straight from the fragments.
  const int64_t krows = key_rows(p, seq, b, hk);
  T* dk_out = static_cast<T*>(p.dk) + krows * p.E;
  T* dv_out = static_cast<T*>(p.dv) + krows * p.Ev;
#pragma unroll
  for (int kt = 0; kt < KT; ++kt)
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = j0 + key_of(kt, e), c = c0 + n * 8 + 2 * t + (e & 1);
        if (j >= seq.Lk) continue;
        if (c < p.E) dk_out[int64_t(j) * p.E + c] = from_float<T>(dk[kt][n][e] * p.scale);
        if (c < p.Ev) dv_out[int64_t(j) * p.Ev + c] = from_float<T>(dv[kt][n][e]);
      }
}

// Whether code of `arch` (__CUDA_ARCH__ / 10, or code_arch) holds family D's KT = 2 variant
// (kMods: the one with softcap and ALiBi): sm_90 code at D = 64..128, with the modifiers from
// D = 96 (at D = 64, 128 queries a step, their per-score derivative spills 60 bytes). Below
// sm_90 its shared memory does not fit at D = 64 (179 KB) nor 128 (174 KB), and ptxas 13.0
// spills D = 96 (8 bytes); at D = 32 it reads more shared memory per MMA than KT = 1 (0.67
// ldmatrix per MMA against 0.58: S^T and dP^T of 32 queries over 32 columns) and leaves half
// the warps without a dQ task.
template <int D, bool kMods = false>
__host__ __device__ constexpr bool two_key_tiles(int arch) {
  if constexpr (D < (kMods ? 96 : 64) || D > 128)
    return false;
  else
    return arch >= 90 && Config<D, 2>::smem_bytes <= arch_smem_optin(arch);
}

// The explicit one block per SM lets ptxas use every register a thread may have: without it,
// under torch's build flags, it held the d32 modifier kernel at 168 registers and spilled. The
// KT = 2 variant is a stub in the code of an arch that does not hold it (never launched there).
template <typename T, int D, bool kMods, int KT>
__global__ void __launch_bounds__(Config<D, KT>::kThreads, 1) sdpa_bwd_kernel(const SdpaParams p) {
#if defined(__CUDA_ARCH__)
  if constexpr (KT == 2 && !two_key_tiles<D, kMods>(__CUDA_ARCH__ / 10)) {
    __trap();
  } else
#endif
  {
    sdpa_bwd_tiles<T, D, kMods, KT>(p);
  }
}

template <typename T, int D, bool kMods, int KT>
cudaError_t launch_tiles(const SdpaParams& p, cudaStream_t stream) {
  using C = Config<D, KT>;
  const dim3 grid(ceil_div(p.Lk, C::BN), p.Hkv, p.B);
  return launch_kernel(sdpa_bwd_kernel<T, D, kMods, KT>, grid, dim3(C::kThreads), C::smem_bytes,
                       stream, p);
}

// KT = 2 where the code holds it (an sm_90 device may run sm_80 code) and the device its shared
// memory (not 99 KB parts); the sinks need nothing in the backward, so the plain kernel serves
// them. Else KT = 1, which every part takes up to the 160 family.
template <typename T, int D>
cudaError_t launch(const SdpaParams& p, cudaStream_t stream) {
  const bool modified = p.mods.softcap > 0.f || p.mods.alibi != nullptr;
  if constexpr (D >= 64 && D <= 128) {
    const void* probe = reinterpret_cast<const void*>(sdpa_bwd_kernel<T, D, false, 2>);
    const int arch = code_arch(probe);
    if (Config<D, 2>::smem_bytes <= device_smem_optin()) {
      if (!modified && two_key_tiles<D>(arch)) return launch_tiles<T, D, false, 2>(p, stream);
      if constexpr (two_key_tiles<D, true>(90)) {  // not instantiated where no code holds it
        if (modified && two_key_tiles<D, true>(arch)) return launch_tiles<T, D, true, 2>(p, stream);
      }
    }
  }
  return launch_on_flag(p.mods.any(), [&](auto mods) {
    return launch_tiles<T, D, decltype(mods)::value, 1>(p, stream);
  });
}

}  // namespace sdpa_bwd_impl

// The dynamic shared memory of family D's backward launch with KT key tiles a warp; KT = 1
// (the least: the variant any part that runs the backward takes) by default.
template <int D, int KT = 1>
constexpr size_t sdpa_bwd_smem_bytes() {
  return sdpa_bwd_impl::Config<D, KT>::smem_bytes;
}

// Instantiated once per family by sdpa_bwd_d<D>.cu. dk and dv of keys no query sees (or every
// key when Lq == 0) are written as zeros by the kernel, so Lk > 0 always launches. Needs
// p.delta (sdpa_bwd_delta) and p.row_sums.
template <int D>
cudaError_t sdpa_bwd_family(const SdpaParams& p, cudaStream_t stream) {
  if (p.B == 0 || p.Hkv == 0 || p.Lk == 0) return cudaSuccess;
  return p.dtype == DType::Half ? sdpa_bwd_impl::launch<__half, D>(p, stream)
                                : sdpa_bwd_impl::launch<__nv_bfloat16, D>(p, stream);
}

}  // namespace cuda
}  // namespace attnx
