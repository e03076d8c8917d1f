// attnx._C.plain_kvcache_args: the checks of a plain decoding call in one native call
// (kvcache_plain_args.cpp says why).
#pragma once

#include <torch/extension.h>

#include <optional>

namespace attnx {

// None where the call is not plainly valid; else (lens, cache_seqlens, seqlens, head_dim):
// lens a tuple of ints (one per sequence, or the one `given_length` where cache_seqlens is
// None), cache_seqlens the int32 (B,) tensor the call keeps (built from given_length where none
// was given), seqlens its contiguous copy or itself.
pybind11::object plain_kvcache_args(const at::Tensor& q, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache,
                                    const std::optional<at::Tensor>& cache_seqlens,
                                    int64_t given_length,
                                    const std::optional<at::Tensor>& block_table,
                                    int64_t max_table_ids);

}  // namespace attnx
