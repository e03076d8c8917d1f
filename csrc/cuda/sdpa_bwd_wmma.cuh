// SDPA backward for head dims 129-256 (family 256), on nvcuda::wmma with fp32 accumulate: the
// previous design, kept for the dims the register-resident design of sdpa_bwd.cuh cannot hold
// (its dK and dV accumulators would take 2 x 128 fp32 registers per thread at D = 256).
//
// One CTA of 4 warps per (key tile of BN keys, kv head, batch). It keeps its dK and dV tiles in
// WMMA accumulator fragments (no per-row rescaling is ever needed for them, so the opaque
// fragment layout is fine) and loops over the query heads of its GQA group and the query tiles
// of BM rows that can see its keys (the band decides which). Per (head, query tile):
//   S  = Q K^T,  dPd = dO V^T                      (shared memory, fp32)
//   P  = exp(scale*S + mask - lse) / R,  Pd = P * z  (z: dropout factor, 0 or 1/(1-p); R: the
//                                                   row sum of huge-lse rows, sdpa_bwd.cuh)
//   dS = P * (dPd * z - delta),  delta = rowsum(dO * O)   (sdpa_bwd_delta.cu)
//   dV += Pd^T dO,  dK += dS^T Q,  dQ += dS K        (dQ: fp32 atomics into dq_acc; dK and dQ
//                                                      get the factor `scale` at the end)
// The gradient of a float mask is dS itself (the mask is added to the scaled scores); it is
// written for every element of the tiles visited, the host zero-fills the rest.
//
// Layout assumptions as in sdpa_fwd.cuh (contiguous last dims, E, Ev <= D, bounds-checked
// zero-filled loads); grad_out, out, dq_acc, dk, dv, dmask, lse and delta are contiguous.
#pragma once

#include "common.cuh"
#include "sdpa_bwd_tiles.cuh"

