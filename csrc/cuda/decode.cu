// Decoding against a KV cache (attnx::kvcache_fwd): a few queries per sequence against a long
// cache, split-K as flash-decoding does, on CUDA cores in fp32 (Lq * G rows are too few to feed
// the tensor cores; the kernel is bound by reading the cache).
//
// Split kernel: one CTA per (split x row tile, kv head, batch). Its rows are up to kDecodeRows
// of the G * Lq query rows that share the kv head (row r: head kvh * G + r / Lq, query r % Lq),
// so each K/V tile is read from the cache once for the whole group. Its keys are the positions
// [split * split_len, (split + 1) * split_len) below the sequence's length n that some row's
// band reaches; positions past n are never read. Per tile of kDecodeKeys keys: the tile's key
// offsets (through the block table when paged), K and V rows to shared memory (16-byte loads
// when aligned), scores with lane = key and warp = rows (each K element read once for 4 rows),
// the online softmax in the log2 domain (row max and sum reduced across the warp), then the
// fp32 output rows, thread = value column(s), rescaled and accumulated from P and V. The rows
// stay normalised (o = sum_j P_j v_j / l, P / l and the rescale a l_old / l_new through shared
// memory): a convex combination of values, finite where the unnormalised sum of bf16 values near
// their largest over a few keys overflowed float32 (and a later rescale made it NaN).
// With one split the CTA writes out and lse itself; otherwise its normalised partial output and
// lse go to fp32 scratch and the merge kernel combines the splits by their lse.
//
// Score modifiers (the kMods instantiations; the plain ones keep their code): a score leaves the
// log2 domain for softcap and ALiBi (bottom-right: -slope |i + n - Lq - j|) and comes back; the
// sink joins each row once, where its lse is final: in the split kernel with one split, else in
// the merge.
//
// Scores past float32's range (|q . k scale| past 3.4e38 from finite inputs): an admitted score
// that overflowed is NaN (overflow_as_nan), which reaches the row's lse; the kernel that writes
// the row's final output (the split kernel with one split, else the merge) redoes such rows in
// float64 (rerun_row), a warp a row.
//
// A direct caller's bad lengths or block ids read nothing out of bounds: n is clamped to the
// cache's capacity and keys in blocks outside [0, num_blocks) are skipped (attnx's functions
// check both before any kernel runs).
#include "common.cuh"
#include "decode.h"
#include "float64_rerun.cuh"

