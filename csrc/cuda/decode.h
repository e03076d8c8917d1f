// The plain-C++ interface of the KV-cache decoding kernels (decode.cu), as launch.h is for the
// others: raw pointers, sizes and strides in elements.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "launch.h"

namespace attnx {
namespace cuda {

// attnx::kvcache_fwd (csrc/ops.cpp): q (B, Hq, Lq, E); the caches (B, Hkv, Lmax, E|Ev), or paged
// (num_blocks, Hkv, block_size, E|Ev) with table int32 (B, max_blocks) read through
// table_stride; seqlens int32 (B,) (keys attended, clamped to the capacity); query i of
// sequence b admits key j < n iff i + (n - Lq) + window_lo <= j <= i + (n - Lq) + window_hi.
struct KvcacheParams {
  DType dtype;
  int B, Hq, Hkv, Lq, E, Ev;
  int64_t capacity;  // keys a sequence can hold: Lmax, or max_blocks * block_size
  int64_t block_size;  // paged: keys per block; 0: contiguous
  int64_t num_blocks;  // paged: blocks in the cache (ids outside [0, num_blocks) are never read)
  float scale;
  int64_t window_lo, window_hi;
  const void *q, *k, *v;
  Strides4 sq, sk, sv;  // sk, sv: the caches' (block or batch, head, slot) strides
  const int32_t* seqlens;
  const int32_t* table;
  int64_t table_stride;
  // The score modifiers (launch.h), ALiBi aligned bottom-right: -slope |i + n - Lq - j|.
  ScoreMods mods;
  int splits;  // key splits per sequence (kvcache_splits); each holds split_len keys
  int64_t split_len;
  // out (B, Hq, Lq, Ev) in q's dtype, lse (B, Hq, Lq) fp32, contiguous; with splits > 1 the
  // scratch o_part (B, Hq, Lq, splits, Ev) and lse_part (B, Hq, Lq, splits) fp32.
  void* out;
  float* lse;
  float *o_part, *lse_part;
};

// Query rows (of the G * Lq a kv head's group holds) per CTA, and keys per tile.
constexpr int kDecodeRows = 16, kDecodeKeys = 32;
constexpr int kDecodeMaxHeadDim = 256;

// Fills p.splits and p.split_len for `ctas` CTAs per split: enough splits to fill the GPU, at
// least a key tile each.
void kvcache_splits(KvcacheParams& p);
// Dynamic shared memory of the split kernel for head dims E, Ev.
size_t kvcache_smem_bytes(int E, int Ev);
cudaError_t launch_kvcache_fwd(const KvcacheParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace attnx
