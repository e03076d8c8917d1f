// SDPA backward kernels for head dims up to 192 (fp16 and bf16); see sdpa_bwd.cuh.
#include "sdpa_bwd.cuh"

namespace attnx {
namespace cuda {
template cudaError_t sdpa_bwd_family<192>(const SdpaParams&, cudaStream_t);
}  // namespace cuda
}  // namespace attnx
