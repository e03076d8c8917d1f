// The CPU kernels of the attnx ops (schemas: csrc/ops.cpp).
#include <torch/library.h>

#include <utility>

#include "additive_cpu.h"
#include "cpu_choice.h"
#include "decode_cpu.h"
#include "sdpa_cpu.h"
#include "varlen_cpu.h"

namespace {

// Every op makes the vector-width choice of cpu_choice.h (once per process) on the calling
// thread before its kernels start: measured on a quiet thread, not on a worker of a parallel
// region whose siblings are busy. (The SDPA engine is chosen at the SDPA kernels' entry.)
template <auto Kernel>
struct Chosen;
template <typename R, typename... Args, R (*Kernel)(Args...)>
struct Chosen<Kernel> {
  static R call(Args... args) {
    attnx::cpu::vector_choice();
    return Kernel(std::forward<Args>(args)...);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(attnx, CPU, m) {
  m.impl("sdpa_fwd", &Chosen<&attnx::cpu::sdpa_fwd>::call);
  m.impl("sdpa_bwd", &Chosen<&attnx::cpu::sdpa_bwd>::call);
  m.impl("sdpa_mod_fwd", &Chosen<&attnx::cpu::sdpa_mod_fwd>::call);
  m.impl("sdpa_mod_bwd", &Chosen<&attnx::cpu::sdpa_mod_bwd>::call);
  m.impl("additive_fwd", &Chosen<&attnx::cpu::additive_fwd>::call);
  m.impl("additive_bwd", &Chosen<&attnx::cpu::additive_bwd>::call);
  m.impl("kvcache_fwd", &Chosen<&attnx::cpu::kvcache_fwd>::call);
  m.impl("kvcache_mod_fwd", &Chosen<&attnx::cpu::kvcache_mod_fwd>::call);
  m.impl("varlen_fwd", &Chosen<&attnx::cpu::varlen_fwd>::call);
  m.impl("varlen_bwd", &Chosen<&attnx::cpu::varlen_bwd>::call);
  m.impl("varlen_mod_fwd", &Chosen<&attnx::cpu::varlen_mod_fwd>::call);
  m.impl("varlen_mod_bwd", &Chosen<&attnx::cpu::varlen_mod_bwd>::call);
}
