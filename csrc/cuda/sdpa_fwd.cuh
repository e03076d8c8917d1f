// SDPA forward, FlashAttention-2 style on tensor cores (nvcuda::wmma 16x16x16, fp32 accumulate).
//
// One CTA of 4 warps per (query tile of BM = 64 rows, query head, batch); warp w owns query
// rows 16w..16w+15 of the tile. Shared memory holds the Q tile, one K and V tile of BN keys,
// and per warp its S = Q K^T block (fp32), its P block (input dtype, the operand of P V) and
// its output accumulator O (fp32). The loop over key tiles keeps, per query row, the running
// max m and sum l of exp(s - m) (online softmax): each tile rescales O by exp(m_old - m_new)
// before adding P V. O lives in shared memory rather than in WMMA fragments because the
// fragment layout is opaque and the rescale is per row. Rows are split over lane pairs: lane
// 2r + h handles row r, columns [h*BN/2, (h+1)*BN/2) of S and [h*D/2, (h+1)*D/2) of O.
//
// Layout assumptions: q, k, v have a contiguous last dim (the host guarantees it); head dims
// E, Ev <= D; loads are bounds-checked and zero-filled past Lq, Lk, E, Ev, so any sizes work.
// Tiles outside the band [i + lo, i + hi] are skipped. A row with no admissible key ends with
// l = 0 and is written as zeros with lse = -inf.
//
// Row-sums mode (p.row_sums set; the backward's first pass): the same scores and running m, l
// without P V, ending with R_i = sum_j exp(s_ij - lse_i) = l exp(m - lse_i) against the saved
// lse for rows of huge lse; query tiles with no such row write R = 1 and stop at once.
#pragma once

#include "common.cuh"

namespace attnx {
namespace cuda {
namespace sdpa_fwd_impl {

using namespace nvcuda;

constexpr int kBM = 64;
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;

template <int D>
struct Config {
  static constexpr int BN = D > 128 ? 32 : 64;  // keeps shared memory under sm80's 163 KB
  static constexpr int LDH = D + 8;             // 16-bit tiles: padded rows, ldm % 8 == 0
  static constexpr int LDS = BN + 4;            // fp32 S rows
  static constexpr int LDP = BN + 8;            // 16-bit P rows
  static constexpr int LDO = D + 4;             // fp32 O rows
  static constexpr size_t smem_bytes =
      2 * (size_t(kBM) * LDH + 2 * size_t(BN) * LDH + size_t(kBM) * LDP) +
      4 * (size_t(kBM) * LDS + size_t(kBM) * LDO);
};

// Loads rows [row0, row0 + rows) of a (L, D-padded) tile, zero past `L` rows and `cols` columns;
// 16 bytes per load when `vec16` (then cols % 8 == 0, so a vector is wholly in or out).
template <typename T, int D, int LD>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int64_t row_stride, int row0,
                                          int rows, int L, int cols, bool vec16) {
  if (vec16) {
    constexpr int V = 16 / sizeof(T);
    for (int idx = threadIdx.x; idx < rows * (D / V); idx += kThreads) {
      const int r = idx / (D / V), c = (idx % (D / V)) * V;
      const int g = row0 + r;
      uint4 val = make_uint4(0u, 0u, 0u, 0u);
      if (g < L && c < cols) val = *reinterpret_cast<const uint4*>(src + int64_t(g) * row_stride + c);
      *reinterpret_cast<uint4*>(dst + r * LD + c) = val;
    }
    return;
  }
  for (int idx = threadIdx.x; idx < rows * D; idx += kThreads) {
    const int r = idx / D, c = idx % D;
    const int g = row0 + r;
    dst[r * LD + c] = (g < L && c < cols) ? src[int64_t(g) * row_stride + c] : from_float<T>(0.f);
  }
}

// At least 2 CTAs per SM: shared memory allows 1-3 anyway, and without the bound ptxas (CUDA 13)
// aims for fewer registers and spills (tests/test_cuda_resources.py).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 2) sdpa_fwd_kernel(const SdpaParams p) {
  using C = Config<D>;
  constexpr int BN = C::BN;
  ATTNX_DYNAMIC_SMEM(unsigned char, smem_raw, 128);
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* Ks = Qs + kBM * C::LDH;
  T* Vs = Ks + BN * C::LDH;
  T* Ps = Vs + BN * C::LDH;
  float* Ss = reinterpret_cast<float*>(Ps + kBM * C::LDP);
  float* Os = Ss + kBM * C::LDS;

  const int i0 = blockIdx.x * kBM, h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.Hq / p.Hkv);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = warp * 16 + lane / 2, half = lane % 2;  // this lane's row of the tile
  const int i = i0 + row;

  const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + hk * p.sk.h;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + hk * p.sv.h;
  const uint32_t key_bh = dropout_key_bh(p.drop, uint32_t(int64_t(b) * p.Hq + h));

  load_tile<T, D, C::LDH>(Qs, q, p.sq.l, i0, kBM, p.Lq, p.E, p.sq.vec16);
  for (int idx = threadIdx.x; idx < kBM * C::LDO; idx += kThreads) Os[idx] = 0.f;
  __syncthreads();  // Os is read below even when no key tile is visited

