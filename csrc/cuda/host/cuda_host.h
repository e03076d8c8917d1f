// The host harness: what csrc/cuda's kernels use of CUDA, for a host C++ compiler, so that the
// kernels' own source runs on the CPU (tests only; see README.md beside this file). Included
// through ../device.cuh when ATTNX_CUDA_HOST is defined; never seen by nvcc.
//
// A launch runs the grid's blocks one after the other, in an order shuffled per seed; a block's
// threads are fibers (ucontext) that each run until they reach a barrier (__syncthreads, or a
// warp's collective: __syncwarp, __shfl_xor_sync, __any_sync, mma_m16n8k16, ldmatrix). The next
// fiber to run is the first of a queue that starts shuffled and takes the fibers a completed
// barrier releases at its front, so released threads run ahead of those that have not reached
// the barrier yet: a missing barrier lets a thread read what others have not written yet, or
// overwrite what they have not read, and the results come out wrong.
#pragma once

// Execution spaces and launch bounds mean nothing on the host.
#define __host__
#define __device__
#define __global__
#define __launch_bounds__(...)
// A block's static __shared__ variables: one per OS thread, which runs one block at a time.
#define __shared__ static thread_local

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>  // types only (dim3, uint4, cudaError_t): nothing links libcudart

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "scheduler.h"

#define threadIdx (::attnx::host::place().thread)
#define blockIdx (::attnx::host::place().block)
#define blockDim (::attnx::host::place().block_dim)
#define gridDim (::attnx::host::place().grid_dim)

// extern __shared__ T name[] of the device code: this block's dynamic shared memory.
#define ATTNX_DYNAMIC_SMEM(T, name, align) \
  T* const name = reinterpret_cast<T*>(::attnx::host::dynamic_smem_base())

inline void __syncthreads() { ::attnx::host::block_barrier(); }

// Whether `predicate` holds in any thread of the block, as a barrier: three barriers around one
// slot per block (per OS thread: it runs one block at a time), so that the slot is cleared after
// every thread has read the last call's result and read after every thread has written.
inline int __syncthreads_or(int predicate) {
  static thread_local int any;
  ::attnx::host::block_barrier();
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) any = 0;
  ::attnx::host::block_barrier();
  if (predicate) any = 1;
  ::attnx::host::block_barrier();
  return any;
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::attnx::host::warp_collective("__syncwarp", mask, nullptr, [](void* const*) {});
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  struct Slot {
    T in, out;
  } slot{value, value};
  ::attnx::host::warp_collective(
      "__shfl_xor_sync", (uintptr_t(mask) << 32) ^ (uintptr_t(lane_mask) << 8) ^ width, &slot,
      [&](void* const* slots) {
        for (int l = 0; l < 32; ++l) {
          const int src = l ^ lane_mask;  // a source outside the lane's segment reads its own
          const bool same_segment = src / width == l / width;
          static_cast<Slot*>(slots[l])->out = static_cast<Slot*>(slots[same_segment ? src : l])->in;
        }
      });
  return slot.out;
}

// A float product rounded as it stands (never contracted into an FMA: nvcc's __fmul_rn; the
// harness is built without FMA instructions).
inline float __fmul_rn(float a, float b) { return a * b; }

// Whether `predicate` holds in any lane of the warp (full masks only: what the kernels use).
inline int __any_sync(unsigned mask, int predicate) {
  struct Slot {
    int in, out;
  } slot{predicate, 0};
  ::attnx::host::warp_collective("__any_sync", mask, &slot, [](void* const* slots) {
    int any = 0;
    for (int l = 0; l < 32; ++l) any |= static_cast<Slot*>(slots[l])->in != 0;
    for (int l = 0; l < 32; ++l) static_cast<Slot*>(slots[l])->out = any;
  });
  return slot.out;
}

// Blocks run one at a time and a block's fibers one at a time: a read-modify-write is atomic.
inline float atomicAdd(float* address, float value) {
  const float old = *address;
  *address = old + value;
  return old;
}
inline double atomicAdd(double* address, double value) {
  const double old = *address;
  *address = old + value;
  return old;
}

// CUDA's min and max take mixed integer types.
template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) {
  return a < b ? a : b;
}
template <typename A, typename B>
inline std::common_type_t<A, B> max(A a, B b) {
  return a < b ? b : a;
}

namespace attnx {
namespace cuda {

// device.cuh's rcp_approx (rcp.approx.ftz.f32), here correctly rounded.
inline float rcp_approx(float x) { return 1.f / x; }
// device.cuh's exp2_approx (ex2.approx.ftz.f32), here the C library's exp2f.
inline float exp2_approx(float x) { return std::exp2(x); }

// The bits of a float.
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// device.cuh's code_arch: the architecture the harness stands for (set_sm90).
inline int code_arch(const void*) { return ::attnx::host::sm90() ? 90 : 80; }

// device.cuh's device_smem_optin: the opt-in shared memory of the part the harness stands for
// (set_smem_optin; by default an H100's with set_sm90, else an A100's).
inline size_t device_smem_optin() { return ::attnx::host::smem_optin(); }

// device.cuh's red_add_f32x2 (red.global.add.v2.f32 from sm_90, which needs an 8-byte aligned
// pair): blocks and fibers run one at a time, so plain adds are atomic.
inline void red_add_f32x2(float* at, float a, float b) {
  if (reinterpret_cast<uintptr_t>(at) % 8 != 0)
    ::attnx::host::misuse("red_add_f32x2 address not 8-byte aligned");
  at[0] += a;
  at[1] += b;
}

// The launch of the device code (device.cuh): the grid runs here, through the harness.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t, const Args&... args) {
  return ::attnx::host::run(grid, block, smem, [&] { kernel(args...); });
}

}  // namespace cuda
}  // namespace attnx

