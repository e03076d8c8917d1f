// The dynamic shared memory each SDPA launch requests, for the host: attnx._C.cuda_smem_bytes
// (python_module.cpp) hands it to the cuda backend's per-call check (attnx/_backends/cuda.py)
// and to tests/test_cuda_resources.py, so the kernels' own Config is the one formula.
#include "sdpa_bwd.cuh"

namespace attnx {
namespace cuda {
namespace {

static_assert(sizeof(kSdpaFamilies) == 3 * sizeof(int) && kSdpaFamilies[0] == 64 &&
                  kSdpaFamilies[1] == 128 && kSdpaFamilies[2] == 256,
              "sdpa_smem_bytes has one case per family");

template <int D>
size_t family_bytes(bool backward) {
  return backward ? sdpa_bwd_impl::Config<D>::smem_bytes : sdpa_fwd_impl::Config<D>::smem_bytes;
}

}  // namespace

size_t sdpa_smem_bytes(bool backward, int dim) {
  return dim <= 64 ? family_bytes<64>(backward)
         : dim <= 128 ? family_bytes<128>(backward)
         : dim <= 256 ? family_bytes<256>(backward)
                      : 0;
}

}  // namespace cuda
}  // namespace attnx
