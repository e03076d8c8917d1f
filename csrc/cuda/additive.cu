// Additive (Bahdanau) attention, forward and backward, fused on CUDA cores in fp32:
//   s[i, j] = sum_a v[a] * tanh(q[i, a] + k[j, a]),  P = softmax_j(s + mask),  out = (P*z) value
// The (Lq, Lk, A) tanh tensor is never stored: each kernel recomputes tanh from q and k tiles
// held in shared memory, A chunk by A chunk.
//
// Forward: one CTA per (query tile of BQ rows, head, batch); for each key tile of BK keys it
// builds the score tile, runs the online softmax per row (running max m and sum l) and
// rescales and accumulates the fp32 output tile (BQ, Ev) in shared memory. With return_weights,
// a second pass over the same key tiles recomputes the scores and writes P*z (exp(s - m) / l:
// exact on rows of huge lse too, where exp(s - lse) is not; common.cuh).
//
// Backward: one CTA per (query tile, head, batch). Per key tile it recomputes s and P =
// exp(s - lse) / R (R = 1 but on rows of huge lse, where a first pass over the key tiles sums
// R = sum_j exp(s_j - lse), which the rounded lse leaves above 1; common.cuh), forms
//   dPd = dO value^T (+ dW),  dS = P * (dPd * z - delta),  delta = rowsum(dO * out)  (host)
// and then, A chunk by A chunk, with t = tanh(q + k) and g = dS * (1 - t^2):
//   dq[i, a] += v[a] sum_j g      (rows owned by this CTA: plain read-modify-write)
//   dk[j, a] += v[a] sum_i g,  dv[a] += sum_ij dS t,  dvalue[j] += sum_i Pd[i, j] dO[i]
// (fp32 atomics: other query tiles add to the same keys). dmask = dS.
//
// Layouts: q, k, value with a contiguous last dim; v (H, A) through its strides (a broadcast
// (A,) vector has stride 0 on H); outputs and fp32 accumulators contiguous. Loads are
// bounds-checked, so any Lq, Lk, A, Ev work; Ev is bounded by the shared memory the host checks
// (additive_smem_ok).
#include "common.cuh"

