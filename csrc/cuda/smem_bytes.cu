// The dynamic shared memory each SDPA launch requests, for the host: attnx._C.cuda_smem_bytes
// (python_module.cpp) hands it to the cuda backend's per-call check (attnx/_backends/cuda.py)
// and to tests/test_cuda_resources.py, so the kernels' own Config is the one formula.
#include "sdpa_bwd.cuh"
#include "sdpa_fwd.cuh"

namespace attnx {
namespace cuda {
namespace {

static_assert(sizeof(kSdpaFwdFamilies) == 7 * sizeof(int) && kSdpaFwdFamilies[6] == 256,
              "forward_bytes has one case per family");
static_assert(sizeof(kSdpaBwdFamilies) == 7 * sizeof(int) && kSdpaBwdFamilies[0] == 32 &&
                  kSdpaBwdFamilies[1] == 64 && kSdpaBwdFamilies[2] == 96 &&
                  kSdpaBwdFamilies[3] == 128 && kSdpaBwdFamilies[4] == 160 &&
                  kSdpaBwdFamilies[5] == 192 && kSdpaBwdFamilies[6] == 256,
              "backward_bytes has one case per family, the forward's");

size_t forward_bytes(int dim) {
  switch (sdpa_fwd_family_of(dim)) {
    case 32: return sdpa_fwd_impl::smem_bytes<32>();
    case 64: return sdpa_fwd_impl::smem_bytes<64>();
    case 96: return sdpa_fwd_impl::smem_bytes<96>();
    case 128: return sdpa_fwd_impl::smem_bytes<128>();
    case 160: return sdpa_fwd_impl::smem_bytes<160>();
    case 192: return sdpa_fwd_impl::smem_bytes<192>();
    case 256: return sdpa_fwd_impl::smem_bytes<256>();
    default: return 0;
  }
}

size_t backward_bytes(int dim) {
  switch (sdpa_fwd_family_of(dim)) {  // the backward's families are the forward's
    case 32: return sdpa_bwd_smem_bytes<32>();
    case 64: return sdpa_bwd_smem_bytes<64>();
    case 96: return sdpa_bwd_smem_bytes<96>();
    case 128: return sdpa_bwd_smem_bytes<128>();
    case 160: return sdpa_bwd_smem_bytes<160>();
    case 192: return sdpa_bwd_smem_bytes<192>();
    case 256: return sdpa_bwd_smem_bytes<256>();
    default: return 0;
  }
}

}  // namespace

size_t sdpa_smem_bytes(bool backward, int dim) {
  return backward ? backward_bytes(dim) : forward_bytes(dim);
}

size_t sdpa_bwd_kt2_smem_bytes(int dim) {
  switch (sdpa_fwd_family_of(dim)) {
    case 64: return sdpa_bwd_smem_bytes<64, 2>();
    case 96: return sdpa_bwd_smem_bytes<96, 2>();
    case 128: return sdpa_bwd_smem_bytes<128, 2>();
    default: return 0;
  }
}

}  // namespace cuda
}  // namespace attnx
