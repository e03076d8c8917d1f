// The exact inner loops of the fused additive-attention kernels: one (query, key) pair at a
// time, over the attention dim A, with tanh itself. float32 pairs take them where an operand
// is too large for the exponential form (additive_terms.h), float64 ones always; the float
// versions are compiled for several instruction sets and picked at load time.
#pragma once
#include <cstdint>

namespace attnx::cpu::additive {

// sum_a v[a] * tanh(q[a] + k[a]).
float tanh_dot(const float* q, const float* k, const float* v, int64_t n);
double tanh_dot(const double* q, const double* k, const double* v, int64_t n);

// As tanh_dot, also storing t[a] = tanh(q[a] + k[a]) for grad_terms.
float tanh_dot_keep(const float* q, const float* k, const float* v, float* t, int64_t n);
double tanh_dot_keep(const double* q, const double* k, const double* v, double* t, int64_t n);

// The gradient of one score s = sum_a v[a] t[a] with d(loss)/ds = ds: with u = (1 - t^2) / 4,
// dq[a] += ds u, dk[a] += ds u (the units of exp_grads, additive_terms.h), dvt[a] += ds t (v's
// gradient itself: not exp_grads' ds r, whose sum - 2 sum ds r loses t's precision where
// |t| is small).
void grad_terms(const float* t, float ds, float* dq, float* dk, float* dvt, int64_t n);
void grad_terms(const double* t, double ds, double* dq, double* dk, double* dvt, int64_t n);

// y[a] += alpha * x[a].
void axpy(float alpha, const float* x, float* y, int64_t n);
void axpy(double alpha, const double* x, double* y, int64_t n);

// sum_a x[a] * y[a].
float dot(const float* x, const float* y, int64_t n);
double dot(const double* x, const double* y, int64_t n);

}  // namespace attnx::cpu::additive
