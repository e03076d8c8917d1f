// SDPA forward kernels for the head-dim family 32 (fp16 and bf16); see sdpa_fwd.cuh.
#include "sdpa_fwd.cuh"

namespace attnx {
namespace cuda {
template cudaError_t sdpa_fwd_family<32>(const SdpaParams&, cudaStream_t);
}  // namespace cuda
}  // namespace attnx