namespace attnx {
namespace cuda {
namespace {

constexpr int kThreads = 128, kWarps = kThreads / 32;
constexpr int kRows = kDecodeRows, kKeys = kDecodeKeys;
constexpr int kRowsPerWarp = kRows / kWarps;  // rows r = warp + kWarps * u
static_assert(kKeys == 32 && kRows % kWarps == 0, "score layout: lane = key, warp = rows");
constexpr float kLn2 = 0.6931471805599453f;
// CTAs the splits aim at: two waves of an H100's 132 SMs; kMaxSplits bounds the scratch (and
// the merge's loop over the splits).
constexpr int kTargetCtas = 264, kMaxSplits = 128;

// K rows' stride in shared memory, in elements: an odd number of 4-byte words, so that the 32
// lanes reading one column of 32 rows hit 32 banks.
__host__ __device__ inline int key_stride(int E) {
  const int s = (E + 1) / 2 * 2;
  return (s / 2) % 2 == 1 ? s : s + 2;
}

struct Smem {  // byte offsets into the dynamic shared memory
  int q, p, alpha, koff, voff, k, v, total;
  __host__ __device__ Smem(int E, int Ev) {
    q = 0;                            // fp32 [kRows][E]: q * scale * log2(e)
    p = q + kRows * E * 4;            // fp32 [kRows][kKeys]: the tile's probabilities
    alpha = p + kRows * kKeys * 4;    // fp32 [kRows]: the tile's rescale of the output rows
    koff = alpha + kRows * 4;         // int64 [kKeys]: the tile's K row offsets, -1: no key
    voff = koff + kKeys * 8;          // int64 [kKeys]: its V row offsets
    k = voff + kKeys * 8;             // T [kKeys][key_stride(E)]
    v = k + (kKeys * key_stride(E) * 2 + 15) / 16 * 16;  // T [kKeys][Ev]
    total = v + kKeys * Ev * 2;
  }
};
static_assert(kRows * 4 % 8 == 0, "the offsets are 8-byte aligned");

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Rows of `width` elements at src + off[j] (zeros where off[j] < 0) to dst[j * stride].
template <typename T>
__device__ __forceinline__ void load_rows(T* dst, int stride, const T* src, const int64_t* off,
                                          int width, bool vec16, int tid) {
  if (vec16) {  // 8 elements per 16-byte load; smem rows are not 16-byte aligned (key_stride)
    const int chunks = width / 8;
    for (int idx = tid; idx < kKeys * chunks; idx += kThreads) {
      const int j = idx / chunks, c = idx % chunks * 8;
      uint4 raw{0u, 0u, 0u, 0u};
      if (off[j] >= 0) raw = *reinterpret_cast<const uint4*>(src + off[j] + c);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int u = 0; u < 8; ++u) dst[j * stride + c + u] = e[u];
    }
  } else {
    for (int idx = tid; idx < kKeys * width; idx += kThreads) {
      const int j = idx / width, c = idx % width;
      dst[j * stride + c] = off[j] >= 0 ? src[off[j] + c] : from_float<T>(0.f);
    }
  }
}

// The sink of head h in the log2 domain, or -inf without sinks.
__device__ __forceinline__ float sink_log2(const ScoreMods& m, int h) {
  return m.sinks != nullptr ? m.sinks[h] * kLog2e : -INFINITY;
}

// Where slot `slot` of cache block (or sequence) `blk`, kv head kvh, lies: its K and V offsets,
// -1 for a block outside [0, num_blocks) (a paged cache's table may hold any int).
__device__ __forceinline__ void slot_offsets(const KvcacheParams& p, int64_t blk, int kvh,
                                             int64_t slot, int64_t* ko, int64_t* vo) {
  *ko = *vo = -1;
  if (blk >= 0 && (p.block_size == 0 || blk < p.num_blocks)) {
    *ko = blk * p.sk.b + kvh * p.sk.h + slot * p.sk.l;
    *vo = blk * p.sv.b + kvh * p.sv.h + slot * p.sv.l;
  }
}

// Where key `pos` of sequence b, kv head kvh lies in the cache (through the block table when
// paged).
__device__ __forceinline__ void key_offsets(const KvcacheParams& p, int b, int kvh, int64_t pos,
                                            int64_t* ko, int64_t* vo) {
  if (p.block_size > 0)
    slot_offsets(p, p.table[b * p.table_stride + pos / p.block_size], kvh, pos % p.block_size,
                 ko, vo);
  else
    slot_offsets(p, b, kvh, pos, ko, vo);
}

// Row (b, h, i) of out and lse (`row`, flattened) again, by one warp, from float64 scores:
// the row's max in a first pass, then per 64 columns (lanes over them) P = exp(s - max) and
// P V summed, the sink joining the sum. The exponentials take float32 (their arguments are <=
// 0 and their sums at most the keys), the keys are walked without a division, and (b, h, i)
// come from the caller: the split kernel stays within 128 registers without spills (96-107,
// was 72-107 without this path; an online softmax in float64, whose exp and log are long
// sequences, spilled at 128). For rows whose scores passed float32's range, whose lse came out
// NaN.
template <typename T>
__device__ __forceinline__ void rerun_row(const KvcacheParams& p, int b, int h, int i,
                                          int64_t row, int lane) {
  const int kvh = h / (p.Hq / p.Hkv);
  const T* q = static_cast<const T*>(p.q) + b * p.sq.b + h * p.sq.h + i * p.sq.l;
  const int64_t n = min(max(int64_t(p.seqlens[b]), int64_t(0)), p.capacity);
  const int64_t diag = n - p.Lq + i;  // the query's diagonal key
  const int64_t j_lo = max(int64_t(0), diag + p.window_lo);
  const int64_t j_hi = min(n - 1, diag + p.window_hi);
  const float slope = alibi_slope(p.mods, int64_t(b) * p.Hq + h);
  const float sink = p.mods.sinks != nullptr ? p.mods.sinks[h] : -INFINITY;
  // f(score, value row) over the band's keys in the cache, in order
  auto each_key = [&](auto f) {
    const int64_t bs = p.block_size > 0 ? p.block_size : INT64_MAX;
    int64_t page = j_lo / bs, slot = j_lo % bs;
#pragma unroll 1
    for (int64_t j = j_lo; j <= j_hi; ++j) {
      int64_t ko, vo;
      slot_offsets(p, p.block_size > 0 ? p.table[b * p.table_stride + page] : b, kvh, slot, &ko,
                   &vo);
      if (ko >= 0) {
        const double x = warp_dot_d(q, static_cast<const T*>(p.k) + ko, p.E, lane);
        f(modified_score_f64(x * double(p.scale), p.mods, slope, fabs(double(j - diag))),
          static_cast<const T*>(p.v) + vo);
      }
      if (++slot == bs) slot = 0, ++page;
    }
  };
  double m = sink;
  each_key([&](double x, const T*) { m = fmax(m, x); });
  // exp(x - m) in float32 (0 below -1e4; NaN kept)
  auto weight = [&](double x) { return expf(float(x - m < -1e4 ? -1e4 : x - m)); };
  int c0 = 0;
  do {
    float l = sink != -INFINITY ? weight(sink) : 0.f;
    double o[2] = {0.0, 0.0};  // columns c0 + lane, c0 + 32 + lane
    each_key([&](double x, const T* v) {
      const float w = weight(x);
      l += w;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int c = c0 + lane + 32 * u;
        if (c < p.Ev) o[u] += double(w) * double(to_float(v[c]));
      }
    });
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int c = c0 + lane + 32 * u;
      if (c < p.Ev)
        static_cast<T*>(p.out)[row * p.Ev + c] =
            from_float<T>(l != 0.f ? saturated(o[u] / l) : 0.f);
    }
    if (c0 == 0 && lane == 0)
      p.lse[row] = l != 0.f ? lse_as_float(m + double(logf(l))) : -INFINITY;
  } while ((c0 += 64) < p.Ev);
}

