// The SDPA backward's pre-pass: delta_i = rowsum(dO_i * O_i) - grad_lse_i, the row constant of
// dS = P (dP - delta), read by every key block of sdpa_bwd.cuh. One warp per row reads dO and O
// in their own dtype (no fp32 copies) and sums in fp32. Rows as the backward indexes them
// (SeqView: a batch, or a packed sequence).
#include "common.cuh"

namespace attnx {
namespace cuda {
namespace {

constexpr int kRowsPerBlock = 4;

template <typename T>
__global__ void __launch_bounds__(32 * kRowsPerBlock) sdpa_bwd_delta_kernel(const SdpaParams p) {
  const int i = blockIdx.x * kRowsPerBlock + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.z, h = blockIdx.y;
  const SeqView seq = seq_view(p, b);
  if (i >= seq.Lq) return;  // whole warps: no barrier below
  const int64_t row = query_rows(p, seq, b, h) + i;
  const T* o = static_cast<const T*>(p.out) + row * p.Ev;
  const T* dout = static_cast<const T*>(p.dout) + row * p.Ev;
  float sum = 0.f;
  for (int c = lane; c < p.Ev; c += 32) sum += to_float(o[c]) * to_float(dout[c]);
#pragma unroll
  for (int m = 16; m > 0; m /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  if (lane == 0) p.delta[row] = sum - (p.grad_lse != nullptr ? p.grad_lse[row] : 0.f);
}

}  // namespace

cudaError_t sdpa_bwd_delta(const SdpaParams& p, cudaStream_t stream) {
  if (p.B == 0 || p.Hq == 0 || p.Lq == 0) return cudaSuccess;
  const dim3 grid(ceil_div(p.Lq, kRowsPerBlock), p.Hq, p.B);
  return p.dtype == DType::Half
             ? launch_kernel(sdpa_bwd_delta_kernel<__half>, grid, dim3(32 * kRowsPerBlock), 0,
                             stream, p)
             : launch_kernel(sdpa_bwd_delta_kernel<__nv_bfloat16>, grid, dim3(32 * kRowsPerBlock),
                             0, stream, p);
}

}  // namespace cuda
}  // namespace attnx