namespace attnx {
namespace cuda {
namespace sdpa_bwd_wmma_impl {

using namespace nvcuda;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;

template <int D>
struct Config {
  static constexpr int BM = D > 128 ? 32 : 64;  // query rows per step
  static constexpr int BN = BM;                 // keys per CTA (dQ scratch is reused for dK/dV)
  static constexpr int LDH = D + 8;
  static constexpr int LDS = BN + 4;
  static constexpr int LDP = BN + 8;
  static constexpr int LDO = D + 4;
  static constexpr int KV_FRAGS = (BN / 16) * (D / 16) / kWarps;  // dK (and dV) tiles per warp
  static constexpr size_t smem_bytes =
      2 * (2 * size_t(BN) * LDH + 2 * size_t(BM) * LDH + 2 * size_t(BM) * LDP) +
      4 * (2 * size_t(BM) * LDS + size_t(BM) * LDO + 3 * size_t(BM));
  static_assert((BN / 16) * (D / 16) % kWarps == 0, "dK/dV tiles must split evenly over warps");
};

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) sdpa_bwd_kernel(const SdpaParams p) {
  using C = Config<D>;
  constexpr int BM = C::BM, BN = C::BN;
  ATTNX_DYNAMIC_SMEM(unsigned char, smem_raw, 128);
  T* Ks = reinterpret_cast<T*>(smem_raw);
  T* Vs = Ks + BN * C::LDH;
  T* Qs = Vs + BN * C::LDH;
  T* dOs = Qs + BM * C::LDH;
  T* Ps = dOs + BM * C::LDH;   // Pd, (BM, BN)
  T* dSs = Ps + BM * C::LDP;   // dS, (BM, BN)
  float* Ss = reinterpret_cast<float*>(dSs + BM * C::LDP);
  float* dPs = Ss + BM * C::LDS;
  float* dQs = dPs + BM * C::LDS;  // (BM, D) dQ scratch, then the dK and dV tiles
  float* lse_s = dQs + BM * C::LDO;
  float* delta_s = lse_s + BM;
  float* inv_r_s = delta_s + BM;

  const int j0 = blockIdx.x * BN, hk = blockIdx.y, b = blockIdx.z;
  const int group = p.Hq / p.Hkv;
  const int warp = threadIdx.x / 32;
  // grad_out is contiguous and freshly allocated (aligned): only its row length matters.
  const bool dout_vec16 = p.Ev % (16 / sizeof(T)) == 0;

  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + hk * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + hk * p.sv.h;
  load_tile_async<T, D, C::LDH, kThreads>(Ks, k, p.sk.l, j0, BN, p.Lk, p.E, p.sk.vec16);
  load_tile_async<T, D, C::LDH, kThreads>(Vs, v, p.sv.l, j0, BN, p.Lk, p.Ev, p.sv.vec16);
  cp_async_commit();

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> dk_acc[C::KV_FRAGS], dv_acc[C::KV_FRAGS];
#pragma unroll
  for (int f = 0; f < C::KV_FRAGS; ++f) {
    wmma::fill_fragment(dk_acc[f], 0.f);
    wmma::fill_fragment(dv_acc[f], 0.f);
  }

  // Query rows that can see a key of [j0, j0 + BN): j - hi <= i <= j - lo.
  const int64_t ilo = max(int64_t(0), int64_t(j0) - p.window_hi);
  const int64_t ihi = min(int64_t(p.Lq) - 1, int64_t(min(j0 + BN, p.Lk) - 1) - p.window_lo);
  const int qt0 = int(ilo / BM), qt1 = ihi < ilo ? qt0 - 1 : int(ihi / BM);

  for (int g = 0; g < group; ++g) {
    const int h = hk * group + g;
    const int64_t bh = int64_t(b) * p.Hq + h;
    const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
    const T* dout = static_cast<const T*>(p.dout) + bh * p.Lq * p.Ev;
    const uint32_t key_bh = dropout_key_bh(p.drop, uint32_t(bh));
    for (int qt = qt0; qt <= qt1; ++qt) {
      const int i0 = qt * BM;
      __syncthreads();  // the previous step's tiles are no longer read
      load_tile_async<T, D, C::LDH, kThreads>(Qs, q, p.sq.l, i0, BM, p.Lq, p.E, p.sq.vec16);
      load_tile_async<T, D, C::LDH, kThreads>(dOs, dout, p.Ev, i0, BM, p.Lq, p.Ev, dout_vec16);
      for (int r = threadIdx.x; r < BM; r += kThreads) {
        const bool in = i0 + r < p.Lq;
        lse_s[r] = in ? p.lse[bh * p.Lq + i0 + r] : -INFINITY;
        delta_s[r] = in ? p.delta[bh * p.Lq + i0 + r] : 0.f;
        inv_r_s[r] = in ? 1.f / p.row_sums[bh * p.Lq + i0 + r] : 1.f;
      }
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();

      // S = Q K^T and dPd = dO V^T; K and V row-major (key, dim) are column-major K^T, V^T.
      for (int t = warp; t < (BM / 16) * (BN / 16); t += kWarps) {
        const int it = t / (BN / 16), nt = t % (BN / 16);
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> s_acc, dp_acc;
        wmma::fill_fragment(s_acc, 0.f);
        wmma::fill_fragment(dp_acc, 0.f);
        for (int kt = 0; kt < D / 16; ++kt) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bf;
          wmma::load_matrix_sync(a, Qs + it * 16 * C::LDH + kt * 16, C::LDH);
          wmma::load_matrix_sync(bf, Ks + nt * 16 * C::LDH + kt * 16, C::LDH);
          wmma::mma_sync(s_acc, a, bf, s_acc);
          wmma::load_matrix_sync(a, dOs + it * 16 * C::LDH + kt * 16, C::LDH);
          wmma::load_matrix_sync(bf, Vs + nt * 16 * C::LDH + kt * 16, C::LDH);
          wmma::mma_sync(dp_acc, a, bf, dp_acc);
        }
        wmma::store_matrix_sync(Ss + it * 16 * C::LDS + nt * 16, s_acc, C::LDS, wmma::mem_row_major);
        wmma::store_matrix_sync(dPs + it * 16 * C::LDS + nt * 16, dp_acc, C::LDS, wmma::mem_row_major);
      }
      __syncthreads();

      for (int idx = threadIdx.x; idx < BM * BN; idx += kThreads) {
        const int r = idx / BN, c = idx % BN;
        const int i = i0 + r, j = j0 + c;
        const float s = admit<T>(Ss[r * C::LDS + c] * p.scale, p.mask, p.window_lo,
                                 p.window_hi, b, h, i, j, p.Lq, p.Lk);
        const float lse = lse_s[r];
        const float pr =
            (s == -INFINITY || lse == -INFINITY) ? 0.f : fast_exp(s - lse) * inv_r_s[r];
        const float z = dropout_factor(p.drop, key_bh, uint32_t(i), uint32_t(j));
        const float ds = pr * (dPs[r * C::LDS + c] * z - delta_s[r]);
        Ps[r * C::LDP + c] = from_float<T>(pr * z);
        dSs[r * C::LDP + c] = from_float<T>(ds);
        if (p.dmask != nullptr && i < p.Lq && j < p.Lk)
          static_cast<T*>(p.dmask)[(bh * p.Lq + i) * p.Lk + j] = from_float<T>(ds);
      }
      __syncthreads();

      // dV += Pd^T dO and dK += dS^T Q: Pd^T is Pd read column-major.
#pragma unroll
      for (int f = 0; f < C::KV_FRAGS; ++f) {
        const int t = warp * C::KV_FRAGS + f;
        const int jt = t / (D / 16), dt = t % (D / 16);
        // Not unrolled: with the dK, dV accumulators live, unrolling spills (bf16, 255 registers).
#pragma unroll 1
        for (int kt = 0; kt < BM / 16; ++kt) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> a;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bf;
          wmma::load_matrix_sync(a, Ps + kt * 16 * C::LDP + jt * 16, C::LDP);
          wmma::load_matrix_sync(bf, dOs + kt * 16 * C::LDH + dt * 16, C::LDH);
          wmma::mma_sync(dv_acc[f], a, bf, dv_acc[f]);
          wmma::load_matrix_sync(a, dSs + kt * 16 * C::LDP + jt * 16, C::LDP);
          wmma::load_matrix_sync(bf, Qs + kt * 16 * C::LDH + dt * 16, C::LDH);
          wmma::mma_sync(dk_acc[f], a, bf, dk_acc[f]);
        }
      }
      // dQ (tile) = dS K, added into dq_acc with atomics (other key tiles add to the same rows).
      for (int t = warp; t < (BM / 16) * (D / 16); t += kWarps) {
        const int it = t / (D / 16), dt = t % (D / 16);
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(acc, 0.f);
        for (int kt = 0; kt < BN / 16; ++kt) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bf;
          wmma::load_matrix_sync(a, dSs + it * 16 * C::LDP + kt * 16, C::LDP);
          wmma::load_matrix_sync(bf, Ks + kt * 16 * C::LDH + dt * 16, C::LDH);
          wmma::mma_sync(acc, a, bf, acc);
        }
        wmma::store_matrix_sync(dQs + it * 16 * C::LDO + dt * 16, acc, C::LDO, wmma::mem_row_major);
      }
      __syncthreads();
      float* dq = p.dq_acc + bh * p.Lq * p.E;
      for (int idx = threadIdx.x; idx < BM * p.E; idx += kThreads) {
        const int r = idx / p.E, c = idx % p.E;
        if (i0 + r < p.Lq) atomicAdd(dq + int64_t(i0 + r) * p.E + c, dQs[r * C::LDO + c] * p.scale);
      }
    }
  }

  cp_async_wait<0>();  // K and V of a block no query sees: never waited for in the loop

  // Write dK (times scale) and dV through the dQ scratch (BN == BM rows).
  const int64_t bhk = int64_t(b) * p.Hkv + hk;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    __syncthreads();
