// What the kernels use of CUDA beyond plain C++, in one place: the toolkit's headers under nvcc,
// or their host twins (host/cuda_host.h) when the host harness compiles the same kernel source
// with a C++ compiler (ATTNX_CUDA_HOST; tests only). Every construct plain C++ lacks goes
// through a name defined here or there: ATTNX_DYNAMIC_SMEM for `extern __shared__` and
// launch_kernel for `<<<...>>>`; barriers, shuffles and atomics keep their CUDA names.
#pragma once

#if defined(ATTNX_CUDA_HOST)
#include "host/cuda_host.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "smem_grants.h"

// The block's dynamic shared memory as an array `name` of T.
#define ATTNX_DYNAMIC_SMEM(T, name, align) extern __shared__ __align__(align) T name[]

namespace attnx {
namespace cuda {

// Lets `kernel` use `bytes` of dynamic shared memory on the current device (SmemGrants: the
// attribute is set once per device and kernel, not on every launch).
inline cudaError_t reserve_dynamic_smem(const void* kernel, size_t bytes) {
  if (bytes <= SmemGrants::kDefaultLimit) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static SmemGrants grants;
  return grants.reserve(device, kernel, bytes, [](const void* f, size_t n) {
    return cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, int(n));
  });
}

// 1 / x by the SFU's approximate reciprocal (rcp.approx.ftz: within 1 ulp, 0 for inf): one
// instruction where 1.f / x is a dozen.
__device__ __forceinline__ float rcp_approx(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// 2^x by the SFU (ex2.approx.ftz: relative error about 2^-22, subnormal results flushed to 0,
// 0 for -inf): one MUFU.EX2 where exp2f adds a range test and two scalings around it for
// subnormal results, which a softmax's probabilities (relative to a row max of 1) never need.
__device__ __forceinline__ float exp2_approx(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// The architecture the code of `kernel` on the current device was compiled for (__CUDA_ARCH__
// / 10: its PTX version, a cubin's or the PTX the driver compiles for a newer device), 0 where
// it cannot be read (the launch then reports why). Kernels whose variants differ by arch
// launch the one that code holds (sdpa_fwd.cuh row_tiles, sdpa_bwd.cuh two_key_tiles).
inline int code_arch(const void* kernel) {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess ? attributes.ptxVersion : 0;
}

// The dynamic shared memory a block may opt in to on the current device
// (cudaDevAttrMaxSharedMemoryPerBlockOptin), 0 where it cannot be read. Kernels with variants
// of different shared memory launch the largest that fits (sdpa_bwd.cuh).
inline size_t device_smem_optin() {
  int device = 0, bytes = 0;
  const cudaDeviceAttr attr = cudaDevAttrMaxSharedMemoryPerBlockOptin;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, attr, device) != cudaSuccess)
    return 0;
  return size_t(bytes);
}

// at[0] += a, at[1] += b in global memory (at 8-byte aligned), atomically per element: from
// sm_90 one vector reduction (red.global.add.v2.f32: one instruction, and the pair's 8 bytes in
// one request), before two atomics.
__device__ __forceinline__ void red_add_f32x2(float* at, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(at), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(at, a);
  atomicAdd(at + 1, b);
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), and the launch's error.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, const Args&... args) {
  cudaError_t err = reserve_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, block, smem, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace attnx
#endif
