// The inner loops of additive attention (declared in additive_rows.h).
//
// The build targets baseline x86-64 (SSE2), so the float loops are written with GCC/Clang
// vector extensions (8 lanes) and, on x86-64 with GCC, cloned for x86-64-v3 (AVX2, FMA): the
// loader picks the clone the CPU supports, so one binary runs everywhere and is fast where it
// can be. (A clone for "arch=haswell" would be picked by CPU model, not features: never on AMD.)
//
// tanh is a rational minimax-style fit, tanh(x) ~ x P(x^2) / Q(x^2) on |x| <= 9 (beyond that
// tanh rounds to +-1 in float32), fitted for this project by iteratively reweighted least
// squares on the relative error; evaluated in float32 its relative error stays below 5e-7.
// It costs one division and nine FMAs, several times cheaper than a libm call per element.
#include "additive_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ATTNX_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define ATTNX_CLONES
#endif

#if defined(__GNUC__) && !defined(__clang__)
// The 8-lane vectors never cross a function boundary (all helpers are always_inline), so the
// ABI note GCC gives about passing them without AVX does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace attnx::cpu::additive {
namespace {

constexpr float kClamp = 9.0f;
constexpr float kP0 = 1.0f;
constexpr float kP1 = 0.12979591451566733f;
constexpr float kP2 = 0.0029856506986992576f;
constexpr float kP3 = 9.857241501747688e-06f;
constexpr float kP4 = -1.4526349428889418e-08f;
constexpr float kP5 = 2.2625540330167837e-11f;
constexpr float kQ1 = 0.4631291405251291f;
constexpr float kQ2 = 0.024028863304156187f;
constexpr float kQ3 = 0.00023705924674082262f;

constexpr int kLanes = 8;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));

template <typename T>
__attribute__((always_inline)) inline T tanh_rational(T x) {
  x = x < -kClamp ? -kClamp : x;
  x = x > kClamp ? kClamp : x;
  const T y = x * x;
  const T p = ((((kP5 * y + kP4) * y + kP3) * y + kP2) * y + kP1) * y + kP0;
  const T q = ((kQ3 * y + kQ2) * y + kQ1) * y + 1.0f;
  T r = x * p / q;
  r = r > 1.0f ? 1.0f : r;  // the fit overshoots 1 by a few ulp near the clamp
  return r < -1.0f ? -1.0f : r;
}

__attribute__((always_inline)) inline vfloat load(const float* p) {
  vfloat x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

__attribute__((always_inline)) inline void store(float* p, vfloat x) {
  std::memcpy(p, &x, sizeof(x));
}

__attribute__((always_inline)) inline float hsum(vfloat x) {
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += x[l];
  return s;
}

}  // namespace

ATTNX_CLONES float tanh_dot(const float* q, const float* k, const float* v, int64_t n) {
  vfloat acc0 = {}, acc1 = {};
  int64_t a = 0;
  for (; a + 2 * kLanes <= n; a += 2 * kLanes) {
    acc0 += load(v + a) * tanh_rational(load(q + a) + load(k + a));
    acc1 += load(v + a + kLanes) * tanh_rational(load(q + a + kLanes) + load(k + a + kLanes));
  }
  if (a + kLanes <= n) {
    acc0 += load(v + a) * tanh_rational(load(q + a) + load(k + a));
    a += kLanes;
  }
  float s = hsum(acc0 + acc1);
  for (; a < n; ++a) s += v[a] * tanh_rational(q[a] + k[a]);
  return s;
}

ATTNX_CLONES float tanh_dot_keep(const float* q, const float* k, const float* v, float* t,
                                 int64_t n) {
  vfloat acc = {};
  int64_t a = 0;
  for (; a + kLanes <= n; a += kLanes) {
    const vfloat th = tanh_rational(load(q + a) + load(k + a));
    store(t + a, th);
    acc += load(v + a) * th;
  }
  float s = hsum(acc);
  for (; a < n; ++a) {
    t[a] = tanh_rational(q[a] + k[a]);
    s += v[a] * t[a];
  }
  return s;
}

ATTNX_CLONES void grad_terms(const float* t, float ds, float* dq, float* dk, float* dvt,
                             int64_t n) {
  int64_t a = 0;
  for (; a + kLanes <= n; a += kLanes) {
    const vfloat th = load(t + a);
    const vfloat g = (0.25f * ds) * ((1.0f - th) * (1.0f + th));
    store(dq + a, load(dq + a) + g);
    store(dk + a, load(dk + a) + g);
    store(dvt + a, load(dvt + a) + ds * th);
  }
  for (; a < n; ++a) {
    const float g = 0.25f * ds * ((1.0f - t[a]) * (1.0f + t[a]));
    dq[a] += g;
    dk[a] += g;
    dvt[a] += ds * t[a];
  }
}

// Written out on vectors: GCC's own vectorization of the plain loop ran at about one scalar
// FMA per cycle here (its runtime alias checks), a quarter of the forward's time at Ev = 256.
ATTNX_CLONES void axpy(float alpha, const float* x, float* y, int64_t n) {
  int64_t a = 0;
  for (; a + kLanes <= n; a += kLanes) store(y + a, load(y + a) + alpha * load(x + a));
  for (; a < n; ++a) y[a] += alpha * x[a];
}

ATTNX_CLONES float dot(const float* x, const float* y, int64_t n) {
  vfloat acc = {};
  int64_t a = 0;
  for (; a + kLanes <= n; a += kLanes) acc += load(x + a) * load(y + a);
  float s = hsum(acc);
  for (; a < n; ++a) s += x[a] * y[a];
  return s;
}

// float64 is the gradcheck / golden-accuracy path: exact libm tanh, plain loops.
double tanh_dot(const double* q, const double* k, const double* v, int64_t n) {
  double s = 0.0;
  for (int64_t a = 0; a < n; ++a) s += v[a] * std::tanh(q[a] + k[a]);
  return s;
}

double tanh_dot_keep(const double* q, const double* k, const double* v, double* t, int64_t n) {
  double s = 0.0;
  for (int64_t a = 0; a < n; ++a) {
    t[a] = std::tanh(q[a] + k[a]);
    s += v[a] * t[a];
  }
  return s;
}

void grad_terms(const double* t, double ds, double* dq, double* dk, double* dvt, int64_t n) {
  for (int64_t a = 0; a < n; ++a) {
    const double g = 0.25 * ds * ((1.0 - t[a]) * (1.0 + t[a]));
    dq[a] += g;
    dk[a] += g;
    dvt[a] += ds * t[a];
  }
}

void axpy(double alpha, const double* x, double* y, int64_t n) {
  for (int64_t a = 0; a < n; ++a) y[a] += alpha * x[a];
}

double dot(const double* x, const double* y, int64_t n) {
  double s = 0.0;
  for (int64_t a = 0; a < n; ++a) s += x[a] * y[a];
  return s;
}

}  // namespace attnx::cpu::additive
