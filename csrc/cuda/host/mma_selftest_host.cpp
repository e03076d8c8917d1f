// The test-only primitive kernels (mma_selftest.cu), their own source, for the host harness.
#include "cuda_host.h"

#include "mma_selftest.cu"
