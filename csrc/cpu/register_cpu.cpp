// The CPU kernels of the attnx ops (schemas: csrc/ops.cpp).
#include <torch/library.h>

#include "additive_cpu.h"
#include "decode_cpu.h"
#include "sdpa_cpu.h"
#include "varlen_cpu.h"

TORCH_LIBRARY_IMPL(attnx, CPU, m) {
  m.impl("sdpa_fwd", &attnx::cpu::sdpa_fwd);
  m.impl("sdpa_bwd", &attnx::cpu::sdpa_bwd);
  m.impl("sdpa_mod_fwd", &attnx::cpu::sdpa_mod_fwd);
  m.impl("sdpa_mod_bwd", &attnx::cpu::sdpa_mod_bwd);
  m.impl("additive_fwd", &attnx::cpu::additive_fwd);
  m.impl("additive_bwd", &attnx::cpu::additive_bwd);
  m.impl("kvcache_fwd", &attnx::cpu::kvcache_fwd);
  m.impl("kvcache_mod_fwd", &attnx::cpu::kvcache_mod_fwd);
  m.impl("varlen_fwd", &attnx::cpu::varlen_fwd);
  m.impl("varlen_bwd", &attnx::cpu::varlen_bwd);
  m.impl("varlen_mod_fwd", &attnx::cpu::varlen_mod_fwd);
  m.impl("varlen_mod_bwd", &attnx::cpu::varlen_mod_bwd);
}