// NC: value columns per thread (tid + kThreads * w), ceil(Ev / kThreads). kMods: the score
// modifiers are applied.
template <typename T, int NC, bool kMods>
__global__ void __launch_bounds__(kThreads) kvcache_split_kernel(const KvcacheParams p) {
  ATTNX_DYNAMIC_SMEM(unsigned char, smem, 16);
  const Smem L(p.E, p.Ev);
  float* qs = reinterpret_cast<float*>(smem + L.q);
  float* ps = reinterpret_cast<float*>(smem + L.p);
  float* alpha_s = reinterpret_cast<float*>(smem + L.alpha);
  int64_t* koff = reinterpret_cast<int64_t*>(smem + L.koff);
  int64_t* voff = reinterpret_cast<int64_t*>(smem + L.voff);
  T* ks = reinterpret_cast<T*>(smem + L.k);
  T* vs = reinterpret_cast<T*>(smem + L.v);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int G = p.Hq / p.Hkv, R = G * p.Lq, row_tiles = ceil_div(R, kRows);
  const int split = blockIdx.x / row_tiles, r0 = blockIdx.x % row_tiles * kRows;
  const int kvh = blockIdx.y, b = blockIdx.z;
  const int rows = min(kRows, R - r0), kstride = key_stride(p.E);

  // the rows' queries, scaled into the log2 domain; rows past `rows` zero
  const T* q = static_cast<const T*>(p.q);
  const float qscale = p.scale * kLog2e;
  for (int idx = tid; idx < kRows * p.E; idx += kThreads) {
    const int r = idx / p.E, d = idx % p.E;
    float x = 0.f;
    if (r < rows) {
      const int h = kvh * G + (r0 + r) / p.Lq, i = (r0 + r) % p.Lq;
      x = to_float(q[b * p.sq.b + h * p.sq.h + i * p.sq.l + d]) * qscale;
    }
    qs[idx] = x;
  }

  // The keys some row's band reaches in this split: [start, end). The rows' queries span
  // [i_lo, i_hi] (every query once the rows wrap around a head).
  const int64_t n = min(max(int64_t(p.seqlens[b]), int64_t(0)), p.capacity);
  const int64_t diag = n - p.Lq;  // query i's diagonal is key i + diag (bottom-right)
  const int first = r0 % p.Lq, last = (r0 + rows - 1) % p.Lq;
  const bool wraps = rows >= p.Lq || first > last;
  const int i_lo = wraps ? 0 : first, i_hi = wraps ? p.Lq - 1 : last;
  const int64_t start =
      max(max(int64_t(split) * p.split_len, diag + i_lo + p.window_lo), int64_t(0));
  const int64_t end =
      min(min(int64_t(split + 1) * p.split_len, n), diag + i_hi + p.window_hi + 1);

  float m[kRowsPerWarp], l[kRowsPerWarp];  // the same in every lane of the warp
#pragma unroll
  for (int u = 0; u < kRowsPerWarp; ++u) {
    m[u] = -INFINITY;
    l[u] = 0.f;
  }
  float acc[kRows][NC];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int w = 0; w < NC; ++w) acc[r][w] = 0.f;

  for (int64_t t0 = start; t0 < end; t0 += kKeys) {
    __syncthreads();  // q is written; the previous tile's offsets, K, V and P are consumed
    if (tid < kKeys) {
      const int64_t pos = t0 + tid;
      int64_t ko = -1, vo = -1;
      if (pos < end) key_offsets(p, b, kvh, pos, &ko, &vo);
      koff[tid] = ko;
      voff[tid] = vo;
    }
    __syncthreads();
    load_rows(ks, kstride, k, koff, p.E, p.sk.vec16, tid);
    load_rows(vs, p.Ev, v, voff, p.Ev, p.sv.vec16, tid);
    __syncthreads();

    float s[kRowsPerWarp];
#pragma unroll
    for (int u = 0; u < kRowsPerWarp; ++u) s[u] = 0.f;
    const T* krow = ks + lane * kstride;
    for (int d = 0; d < p.E; ++d) {
      const float kd = to_float(krow[d]);
#pragma unroll
      for (int u = 0; u < kRowsPerWarp; ++u) s[u] += qs[(warp + kWarps * u) * p.E + d] * kd;
    }
    const bool key_ok = koff[lane] >= 0;
    const int64_t pos = t0 + lane;
#pragma unroll
    for (int u = 0; u < kRowsPerWarp; ++u) {
      const int r = warp + kWarps * u;
      const int64_t rel = pos - (diag + (r0 + r) % p.Lq);
      const bool ok = key_ok && r < rows && rel >= p.window_lo && rel <= p.window_hi;
      float x = ok ? overflow_as_nan(s[u]) : -INFINITY;
      if constexpr (kMods) {
        if (ok) {  // natural units for the modifiers, back to log2
          const int h = kvh * G + (r0 + r) / p.Lq;
          float tc;
          x = modified_score(x * kLn2, p.mods, alibi_slope(p.mods, int64_t(b) * p.Hq + h),
                             fabsf(float(rel)), tc) * kLog2e;
        }
      }
      const float m_new = fmaxf(m[u], warp_max(x));
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // no -inf - -inf
      const float pr = exp2f(x - m_use);
      const float a = exp2f(m[u] - m_use);
      float rescale;
      const float inv = normalised_step(l[u], a, warp_sum(pr), &rescale);
      ps[r * kKeys + lane] = pr * inv;
      if (lane == 0) alpha_s[r] = rescale;
      m[u] = m_new;
    }
    __syncthreads();

#pragma unroll
    for (int w = 0; w < NC; ++w) {
      const int c = tid + kThreads * w;
      if (c >= p.Ev) continue;
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r][w] *= alpha_s[r];
      for (int j = 0; j < kKeys; ++j) {
        const float vj = to_float(vs[j * p.Ev + c]);
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r][w] += ps[r * kKeys + j] * vj;
      }
    }
  }

  // Each row's output factor to shared memory (the sink's share taken out; 0 for rows with no
  // key), its lse (natural log) out (-inf for rows with no key).
  __syncthreads();  // the last tile's alpha is consumed
  const int64_t row0 = (int64_t(b) * p.Hkv + kvh) * R + r0;  // (b, h, i) of row r0, flattened
  bool past_range = false;  // some row's lse is NaN (one split: this CTA redoes it)
