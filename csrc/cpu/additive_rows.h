// The inner loops of the fused additive-attention kernels: one (query, key) pair at a time,
// over the attention dim A. These are where all the tanh work happens; the float versions are
// compiled for several instruction sets and picked at load time (additive_rows.cpp).
#pragma once
#include <cstdint>

namespace attnx::cpu::additive {

// sum_a v[a] * tanh(q[a] + k[a]).
float tanh_dot(const float* q, const float* k, const float* v, int64_t n);
double tanh_dot(const double* q, const double* k, const double* v, int64_t n);

// As tanh_dot, also storing t[a] = tanh(q[a] + k[a]) for grad_pair.
float tanh_dot_keep(const float* q, const float* k, const float* v, float* t, int64_t n);
double tanh_dot_keep(const double* q, const double* k, const double* v, double* t, int64_t n);

// The gradient of one score s = sum_a v[a] t[a] with d(loss)/ds = ds:
// dq[a] += ds v[a] (1 - t[a]^2), dk[a] += the same, dv[a] += ds t[a].
void grad_pair(const float* t, const float* v, float ds, float* dq, float* dk, float* dv,
               int64_t n);
void grad_pair(const double* t, const double* v, double ds, double* dq, double* dk, double* dv,
               int64_t n);

// y[a] += alpha * x[a].
void axpy(float alpha, const float* x, float* y, int64_t n);
void axpy(double alpha, const double* x, double* y, int64_t n);

// sum_a x[a] * y[a].
float dot(const float* x, const float* y, int64_t n);
double dot(const double* x, const double* y, int64_t n);

}  // namespace attnx::cpu::additive
