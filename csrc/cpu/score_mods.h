// The score modifiers softcap, ALiBi and sinks as the CPU kernels apply them (API.md).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>

namespace attnx::cpu {

// s = cap tanh(s / cap) over s[0, n), and dcap = 1 - tanh^2 where dcap is not null (sdpa_tile.cpp:
// the float version vectorized, within 3e-7 of tanh relative).
void softcap_row(float* s, int64_t n, float cap, float* dcap);
void softcap_row(double* s, int64_t n, double cap, double* dcap);
// s[j] -= slope |diag - j| over s[0, n): ALiBi on one row, diag the key on its diagonal less the
// row's first key (sdpa_tile.cpp: the float version vectorized; as a scalar loop converting
// int64 distances, in a file built for baseline x86-64, an ALiBi forward took 2.2x the plain
// one's time, B 1 H 8 L 2048 D 64, 2 threads; the rest of that gap was subnormal products:
// vector_body.h's exp2v).
void alibi_row(float* s, int64_t n, float slope, int64_t diag);
// The vector ALiBi bodies (alibi_row, decode_vectors.h's lane_alibi) hold distances in int32
// lanes: they take rows whose distances stay below this; longer ones take a scalar loop.
constexpr int64_t kAlibiInt32 = int64_t{1} << 30;
void alibi_row(double* s, int64_t n, double slope, int64_t diag);

// The score modifiers (csrc/ops.cpp) in a kernel's type. The kernels take them as a template
// flag too: without it (the plain ops) none of their code is compiled in.
template <typename T>
struct Mods {
  T softcap = 0;                 // 0: none
  const float* alibi = nullptr;  // (B * Hq) slopes, or null
  const T* sinks = nullptr;      // (Hq), or null
  int64_t alibi_offset = 0;      // query i's diagonal is key i + alibi_offset

  // The scaled scores s of keys j0 .. j0 + n - 1 of row i of head bh = b * Hq + h, soft-capped
  // and ALiBi subtracted (query i's diagonal is key i + alibi_offset: a bottom-right caller
  // passes i + its offset instead), before the mask. dcap (or null) receives the softcap's
  // derivative 1 - tanh^2, which the backward multiplies into dS.
  void apply(T* s, int64_t n, int64_t bh, int64_t i, int64_t j0, T* dcap) const {
    if (softcap > T(0)) softcap_row(s, n, softcap, dcap);
    if (alibi != nullptr) alibi_row(s, n, static_cast<T>(alibi[bh]), i + alibi_offset - j0);
  }
};

// The modifier arguments of an op (softcap 0: none; alibi_slopes float32 (B, Hq); sinks (Hq)),
// checked, held as the tensors the kernels read.
struct ModArgs {
  double softcap = 0;
  at::Tensor alibi;             // float32 (B * Hq), contiguous, or undefined
  at::Tensor sinks_f, sinks_d;  // (Hq) as float32 and as float64, or undefined
  int64_t alibi_offset = 0;     // Mods::alibi_offset (varlen: each sequence's Lk - Lq)

  bool any() const { return softcap > 0 || alibi.defined() || sinks_f.defined(); }
  template <typename T>
  Mods<T> view() const {
    Mods<T> m;
    m.softcap = static_cast<T>(softcap);
    m.alibi = alibi.defined() ? alibi.data_ptr<float>() : nullptr;
    const at::Tensor& sinks = std::is_same_v<T, double> ? sinks_d : sinks_f;
    m.sinks = sinks.defined() ? sinks.data_ptr<T>() : nullptr;
    m.alibi_offset = alibi_offset;
    return m;
  }
};

inline ModArgs mod_args(const char* op, double softcap, const std::optional<at::Tensor>& alibi,
                        const std::optional<at::Tensor>& sinks, int64_t b, int64_t hq) {
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0, op, ": expected softcap >= 0 (0: none)");
  ModArgs m;
  m.softcap = softcap;
  if (alibi.has_value()) {
    TORCH_CHECK(alibi->scalar_type() == at::kFloat && alibi->is_cpu() && alibi->dim() == 2 &&
                    alibi->size(0) == b && alibi->size(1) == hq,
                op, ": expected float32 CPU alibi_slopes of shape (B, Hq), got ", alibi->sizes());
    m.alibi = alibi->contiguous();
  }
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->is_cpu() && sinks->dim() == 1 && sinks->size(0) == hq, op,
                ": expected CPU sinks of shape (Hq,), got ", sinks->sizes());
    m.sinks_f = sinks->to(at::kFloat).contiguous();
    m.sinks_d = sinks->to(at::kDouble).contiguous();
  }
  return m;
}

}  // namespace attnx::cpu
