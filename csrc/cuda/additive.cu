// Additive (Bahdanau) attention, forward and backward, fused on CUDA cores in fp32:
//   s[i, j] = sum_a v[a] * tanh(q[i, a] + k[j, a]),  P = softmax_j(s + mask),  out = (P*z) value
// The (Lq, Lk, A) tanh tensor is never stored: each kernel recomputes it from q and k tiles held
// in shared memory, A chunk by A chunk, through
//   r = 1 / (e^{2q} e^{2k} + 1) = (1 - tanh(q + k)) / 2,   tanh = 1 - 2r,   1 - tanh^2 = 4r(1 - r)
// with e^{2q} and e^{2k} computed once per loaded element (1/kBK + 1/kBQ of an exp per (i, j, a)).
// Two terms share one approximate reciprocal (`r_pair`): with d = e^{2q} e^{2k} + 1,
//   r1 = d2 / (d1 d2),  r2 = d1 / (d1 d2),
// so a term costs about three FMA-pipe ops and half an SFU op. The SFU bounds these loops: it
// does 16 lanes a clock an SM against 128 FMA lanes (a warp's reciprocal holds its SM quarter's
// SFU for 8 clocks), and one reciprocal a term left the score loop at 8 clocks of SFU per 4
// instructions issued; tanhf would be two SFU ops and about 18 others. For |x| <= kExpLimit,
// d lies in [1, e^{4 kExpLimit} + 1] (see kExpLimit for d1 d2); a chunk holding a larger |q|
// or |k| (rare: it is tanh's flat tail) keeps the raw values and computes
// r = 1 / (e^{2(q+k)} + 1) per element. Then s = sum_a v - 2 sum_a v r.
//
// Forward: one CTA per (query tile of kBQ rows, head, batch). Per key tile of kBK keys: the score
// tile in registers (thread = 2 rows x 4 keys); the online softmax on those registers, each row's
// max and sum reduced across the 16 lanes that hold it (every warp takes part); P*z to shared
// memory; then, kEC value columns at a time, the value tile is loaded into shared memory once and
// the fp32 output tile (kBQ, Ev), kept in shared memory, is rescaled and accumulated. Its rows
// stay normalised (O = sum_j P_j [j kept] value_j / l: P / l of the kept keys and the rescale
// alpha l_old / l_new go to shared memory): a convex combination of values, finite where the
// unnormalised sum of bf16 values near their largest over a few keys overflowed float32 (inf
// out, or NaN after a rescale). Dropout's 1 / (1 - p) multiplies O once, at the end: within
// the sums, the first tiles' kept keys would take O up to max|value| / (1 - p) before the
// later keys' share brought it down (inf where the result is finite). With
// return_weights, each tile's exp(s - m_t) z is written to the weights as it is computed, with
// the running max m_t to a scratch, and a last pass over them (no scores recomputed) scales
// them by exp(m_t - m) / l: exact on rows of huge lse too, where exp(s - lse) is not
// (common.cuh).
//
// Backward: one CTA per (query tile, head, batch). Per key tile it recomputes s and P =
// exp(s - lse) / R (R = 1 but on rows of huge lse, where a first pass over the key tiles sums
// R = sum_j exp(s_j - lse), which the rounded lse leaves above 1; common.cuh), forms
//   dPd = dO value^T (+ dW),  dS = P * (dPd * z - delta),  delta = rowsum(dO * out)  (host)
// with the value tile in shared memory, dvalue[j] += sum_i Pd[i, j] dO[i] (fp32 atomics: other
// query tiles add to the same keys), and then, A chunk by A chunk (lane = a, warp = 16 keys,
// each r computed once and used three times):
//   dq[i, a] += 4 v[a] sum_j dS r(1 - r)   (rows owned by this CTA: warps reduced in shared
//                                            memory, then a plain read-modify-write)
//   dk[j, a] += 4 v[a] sum_i dS r(1 - r)   (one atomic per (CTA, j, a))
//   dv[a]    += sum_ij dS - 2 sum_ij dS r  (into this CTA's own row of dv partials: no atomics;
//                                            the host sums the rows)
// dmask = dS.
//
// Layouts: q, k, value with a contiguous last dim; v (H, A) through its strides (a broadcast
// (A,) vector has stride 0 on H); outputs and fp32 accumulators contiguous. Loads are
// bounds-checked, so any Lq, Lk, A, Ev work; Ev is bounded by the shared memory the host checks
// (additive_smem_bytes).
#include "common.cuh"

