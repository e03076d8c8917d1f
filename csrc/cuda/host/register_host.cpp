// attnx._cuda_host: the CUDA kernels run on CPU tensors through the host harness, registered as
// the attnx_cuda_host ops (the attnx schemas; the `cuda` backend calls them under
// ATTNX_CUDA_ON_CPU=1). Checks, outputs and launch parameters are kernel_ops.cpp's, as on a
// GPU; what differs is where the buffers live: every tensor a kernel reads or writes is a copy
// whose last byte (rounded up to 16) touches a PROT_NONE page, so an access past a tensor's
// extent faults, and outputs start as NaN (0xFF bytes), so an element a kernel should have
// written and did not shows.
#include <sys/mman.h>
#include <unistd.h>
#include <torch/extension.h>

#include <cstring>

#include "../../op_schemas.h"
#include "../kernel_ops.h"
#include "mma_selftest.h"
#include "scheduler.h"

namespace attnx {
namespace cuda {
namespace {

using at::Tensor;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// A 1-D CPU tensor of `numel` elements ending at a guard page, every byte set to `fill`.
Tensor guarded(int64_t numel, const at::TensorOptions& options, int fill) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t span = round_up(size_t(numel) * at::elementSize(options.dtype().toScalarType()), 16);
  const size_t data_bytes = round_up(std::max<size_t>(span, 1), page);
  const size_t total = data_bytes + page;
  char* base = static_cast<char*>(
      mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  TORCH_CHECK(base != MAP_FAILED, "attnx cuda host harness: out of memory");
  TORCH_CHECK(mprotect(base + data_bytes, page, PROT_NONE) == 0, "mprotect failed");
  std::memset(base, fill, data_bytes);
  return at::from_blob(base + data_bytes - span, {numel},
                       [base, total](void*) { munmap(base, total); }, options);
}

class Host final : public Target {
 public:
  at::DeviceType device_type() const override { return at::kCPU; }
  size_t smem_optin() const override { return 227 * 1024; }  // an H100's
  cudaStream_t stream() const override { return nullptr; }
  void check(cudaError_t err) const override {
    TORCH_CHECK(err == cudaSuccess, "attnx cuda host harness: ", host::last_error());
  }
  // A copy of the elements `t` spans (its strides kept: broadcast masks stay broadcast).
  Tensor input(const Tensor& t) const override {
    if (t.numel() == 0) return t;
    int64_t extent = 1;
    for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
    Tensor copy = guarded(extent, t.options(), 0xFF);
    copy.copy_(t.as_strided({extent}, {1}));
    return copy.as_strided(t.sizes(), t.strides());
  }
  Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) const override {
    return guarded(c10::multiply_integers(sizes), options, 0xFF).view(sizes);
  }
  Tensor zeros(at::IntArrayRef sizes, const at::TensorOptions& options) const override {
    return guarded(c10::multiply_integers(sizes), options, 0).view(sizes);
  }
};

const Host kHost;

std::tuple<Tensor, Tensor> host_sdpa_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const OptTensor& mask, double scale, int64_t window_lo,
                                         int64_t window_hi, double dropout_p,
                                         const OptTensor& seed) {
  return sdpa_fwd(kHost, q, k, v, mask, scale, window_lo, window_hi, dropout_p, seed);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> host_sdpa_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const OptTensor& mask, const Tensor& out, const Tensor& lse, double scale, int64_t window_lo,
    int64_t window_hi, double dropout_p, const OptTensor& seed, bool mask_grad,
    const OptTensor& grad_lse) {
  return sdpa_bwd(kHost, grad_out, q, k, v, mask, out, lse, scale, window_lo, window_hi,
                  dropout_p, seed, mask_grad, grad_lse);
}

std::tuple<Tensor, Tensor> host_sdpa_mod_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const OptTensor& mask, double scale,
                                            int64_t window_lo, int64_t window_hi,
                                            double dropout_p, const OptTensor& seed,
                                            double softcap, const OptTensor& alibi_slopes,
                                            const OptTensor& sinks) {
  return sdpa_fwd(kHost, q, k, v, mask, scale, window_lo, window_hi, dropout_p, seed, softcap,
                  alibi_slopes, sinks);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> host_sdpa_mod_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
    const OptTensor& mask, const Tensor& out, const Tensor& lse, double scale, int64_t window_lo,
    int64_t window_hi, double dropout_p, const OptTensor& seed, bool mask_grad,
    const OptTensor& grad_lse, double softcap, const OptTensor& alibi_slopes,
    const OptTensor& sinks, bool sinks_grad) {
  return sdpa_mod_bwd(kHost, grad_out, q, k, v, mask, out, lse, scale, window_lo, window_hi,
                      dropout_p, seed, mask_grad, grad_lse, softcap, alibi_slopes, sinks,
                      sinks_grad);
}

