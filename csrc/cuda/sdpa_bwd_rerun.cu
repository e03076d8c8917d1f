// The SDPA backward's slow path for bf16 values near the dtype's largest (3.39e38): there dP =
// dO V^T and delta = rowsum(dO O) pass float32's largest in sdpa_bwd.cuh's fp32 accumulators,
// and dS = P (dP z - delta) comes out inf - inf = NaN (or 0 * inf), though dS itself, P times a
// difference, is usually far inside the range: with attention spread over a few hundred keys,
// dQ and dK fit. dV = P^T dO does not involve V, but a dO near the largest overflows its sums.
// The key-block kernels flag a non-finite dK or dV (every non-finite dS reaches the dK of its
// key: NaN and inf survive the sums) in p.overflowed, after their loop, where the test costs
// nothing. Set, the launches here compute every dQ row (with dmask, delta and the sinks'
// gradient: the query pass) and then every dK and dV row (the key pass, from the rows' R and
// delta the query pass kept) again, one warp a row, in float64, where the products of bf16
// values (at most 3.39e38^2 each, 256 of them) cannot overflow. Unset, a full-grid scan of
// dq_acc (one read, at memory speed) sets p.dq_nonfinite where it holds inf or NaN, and the
// query pass redoes those rows: with dS finite, dQ = scale sum_j dS_ij k_j still passes
// float32's largest where keys near bf16's largest share a large common part (sum_j dS_ij = 0
// cancels it in the true sum, not in the kernels' float32 partial sums and atomics: inf - inf
// = NaN); the passes return at once when neither flag is set. Scores are formed as the
// key-block kernels form them (scaled, modified, admitted, dropped), but in float64, and P from
// each row's own float64 max and sum (the sink's term included), not from the saved lse: rows
// whose scores passed float32's range (|q . k scale| past 3.4e38: the key-block kernels' NaN
// scores flag them, and the scan flags a saved lse of +inf) get their softmax from scores
// float32 could not hold, and a float32 lse near 3e38 is rounded by ~1e31, which exp(s - lse)
// would turn into P of 0 or 1. A result past the dtype's range is inf, as it would be for any
// backend. fp16 values (at most 65504) cannot overflow the float sums, and its scores pass the
// range only at scales near the bound (|scale| 65504^2 E past 3.4e38), but the key-block kernels
// cast dS to half for the dS K and dS^T Q products: past 65504 (values ~3e4, |dP - delta| ~1e5)
// it is inf there, and dQ and dK came out NaN where their true values were ~200. So this runs
// for fp16 as for bf16.
#include "float64_rerun.cuh"