#pragma unroll
  for (int u = 0; u < kRowsPerWarp; ++u) {
    const int r = warp + kWarps * u;
    if (lane != 0) continue;
    float scale_out = 1.f;  // the sink's rescale of the output
    const float l_keys = l[u];
    if constexpr (kMods) {
      if (p.splits == 1 && p.mods.sinks != nullptr && r < rows) {
        const float sink = sink_log2(p.mods, kvh * G + (r0 + r) / p.Lq);
        const float m_new = fmaxf(m[u], sink);
        scale_out = exp2f(m[u] - m_new);  // 0 when no key was admitted
        l[u] = l[u] * scale_out + exp2f(sink - m_new);
        m[u] = m_new;
      }
    }
    alpha_s[r] = l[u] > 0.f ? l_keys * scale_out / l[u] : 0.f;
    if (r >= rows) continue;
    const float lse = l[u] != 0.f ? (m[u] + log2f(l[u])) * kLn2 : -INFINITY;  // (NaN kept)
    if (p.splits == 1) {
      p.lse[row0 + r] = lse;
      past_range = past_range || lse != lse;
    } else {
      p.lse_part[(row0 + r) * p.splits + split] = lse;
    }
  }
  __syncthreads();
#pragma unroll
  for (int w = 0; w < NC; ++w) {
    const int c = tid + kThreads * w;
    if (c >= p.Ev) continue;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= rows) continue;
      const float x = acc[r][w] * alpha_s[r];
      if (p.splits == 1) {
        static_cast<T*>(p.out)[(row0 + r) * p.Ev + c] = from_float<T>(x);
      } else {
        p.o_part[((row0 + r) * p.splits + split) * p.Ev + c] = x;
      }
    }
  }
  if (__syncthreads_or(past_range)) {  // (the lse and out writes above land first)
    for (int r = warp; r < rows; r += kWarps)
      if (p.lse[row0 + r] != p.lse[row0 + r])
        rerun_row<T>(p, b, kvh * G + (r0 + r) / p.Lq, (r0 + r) % p.Lq, row0 + r, lane);
  }
}

