// The sdpa fwd kernels of csrc/cuda, their own source, compiled for the host harness.
#include "cuda_host.h"

#include "../sdpa_fwd_d32.cu"
#include "../sdpa_fwd_d64.cu"
#include "../sdpa_fwd_d96.cu"
#include "../sdpa_fwd_d128.cu"
#include "../sdpa_fwd_d160.cu"
#include "../sdpa_fwd_d192.cu"
#include "../sdpa_fwd_d256.cu"