namespace attnx {
namespace cuda {
namespace {

constexpr int kBQ = 16, kBK = 64, kAC = 32, kEC = 64, kThreads = 128, kWarps = kThreads / 32;
// The score tile's thread layout: rows 2 tr, 2 tr + 1 and keys tc + 16 m (m < 4), tr = tid / 16
// and tc = tid % 16: a row's keys sit in the 16 lanes of a half warp.
constexpr int kRows = 2, kCols = 4, kRowLanes = 16;
static_assert(kBQ == kRows * kThreads / kRowLanes && kBK == kCols * kRowLanes, "score layout");
static_assert(kCols % 2 == 0, "a thread's keys go in pairs (r_pair)");
static_assert(kAC == 32 && kBK == 16 * kWarps, "gradient layout: lane = a, warp = 16 keys");
static_assert(kEC == 64 && kBQ == 4 * kWarps, "value layout: warp = 4 rows, lane = 2 columns");
// |x| up to which e^{2x} is used. Then d <= e^{72} + 1 is finite, and d1 d2 (r_pair) overflows
// only where the other d passes 3.4e38 / e^{72} = 1.8e7: its r then comes out 0 where it is at
// most 5.6e-8, below the fp32 rounding of an r near 1 in the same sums. (At 22, e^{88} d2
// overflows for any d2 > 2: r2 = 0 where it is up to 1/2.)
// Past the limit tanh(x + y) is +-1 in fp32 unless the other operand is as large.
constexpr float kExpLimit = 18.f;
// e^{2x} = 2^{x kTwoLog2e}. Within kExpLimit the SFU's exp2 (exp2_approx) takes it: its result
// lies in [e^-36, e^36], never subnormal; its error, 2^-22 relative plus the product's rounding
// (|x kTwoLog2e| <= 52: 3e-6), moves a term's tanh by at most 2e-6 (dr = r (1 - r) de / e),
// far under the bf16/fp16 output's rounding. (expf took 12-13 instructions an element, 15% of
// a chunk's issue between two barriers; exp2_approx one MUFU and a multiply.)
constexpr float kTwoLog2e = 2.8853900817779268f;
// CTAs per SM the kernels are compiled for (__launch_bounds__): ptxas (CUDA 13) then fits them
// in 96 and 128 registers without spilling (test_cuda_resources.py); the backward's gradient
// loop holds 16 dq partials and 16 e^{2q} per thread.
constexpr int kFwdMinBlocks = 5, kBwdMinBlocks = 4;
constexpr int kStrideA = kAC + 1;   // q and k chunks [row][a]: lanes read different rows, same a
constexpr int kStrideE = kEC + 1;   // value chunks [key][e]: read by key and by column
constexpr int kStrideT = kBQ + 4;   // transposed [key][row] tiles: float4 reads along rows

struct Smem {  // offsets into the dynamic shared memory, in floats
  int eq, ek, val, red, redv, vs, P, dS, O, stat, flag, total;
  explicit __host__ __device__ Smem(int Ev) {
    // One region serves, in turn, the q and k chunks, the value chunk and the gradient
    // partials of the warps.
    eq = 0;
    ek = eq + kBQ * kStrideA;
    val = 0;
    red = 0;
    redv = red + kWarps * kBQ * kAC;
    const int chunks = ek + kBK * kStrideA, values = kBK * kStrideE, partials = redv + kWarps * kAC;
    int o = chunks > values ? chunks : values;
    o = o > partials ? o : partials;
    o = (o + 3) / 4 * 4;  // float4 reads below
    vs = o;   o += kAC;
    P = o;    o += kBK * kStrideT;  // forward: P*z [row][key] (kBQ x kBK); backward: Pd [key][row]
    dS = o;   o += kBK * kStrideT;  // backward: dS [key][row]
    O = o;    o += kBQ * Ev;        // forward: the output tile; backward: the dO tile
    stat = o; o += 4 * kBQ;  // forward: alpha, l, m per row; backward: lse, delta, R per row
                             // and the dS sums of the warps
    flag = o; o += 1;               // set by a thread whose chunk holds |x| > kExpLimit
    total = o;
  }
};
static_assert(kBQ * kBK <= kBK * kStrideT, "the forward's P tile fits its region");

__host__ __device__ int key_tiles(int Lk) { return ceil_div(Lk, kBK); }

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

// r = 1 / (e^{2(x + y)} + 1) from raw q and k, for chunks past kExpLimit (where
// e^{2(x+y)} = inf gives r = 0, tanh = 1; exp2f's relative error, which grows with |x + y|, is
// scaled by dr/de = r(1 - r) <= e^{-2|x+y|} there).
__device__ __forceinline__ float r_raw(float x, float y) {
  return rcp_approx(1.f + exp2f(kTwoLog2e * (x + y)));
}

// scale / (d1 d2), d1 and d2 (d = xy + 1) for two pairs of exponentials: r1 = d2 times the first,
// r2 = d1 times it. One reciprocal for two terms (see the top of the file); d1 d2 rounds twice
// more than 1 / d, about 2 ulp in all.
struct RPair {
  float s, d1, d2;
};
__device__ __forceinline__ RPair r_pair(float x1, float y1, float x2, float y2, float scale) {
  const float d1 = fmaf(x1, y1, 1.f), d2 = fmaf(x2, y2, 1.f);
  return {scale * rcp_approx(d1 * d2), d1, d2};
}

// Loads the A chunk [a0, a0 + kAC) of the query tile, the key tile and v (zero past the ends,
// where v = 0 cancels the term) and turns q, k into e^{2q}, e^{2k} unless a value exceeds
// kExpLimit. Starts and ends with __syncthreads; returns whether the chunk holds exponentials.
template <typename T>
__device__ bool load_chunk(const AdditiveParams& p, const Head<T>& hd, const Smem& L, float* sm,
                           int i0, int j0, int a0) {
  // thread: column a of rows r0 + n kThreads / kAC
  constexpr int kStep = kThreads / kAC;
  const int r0 = threadIdx.x / kAC, a = threadIdx.x % kAC;
  const bool a_in = a0 + a < p.A;
  __syncthreads();
  bool big = false;
#pragma unroll
  for (int r = r0; r < kBQ; r += kStep) {
    const float x = a_in && i0 + r < p.Lq ? to_float(hd.q[int64_t(i0 + r) * p.sq.l + a0 + a]) : 0.f;
    big = big || !(fabsf(x) <= kExpLimit);  // NaN too: it then propagates through exp2f
    sm[L.eq + r * kStrideA + a] = x;
  }
#pragma unroll 4
  for (int r = r0; r < kBK; r += kStep) {
    const float x = a_in && j0 + r < p.Lk ? to_float(hd.k[int64_t(j0 + r) * p.sk.l + a0 + a]) : 0.f;
    big = big || !(fabsf(x) <= kExpLimit);
    sm[L.ek + r * kStrideA + a] = x;
  }
  if (threadIdx.x < kAC) sm[L.vs + a] = a_in ? to_float(hd.v[int64_t(a0 + a) * p.va]) : 0.f;
  if (big) sm[L.flag] = 1.f;
  __syncthreads();
  const bool fast = sm[L.flag] == 0.f;
  if (fast) {  // each thread turns the entries it wrote
#pragma unroll
    for (int r = r0; r < kBQ; r += kStep)
      sm[L.eq + r * kStrideA + a] = exp2_approx(kTwoLog2e * sm[L.eq + r * kStrideA + a]);
#pragma unroll 4
    for (int r = r0; r < kBK; r += kStep)
      sm[L.ek + r * kStrideA + a] = exp2_approx(kTwoLog2e * sm[L.ek + r * kStrideA + a]);
  }
  __syncthreads();
  // every thread has read the flag; the next chunk's threads set it after its first barrier
  if (threadIdx.x == 0) sm[L.flag] = 0.f;
  return fast;
}

// acc[u][m] += sum_a v[a] r(i, j, a) and vsum += sum_a v[a] over the loaded chunk, for this
// thread's rows 2 tr + u and keys tc + 16 m.
template <bool kFast>
__device__ __forceinline__ void chunk_scores(const Smem& L, const float* sm, int tr, int tc,
                                             float (&acc)[kRows][kCols], float& vsum) {
  const float* eq = sm + L.eq + kRows * tr * kStrideA;
  const float* ek = sm + L.ek + tc * kStrideA;
#pragma unroll 4
  for (int a = 0; a < kAC; ++a) {
    const float w = sm[L.vs + a];
    vsum += w;
    float x[kRows], y[kCols];
#pragma unroll
    for (int u = 0; u < kRows; ++u) x[u] = eq[u * kStrideA + a];
#pragma unroll
    for (int m = 0; m < kCols; ++m) y[m] = ek[m * kRowLanes * kStrideA + a];
#pragma unroll
    for (int u = 0; u < kRows; ++u)
#pragma unroll
      for (int m = 0; m < kCols; m += 2) {
        if constexpr (kFast) {  // w r1 = (w / (d1 d2)) d2: the scale folds into the sums' FMAs
          const RPair rp = r_pair(x[u], y[m], x[u], y[m + 1], w);
          acc[u][m] = fmaf(rp.s, rp.d2, acc[u][m]);
          acc[u][m + 1] = fmaf(rp.s, rp.d1, acc[u][m + 1]);
        } else {
          acc[u][m] = fmaf(w, r_raw(x[u], y[m]), acc[u][m]);
          acc[u][m + 1] = fmaf(w, r_raw(x[u], y[m + 1]), acc[u][m + 1]);
        }
      }
  }
}

// s = this thread's scores of the tile at (i0, j0) after band and mask (-inf where not
// admissible). Starts and ends with __syncthreads.
template <typename T>
__device__ void score_tile(const AdditiveParams& p, const Head<T>& hd, const Smem& L, float* sm,
                           int b, int h, int i0, int j0, float (&s)[kRows][kCols]) {
  const int tr = threadIdx.x / kRowLanes, tc = threadIdx.x % kRowLanes;
  float acc[kRows][kCols] = {}, vsum = 0.f;
  __syncthreads();  // the previous tile's readers of the shared tiles are done, whatever A is
  for (int a0 = 0; a0 < p.A; a0 += kAC) {
    if (load_chunk(p, hd, L, sm, i0, j0, a0))
      chunk_scores<true>(L, sm, tr, tc, acc, vsum);
    else
      chunk_scores<false>(L, sm, tr, tc, acc, vsum);
  }
#pragma unroll
  for (int u = 0; u < kRows; ++u)
#pragma unroll
    for (int m = 0; m < kCols; ++m)
      s[u][m] = admit<T>(vsum - 2.f * acc[u][m], p.mask, p.window_lo, p.window_hi, b, h,
                         i0 + kRows * tr + u, j0 + tc + kRowLanes * m, p.Lq, p.Lk);
  __syncthreads();
}

// The sum (max) of x over the 16 lanes of this half warp, which hold one row's keys.
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
  for (int o = 1; o < kRowLanes; o *= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float row_max(float x) {
#pragma unroll
  for (int o = 1; o < kRowLanes; o *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Loads value columns [e0, e0 + kEC) of the key tile at j0 (zero past the ends) into the
// shared value chunk. Starts and ends with __syncthreads.
template <typename T>
__device__ void load_value_chunk(const AdditiveParams& p, const Head<T>& hd, const Smem& L,
                                 float* sm, int j0, int e0) {
  __syncthreads();
  const int nk = min(kBK, p.Lk - j0), e = threadIdx.x % kEC;
  const bool e_in = e0 + e < p.Ev;
#pragma unroll 4
  for (int c = threadIdx.x / kEC; c < kBK; c += kThreads / kEC)
    sm[L.val + c * kStrideE + e] =
        e_in && c < nk ? to_float(hd.value[int64_t(j0 + c) * p.svalue.l + e0 + e]) : 0.f;
  __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kFwdMinBlocks)
    additive_fwd_kernel(const AdditiveParams p) {
  ATTNX_DYNAMIC_SMEM(float, sm, 16);
  const Smem L(p.Ev);
  const int i0 = blockIdx.x * kBQ, h = blockIdx.y, b = blockIdx.z;
  const Head<T> hd(p, b, h);
  const int tr = threadIdx.x / kRowLanes, tc = threadIdx.x % kRowLanes;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* alpha_s = sm + L.stat;
  float* l_s = alpha_s + kBQ;
  float* m_s = l_s + kBQ;

  for (int idx = threadIdx.x; idx < kBQ * p.Ev; idx += kThreads) sm[L.O + idx] = 0.f;
  if (threadIdx.x == 0) sm[L.flag] = 0.f;
  // the running max and sum of rows 2 tr + u, the same in the 16 lanes of the row
  float m_run[kRows], l_run[kRows];
#pragma unroll
  for (int u = 0; u < kRows; ++u) {
    m_run[u] = -INFINITY;
    l_run[u] = 0.f;
  }
  int t0, t1;
  key_tile_range(i0, min(i0 + kBQ, p.Lq) - 1, p.Lk, p.window_lo, p.window_hi, kBK, t0, t1);
  for (int t = t0; t <= t1; ++t) {
    const int j0 = t * kBK;
    float s[kRows][kCols];
    score_tile(p, hd, L, sm, b, h, i0, j0, s);
    // Online softmax on the registers; P*z goes to shared memory with the row's new max.
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int r = kRows * tr + u;
      float mx = s[u][0];
#pragma unroll
      for (int m = 1; m < kCols; ++m) mx = fmaxf(mx, s[u][m]);
      const float m_new = fmaxf(m_run[u], row_max(mx));
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = fast_exp(m_run[u] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int m = 0; m < kCols; ++m) {
        s[u][m] = fast_exp(s[u][m] - m_use);
        sum += s[u][m];
      }
      float rescale;
      const float inv = normalised_step(l_run[u], alpha, row_sum(sum), &rescale);
#pragma unroll
      for (int m = 0; m < kCols; ++m) {
        const int c = tc + kRowLanes * m;
        const float z = dropout_factor(p.drop, hd.key_bh, uint32_t(i0 + r), uint32_t(j0 + c));
        const float pz = s[u][m] * z;
        sm[L.P + r * kBK + c] = z != 0.f ? s[u][m] * inv : 0.f;
        if (p.weights != nullptr && i0 + r < p.Lq && j0 + c < p.Lk)
          p.weights[(hd.bh * p.Lq + i0 + r) * p.Lk + j0 + c] = pz;
      }
      if (tc == 0) alpha_s[r] = rescale;
      m_run[u] = m_new;
      // m_new, not m_use: a row that has admitted no key yet keeps -inf, whose scale below is
      // 0 (its weights here are 0); m_use's 0 gave exp(0 - m) = inf there where the row's
      // final max m lies below -88, and 0 inf = NaN weights (and gradients through them).
      if (p.weights != nullptr && tc == 0 && i0 + r < p.Lq)
        p.weight_max[(hd.bh * p.Lq + i0 + r) * key_tiles(p.Lk) + t] = m_new;
    }
    // O = alpha O + (P*z) value, kEC columns at a time: warp = rows 4 warp .. 4 warp + 3, lane
    // = columns lane and lane + 32 of the chunk.
    for (int e0 = 0; e0 < p.Ev; e0 += kEC) {
      load_value_chunk(p, hd, L, sm, j0, e0);  // its first barrier also publishes P and alpha
      float o[4][2];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const int e = e0 + lane + 32 * x;
          o[u][x] = e < p.Ev ? sm[L.O + (4 * warp + u) * p.Ev + e] * alpha_s[4 * warp + u] : 0.f;
        }
#pragma unroll 2
      for (int c = 0; c < kBK; c += 4) {
        float4 pr[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
          pr[u] = *reinterpret_cast<const float4*>(sm + L.P + (4 * warp + u) * kBK + c);
#pragma unroll
        for (int cc = 0; cc < 4; ++cc) {
          const float* vrow = sm + L.val + (c + cc) * kStrideE + lane;
          const float v0 = vrow[0], v1 = vrow[32];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const float pu = cc == 0 ? pr[u].x : cc == 1 ? pr[u].y : cc == 2 ? pr[u].z : pr[u].w;
            o[u][0] = fmaf(pu, v0, o[u][0]);
            o[u][1] = fmaf(pu, v1, o[u][1]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int x = 0; x < 2; ++x) {
          const int e = e0 + lane + 32 * x;
          if (e < p.Ev) sm[L.O + (4 * warp + u) * p.Ev + e] = o[u][x];
        }
    }
  }
  if (tc == 0) {
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      l_s[kRows * tr + u] = l_run[u];
      m_s[kRows * tr + u] = m_run[u];
    }
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < kBQ * p.Ev; idx += kThreads) {
    const int r = idx / p.Ev, e = idx % p.Ev;
    if (i0 + r >= p.Lq) continue;
    static_cast<T*>(p.out)[(hd.bh * p.Lq + i0 + r) * p.Ev + e] =
        from_float<T>(sm[L.O + idx] * p.drop.keep_scale);  // (1 without dropout)
  }
  if (threadIdx.x < kBQ && i0 + int(threadIdx.x) < p.Lq) {
    const float l = l_s[threadIdx.x];
    p.lse[hd.bh * p.Lq + i0 + threadIdx.x] = l > 0.f ? m_s[threadIdx.x] + logf(l) : -INFINITY;
  }
  if (p.weights == nullptr) return;
  // exp(s - m_t) z -> exp(s - m) z / l, each thread on the entries it wrote (the barrier above
  // published the maxima; the host zero-fills tiles outside the band).
  for (int t = t0; t <= t1; ++t) {
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int i = i0 + kRows * tr + u;
      if (i >= p.Lq) continue;
      const float m_use = m_run[u] == -INFINITY ? 0.f : m_run[u];
      const float scale = l_run[u] == 0.f ? 0.f
          : fast_exp(p.weight_max[(hd.bh * p.Lq + i) * key_tiles(p.Lk) + t] - m_use) / l_run[u];
#pragma unroll
      for (int m = 0; m < kCols; ++m) {
        const int j = t * kBK + tc + kRowLanes * m;
        if (j >= p.Lk) continue;
        p.weights[(hd.bh * p.Lq + i) * p.Lk + j] *= scale;
      }
    }
  }
}

// The gradient terms of the loaded A chunk (lane = a, warp = keys 16 warp .. 16 warp + 15):
// dk atomics, and this warp's dq[i] = sum_j dS r(1 - r) and dvr = sum_ij dS r for lane a.
template <bool kFast>
__device__ __forceinline__ void chunk_grads(const AdditiveParams& p, const Smem& L,
                                            const float* sm, int64_t bh, int j0, int a0,
                                            float (&dq)[kBQ], float& dvr) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nk = min(kBK, p.Lk - j0);
  float x[kBQ];
#pragma unroll
  for (int i = 0; i < kBQ; ++i) x[i] = sm[L.eq + i * kStrideA + lane];
  const float v4 = 4.f * sm[L.vs + lane];
  for (int cc = 0; cc < kBK / kWarps; ++cc) {
    const int c = warp * (kBK / kWarps) + cc;
    const float y = sm[L.ek + c * kStrideA + lane];
    float g = 0.f;
#pragma unroll
    for (int i = 0; i < kBQ; i += 4) {
      const float4 d4 = *reinterpret_cast<const float4*>(sm + L.dS + c * kStrideT + i);
      const float ds[4] = {d4.x, d4.y, d4.z, d4.w};
      // One reciprocal a term here, not r_pair: a term's other five FMA-pipe ops already fill
      // the 8 clocks its reciprocal holds the SFU, and pairs add three more per two terms
      // (sm_90 SASS: 127 -> 143 instructions a 16-term step).
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const float r = kFast ? rcp_approx(fmaf(x[i + n], y, 1.f)) : r_raw(x[i + n], y);
        const float gi = ds[n] * fmaf(-r, r, r);
        dq[i + n] += gi;
        g += gi;
        dvr = fmaf(ds[n], r, dvr);
      }
    }
    if (c < nk && a0 + lane < p.A && g != 0.f)
      atomicAdd(p.dk + (bh * p.Lk + j0 + c) * p.A + a0 + lane, v4 * g);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kBwdMinBlocks)
    additive_bwd_kernel(const AdditiveParams p) {
  ATTNX_DYNAMIC_SMEM(float, sm, 16);
  const Smem L(p.Ev);
  const int i0 = blockIdx.x * kBQ, h = blockIdx.y, b = blockIdx.z;
  const Head<T> hd(p, b, h);
  const int tr = threadIdx.x / kRowLanes, tc = threadIdx.x % kRowLanes;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Per row of the tile, in shared memory rather than registers (the gradient loop needs them)
  float* lse_s = sm + L.stat;
  float* delta_s = lse_s + kBQ;
  float* R_s = delta_s + kBQ;
  float* ds_sum = R_s + kBQ;  // per warp

  for (int idx = threadIdx.x; idx < kBQ * p.Ev; idx += kThreads) {
    const int r = idx / p.Ev, e = idx % p.Ev;
    sm[L.O + idx] = i0 + r < p.Lq
        ? to_float(static_cast<const T*>(p.dout)[(hd.bh * p.Lq + i0 + r) * p.Ev + e]) : 0.f;
  }
  if (threadIdx.x == 0) sm[L.flag] = 0.f;
  bool any_huge = false;  // every thread reads the tile's lse, so all take the same branches
  for (int r = 0; r < kBQ; ++r)
    any_huge = any_huge || (i0 + r < p.Lq && huge_lse(p.lse[hd.bh * p.Lq + i0 + r]));
  if (threadIdx.x < kBQ) {
    const int i = i0 + threadIdx.x;
    lse_s[threadIdx.x] = i < p.Lq ? p.lse[hd.bh * p.Lq + i] : -INFINITY;
    delta_s[threadIdx.x] = i < p.Lq ? p.delta[hd.bh * p.Lq + i] : 0.f;
    R_s[threadIdx.x] = 1.f;
  }

  int t0, t1;
  key_tile_range(i0, min(i0 + kBQ, p.Lq) - 1, p.Lk, p.window_lo, p.window_hi, kBK, t0, t1);
  if (any_huge) {
    float R[kRows] = {};
    for (int t = t0; t <= t1; ++t) {
      float s[kRows][kCols];
      score_tile(p, hd, L, sm, b, h, i0, t * kBK, s);  // its first barrier publishes lse_s
#pragma unroll
      for (int u = 0; u < kRows; ++u) {
        const float lse = lse_s[kRows * tr + u];
        float sum = 0.f;
#pragma unroll
        for (int m = 0; m < kCols; ++m)
          if (s[u][m] != -INFINITY && lse != -INFINITY) sum += fast_exp(s[u][m] - lse);
        R[u] += row_sum(sum);
      }
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u)
      if (tc == 0 && huge_lse(lse_s[kRows * tr + u])) R_s[kRows * tr + u] = R[u];
  }
  for (int t = t0; t <= t1; ++t) {
    const int j0 = t * kBK, nk = min(kBK, p.Lk - j0);
    float s[kRows][kCols], dp[kRows][kCols] = {};
    score_tile(p, hd, L, sm, b, h, i0, j0, s);  // s becomes P below
#pragma unroll
    for (int u = 0; u < kRows; ++u)
#pragma unroll
      for (int m = 0; m < kCols; ++m) {
        const int r = kRows * tr + u, c = tc + kRowLanes * m;
        const float pr = (s[u][m] == -INFINITY || lse_s[r] == -INFINITY)
                             ? 0.f
                             : fast_exp(s[u][m] - lse_s[r]) / R_s[r];
        s[u][m] = pr;
        sm[L.P + c * kStrideT + r] =
            pr * dropout_factor(p.drop, hd.key_bh, uint32_t(i0 + r), uint32_t(j0 + c));
      }
    // Per value chunk: dPd += dO value^T on the score layout, and dvalue += Pd^T dO with
    // thread = column e0 + threadIdx.x % kEC, keys of one parity.
    for (int e0 = 0; e0 < p.Ev; e0 += kEC) {
      load_value_chunk(p, hd, L, sm, j0, e0);  // its first barrier also publishes Pd
      const int ne = min(kEC, p.Ev - e0);
      for (int e = 0; e < ne; ++e) {
        float y[kCols];
#pragma unroll
        for (int m = 0; m < kCols; ++m) y[m] = sm[L.val + (tc + kRowLanes * m) * kStrideE + e];
#pragma unroll
        for (int u = 0; u < kRows; ++u) {
          const float d = sm[L.O + (kRows * tr + u) * p.Ev + e0 + e];
#pragma unroll
          for (int m = 0; m < kCols; ++m) dp[u][m] = fmaf(d, y[m], dp[u][m]);
        }
      }
      const int e = threadIdx.x % kEC;
      if (e < ne) {
        float d[kBQ];
#pragma unroll
        for (int r = 0; r < kBQ; ++r) d[r] = sm[L.O + r * p.Ev + e0 + e];
        for (int c = threadIdx.x / kEC; c < nk; c += kThreads / kEC) {
          float acc = 0.f;
#pragma unroll
          for (int r = 0; r < kBQ; r += 4) {
            const float4 pd = *reinterpret_cast<const float4*>(sm + L.P + c * kStrideT + r);
            acc = fmaf(pd.x, d[r], fmaf(pd.y, d[r + 1], fmaf(pd.z, d[r + 2], fmaf(pd.w, d[r + 3], acc))));
          }
          if (acc != 0.f) atomicAdd(p.dvalue + (hd.bh * p.Lk + j0 + c) * p.Ev + e0 + e, acc);
        }
      }
    }
    float ds_thread = 0.f;
#pragma unroll
    for (int u = 0; u < kRows; ++u)
#pragma unroll
      for (int m = 0; m < kCols; ++m) {
        const int r = kRows * tr + u, c = tc + kRowLanes * m, i = i0 + r, j = j0 + c;
        const float pr = s[u][m];
        float ds = 0.f;
        if (pr != 0.f) {  // then i < Lq and j < Lk
          float d = dp[u][m];
          if (p.dweights != nullptr)
            d += p.dweights[(hd.bh * p.Lq + i) * p.Lk + j];
          // z again: cheaper than 8 registers held through the value loop
          const float z = dropout_factor(p.drop, hd.key_bh, uint32_t(i), uint32_t(j));
          ds = pr * (d * z - delta_s[r]);
        }
        sm[L.dS + c * kStrideT + r] = ds;
        ds_thread += ds;
        if (p.dmask != nullptr && i < p.Lq && j < p.Lk)
          store_mask_grad<T>(p.dmask, p.mask.kind, (hd.bh * p.Lq + i) * p.Lk + j, ds);
      }
    ds_thread += __shfl_xor_sync(0xffffffffu, ds_thread, 16);
    ds_thread = row_sum(ds_thread);
    if (lane == 0) ds_sum[warp] = ds_thread;
    for (int a0 = 0; a0 < p.A; a0 += kAC) {
      float dqw[kBQ] = {}, dvr = 0.f;
      if (load_chunk(p, hd, L, sm, i0, j0, a0))  // its first barrier also publishes dS
        chunk_grads<true>(p, L, sm, hd.bh, j0, a0, dqw, dvr);
      else
        chunk_grads<false>(p, L, sm, hd.bh, j0, a0, dqw, dvr);
      __syncthreads();  // the chunk is read: its region takes the warps' partials
#pragma unroll
      for (int i = 0; i < kBQ; ++i) sm[L.red + (warp * kBQ + i) * kAC + lane] = dqw[i];
      sm[L.redv + warp * kAC + lane] = dvr;
      __syncthreads();
#pragma unroll
      for (int n = 0; n < kBQ * kAC / kThreads; ++n) {
        const int idx = threadIdx.x + n * kThreads, i = idx / kAC, a = idx % kAC;
        if (i0 + i >= p.Lq || a0 + a >= p.A) continue;
        float g = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) g += sm[L.red + w * kBQ * kAC + idx];
        p.dq[(hd.bh * p.Lq + i0 + i) * p.A + a0 + a] += 4.f * sm[L.vs + a] * g;
      }
      if (threadIdx.x < kAC && a0 + int(threadIdx.x) < p.A) {
        float sum_ds = 0.f, sum_dsr = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          sum_ds += ds_sum[w];
          sum_dsr += sm[L.redv + w * kAC + threadIdx.x];
        }
        // this CTA's own row of the partials
        const int64_t cta = int64_t(b) * gridDim.x + blockIdx.x;
        p.dv[(cta * p.H + h) * p.A + a0 + threadIdx.x] += sum_ds - 2.f * sum_dsr;
      }
    }
  }
}

template <typename K>
cudaError_t launch(K kernel, const AdditiveParams& p, cudaStream_t stream) {
  if (p.B == 0 || p.H == 0 || p.Lq == 0) return cudaSuccess;
  return launch_kernel(kernel, dim3(additive_query_tiles(p.Lq), p.H, p.B), dim3(kThreads),
                       additive_smem_bytes(p.Ev), stream, p);
}

}  // namespace

size_t additive_smem_bytes(int Ev) { return size_t(Smem(Ev).total) * sizeof(float); }

int additive_query_tiles(int Lq) { return ceil_div(Lq, kBQ); }

int additive_key_tiles(int Lk) { return key_tiles(Lk); }

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
