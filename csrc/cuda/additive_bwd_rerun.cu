// The additive backward's slow path for bf16 values near the dtype's largest, as
// sdpa_bwd_rerun.cu is the SDPA one's: there dPd = dO value^T and delta = rowsum(dO O) pass
// float32's largest and dS = P (dPd z - delta) comes out NaN, though dS itself usually fits.
// fp16 takes it too: an output past 65504 (values ~1e4 under heavy dropout) is saved as inf,
// and delta from it is inf (the rerun's delta is sum_j P_ij z_ij dPd_ij, without O).
// A non-finite dS reaches v's gradient (its CTA's partial sum of dS tanh), which the host sums
// anyway; it turns "every element of it and of dvalue finite" into the device flag
// p.overflowed (no synchronisation) and launches the two passes below, which return at once
// while the flag says so. Otherwise they compute in float64, a warp a row, every dq row, v's gradient and dmask
// (queries), then every dk and dvalue row (keys, from the queries' R and delta). Scores and P
// are formed as additive.cu forms them (tanh of q + k summed with v in float, the band and
// mask, exp(s - lse) / R, dropout's hash). dvalue = (P z)^T dO does not involve the values,
// but a dO near the largest overflows its float32 sums (and mostly dPd and delta too).
#include "float64_rerun.cuh"

