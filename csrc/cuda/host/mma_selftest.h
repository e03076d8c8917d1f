// Test-only kernels (mma_selftest.cu) that check ../mma.cuh's primitives against the PTX ISA's
// fragment layouts, independently of the attention kernels; tests/test_cuda_mma.py calls them
// through attnx._cuda_host. Plain types only, so register_host.cpp (torch) can include it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace attnx {
namespace cuda {
namespace selftest {

// Four 16x16 fp32 products into out (4, 16, 16), one warp: A Bt^T through ldmatrix_x4, A V
// through ldmatrix_x4_trans, then the same two through ldmatrix_x2 / x2_trans, with 16x16
// row-major a, bt (n, k) and v (k, n) of fp16 (bf16 when `bf16`) brought in by cp.async in two
// groups; rows of a from a_rows on are out of bounds (zero-filled, never read).
cudaError_t tile_products(bool bf16, const void* a, const void* bt, const void* v, int a_rows,
                          float* out);

// d (32, 4) += the mma_m16n8k16 of the per-lane registers a (32, 4) and b (32, 2).
cudaError_t mma_fragments(bool bf16, const uint32_t* a, const uint32_t* b, float* d);

// The registers (4 variants, 32 lanes, 4) that ldmatrix x4, x4.trans, x2, x2.trans give for
// the four 8x8 16-bit matrices m (4, 8, 8), lane l passing row l % 8 of matrix l / 8 (x2: two
// registers, the other two left as they are).
cudaError_t ldmatrix_fragments(const uint16_t* m, uint32_t* out);

}  // namespace selftest
}  // namespace cuda
}  // namespace attnx
