// The dynamic shared memory each SDPA launch requests, for the host: attnx._C.cuda_smem_bytes
// (python_module.cpp) hands it to the cuda backend's per-call check (attnx/_backends/cuda.py)
// and to tests/test_cuda_resources.py, so the kernels' own Config is the one formula.
#include "sdpa_bwd.cuh"

namespace attnx {
namespace cuda {
namespace {

static_assert(sizeof(kSdpaFamilies) == 3 * sizeof(int) && kSdpaFamilies[0] == 64 &&
                  kSdpaFamilies[1] == 128 && kSdpaFamilies[2] == 256,
              "sdpa_smem_bytes has one backward case per family");
static_assert(sizeof(kSdpaFwdFamilies) == 7 * sizeof(int) && kSdpaFwdFamilies[6] == 256,
              "sdpa_smem_bytes has one forward case per family");

size_t fwd_bytes(int dim) {
  switch (sdpa_fwd_family_of(dim)) {
    case 32: return sdpa_fwd_impl::Config<32>::smem_bytes;
    case 64: return sdpa_fwd_impl::Config<64>::smem_bytes;
    case 96: return sdpa_fwd_impl::Config<96>::smem_bytes;
    case 128: return sdpa_fwd_impl::Config<128>::smem_bytes;
    case 160: return sdpa_fwd_impl::Config<160>::smem_bytes;
    case 192: return sdpa_fwd_impl::Config<192>::smem_bytes;
    case 256: return sdpa_fwd_impl::Config<256>::smem_bytes;
    default: return 0;
  }
}

size_t bwd_bytes(int dim) {
  return dim <= 64 ? sdpa_bwd_impl::Config<64>::smem_bytes
         : dim <= 128 ? sdpa_bwd_impl::Config<128>::smem_bytes
         : dim <= 256 ? sdpa_bwd_impl::Config<256>::smem_bytes
                      : 0;
}

}  // namespace

size_t sdpa_smem_bytes(bool backward, int dim) {
  return backward ? bwd_bytes(dim) : fwd_bytes(dim);
}

}  // namespace cuda
}  // namespace attnx