namespace attnx {
namespace cuda {
namespace {

// What a pair (i, j) of head h needs of its query row i: q, dO and the row values in float64
// (its scores' max, +inf for rows without probabilities; 1 / the sum of exp(s - max); delta).
template <typename T>
struct QueryRow {
  const T *q, *dout;
  int64_t row;  // in the buffers indexed by query row
  double max, inv_r, delta;
};

template <typename T>
__device__ __forceinline__ QueryRow<T> query_row(const SdpaParams& p, const SeqView& seq, int b,
                                                 int h, int i) {
  QueryRow<T> r;
  r.row = query_rows(p, seq, b, h) + i;
  r.q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h + (seq.q0 + i) * p.sq.l;
  r.dout = static_cast<const T*>(p.dout) + r.row * p.Ev;
  return r;
}

// The score of pair (i, j) as the key-block kernels form it, in float64: scaled, modified,
// admitted (-inf outside the band and the mask); *tc: tanh(score / softcap) with a softcap.
template <typename T, bool kMods>
__device__ __forceinline__ double pair_score(const SdpaParams& p, const SeqView& seq, int b,
                                             int h, int i, int j, const T* q_row, const T* k_row,
                                             int lane, double* tc) {
  double x = warp_dot_d(q_row, k_row, p.E, lane) * double(p.scale);
  if constexpr (kMods) {
    if (p.mods.softcap > 0.f) *tc = softcap_tanh(x / double(p.mods.softcap));
    x = modified_score_f64(x, p.mods, alibi_slope(p.mods, int64_t(b) * p.Hq + h),
                           fabs(double(i + seq.diag - j)));
  }
  return admit<T, double>(x, p.mask, seq.lo, seq.hi, b, h, i, j, seq.Lq, seq.Lk);
}

// dS_ij (after the softcap's derivative) in float64; dmask_ij, dS before that derivative, in
// *ds_mask; P_ij z_ij (dropped, as dV takes it) in *pz. k_row, v_row: key j's rows of head h's
// kv head.
template <typename T, bool kMods>
__device__ __forceinline__ double pair_ds(const SdpaParams& p, const SeqView& seq, int b, int h,
                                          int i, int j, const QueryRow<T>& r, const T* k_row,
                                          const T* v_row, int lane, double* ds_mask, double* pz) {
  double tc = 0.0;
  const double x = pair_score<T, kMods>(p, seq, b, h, i, j, r.q, k_row, lane, &tc);
  const double prob = exp(x - r.max) * r.inv_r;
  double ds = 0.0;
  *pz = 0.0;
  if (prob != 0.0) {  // (a warp-uniform branch: every lane holds the same sums)
    const double z = dropout_factor(p.drop, sdpa_dropout_key(p, b, h), i, j);
    ds = prob * (warp_dot_d(r.dout, v_row, p.Ev, lane) * z - r.delta);
    *pz = prob * z;
  }
  *ds_mask = ds;
  if (kMods && p.mods.softcap > 0.f) ds *= 1.0 - tc * tc;
  return ds;
}

// Query row i of head h: its delta, its scores' max and 1 / sum_j exp(s_j - max) (the sink's
// term included), in float64, kept for the key pass; dQ_i = scale sum_j dS_ij k_j over the
// band, written over dq_acc; its dmask row; delta (float, inf past the range) and the sink's
// gradient. delta = sum_j P_ij z_ij dP_ij, which is rowsum(dO O) without O's rounding: an
// output past the dtype's range (fp16 values ~1e3 under dropout 0.99) is saved as inf, and
// rowsum(dO O) from it made every dS of the row NaN (Triton's rerun sums the same way).
template <typename T, bool kMods>
__device__ __forceinline__ void rerun_query_row(const SdpaParams& p, const SeqView& seq, int b,
                                                int h, int i, int lane) {
  const int hk = h / (p.Hq / p.Hkv);
  const T* k = static_cast<const T*>(p.k) + b * p.sk.b + hk * p.sk.h + seq.k0 * p.sk.l;
  const T* v = static_cast<const T*>(p.v) + b * p.sv.b + hk * p.sv.h + seq.k0 * p.sv.l;
  QueryRow<T> r = query_row<T>(p, seq, b, h, i);
  const int64_t j_lo = max(int64_t(0), i + seq.lo), j_hi = min(int64_t(seq.Lk) - 1, i + seq.hi);
  const float sink = p.mods.sinks != nullptr ? p.mods.sinks[h] : -INFINITY;
  const uint32_t key_bh = sdpa_dropout_key(p, b, h);
  RowSoftmax64 sm;
  double pdp = 0.0;  // sum_j exp(s_j - max) z_ij dP_ij, rescaled with the sum
  for (int j = int(j_lo); j <= j_hi; ++j) {
    double tc, a;
    const double x = pair_score<T, kMods>(p, seq, b, h, i, j, r.q, k + j * p.sk.l, lane, &tc);
    if (x == -INFINITY) continue;
    const double w = sm.add(x, &a) * dropout_factor(p.drop, key_bh, i, j);
    pdp = pdp * a + (w != 0.0 ? w * warp_dot_d(r.dout, v + j * p.sv.l, p.Ev, lane) : 0.0);
  }
  if (sink != -INFINITY) {  // (its value is 0: it adds to the sum, not to dP)
    double a;
    sm.add(sink, &a);
    pdp *= a;
  }
  // a row without probabilities: P = exp(s - inf) = 0
  r.max = sm.l != 0.0 ? sm.m : INFINITY;
  r.inv_r = sm.l != 0.0 ? 1.0 / sm.l : 0.0;
  r.delta = pdp * r.inv_r - (p.grad_lse != nullptr ? double(p.grad_lse[r.row]) : 0.0);
  T* dmask = p.dmask == nullptr
                 ? nullptr
                 : static_cast<T*>(p.dmask) + ((int64_t(b) * p.Hq + h) * p.Lq + i) * p.Lk;
  double dq[kRerunCols] = {};
  for (int j = int(j_lo); j <= j_hi; ++j) {
    double ds_mask, pz;
    const double ds = pair_ds<T, kMods>(p, seq, b, h, i, j, r, k + j * p.sk.l, v + j * p.sv.l,
                                        lane, &ds_mask, &pz);
#pragma unroll
    for (int u = 0; u < kRerunCols; ++u) {
      const int c = lane + 32 * u;
      if (c < p.E) dq[u] += ds * double(to_float(k[j * p.sk.l + c]));
    }
    if (dmask != nullptr && lane == 0) dmask[j] = from_float<T>(saturated(ds_mask));
  }
#pragma unroll
  for (int u = 0; u < kRerunCols; ++u) {
    const int c = lane + 32 * u;
    if (c < p.E) p.dq_acc[r.row * p.E + c] = saturated(dq[u] * p.scale);
  }
  // dmask past the band: the key-block kernels wrote dS = 0 * (dP - delta) there, NaN where
  // those overflowed
  if (dmask != nullptr)
    for (int j = lane; j < seq.Lk; j += 32)
      if (j < j_lo || j > j_hi) dmask[j] = from_float<T>(0.f);
  if (lane == 0) {
    p.rerun_max[r.row] = r.max;
    p.rerun_inv_r[r.row] = r.inv_r;
    p.rerun_delta[r.row] = r.delta;
    p.delta[r.row] = saturated(r.delta);
    // the sink's gradient from this row (kernel_ops.cpp computes it from delta otherwise): its
    // probability exp(sink - max) / sum times (0 - delta)
    if (p.dsinks != nullptr && sink != -INFINITY)
      atomicAdd(p.dsinks + h, -exp(double(sink) - r.max) * r.inv_r * r.delta);
  }
}

// Key row j of kv head hk: dK_j = scale sum over the group's query heads and the band's rows of
// dS_ij q_i, and dV_j = sum of P_ij z_ij dO_i (a dO near bf16's largest, which overflowed dP and
// delta, can overflow the kernels' float32 sums there too), written over dk and dv; the rows'
// 1 / R and delta from the query pass.
template <typename T, bool kMods>
__device__ __forceinline__ void rerun_key_row(const SdpaParams& p, const SeqView& seq, int b,
                                              int hk, int j, int lane) {
  const int group = p.Hq / p.Hkv;
  const T* k_row = static_cast<const T*>(p.k) + b * p.sk.b + hk * p.sk.h + (seq.k0 + j) * p.sk.l;
  const T* v_row = static_cast<const T*>(p.v) + b * p.sv.b + hk * p.sv.h + (seq.k0 + j) * p.sv.l;
  double dk[kRerunCols] = {}, dv[kRerunCols] = {};
  const int64_t i_lo = max(int64_t(0), j - seq.hi), i_hi = min(int64_t(seq.Lq) - 1, j - seq.lo);
  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    for (int i = int(i_lo); i <= i_hi; ++i) {
      QueryRow<T> r = query_row<T>(p, seq, b, h, i);
      r.max = p.rerun_max[r.row];
      r.inv_r = p.rerun_inv_r[r.row];
      r.delta = p.rerun_delta[r.row];
      double ds_mask, pz;
      const double ds =
          pair_ds<T, kMods>(p, seq, b, h, i, j, r, k_row, v_row, lane, &ds_mask, &pz);
#pragma unroll
      for (int u = 0; u < kRerunCols; ++u) {
        const int c = lane + 32 * u;
        if (c < p.E) dk[u] += ds * double(to_float(r.q[c]));
        if (c < p.Ev && pz != 0.0) dv[u] += pz * double(to_float(r.dout[c]));
      }
    }
  }
  const int64_t row = key_rows(p, seq, b, hk) + j;
  T* dk_out = static_cast<T*>(p.dk) + row * p.E;
  T* dv_out = static_cast<T*>(p.dv) + row * p.Ev;
#pragma unroll
  for (int u = 0; u < kRerunCols; ++u) {
    const int c = lane + 32 * u;
    if (c < p.E) dk_out[c] = from_float<T>(saturated(dk[u] * p.scale));
    if (c < p.Ev) dv_out[c] = from_float<T>(saturated(dv[u]));
  }
}

// Sets *p.dq_nonfinite where the n floats of dq_acc hold inf or NaN, and *p.overflowed where
// one of the `rows` saved lse is +inf: such a row's scores passed float32's range, and the
// key-block kernels took its P = exp(s - inf) as 0 wherever s came out finite (nothing when the
// backward is flagged: the passes redo every row then). Threads read consecutive floats
// (coalesced), a grid-stride loop.
__global__ void sdpa_bwd_dq_scan_kernel(const SdpaParams p, int64_t n, int64_t rows) {
  if (*p.overflowed != 0.f) return;
  bool finite = true, past_range = false;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    finite &= finite_float(p.dq_acc[i]);
    if (i < rows) past_range |= p.lse[i] == INFINITY;
  }
  if (!finite) *p.dq_nonfinite = 1.f;
  if (past_range) *p.overflowed = 1.f;
}

// Whether dq_acc's query row i of head h holds only finite values (the same in every lane).
__device__ __forceinline__ bool dq_row_finite(const SdpaParams& p, const SeqView& seq, int b,
                                              int h, int i, int lane) {
  const float* row = p.dq_acc + (query_rows(p, seq, b, h) + i) * p.E;
  bool finite = true;
  for (int c = lane; c < p.E; c += 32) finite &= finite_float(row[c]);
  return !__any_sync(0xffffffffu, !finite);
}

// kKeys: the key pass (after the query pass, whose 1 / R and delta it reads). Tasks: the
// B Hq Lq query rows or the B Hkv Lk key rows, taken by the grid's warps in turn (rows past a
// packed sequence's lengths are skipped). Unflagged, the query pass redoes the rows whose dQ
// came out non-finite where the scan found some, and the key pass nothing (dK and dV were
// finite: no dS overflowed).
template <typename T, bool kMods, bool kKeys>
__global__ void __launch_bounds__(32 * kRerunWarps, 1) sdpa_bwd_rerun_kernel(const SdpaParams p) {
  const bool flagged = *p.overflowed != 0.f;
  if (!flagged && (kKeys || *p.dq_nonfinite == 0.f)) return;
  const int lane = threadIdx.x % 32, L = kKeys ? p.Lk : p.Lq, H = kKeys ? p.Hkv : p.Hq;
  const int64_t tasks = int64_t(p.B) * H * L, warps = int64_t(gridDim.x) * kRerunWarps;
  for (int64_t t = blockIdx.x * kRerunWarps + threadIdx.x / 32; t < tasks; t += warps) {
    const int x = int(t % L), h = int(t / L % H), b = int(t / L / H);
    const SeqView seq = seq_view(p, b);
    if constexpr (kKeys) {
      if (x < seq.Lk) rerun_key_row<T, kMods>(p, seq, b, h, x, lane);
    } else {
      if (x < seq.Lq && (flagged || !dq_row_finite(p, seq, b, h, x, lane)))
        rerun_query_row<T, kMods>(p, seq, b, h, x, lane);
    }
  }
}

template <typename T>
cudaError_t launch_rerun(const SdpaParams& p, cudaStream_t stream) {
  return launch_on_flag(p.mods.any(), [&](auto mods) {
    constexpr bool kMods = decltype(mods)::value;
    const dim3 block(32 * kRerunWarps);
    const cudaError_t err = launch_kernel(sdpa_bwd_rerun_kernel<T, kMods, false>,
                                          rerun_grid(int64_t(p.B) * p.Hq * p.Lq), block, 0,
                                          stream, p);
    if (err != cudaSuccess) return err;
    return launch_kernel(sdpa_bwd_rerun_kernel<T, kMods, true>,
                         rerun_grid(int64_t(p.B) * p.Hkv * p.Lk), block, 0, stream, p);
  });
}

}  // namespace

cudaError_t sdpa_bwd_rerun(const SdpaParams& p, cudaStream_t stream) {
  if (p.rerun_max == nullptr || p.B == 0 || p.Hq == 0 || p.Lq == 0 || p.Lk == 0)
    return cudaSuccess;
  // dq_acc's rows: B Hq Lq, or the packed total in Lq's place (query_rows); E values each
  const int64_t rows = int64_t(p.Hq) * (p.cu_q != nullptr ? p.total_q : int64_t(p.B) * p.Lq);
  const int64_t n = rows * p.E;
  const int64_t scan_blocks = std::min<int64_t>((n + 1023) / 1024, 1024);
  cudaError_t err = launch_kernel(sdpa_bwd_dq_scan_kernel, dim3(unsigned(scan_blocks)),
                                  dim3(256), 0, stream, p, n, rows);
  if (err != cudaSuccess) return err;
  return p.dtype == DType::Half ? launch_rerun<__half>(p, stream)
                                : launch_rerun<__nv_bfloat16>(p, stream);
}

}  // namespace cuda
}  // namespace attnx
