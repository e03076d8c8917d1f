// The KV-cache decoding kernels of csrc/cuda, their own source, compiled for the host harness.
#include "cuda_host.h"

#include "../decode.cu"