// out and lse of each row from its splits' partials: weights exp(lse_s - lse), normalised before
// the sum, which stays a convex combination (no overflow). kSinks: the sink joins as one more
// part of no value.
template <typename T, bool kSinks>
__global__ void __launch_bounds__(kThreads, 1) kvcache_merge_kernel(const KvcacheParams p) {
  const int64_t rows = int64_t(p.B) * p.Hq * p.Lq;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* lse_s = p.lse_part + row * p.splits;
    const float sink = kSinks ? p.mods.sinks[row / p.Lq % p.Hq] : -INFINITY;
    float top = sink;
    for (int s = 0; s < p.splits; ++s) top = fmaxf(top, lse_s[s]);
    const float top_use = top == -INFINITY ? 0.f : top;
    float total = kSinks ? expf(sink - top_use) : 0.f;
    for (int s = 0; s < p.splits; ++s) total += expf(lse_s[s] - top_use);
    if (total != total) {  // a split's lse is NaN: its scores passed float32's range
      if (threadIdx.x < 32)
        rerun_row<T>(p, int(row / p.Lq / p.Hq), int(row / p.Lq % p.Hq), int(row % p.Lq), row,
                     threadIdx.x);
      continue;  // (every thread took the same branch: total is the same in all)
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int c = threadIdx.x; c < p.Ev; c += kThreads) {
      float x = 0.f;
      for (int s = 0; s < p.splits; ++s) {
        x += expf(lse_s[s] - top_use) * inv * p.o_part[(row * p.splits + s) * p.Ev + c];
      }
      static_cast<T*>(p.out)[row * p.Ev + c] = from_float<T>(x);
    }
    if (threadIdx.x == 0) p.lse[row] = total > 0.f ? top + logf(total) : -INFINITY;
  }
}