#pragma unroll
    for (int f = 0; f < C::KV_FRAGS; ++f) {
      const int t = warp * C::KV_FRAGS + f;
      const int jt = t / (D / 16), dt = t % (D / 16);
      wmma::store_matrix_sync(dQs + jt * 16 * C::LDO + dt * 16, pass == 0 ? dk_acc[f] : dv_acc[f],
                              C::LDO, wmma::mem_row_major);
    }
    __syncthreads();
    const int cols = pass == 0 ? p.E : p.Ev;
    const float mult = pass == 0 ? p.scale : 1.f;
    T* dst = static_cast<T*>(pass == 0 ? p.dk : p.dv) + bhk * p.Lk * cols;
    for (int idx = threadIdx.x; idx < BN * cols; idx += kThreads) {
      const int r = idx / cols, c = idx % cols;
      if (j0 + r < p.Lk) dst[int64_t(j0 + r) * cols + c] = from_float<T>(dQs[r * C::LDO + c] * mult);
    }
  }
}

template <typename T, int D>
cudaError_t launch(const SdpaParams& p, cudaStream_t stream) {
  const dim3 grid(ceil_div(p.Lk, Config<D>::BN), p.Hkv, p.B);
  return launch_kernel(sdpa_bwd_kernel<T, D>, grid, dim3(kThreads), Config<D>::smem_bytes, stream,
                       p);
}

}  // namespace sdpa_bwd_wmma_impl

}  // namespace cuda
}  // namespace attnx