std::tuple<Tensor, Tensor, Tensor> host_additive_fwd(const Tensor& q, const Tensor& k,
                                                     const Tensor& value, const Tensor& v,
                                                     const OptTensor& mask, int64_t window_lo,
                                                     int64_t window_hi, double dropout_p,
                                                     const OptTensor& seed, bool return_weights) {
  return additive_fwd(kHost, q, k, value, v, mask, window_lo, window_hi, dropout_p, seed,
                      return_weights);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> host_additive_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& value,
    const Tensor& v, const OptTensor& mask, const Tensor& out, const Tensor& lse,
    int64_t window_lo, int64_t window_hi, double dropout_p, const OptTensor& seed,
    bool mask_grad, const OptTensor& grad_lse, const OptTensor& grad_weights) {
  return additive_bwd(kHost, grad_out, q, k, value, v, mask, out, lse, window_lo, window_hi,
                      dropout_p, seed, mask_grad, grad_lse, grad_weights);
}

std::tuple<Tensor, Tensor> host_kvcache_fwd(const Tensor& q, const Tensor& k_cache,
                                            const Tensor& v_cache, const Tensor& seqlens,
                                            const OptTensor& block_table, double scale,
                                            int64_t window_lo, int64_t window_hi) {
  return kvcache_fwd(kHost, q, k_cache, v_cache, seqlens, block_table, scale, window_lo,
                     window_hi);
}

std::tuple<Tensor, Tensor> host_kvcache_mod_fwd(const Tensor& q, const Tensor& k_cache,
                                               const Tensor& v_cache, const Tensor& seqlens,
                                               const OptTensor& block_table, double scale,
                                               int64_t window_lo, int64_t window_hi,
                                               double softcap, const OptTensor& alibi_slopes,
                                               const OptTensor& sinks) {
  return kvcache_fwd(kHost, q, k_cache, v_cache, seqlens, block_table, scale, window_lo,
                     window_hi, softcap, alibi_slopes, sinks);
}

std::tuple<Tensor, Tensor> host_varlen_mod_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& cu_q, const Tensor& cu_k,
                                              double scale, int64_t window_lo, int64_t window_hi,
                                              double dropout_p, const OptTensor& seed,
                                              double softcap, const OptTensor& alibi_slopes,
                                              const OptTensor& sinks) {
  return varlen_fwd(kHost, q, k, v, cu_q, cu_k, scale, window_lo, window_hi, dropout_p, seed,
                    softcap, alibi_slopes, sinks);
}

std::tuple<Tensor, Tensor> host_varlen_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& cu_q, const Tensor& cu_k, double scale,
                                          int64_t window_lo, int64_t window_hi, double dropout_p,
                                          const OptTensor& seed) {
  return host_varlen_mod_fwd(q, k, v, cu_q, cu_k, scale, window_lo, window_hi, dropout_p, seed,
                            0.0, std::nullopt, std::nullopt);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> host_varlen_mod_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
    const Tensor& cu_k, const Tensor& out, const Tensor& lse, double scale, int64_t window_lo,
    int64_t window_hi, double dropout_p, const OptTensor& seed, const OptTensor& grad_lse,
    double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks, bool sinks_grad) {
  return varlen_bwd(kHost, grad_out, q, k, v, cu_q, cu_k, out, lse, scale, window_lo, window_hi,
                    dropout_p, seed, grad_lse, softcap, alibi_slopes, sinks, sinks_grad);
}

std::tuple<Tensor, Tensor, Tensor> host_varlen_bwd(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
    const Tensor& cu_k, const Tensor& out, const Tensor& lse, double scale, int64_t window_lo,
    int64_t window_hi, double dropout_p, const OptTensor& seed, const OptTensor& grad_lse) {
  auto [dq, dk, dv, dsinks] =
      host_varlen_mod_bwd(grad_out, q, k, v, cu_q, cu_k, out, lse, scale, window_lo, window_hi,
                         dropout_p, seed, grad_lse, 0.0, std::nullopt, std::nullopt, false);
  return {dq, dk, dv};
}

// The primitives' self-tests (mma_selftest.h) on contiguous CPU tensors, in guarded buffers.
Tensor guarded_input(const Tensor& t, at::ScalarType dtype, at::IntArrayRef sizes) {
  TORCH_CHECK(t.scalar_type() == dtype && t.sizes() == sizes, "expected a ", dtype, " tensor of ",
              sizes, ", got ", t.scalar_type(), " ", t.sizes());
  return kHost.input(t.contiguous());
}

