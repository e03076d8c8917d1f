// Test-only kernels of mma_selftest.h, written against ../mma.cuh like the attention kernels, so
// the same source runs through the host harness (tests) and compiles with nvcc (the PTX check).
#include "../device.cuh"
#include "../mma.cuh"
#include "mma_selftest.h"

namespace attnx {
namespace cuda {
namespace selftest {
namespace {

constexpr int kTile = 16 * 16;  // elements of a 16x16 tile

// Lane l's address for ldmatrix of a 16x16 row-major tile (row stride 16): matrix l / 8, row
// l % 8, the matrices at rows 8 * (i & row_bit ? 1 : 0) and columns 8 * (i & col_bit ? 1 : 0).
template <typename T>
__device__ const T* row_of(const T* tile, int lane, int row_bit, int col_bit) {
  const int i = lane / 8, r = lane % 8;
  return tile + (r + ((i & row_bit) ? 8 : 0)) * 16 + ((i & col_bit) ? 8 : 0);
}

__device__ void store(float* out, int nb, const float (&d)[4]) {
  const int g = threadIdx.x / 4, t = threadIdx.x % 4;
  for (int e = 0; e < 4; ++e) out[(g + 8 * (e / 2)) * 16 + nb * 8 + 2 * t + e % 2] = d[e];
}

template <typename T>
__global__ void tile_products_kernel(const T* a, const T* bt, const T* v, int a_rows, float* out) {
  ATTNX_DYNAMIC_SMEM(unsigned char, smem_raw, 16);
  T* As = reinterpret_cast<T*>(smem_raw);
  T* Bs = As + kTile;
  T* Vs = Bs + kTile;
  const int lane = threadIdx.x, row = lane / 2, col = (lane % 2) * 8;  // a 16-byte chunk each
  cp_async_16(As + row * 16 + col, a + row * 16 + col, row < a_rows);
  cp_async_16(Bs + row * 16 + col, bt + row * 16 + col, true);
  cp_async_commit();
  cp_async_16(Vs + row * 16 + col, v + row * 16 + col, true);
  cp_async_commit();

  cp_async_wait<1>();  // A and Bt landed; V may still be in flight
  __syncwarp();
  uint32_t fa[4], fb[4], fb2[2];
  ldmatrix_x4(fa, row_of(As, lane, 1, 2));  // matrices (rows 0-7|8-15) x (cols 0-7|8-15): a[]
  ldmatrix_x4(fb, row_of(Bs, lane, 2, 1));  // (n 0-7, k 0-7), (n 0-7, k 8-15), then n 8-15
  for (int nb = 0; nb < 2; ++nb) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t b[2] = {fb[2 * nb], fb[2 * nb + 1]};
    mma_m16n8k16<T>(d, fa, b);
    store(out, nb, d);
    float d2[4] = {0.f, 0.f, 0.f, 0.f};
    ldmatrix_x2(fb2, row_of(Bs + nb * 8 * 16, lane, 0, 1));  // lanes 0-15: k 0-7, then 8-15
    mma_m16n8k16<T>(d2, fa, fb2);
    store(out + 2 * kTile, nb, d2);
  }

  cp_async_wait<0>();
  __syncwarp();
  ldmatrix_x4_trans(fb, row_of(Vs, lane, 1, 2));  // (k 0-7, n 0-7), (k 8-15, n 0-7), then n 8-15
  for (int nb = 0; nb < 2; ++nb) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t b[2] = {fb[2 * nb], fb[2 * nb + 1]};
    mma_m16n8k16<T>(d, fa, b);
    store(out + kTile, nb, d);
    float d2[4] = {0.f, 0.f, 0.f, 0.f};
    ldmatrix_x2_trans(fb2, row_of(Vs + nb * 8, lane, 1, 0));
    mma_m16n8k16<T>(d2, fa, fb2);
    store(out + 3 * kTile, nb, d2);
  }
}

template <typename T>
__global__ void mma_fragments_kernel(const uint32_t* a, const uint32_t* b, float* d) {
  const int lane = threadIdx.x;
  uint32_t fa[4], fb[2];
  float fd[4];
  for (int e = 0; e < 4; ++e) fa[e] = a[lane * 4 + e];
  for (int e = 0; e < 2; ++e) fb[e] = b[lane * 2 + e];
  for (int e = 0; e < 4; ++e) fd[e] = d[lane * 4 + e];
  mma_m16n8k16<T>(fd, fa, fb);
  for (int e = 0; e < 4; ++e) d[lane * 4 + e] = fd[e];
}

__global__ void ldmatrix_fragments_kernel(const uint16_t* m, uint32_t* out) {
  ATTNX_DYNAMIC_SMEM(uint16_t, ms, 16);
  const int lane = threadIdx.x;
  for (int e = 0; e < 8; ++e) ms[lane * 8 + e] = m[lane * 8 + e];  // row lane % 8 of matrix lane / 8
  __syncwarp();
  const uint16_t* row = ms + lane * 8;
  uint32_t r4[4], r2[2];
  ldmatrix_x4(r4, row);
  for (int e = 0; e < 4; ++e) out[(0 * 32 + lane) * 4 + e] = r4[e];
  ldmatrix_x4_trans(r4, row);
  for (int e = 0; e < 4; ++e) out[(1 * 32 + lane) * 4 + e] = r4[e];
  ldmatrix_x2(r2, row);
  for (int e = 0; e < 2; ++e) out[(2 * 32 + lane) * 4 + e] = r2[e];
  ldmatrix_x2_trans(r2, row);
  for (int e = 0; e < 2; ++e) out[(3 * 32 + lane) * 4 + e] = r2[e];
}

}  // namespace

cudaError_t tile_products(bool bf16, const void* a, const void* bt, const void* v, int a_rows,
                          float* out) {
  const size_t smem = 3 * kTile * 2;
  if (bf16) {
    using T = __nv_bfloat16;
    return launch_kernel(tile_products_kernel<T>, dim3(1), dim3(32), smem, nullptr,
                         static_cast<const T*>(a), static_cast<const T*>(bt),
                         static_cast<const T*>(v), a_rows, out);
  }
  using T = __half;
  return launch_kernel(tile_products_kernel<T>, dim3(1), dim3(32), smem, nullptr,
                       static_cast<const T*>(a), static_cast<const T*>(bt),
                       static_cast<const T*>(v), a_rows, out);
}

cudaError_t mma_fragments(bool bf16, const uint32_t* a, const uint32_t* b, float* d) {
  return bf16 ? launch_kernel(mma_fragments_kernel<__nv_bfloat16>, dim3(1), dim3(32), 0, nullptr,
                              a, b, d)
              : launch_kernel(mma_fragments_kernel<__half>, dim3(1), dim3(32), 0, nullptr, a, b, d);
}

cudaError_t ldmatrix_fragments(const uint16_t* m, uint32_t* out) {
  return launch_kernel(ldmatrix_fragments_kernel, dim3(1), dim3(32), 4 * 64 * 2, nullptr, m, out);
}

}  // namespace selftest
}  // namespace cuda
}  // namespace attnx
