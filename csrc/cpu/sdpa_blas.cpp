#include "sdpa_blas.h"

#include <ATen/ATen.h>

#include <limits>

// Fortran BLAS entry points. Weak, so the extension still loads against a torch that does not
// export them; the calls then go through at::addmm_ (same BLAS, a little more overhead).
extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
            const float*, const int*, const float*, const int*, const float*, float*,
            const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*,
            const double*, const int*, const double*, const int*, const double*, double*,
            const int*) __attribute__((weak));
}

namespace attnx::cpu {
namespace {

template <typename T>
using Blas = void (*)(const char*, const char*, const int*, const int*, const int*, const T*,
                      const T*, const int*, const T*, const int*, const T*, T*, const int*);

bool fits_int(std::initializer_list<int64_t> xs) {
  for (int64_t x : xs) {
    if (x > std::numeric_limits<int>::max()) return false;
  }
  return true;
}

template <typename T>
void gemm_impl(Blas<T> blas, bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha,
               const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum (no value columns: lse-only gradients); BLAS rejects its
                 // zero leading dimensions and leaves C as it was
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; ++j) c[r * ldc + j] = beta == T(0) ? T(0) : beta * c[r * ldc + j];
    return;
  }
  if (blas != nullptr && fits_int({m, n, k, lda, ldb, ldc})) {
    // Column-major BLAS sees the row-major C as C^T = op(B)^T op(A)^T.
    const int im = static_cast<int>(n), in = static_cast<int>(m), ik = static_cast<int>(k);
    const int ilda = static_cast<int>(ldb), ildb = static_cast<int>(lda),
              ildc = static_cast<int>(ldc);
    blas(tb ? "T" : "N", ta ? "T" : "N", &im, &in, &ik, &alpha, b, &ilda, a, &ildb, &beta, c,
         &ildc);
    return;
  }
  const auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  auto av = at::from_blob(const_cast<T*>(a), {m, k},
                          ta ? at::IntArrayRef{1, lda} : at::IntArrayRef{lda, 1}, opts);
  auto bv = at::from_blob(const_cast<T*>(b), {k, n},
                          tb ? at::IntArrayRef{1, ldb} : at::IntArrayRef{ldb, 1}, opts);
  auto cv = at::from_blob(c, {m, n}, {ldc, 1}, opts);
  cv.addmm_(av, bv, beta, alpha);
}

}  // namespace

void gemm_rm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
             int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  gemm_impl<float>(sgemm_, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void gemm_rm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
             int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  gemm_impl<double>(dgemm_, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace attnx::cpu
