// The sdpa bwd kernels of csrc/cuda, their own source, compiled for the host harness.
#include "cuda_host.h"

#include "../sdpa_bwd_delta.cu"
#include "../sdpa_bwd_rerun.cu"
#include "../sdpa_bwd_d32.cu"
#include "../sdpa_bwd_d64.cu"
#include "../sdpa_bwd_d96.cu"
#include "../sdpa_bwd_d128.cu"
#include "../sdpa_bwd_d160.cu"
#include "../sdpa_bwd_d192.cu"
#include "../sdpa_bwd_d256.cu"
