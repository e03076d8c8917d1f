// Tile products for the CPU attention kernels, on the BLAS torch itself links (MKL's sgemm_ /
// dgemm_ when torch exports them, else at::addmm_ on views of the same memory).
#pragma once
#include <cstdint>

namespace attnx::cpu {

// Row-major C (m x n, row stride ldc) = alpha * op(A) op(B) + beta * C, with op(A) m x k and
// op(B) k x n. A is stored m x k (row stride lda), or k x m when ta; likewise B with tb.
// beta == 0 ignores what C held.
void gemm_rm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
             int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm_rm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
             int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

}  // namespace attnx::cpu