Tensor test_tile_products(const Tensor& a, const Tensor& bt, const Tensor& v, int64_t a_rows) {
  const at::ScalarType dt = a.scalar_type();
  TORCH_CHECK(dt == at::kHalf || dt == at::kBFloat16, "a: fp16 or bf16");
  const Tensor ga = guarded_input(a, dt, {16, 16}), gb = guarded_input(bt, dt, {16, 16}),
               gv = guarded_input(v, dt, {16, 16});
  Tensor out = kHost.empty({4, 16, 16}, a.options().dtype(at::kFloat));
  kHost.check(selftest::tile_products(dt == at::kBFloat16, ga.data_ptr(), gb.data_ptr(),
                                      gv.data_ptr(), int(a_rows), out.data_ptr<float>()));
  return out;
}

Tensor test_mma_fragments(const Tensor& a, const Tensor& b, const Tensor& d, bool bf16) {
  const Tensor ga = guarded_input(a, at::kInt, {32, 4}), gb = guarded_input(b, at::kInt, {32, 2});
  Tensor out = kHost.empty({32, 4}, d.options());
  out.copy_(guarded_input(d, at::kFloat, {32, 4}));
  kHost.check(selftest::mma_fragments(bf16, reinterpret_cast<const uint32_t*>(ga.data_ptr()),
                                      reinterpret_cast<const uint32_t*>(gb.data_ptr()),
                                      out.data_ptr<float>()));
  return out;
}

Tensor test_ldmatrix_fragments(const Tensor& m) {
  const Tensor gm = guarded_input(m, at::kShort, {4, 8, 8});
  Tensor out = kHost.zeros({4, 32, 4}, m.options().dtype(at::kInt));
  kHost.check(selftest::ldmatrix_fragments(reinterpret_cast<const uint16_t*>(gm.data_ptr()),
                                           reinterpret_cast<uint32_t*>(out.data_ptr())));
  return out;
}

}  // namespace
}  // namespace cuda
}  // namespace attnx

TORCH_LIBRARY(attnx_cuda_host, m) {
  for (const char* schema : attnx::kOpSchemas) m.def(schema);
}

TORCH_LIBRARY_IMPL(attnx_cuda_host, CPU, m) {
  m.impl("sdpa_fwd", &attnx::cuda::host_sdpa_fwd);
  m.impl("sdpa_bwd", &attnx::cuda::host_sdpa_bwd);
  m.impl("sdpa_mod_fwd", &attnx::cuda::host_sdpa_mod_fwd);
  m.impl("sdpa_mod_bwd", &attnx::cuda::host_sdpa_mod_bwd);
  m.impl("additive_fwd", &attnx::cuda::host_additive_fwd);
  m.impl("additive_bwd", &attnx::cuda::host_additive_bwd);
  m.impl("kvcache_fwd", &attnx::cuda::host_kvcache_fwd);
  m.impl("kvcache_mod_fwd", &attnx::cuda::host_kvcache_mod_fwd);
  m.impl("varlen_fwd", &attnx::cuda::host_varlen_fwd);
  m.impl("varlen_bwd", &attnx::cuda::host_varlen_bwd);
  m.impl("varlen_mod_fwd", &attnx::cuda::host_varlen_mod_fwd);
  m.impl("varlen_mod_bwd", &attnx::cuda::host_varlen_mod_bwd);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "attnx's CUDA kernels on the CPU through the host harness (torch.ops.attnx_cuda_host)";
  m.def("set_seed", &attnx::host::set_seed,
        "the seed of the order in which the harness runs blocks and threads");
  m.def("set_last_blocks", &attnx::host::set_last_blocks,
        "run only each launch's last n blocks (0: all); for tests of far offsets");
  m.def("set_sm90", &attnx::host::set_sm90,
        "launch the variants of sm_90 code (True, the default) or of sm_80 code");
  m.def("set_smem_optin", &attnx::host::set_smem_optin,
        "the opt-in shared memory per block of the part the harness stands for (0: by set_sm90)");
  m.def("last_launch_threads", &attnx::host::last_launch_threads,
        "the threads a block of the last launch with dynamic shared memory had (a tile kernel's)");
  // Self-tests of csrc/cuda/mma.cuh's primitives (tests/test_cuda_mma.py; mma_selftest.h).
  m.def("test_tile_products", &attnx::cuda::test_tile_products,
        "(4, 16, 16) fp32: a bt^T and a v through ldmatrix x4/x4.trans, then x2/x2.trans");
  m.def("test_mma_fragments", &attnx::cuda::test_mma_fragments,
        "d + the mma_m16n8k16 of per-lane registers a (32, 4) and b (32, 2) (int32)");
  m.def("test_ldmatrix_fragments", &attnx::cuda::test_ldmatrix_fragments,
        "(4, 32, 4) int32: the registers of ldmatrix x4, x4.trans, x2, x2.trans of m (4, 8, 8)");
}
