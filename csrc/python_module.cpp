// attnx._C as a Python module: loading it registers the ops (csrc/ops.cpp and the device
// registrations); build_info tells `attnx info` what this binary was compiled with.
#include <torch/extension.h>

#include "cpu/sdpa_panels.h"
#include "cpu/sdpa_tile.h"

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
  // Which engine runs the float32 CPU SDPA products (csrc/cpu/sdpa_products.h).
  info["cpu_gemm"] = attnx::cpu::panels_available() ? "panels" : "blas";
  // Which instruction set runs the CPU kernels' row operations (csrc/cpu/sdpa_tile.h), and with
  // it the panel micro-kernel's width (csrc/cpu/sdpa_panels.h).
  info["cpu_vector"] = attnx::cpu::vector_isa();
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "attnx native ops (registered under torch.ops.attnx)";
  m.def("build_info", &build_info, "what this extension was compiled with");
}
