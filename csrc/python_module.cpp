// attnx._C as a Python module: loading it registers the ops (csrc/ops.cpp and the device
// registrations); build_info tells `attnx info` what this binary was compiled with.
#include <torch/extension.h>

#include <string>

#include "kvcache_plain_args.h"
#include "cpu/additive_terms.h"
#include "cpu/cpu_choice.h"
#include "cpu/sdpa_panels.h"
#include "cpu/sdpa_tile.h"
#ifdef ATTNX_WITH_CUDA
#include "cuda/decode.h"
#include "cuda/launch.h"
#endif

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
  info["torch"] = ATTNX_TORCH_VERSION;
#ifdef ATTNX_WITH_CUDA
  info["cuda"] = true;
  info["cuda_version"] = ATTNX_CUDA_VERSION;
  info["cuda_archs"] = ATTNX_CUDA_ARCHS;
#else
  info["cuda"] = false;
#endif
  info["openmp"] =
#ifdef _OPENMP
      true;
#else
      false;
#endif
  // Which engine runs the float32 CPU SDPA products (csrc/cpu/sdpa_products.h), and which
  // instruction set the CPU kernels' row operations (csrc/cpu/sdpa_tile.h) and the panel
  // micro-kernel's width and strip height (csrc/cpu/sdpa_panels.h): chosen at first use
  // (csrc/cpu/cpu_choice.h), which asking here triggers; how each was chosen, and the times
  // where measured.
  const auto& engine = attnx::cpu::engine_choice();
  const auto& vector = attnx::cpu::vector_choice();
  info["cpu_gemm"] = engine.panels ? "panels" : "blas";
  info["cpu_vector"] = attnx::cpu::vector_isa();
  info["cpu_strip_rows"] = vector.strip_rows;
  pybind11::dict how;
  how["gemm"] = engine.how;
  how["vector"] = vector.how;
  how["strip_rows"] = vector.strip_how;
  if (std::string(engine.how) == "measured") {
    how["gemm_seconds"] = pybind11::dict(pybind11::arg("panels") = engine.panels_s,
                                         pybind11::arg("blas") = engine.blas_s);
  }
  if (std::string(vector.how) == "measured") {
    how["vector_seconds"] = pybind11::dict(pybind11::arg("avx512") = vector.wide_s,
                                           pybind11::arg("avx2") = vector.narrow_s);
  }
  if (std::string(vector.strip_how) == "measured") {
    how["strip_seconds"] = pybind11::dict(pybind11::arg("12") = vector.tall_s,
                                          pybind11::arg("6") = vector.short_s);
  }
  info["cpu_choice"] = how;
  return info;
}

// Seconds one thread takes for `terms` terms of the CPU additive kernel's instruction sequence
// on registers alone: the vector limit benchmarks/cpu_additive_targets.py measures it against.
double additive_term_seconds(int64_t terms) {
  if (terms < 1) throw pybind11::value_error("terms: expected a positive count");
  pybind11::gil_scoped_release release;
  return attnx::cpu::additive::term_seconds(terms);
}

// attnx::kvcache_fwd called through the dispatcher with its C++ signature, for attnx's own
// eager decoding calls (attnx/_backends/native.py). torch.ops's Python entry boxes every argument
// into IValues against the schema and the results back: ~110 us a call after a model's weights
// have flushed the caches, as much as torch's whole SDPA call there. The dispatcher is the same:
// dispatch keys, Python modes, the profiler's record of the op see the same call.
std::tuple<at::Tensor, at::Tensor> kvcache_fwd(const at::Tensor& q, const at::Tensor& k_cache,
                                               const at::Tensor& v_cache, const at::Tensor& seqlens,
                                               const std::optional<at::Tensor>& block_table,
                                               double scale, int64_t window_lo, int64_t window_hi) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attnx::kvcache_fwd", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const std::optional<at::Tensor>&, double, int64_t, int64_t)>();
  pybind11::gil_scoped_release release;
  return op.call(q, k_cache, v_cache, seqlens, block_table, scale, window_lo, window_hi);
}

#ifdef ATTNX_WITH_CUDA
// Bytes of dynamic shared memory per block a CUDA kernel's launch requests: "sdpa_fwd" and
// "sdpa_bwd" for head dims up to `dim` ("sdpa_bwd_kt2": the backward's 128-key variant, which
// launches only where it fits; 0 outside 33-128), "additive" (forward and backward) for value
// dim `dim`, "kvcache" (the decoding split kernel) for head dims E = Ev = `dim`.
// The cuda backend checks them against the device per call; the resource test against each
// architecture's limit.
int64_t cuda_smem_bytes(const std::string& kernel, int64_t dim) {
  if (dim < 1 || dim > (int64_t(1) << 20)) throw pybind11::value_error("dim: out of range");
  if (kernel == "sdpa_fwd" || kernel == "sdpa_bwd")
    return static_cast<int64_t>(attnx::cuda::sdpa_smem_bytes(kernel == "sdpa_bwd", int(dim)));
  if (kernel == "sdpa_bwd_kt2")
    return static_cast<int64_t>(attnx::cuda::sdpa_bwd_kt2_smem_bytes(int(dim)));
  if (kernel == "additive") return static_cast<int64_t>(attnx::cuda::additive_smem_bytes(int(dim)));
  if (kernel == "kvcache")
    return static_cast<int64_t>(attnx::cuda::kvcache_smem_bytes(int(dim), int(dim)));
  throw pybind11::value_error(
      "kernel: expected 'sdpa_fwd', 'sdpa_bwd', 'sdpa_bwd_kt2', 'additive' or 'kvcache'");
}
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "attnx native ops (registered under torch.ops.attnx)";
  m.def("build_info", &build_info, "what this extension was compiled with");
  m.def("additive_term_seconds", &additive_term_seconds, pybind11::arg("terms"),
        "seconds one thread takes for `terms` additive-attention terms on registers alone");
  m.def("kvcache_fwd", &kvcache_fwd, "attnx::kvcache_fwd through the dispatcher, unboxed");
  m.def("plain_kvcache_args", &attnx::plain_kvcache_args,
        "the checks of a plain attention_with_kvcache call: (lens, cache_seqlens, seqlens, "
        "head_dim), or None where the full checks must run");
#ifdef ATTNX_WITH_CUDA
  m.def("cuda_smem_bytes", &cuda_smem_bytes, pybind11::arg("kernel"), pybind11::arg("dim"),
        "dynamic shared memory per block a CUDA kernel's launch requests, in bytes");
#endif
}