namespace attnx {
namespace cuda {
namespace {

constexpr int kBQ = 16, kBK = 32, kAC = 64, kThreads = 128;
// CTAs per SM the kernels are compiled for (__launch_bounds__): with 5, ptxas (CUDA 13) fits
// them in 80 registers without spilling; without it, it spilled on sm_90 (test_cuda_resources.py).
constexpr int kMinBlocks = 5;

struct Smem {  // offsets into the dynamic shared memory, in floats
  int qs, ks, vs, S, dS, Pd, O, dO, lse, delta, m, l, alpha, total;
  explicit __host__ __device__ Smem(int Ev) {
    int o = 0;
    qs = o;    o += kBQ * kAC;
    ks = o;    o += kBK * (kAC + 1);  // +1: threads of a warp read different keys, same a
    vs = o;    o += kAC;
    S = o;     o += kBQ * kBK;
    dS = o;    o += kBQ * kBK;
    Pd = o;    o += kBQ * kBK;
    O = o;     o += kBQ * Ev;  // forward: the output tile; backward: the dO tile
    dO = O;
    lse = o;   o += kBQ;
    delta = o; o += kBQ;
    m = o;     o += kBQ;
    l = o;     o += kBQ;
    alpha = o; o += kBQ;
    total = o;
  }
};

template <typename T>
struct Head {  // pointers to one (b, h)
  const T *q, *k, *value, *v;
  int64_t bh;
  uint32_t key_bh;
  __device__ Head(const AdditiveParams& p, int b, int h) {
    q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h;
    k = static_cast<const T*>(p.k) + b * p.sk.b + h * p.sk.h;
    value = static_cast<const T*>(p.value) + b * p.svalue.b + h * p.svalue.h;
    v = static_cast<const T*>(p.v) + h * p.vh;
    bh = int64_t(b) * p.H + h;
    key_bh = dropout_key_bh(p.drop, uint32_t(bh));
  }
};

// Loads the A chunk [a0, a0 + kAC) of the query tile, the key tile and v (zero past the ends).
template <typename T>
__device__ void load_chunk(const AdditiveParams& p, const Head<T>& hd, const Smem& L, float* sm,
                           int i0, int j0, int a0) {
  for (int idx = threadIdx.x; idx < kBQ * kAC; idx += kThreads) {
    const int r = idx / kAC, a = idx % kAC;
    const bool in = i0 + r < p.Lq && a0 + a < p.A;
    sm[L.qs + idx] = in ? to_float(hd.q[int64_t(i0 + r) * p.sq.l + a0 + a]) : 0.f;
  }
  for (int idx = threadIdx.x; idx < kBK * kAC; idx += kThreads) {
    const int r = idx / kAC, a = idx % kAC;
    const bool in = j0 + r < p.Lk && a0 + a < p.A;
    sm[L.ks + r * (kAC + 1) + a] = in ? to_float(hd.k[int64_t(j0 + r) * p.sk.l + a0 + a]) : 0.f;
  }
  for (int a = threadIdx.x; a < kAC; a += kThreads)
    sm[L.vs + a] = a0 + a < p.A ? to_float(hd.v[int64_t(a0 + a) * p.va]) : 0.f;
}

// sm[S] = the scores of the tile after band and mask (-inf where not admissible).
template <typename T>
__device__ void score_tile(const AdditiveParams& p, const Head<T>& hd, const Smem& L, float* sm,
                           int b, int h, int i0, int j0) {
  float acc[kBQ * kBK / kThreads] = {};
  for (int a0 = 0; a0 < p.A; a0 += kAC) {
    __syncthreads();
    load_chunk(p, hd, L, sm, i0, j0, a0);
    __syncthreads();
    const int na = min(kAC, p.A - a0);
#pragma unroll
    for (int e = 0; e < kBQ * kBK / kThreads; ++e) {
      const int idx = threadIdx.x + e * kThreads, r = idx / kBK, c = idx % kBK;
      const float* qr = sm + L.qs + r * kAC;
      const float* kr = sm + L.ks + c * (kAC + 1);
      float s = 0.f;
      for (int a = 0; a < na; ++a) s += sm[L.vs + a] * tanhf(qr[a] + kr[a]);
      acc[e] += s;
    }
  }
#pragma unroll
  for (int e = 0; e < kBQ * kBK / kThreads; ++e) {
    const int idx = threadIdx.x + e * kThreads, r = idx / kBK, c = idx % kBK;
    sm[L.S + idx] = admit<T>(acc[e], p.mask, p.window_lo, p.window_hi, b, h, i0 + r, j0 + c,
                             p.Lq, p.Lk);
  }
  __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    additive_fwd_kernel(const AdditiveParams p) {
  ATTNX_DYNAMIC_SMEM(float, sm, 16);
  const Smem L(p.Ev);
  const int i0 = blockIdx.x * kBQ, h = blockIdx.y, b = blockIdx.z;
  const Head<T> hd(p, b, h);

  for (int idx = threadIdx.x; idx < kBQ * p.Ev; idx += kThreads) sm[L.O + idx] = 0.f;
  for (int r = threadIdx.x; r < kBQ; r += kThreads) {
    sm[L.m + r] = -INFINITY;
    sm[L.l + r] = 0.f;
  }
  int t0, t1;
  key_tile_range(i0, min(i0 + kBQ, p.Lq) - 1, p.Lk, p.window_lo, p.window_hi, kBK, t0, t1);
  for (int t = t0; t <= t1; ++t) {
    const int j0 = t * kBK;
    score_tile(p, hd, L, sm, b, h, i0, j0);
    // Online softmax, one thread per row; sm[S] becomes P*z with the row's new max.
    for (int r = threadIdx.x; r < kBQ; r += kThreads) {
      float* srow = sm + L.S + r * kBK;
      float mx = sm[L.m + r];
      for (int c = 0; c < kBK; ++c) mx = fmaxf(mx, srow[c]);
      const float m_use = mx == -INFINITY ? 0.f : mx;
      const float alpha = fast_exp(sm[L.m + r] - m_use);
      float sum = 0.f;
      for (int c = 0; c < kBK; ++c) {
        const float e = fast_exp(srow[c] - m_use);
        sum += e;
        srow[c] = e * dropout_factor(p.drop, hd.key_bh, uint32_t(i0 + r), uint32_t(j0 + c));
      }
      sm[L.l + r] = sm[L.l + r] * alpha + sum;
      sm[L.m + r] = mx;
      sm[L.alpha + r] = alpha;
    }
    __syncthreads();
    const int nk = min(kBK, p.Lk - j0);
    for (int idx = threadIdx.x; idx < kBQ * p.Ev; idx += kThreads) {
      const int r = idx / p.Ev, e = idx % p.Ev;
      float o = sm[L.O + idx] * sm[L.alpha + r];
      for (int c = 0; c < nk; ++c)
        o += sm[L.S + r * kBK + c] * to_float(hd.value[int64_t(j0 + c) * p.svalue.l + e]);
      sm[L.O + idx] = o;
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < kBQ * p.Ev; idx += kThreads) {
    const int r = idx / p.Ev, e = idx % p.Ev;
    if (i0 + r >= p.Lq) continue;
    const float l = sm[L.l + r];
    static_cast<T*>(p.out)[(hd.bh * p.Lq + i0 + r) * p.Ev + e] =
        from_float<T>(l > 0.f ? sm[L.O + idx] / l : 0.f);
  }
  for (int r = threadIdx.x; r < kBQ; r += kThreads) {
    const float l = sm[L.l + r];
    if (i0 + r < p.Lq) p.lse[hd.bh * p.Lq + i0 + r] = l > 0.f ? sm[L.m + r] + logf(l) : -INFINITY;
  }
  if (p.weights == nullptr) return;
  // Second pass: the probabilities themselves (the host zero-fills tiles outside the band).
  for (int t = t0; t <= t1; ++t) {
    const int j0 = t * kBK;
    score_tile(p, hd, L, sm, b, h, i0, j0);
    for (int idx = threadIdx.x; idx < kBQ * kBK; idx += kThreads) {
      const int r = idx / kBK, c = idx % kBK, i = i0 + r, j = j0 + c;
      if (i >= p.Lq || j >= p.Lk) continue;
      const float s = sm[L.S + idx], l = sm[L.l + r];
      const float pr = (s == -INFINITY || l == 0.f) ? 0.f : fast_exp(s - sm[L.m + r]) / l;
      static_cast<T*>(p.weights)[(hd.bh * p.Lq + i) * p.Lk + j] =
          from_float<T>(pr * dropout_factor(p.drop, hd.key_bh, uint32_t(i), uint32_t(j)));
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    additive_bwd_kernel(const AdditiveParams p) {
  ATTNX_DYNAMIC_SMEM(float, sm, 16);
  const Smem L(p.Ev);
  const int i0 = blockIdx.x * kBQ, h = blockIdx.y, b = blockIdx.z;
  const Head<T> hd(p, b, h);
  const T* dout = static_cast<const T*>(p.dout) + hd.bh * p.Lq * p.Ev;

  for (int idx = threadIdx.x; idx < kBQ * p.Ev; idx += kThreads) {
    const int r = idx / p.Ev, e = idx % p.Ev;
    sm[L.dO + idx] = i0 + r < p.Lq ? to_float(dout[int64_t(i0 + r) * p.Ev + e]) : 0.f;
  }
  bool any_huge = false;  // every thread reads the tile's lse, so all take the same branches
  for (int r = 0; r < kBQ; ++r)
    any_huge = any_huge || (i0 + r < p.Lq && huge_lse(p.lse[hd.bh * p.Lq + i0 + r]));
  float* R = sm + L.l;  // the forward's l slots hold R here
  for (int r = threadIdx.x; r < kBQ; r += kThreads) {
    const bool in = i0 + r < p.Lq;
    sm[L.lse + r] = in ? p.lse[hd.bh * p.Lq + i0 + r] : -INFINITY;
    sm[L.delta + r] = in ? p.delta[hd.bh * p.Lq + i0 + r] : 0.f;
    R[r] = any_huge ? 0.f : 1.f;
  }
  float* dq = p.dq + hd.bh * p.Lq * p.A;
  float* dk = p.dk + hd.bh * p.Lk * p.A;
  float* dvalue = p.dvalue + hd.bh * p.Lk * p.Ev;
  float* dv = p.dv + int64_t(h) * p.A;

  int t0, t1;
  key_tile_range(i0, min(i0 + kBQ, p.Lq) - 1, p.Lk, p.window_lo, p.window_hi, kBK, t0, t1);
  for (int t = t0; any_huge && t <= t1; ++t) {
    score_tile(p, hd, L, sm, b, h, i0, t * kBK);  // starts and ends with __syncthreads
    for (int r = threadIdx.x; r < kBQ; r += kThreads) {
      const float lse = sm[L.lse + r];
      for (int c = 0; c < kBK; ++c) {
        const float s = sm[L.S + r * kBK + c];
        if (s != -INFINITY && lse != -INFINITY) R[r] += fast_exp(s - lse);
      }
      if (t == t1 && !huge_lse(lse)) R[r] = 1.f;
    }
  }
  for (int t = t0; t <= t1; ++t) {
    const int j0 = t * kBK;
    score_tile(p, hd, L, sm, b, h, i0, j0);  // starts and ends with __syncthreads
    for (int idx = threadIdx.x; idx < kBQ * kBK; idx += kThreads) {
      const int r = idx / kBK, c = idx % kBK, i = i0 + r, j = j0 + c;
      const float s = sm[L.S + idx], lse = sm[L.lse + r];
      const float pr = (s == -INFINITY || lse == -INFINITY) ? 0.f : fast_exp(s - lse) / R[r];
      float ds = 0.f, pd = 0.f;
      if (pr != 0.f) {
        const T* val = hd.value + int64_t(j) * p.svalue.l;
        float dp = 0.f;
        for (int e = 0; e < p.Ev; ++e) dp += sm[L.dO + r * p.Ev + e] * to_float(val[e]);
        if (p.dweights != nullptr)  // pr != 0: i < Lq and j < Lk
          dp += to_float(static_cast<const T*>(p.dweights)[(hd.bh * p.Lq + i) * p.Lk + j]);
        const float z = dropout_factor(p.drop, hd.key_bh, uint32_t(i), uint32_t(j));
        pd = pr * z;
        ds = pr * (dp * z - sm[L.delta + r]);
      }
      sm[L.Pd + idx] = pd;
      sm[L.dS + idx] = ds;
      if (p.dmask != nullptr && i < p.Lq && j < p.Lk)
        static_cast<T*>(p.dmask)[(hd.bh * p.Lq + i) * p.Lk + j] = from_float<T>(ds);
    }
    __syncthreads();
    const int nk = min(kBK, p.Lk - j0);
    for (int idx = threadIdx.x; idx < nk * p.Ev; idx += kThreads) {
      const int c = idx / p.Ev, e = idx % p.Ev;
      float acc = 0.f;
      for (int r = 0; r < kBQ; ++r) acc += sm[L.Pd + r * kBK + c] * sm[L.dO + r * p.Ev + e];
      if (acc != 0.f) atomicAdd(dvalue + int64_t(j0 + c) * p.Ev + e, acc);
    }
    for (int a0 = 0; a0 < p.A; a0 += kAC) {
      __syncthreads();
      load_chunk(p, hd, L, sm, i0, j0, a0);
      __syncthreads();
      const int na = min(kAC, p.A - a0);
      for (int idx = threadIdx.x; idx < kBQ * kAC; idx += kThreads) {
        const int r = idx / kAC, a = idx % kAC;
        if (a >= na || i0 + r >= p.Lq) continue;
        const float qa = sm[L.qs + idx];
        float acc = 0.f;
        for (int c = 0; c < nk; ++c) {
          const float tt = tanhf(qa + sm[L.ks + c * (kAC + 1) + a]);
          acc += sm[L.dS + r * kBK + c] * (1.f - tt * tt);
        }
        dq[int64_t(i0 + r) * p.A + a0 + a] += sm[L.vs + a] * acc;
      }
      for (int idx = threadIdx.x; idx < kBK * kAC; idx += kThreads) {
        const int c = idx / kAC, a = idx % kAC;
        if (a >= na || c >= nk) continue;
        const float ka = sm[L.ks + c * (kAC + 1) + a];
        float gk = 0.f, gv = 0.f;
        for (int r = 0; r < kBQ; ++r) {
          const float ds = sm[L.dS + r * kBK + c];
          const float tt = tanhf(sm[L.qs + r * kAC + a] + ka);
          gk += ds * (1.f - tt * tt);
          gv += ds * tt;
        }
        if (gk != 0.f) atomicAdd(dk + int64_t(j0 + c) * p.A + a0 + a, sm[L.vs + a] * gk);
        if (gv != 0.f) atomicAdd(dv + a0 + a, gv);
      }
    }
    __syncthreads();
  }
}

template <typename K>
cudaError_t launch(K kernel, const AdditiveParams& p, cudaStream_t stream) {
  if (p.B == 0 || p.H == 0 || p.Lq == 0) return cudaSuccess;
  return launch_kernel(kernel, dim3(ceil_div(p.Lq, kBQ), p.H, p.B), dim3(kThreads),
                       additive_smem_bytes(p.Ev), stream, p);
}

}  // namespace

size_t additive_smem_bytes(int Ev) { return size_t(Smem(Ev).total) * sizeof(float); }

cudaError_t launch_additive_fwd(const AdditiveParams& p, cudaStream_t stream) {
  return p.dtype == DType::Half ? launch(additive_fwd_kernel<__half>, p, stream)
                                : launch(additive_fwd_kernel<__nv_bfloat16>, p, stream);
}

cudaError_t launch_additive_bwd(const AdditiveParams& p, cudaStream_t stream) {
  return p.dtype == DType::Half ? launch(additive_bwd_kernel<__half>, p, stream)
                                : launch(additive_bwd_kernel<__nv_bfloat16>, p, stream);
}

}  // namespace cuda
}  // namespace attnx
