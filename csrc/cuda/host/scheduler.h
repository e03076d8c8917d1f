// The host harness's scheduler (cuda_host.cpp): blocks and their threads as fibers, barriers
// and warp collectives. cuda_host.h builds the CUDA names on it; register_host.cpp runs and
// seeds it. No CUDA names are defined here, so torch's headers can sit beside it.
#pragma once

#include <cuda_runtime.h>  // types only (dim3, uint3, cudaError_t): nothing links libcudart

#include <cstdint>
#include <functional>

namespace attnx {
namespace host {

// The calling fiber's thread and block.
struct ThreadPlace {
  uint3 thread, block;
  dim3 block_dim, grid_dim;
  int warp, lane;
};
const ThreadPlace& place();
unsigned char* dynamic_smem_base();
// Whether [ptr, ptr + bytes) lies in this block's dynamic shared memory.
bool in_dynamic_smem(const void* ptr, size_t bytes);

// Stops the launch with `message`, naming the calling thread (misuse of a CUDA construct).
[[noreturn]] void misuse(const char* message);

// __syncthreads: waits for every thread of the block that has not exited.
void block_barrier();

// A warp collective: every lane of the warp arrives with the same `what` and `key` (the CUDA
// documentation requires the same call and arguments warp-wide; a mismatch is reported) and
// its own `slot`. The last lane to arrive runs `work` once over all the lanes' slots, before
// any lane goes on.
using WarpWork = std::function<void(void* const* slots)>;
void warp_collective(const char* what, uintptr_t key, void* slot, const WarpWork& work);

// cp.async of the calling thread (mma_host.h): `async_copy` queues 16 bytes from `src` (or 16
// zero bytes when src is null) to `dst`; `async_commit` closes the queued copies into a group;
// `async_wait(n)` performs the copies of all but the newest n groups, which is the only time they
// land, so reading shared memory a copy targets before its wait reads NaN. A thread that exits
// with copies not waited for is an error of the launch.
void async_copy(void* dst, const void* src);
void async_commit();
void async_wait(int n);

// Runs `body` as every thread of every block of the grid; returns cudaErrorLaunchFailure with
// last_error() set when a block deadlocked or a collective was misused.
cudaError_t run(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body);
const char* last_error();

// The launch order's seed (blocks and threads are shuffled from it and the launch's count).
void set_seed(uint64_t seed);

// Test-only: with n > 0 a launch runs only the grid's last n blocks (highest z, then y, then x),
// so that a test can reach offsets past 2^31 elements without computing the blocks before them.
void set_last_blocks(uint64_t n);

// Test-only: the architecture the harness stands for, sm_90 (the default) or sm_80: where a
// kernel's variants differ by arch (device.cuh code_arch), which one a launch runs.
void set_sm90(bool sm90);
bool sm90();

// Test-only: the opt-in shared memory per block of the part the harness stands for, where a
// kernel picks its variant by it (device.cuh device_smem_optin): `bytes`, or with 0 (the
// default) an H100's 227 KB under set_sm90(true), an A100's 163 KB under set_sm90(false).
void set_smem_optin(size_t bytes);
size_t smem_optin();

// Test-only: the threads a block of the last launch had.
size_t last_launch_threads();

}  // namespace host
}  // namespace attnx