namespace attnx {
namespace cuda {
namespace {

// Row i's score against key j: sum_a v[a] tanh(q[i, a] + k[j, a]) after the band and mask.
template <typename T>
__device__ __forceinline__ float additive_score(const AdditiveParams& p, int b, int h, int i,
                                                int j, const T* q_row, const T* k_row,
                                                const T* v, int lane) {
  float x = 0.f;
  for (int a = lane; a < p.A; a += 32)
    x += to_float(v[a * p.va]) * tanhf(to_float(q_row[a]) + to_float(k_row[a]));
#pragma unroll
  for (int w = 16; w >= 1; w /= 2) x += __shfl_xor_sync(0xffffffffu, x, w);
  return admit<T>(x, p.mask, p.window_lo, p.window_hi, b, h, i, j, p.Lq, p.Lk);
}

// The pointers and row values of head (b, h) and one query row i.
template <typename T>
struct Pair {
  const T *q, *k, *value, *v, *dout;
  int64_t bh, row;
  uint32_t key_bh;
  __device__ Pair(const AdditiveParams& p, int b, int h, int i) {
    q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h + int64_t(i) * p.sq.l;
    k = static_cast<const T*>(p.k) + b * p.sk.b + h * p.sk.h;
    value = static_cast<const T*>(p.value) + b * p.svalue.b + h * p.svalue.h;
    v = static_cast<const T*>(p.v) + h * p.vh;
    bh = int64_t(b) * p.H + h;
    row = bh * p.Lq + i;
    dout = static_cast<const T*>(p.dout) + row * p.Ev;
    key_bh = dropout_key_bh(p.drop, uint32_t(bh));
  }
};

// dS_ij in float64 (0 where P is: no value of the pair is read then), from the row's lse, R
// and delta; P_ij z_ij (dropped, as dvalue takes it) in *pz.
template <typename T>
__device__ __forceinline__ double pair_ds(const AdditiveParams& p, const Pair<T>& r, int b, int h,
                                          int i, int j, float lse, float R, double delta,
                                          int lane, double* pz) {
  *pz = 0.0;
  const float s = additive_score(p, b, h, i, j, r.q, r.k + j * p.sk.l, r.v, lane);
  if (s == -INFINITY || lse == -INFINITY) return 0.0;
  const float prob = fast_exp(s - lse) / R;
  if (prob == 0.f) return 0.0;
  double d = warp_dot_d(r.dout, r.value + j * p.svalue.l, p.Ev, lane);
  if (p.dweights != nullptr)
    d += p.dweights[r.row * p.Lk + j];
  const double z = dropout_factor(p.drop, r.key_bh, uint32_t(i), uint32_t(j));
  *pz = double(prob) * z;
  return double(prob) * (d * z - delta);
}

// dx[u] += ds v[a] (1 - tanh^2) and, with dv, (*dv)[u] += ds tanh, tanh = tanh(q[i, a] +
// k[j, a]), a = a0 + lane + 32 u: the pair's share of dq_i or dk_j and of v's gradient.
template <typename T>
__device__ __forceinline__ void add_chunk(const AdditiveParams& p, const T* q_row, const T* k_row,
                                          const T* v, int a0, int lane, double ds,
                                          double (&dx)[kRerunCols], double (*dv)[kRerunCols]) {
#pragma unroll
  for (int u = 0; u < kRerunCols; ++u) {
    const int a = a0 + lane + 32 * u;
    if (a >= p.A) continue;
    const double t = tanh(double(to_float(q_row[a])) + double(to_float(k_row[a])));
    dx[u] += ds * double(to_float(v[a * p.va])) * (1.0 - t * t);
    if (dv != nullptr) (*dv)[u] += ds * t;
  }
}

// Query row i of head h: its R and delta for the key pass, in one pass over the band; dq_i and
// its share of v's gradient (float64 atomics) chunk by chunk; dmask.
// delta = sum_j P_ij z_ij dO . value_j - grad_lse_i, which is rowsum(dO O) - grad_lse_i without
// O's rounding: an output past the dtype's range (fp16 values ~1e4 under dropout 0.99) is saved
// as inf, and rowsum(dO O) from it made every dS of the row NaN. Where lse is huge, P_ij =
// exp(s_ij - lse) / R with R the sum of those exponentials: the sum is divided by R once it is
// known (elsewhere R = 1), so the band's scores are computed once here, not once for R and once
// for delta.
template <typename T>
__device__ void rerun_query_row(const AdditiveParams& p, int b, int h, int i, int lane) {
  const Pair<T> r(p, b, h, i);
  const float lse = p.lse[r.row];
  const int j_lo = int(max(int64_t(0), i + p.window_lo));
  const int j_hi = int(min(int64_t(p.Lk) - 1, i + p.window_hi));
  const bool huge = huge_lse(lse);
  float R = huge ? 0.f : 1.f;
  double weighted = 0.0;  // sum_j exp(s_ij - lse) z_ij dO . value_j
  for (int j = j_lo; j <= j_hi && lse != -INFINITY; ++j) {
    const float s = additive_score(p, b, h, i, j, r.q, r.k + j * p.sk.l, r.v, lane);
    if (s == -INFINITY) continue;
    const float e = fast_exp(s - lse);
    if (huge) R += e;
    const double ez = double(e) * dropout_factor(p.drop, r.key_bh, uint32_t(i), uint32_t(j));
    // (a warp-uniform branch: every lane holds the same sums)
    if (ez != 0.0) weighted += ez * warp_dot_d(r.dout, r.value + j * p.svalue.l, p.Ev, lane);
  }
  // (R = 0 only where every exponential is: weighted is 0 too)
  const double delta = (R != 0.f ? weighted / R : 0.0) -
                       (p.grad_lse != nullptr ? double(p.grad_lse[r.row]) : 0.0);
  if (lane == 0) {
    p.row_r[r.row] = R;
    p.row_delta[r.row] = delta;
  }
  for (int a0 = 0; a0 < p.A; a0 += 32 * kRerunCols) {
    double dq[kRerunCols] = {}, dv[kRerunCols] = {};
    for (int j = j_lo; j <= j_hi; ++j) {
      double pz;
      const double ds = pair_ds(p, r, b, h, i, j, lse, R, delta, lane, &pz);
      // (every pair of the band: the fast pass's may be NaN where this one's is 0)
      if (a0 == 0 && p.dmask != nullptr && lane == 0)
        store_mask_grad<T>(p.dmask, p.mask.kind, r.row * p.Lk + j, saturated(ds));
      if (ds != 0.0) add_chunk(p, r.q, r.k + j * p.sk.l, r.v, a0, lane, ds, dq, &dv);
    }
#pragma unroll
    for (int u = 0; u < kRerunCols; ++u) {
      const int a = a0 + lane + 32 * u;
      if (a >= p.A) continue;
      p.dq[r.row * p.A + a] = saturated(dq[u]);
      if (dv[u] != 0.0) atomicAdd(p.dv64 + int64_t(h) * p.A + a, dv[u]);
    }
  }
}

// Key row j of head h: dk_j, chunk by chunk of A, then dvalue_j = sum_i P_ij z_ij dO_i,
// chunk by chunk of Ev, over the band's query rows.
template <typename T>
__device__ void rerun_key_row(const AdditiveParams& p, int b, int h, int j, int lane) {
  const int i_lo = int(max(int64_t(0), j - p.window_hi));
  const int i_hi = int(min(int64_t(p.Lq) - 1, j - p.window_lo));
  const int64_t key_row = (int64_t(b) * p.H + h) * p.Lk + j;
  constexpr int kChunk = 32 * kRerunCols;
  const int a_end = (p.A + kChunk - 1) / kChunk * kChunk;  // A's chunks, then Ev's
  for (int c0 = 0; c0 < a_end + p.Ev; c0 += kChunk) {
    const bool values = c0 >= a_end;
    const int e0 = c0 - a_end;
    double sum[kRerunCols] = {};
    for (int i = i_lo; i <= i_hi; ++i) {
      const Pair<T> r(p, b, h, i);
      double pz;
      const double ds = pair_ds(p, r, b, h, i, j, p.lse[r.row], p.row_r[r.row],
                                p.row_delta[r.row], lane, &pz);
      if (!values && ds != 0.0)
        add_chunk<T>(p, r.q, r.k + j * p.sk.l, r.v, c0, lane, ds, sum, nullptr);
#pragma unroll
      for (int u = 0; u < kRerunCols; ++u) {
        const int e = e0 + lane + 32 * u;
        if (values && pz != 0.0 && e < p.Ev) sum[u] += pz * double(to_float(r.dout[e]));
      }
    }
#pragma unroll
    for (int u = 0; u < kRerunCols; ++u) {
      const int c = lane + 32 * u;
      if (!values && c0 + c < p.A) p.dk[key_row * p.A + c0 + c] = saturated(sum[u]);
      if (values && e0 + c < p.Ev) p.dvalue[key_row * p.Ev + e0 + c] = saturated(sum[u]);
    }
  }
}

// kKeys: the key pass (after the query pass, whose R and delta it reads).
template <typename T, bool kKeys>
__global__ void __launch_bounds__(32 * kRerunWarps, 1)
    additive_bwd_rerun_kernel(const AdditiveParams p) {
  if (!*p.overflowed) return;
  const int lane = threadIdx.x % 32, L = kKeys ? p.Lk : p.Lq;
  const int64_t tasks = int64_t(p.B) * p.H * L, warps = int64_t(gridDim.x) * kRerunWarps;
  for (int64_t t = blockIdx.x * kRerunWarps + threadIdx.x / 32; t < tasks; t += warps) {
    const int x = int(t % L), h = int(t / L % p.H), b = int(t / L / p.H);
    if constexpr (kKeys)
      rerun_key_row<T>(p, b, h, x, lane);
    else
      rerun_query_row<T>(p, b, h, x, lane);
  }
}

template <typename T>
cudaError_t launch_rerun(const AdditiveParams& p, cudaStream_t stream) {
  const dim3 block(32 * kRerunWarps);
  const cudaError_t err = launch_kernel(additive_bwd_rerun_kernel<T, false>,
                                        rerun_grid(int64_t(p.B) * p.H * p.Lq), block, 0, stream, p);
  if (err != cudaSuccess) return err;
  return launch_kernel(additive_bwd_rerun_kernel<T, true>, rerun_grid(int64_t(p.B) * p.H * p.Lk),
                       block, 0, stream, p);
}

}  // namespace

cudaError_t additive_bwd_rerun(const AdditiveParams& p, cudaStream_t stream) {
  if (p.B == 0 || p.H == 0 || p.Lq == 0 || p.Lk == 0) return cudaSuccess;
  return p.dtype == DType::Half ? launch_rerun<__half>(p, stream)
                                : launch_rerun<__nv_bfloat16>(p, stream);
}

}  // namespace cuda
}  // namespace attnx
