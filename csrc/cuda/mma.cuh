// The sm_80 tensor-core and async-copy primitives the FA2-design kernels use, as thin wrappers:
// inline PTX under nvcc, the host harness's twins (host/mma_host.h) under ATTNX_CUDA_HOST, so the
// same kernel source runs on a GPU and through the harness. Included by kernels after
// device.cuh. Fragment layouts are the PTX ISA's (mma.sync.aligned.m16n8k16.row.col, ldmatrix),
// with g = lane / 4 (groupID) and t = lane % 4 (threadID_in_group); a uint32_t holds two 16-bit
// elements, the lower column (or k) in its low half:
//   A (16x16, row-major)  a[0]: (g, 2t..2t+1)  a[1]: (g+8, 2t..)  a[2]: (g, 2t+8..)  a[3]: (g+8, 2t+8..)
//   B (16x8, k x n)       b[0]: k = 2t..2t+1, n = g              b[1]: k = 2t+8..2t+9, n = g
//   C/D (16x8, fp32)      d[0], d[1]: (g, 2t), (g, 2t+1)         d[2], d[3]: (g+8, 2t), (g+8, 2t+1)
// ldmatrix: lane l passes the address of row l % 8 of matrix l / 8 (8 rows of 8 16-bit
// elements, 16 bytes each, 16-byte aligned, in shared memory; .x2 reads lanes 0-15's); register
// i then holds row g, elements 2t..2t+1 of matrix i, or with .trans column g, rows 2t..2t+1.
// So ldmatrix of a row-major 16x16 A tile (matrices: rows 0-7/8-15 x cols 0-7, then cols 8-15)
// gives a[] directly; of a (n, k) K tile gives b[] (non-trans); of a (k, n) V tile, .trans.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "device.cuh"

#if defined(ATTNX_CUDA_HOST)
#include "host/mma_host.h"
#else

namespace attnx {
namespace cuda {

// d += A B for one warp: A 16x16, B 16x8 of T (__half or __nv_bfloat16), d fp32.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
  static_assert(std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value,
                "mma_m16n8k16 takes __half or __nv_bfloat16");
  if constexpr (std::is_same<T, __half>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four (two) 8x8 16-bit matrices from shared memory, one row address per lane (see above).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_address(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_address(smem_row)));
}

// 16 bytes global -> shared, asynchronously (both 16-byte aligned); with !in_bounds the 16
// shared bytes are zero-filled and gmem is not read (src-size 0), so gmem may be any address.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool in_bounds) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)),
               "l"(gmem), "r"(in_bounds ? 16 : 0)
               : "memory");
}

// Closes this thread's group of cp.async copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are still in flight (the newest N);
// other threads' copies need a __syncthreads after their waits.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace cuda
}  // namespace attnx
#endif

namespace attnx {
namespace cuda {

// Two floats rounded to T, packed as an A or B register: `lo` in the low half (the lower
// column or k), as the fragments above hold them.
template <typename T>
__host__ __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__host__ __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  uint32_t r;
  memcpy(&r, &v, sizeof r);
  return r;
}
template <>
__host__ __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t r;
  memcpy(&r, &v, sizeof r);
  return r;
}

// The two fp16 halves of a pack2<__half> register as floats (lo, hi).
__host__ __device__ __forceinline__ float2 unpack2_half(uint32_t r) {
  __half2 v;
  memcpy(&v, &r, sizeof r);
  return __half22float2(v);
}

}  // namespace cuda
}  // namespace attnx
