// The additive kernels of csrc/cuda, their own source, compiled for the host harness.
#include "cuda_host.h"

#include "../additive.cu"
#include "../additive_bwd_rerun.cu"