template <typename T, int NC>
cudaError_t launch_typed(const KvcacheParams& p, cudaStream_t stream) {
  const int row_tiles = ceil_div(p.Hq / p.Hkv * p.Lq, kRows);
  const dim3 grid(unsigned(p.splits * row_tiles), unsigned(p.Hkv), unsigned(p.B));
  const size_t smem = kvcache_smem_bytes(p.E, p.Ev);
  cudaError_t err = launch_on_flag(p.mods.any(), [&](auto mods) {
    return launch_kernel(kvcache_split_kernel<T, NC, decltype(mods)::value>, grid,
                         dim3(kThreads), smem, stream, p);
  });
  if (err != cudaSuccess || p.splits == 1) return err;
  const int64_t rows = int64_t(p.B) * p.Hq * p.Lq;
  const unsigned blocks = unsigned(min(rows, int64_t(1) << 20));  // more rows: a stride loop
  return launch_on_flag(p.mods.sinks != nullptr, [&](auto sinks) {
    return launch_kernel(kvcache_merge_kernel<T, decltype(sinks)::value>, dim3(blocks),
                         dim3(kThreads), 0, stream, p);
  });
}

template <typename T>
cudaError_t launch_dtype(const KvcacheParams& p, cudaStream_t stream) {
  static_assert(kDecodeMaxHeadDim <= 2 * kThreads, "at most two value columns per thread");
  return p.Ev <= kThreads ? launch_typed<T, 1>(p, stream) : launch_typed<T, 2>(p, stream);
}

}  // namespace

void kvcache_splits(KvcacheParams& p) {
  const int64_t ctas = int64_t(p.B) * p.Hkv * ceil_div(p.Hq / p.Hkv * p.Lq, kRows);
  const int64_t tiles = max(int64_t(1), (p.capacity + kKeys - 1) / kKeys);
  const int64_t want = max(int64_t(1), min(min((kTargetCtas + ctas - 1) / ctas, tiles),
                                           int64_t(kMaxSplits)));
  const int64_t per_split = (max(p.capacity, int64_t(1)) + want - 1) / want;
  p.split_len = (per_split + kKeys - 1) / kKeys * kKeys;
  p.splits = int((max(p.capacity, int64_t(1)) + p.split_len - 1) / p.split_len);
}

size_t kvcache_smem_bytes(int E, int Ev) { return size_t(Smem(E, Ev).total); }

cudaError_t launch_kvcache_fwd(const KvcacheParams& p, cudaStream_t stream) {
  return p.dtype == DType::Half ? launch_dtype<__half>(p, stream)
                                : launch_dtype<__nv_bfloat16>(p, stream);
}

}  // namespace cuda
}  // namespace attnx