  const bool sums = p.row_sums != nullptr;
  if (sums) {  // every thread reads the tile's lse, so all take the same branch
    const int64_t rows = (int64_t(b) * p.Hq + h) * p.Lq;
    bool any_huge = false;
    for (int r = i0; r < min(i0 + kBM, p.Lq); ++r) any_huge = any_huge || huge_lse(p.lse[rows + r]);
    if (!any_huge) {
      if (i < p.Lq && half == 0) p.row_sums[rows + i] = 1.f;
      return;
    }
  }

  float m = -INFINITY, l = 0.f;
  int t0, t1;
  key_tile_range(i0, min(i0 + kBM, p.Lq) - 1, p.Lk, p.window_lo, p.window_hi, BN, t0, t1);
  for (int t = t0; t <= t1; ++t) {
    const int j0 = t * BN;
    __syncthreads();  // the previous K, V tiles are no longer read
    load_tile<T, D, C::LDH>(Ks, k, p.sk.l, j0, BN, p.Lk, p.E, p.sk.vec16);
    load_tile<T, D, C::LDH>(Vs, v, p.sv.l, j0, BN, p.Lk, p.Ev, p.sv.vec16);
    __syncthreads();

    // S = Q K^T for this warp's 16 rows. K is row-major (key, dim), i.e. K^T column-major.
    for (int nt = 0; nt < BN / 16; ++nt) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
      for (int kt = 0; kt < D / 16; ++kt) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> bf;
        wmma::load_matrix_sync(a, Qs + warp * 16 * C::LDH + kt * 16, C::LDH);
        wmma::load_matrix_sync(bf, Ks + nt * 16 * C::LDH + kt * 16, C::LDH);
        wmma::mma_sync(acc, a, bf, acc);
      }
      wmma::store_matrix_sync(Ss + warp * 16 * C::LDS + nt * 16, acc, C::LDS, wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax on this lane's half row.
    float* srow = Ss + row * C::LDS;
    float tile_max = -INFINITY;
    for (int c = half * (BN / 2); c < (half + 1) * (BN / 2); ++c) {
      const float s = admit<T>(srow[c] * p.scale, p.mask, p.window_lo, p.window_hi, b, h, i,
                               j0 + c, p.Lq, p.Lk);
      srow[c] = s;
      tile_max = fmaxf(tile_max, s);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float m_new = fmaxf(m, tile_max);
    const float m_use = m_new == -INFINITY ? 0.f : m_new;  // no admissible key yet: all p = 0
    const float alpha = fast_exp(m - m_use);                 // m = -inf gives 0
    float sum = 0.f;
    T* prow = Ps + row * C::LDP;
    for (int c = half * (BN / 2); c < (half + 1) * (BN / 2); ++c) {
      const float e = fast_exp(srow[c] - m_use);
      sum += e;
      const float f = dropout_factor(p.drop, key_bh, uint32_t(i), uint32_t(j0 + c));
      prow[c] = from_float<T>(e * f);
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = l * alpha + sum;
    m = m_new;
    if (sums) continue;
    float* orow = Os + row * C::LDO;
    for (int c = half * (D / 2); c < (half + 1) * (D / 2); ++c) orow[c] *= alpha;
    __syncwarp();

    // O += P V for this warp's rows; V is row-major (key, dim).
    for (int dt = 0; dt < D / 16; ++dt) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      float* o = Os + warp * 16 * C::LDO + dt * 16;
      wmma::load_matrix_sync(acc, o, C::LDO, wmma::mem_row_major);
      for (int kt = 0; kt < BN / 16; ++kt) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> bf;
        wmma::load_matrix_sync(a, Ps + warp * 16 * C::LDP + kt * 16, C::LDP);
        wmma::load_matrix_sync(bf, Vs + kt * 16 * C::LDH + dt * 16, C::LDH);
        wmma::mma_sync(acc, a, bf, acc);
      }
      wmma::store_matrix_sync(o, acc, C::LDO, wmma::mem_row_major);
    }
    __syncwarp();
  }

  if (i >= p.Lq) return;
  const int64_t bh = int64_t(b) * p.Hq + h;
  if (sums) {
    const float lse = p.lse[bh * p.Lq + i];
    if (half == 0) p.row_sums[bh * p.Lq + i] = huge_lse(lse) ? l * expf(m - lse) : 1.f;
    return;
  }
  const float inv_l = l > 0.f ? 1.f / l : 0.f;
  T* out = static_cast<T*>(p.out) + (bh * p.Lq + i) * p.Ev;
  const float* orow = Os + row * C::LDO;
  for (int c = half; c < p.Ev; c += 2) out[c] = from_float<T>(l > 0.f ? orow[c] * inv_l : 0.f);
  if (half == 0) p.lse[bh * p.Lq + i] = l > 0.f ? m + logf(l) : -INFINITY;
}

template <typename T, int D>
cudaError_t launch(const SdpaParams& p, cudaStream_t stream) {
  const dim3 grid(ceil_div(p.Lq, kBM), p.Hq, p.B);
  return launch_kernel(sdpa_fwd_kernel<T, D>, grid, dim3(kThreads), Config<D>::smem_bytes, stream,
                       p);
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
