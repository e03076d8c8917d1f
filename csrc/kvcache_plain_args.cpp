// The checks of a plain decoding call, in one native call: attnx/_validate.py's
// _plain_kvcache_call asks here before building the call. A decoding step runs once per layer,
// after the layer's weights have flushed the caches; then every tensor attribute Python reads
// (is_cpu, dtype, layout, dim, shape, ...) costs a distinct getter's misses, ~8 us each, ~100 us
// for the lot (Emerald Rapids, after a 512 MiB read). Each check below implies the full Python
// checks' (attnx/_validate.py: kvcache_call) for it; anything else declines (None) and the full
// checks run and raise, naming the argument. tests/test_kvcache_plain_call.py compares the two.
#include "kvcache_plain_args.h"

#include <c10/core/DispatchKeySet.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace attnx {
namespace {

// A dense CPU tensor wrapping nothing: no Python key (subclasses, fake tensors), no functorch or
// functionalization wrapper, no conjugate or negative view bits, not sparse, nested or meta.
// (Every CPU tensor carries AutocastCPU; whether autocast is on is the thread's state.)
bool plain_cpu(const at::Tensor& t) {
  static const c10::DispatchKeySet kPlain({c10::DispatchKey::CPU, c10::DispatchKey::AutogradCPU,
                                           c10::DispatchKey::ADInplaceOrView,
                                           c10::DispatchKey::AutocastCPU});
  // (a subset: set difference keeps the backend bits)
  return t.defined() && (t.key_set() | kPlain) == kPlain && t.layout() == at::kStrided;
}

bool floating(at::ScalarType s) {
  return s == at::kFloat || s == at::kDouble || s == at::kBFloat16 || s == at::kHalf;
}

}  // namespace

pybind11::object plain_kvcache_args(const at::Tensor& q, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache,
                                    const std::optional<at::Tensor>& cache_seqlens,
                                    int64_t given_length,
                                    const std::optional<at::Tensor>& block_table,
                                    int64_t max_table_ids) {
  const pybind11::object declined = pybind11::none();
  if (!plain_cpu(q) || !plain_cpu(k_cache) || !plain_cpu(v_cache)) return declined;
  const auto dtype = q.scalar_type();
  if (!floating(dtype) || k_cache.scalar_type() != dtype || v_cache.scalar_type() != dtype ||
      q.dim() != 4 || k_cache.dim() != 4 || v_cache.dim() != 4)
    return declined;
  const int64_t b = q.size(0), hq = q.size(1), e = q.size(3);
  const int64_t slots = k_cache.size(0), hkv = k_cache.size(1), depth = k_cache.size(2);
  if (k_cache.size(3) != e || v_cache.size(0) != slots || v_cache.size(1) != hkv ||
      v_cache.size(2) != depth || hkv <= 0 || hq % hkv != 0)
    return declined;

  int64_t capacity = depth;
  const bool paged = block_table.has_value();
  if (paged) {
    const at::Tensor& t = *block_table;
    if (!plain_cpu(t) || t.scalar_type() != at::kInt || t.dim() != 2 || t.size(0) != b ||
        t.numel() > max_table_ids || depth <= 0)
      return declined;
    capacity = t.size(1) * depth;
  } else if (slots != b) {
    return declined;
  }

  // The lengths: every sequence's, or one for all where the caller gave an int (as the full
  // checks keep them).
  std::vector<int64_t> lens;
  const bool given = !cache_seqlens.has_value();
  at::Tensor stored;  // cache_seqlens as the call keeps it
  at::Tensor seqlens;  // contiguous, as the kernels index it
  if (given) {
    if (given_length < 0 || given_length > capacity) return declined;
    lens.push_back(given_length);
  } else {
    stored = *cache_seqlens;
    if (!plain_cpu(stored) || stored.scalar_type() != at::kInt || stored.dim() != 1 ||
        stored.size(0) != b)
      return declined;
    seqlens = stored.contiguous();
    const int32_t* raw = seqlens.data_ptr<int32_t>();
    lens.assign(raw, raw + b);
    for (const int64_t n : lens) {
      if (n < 0 || n > capacity) return declined;
    }
  }
  if (paged && b > 0) {
    // the ids of the blocks that hold some key of each sequence; padding past them is not read
    const at::Tensor& t = *block_table;
    const int32_t* ids = t.data_ptr<int32_t>();
    for (int64_t s = 0; s < b; ++s) {
      const int64_t n = lens[given ? 0 : s];
      for (int64_t p = 0; p * depth < n; ++p) {
        const int32_t id = ids[s * t.stride(0) + p * t.stride(1)];
        if (id < 0 || id >= slots) return declined;
      }
    }
  }
  if (given) {
    stored = at::full({b}, given_length, q.options().dtype(at::kInt));
    seqlens = stored;
  }
  pybind11::tuple py_lens(lens.size());
  for (size_t i = 0; i < lens.size(); ++i) py_lens[i] = pybind11::int_(lens[i]);
  return pybind11::make_tuple(py_lens, stored, seqlens, e);
}

}  // namespace attnx
