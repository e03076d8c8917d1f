// The measured choices of cpu_choice.h.
#include "cpu_choice.h"

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <string>

#include <c10/util/Exception.h>

#include "sdpa_cpu.h"
#include "sdpa_panels.h"

namespace attnx::cpu {
namespace {

// The variable's value where it is one of `allowed`, else -1 (unset, empty or anything else:
// the choice is measured; anything else with a warning, which a mistyped switch had lacked).
int env_value(const char* name, std::initializer_list<int> allowed) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return -1;
  const std::string s(v);
  std::string expected;
  for (int a : allowed) {
    if (s == std::to_string(a)) return a;
    expected += (expected.empty() ? "" : " or ") + std::to_string(a);
  }
  TORCH_WARN(name, ": expected ", expected, ", got '", s,
             "'; attnx measures its choice instead (csrc/cpu/README.md)");
  return -1;
}

int env_flag(const char* name) { return env_value(name, {0, 1}); }

// Rounds of each candidate, alternating: the tile's products take ~60 us, the forward and
// backward ~6 ms.
constexpr int kVectorRounds = 5, kEngineRounds = 3;

// The 512-bit kernel's strip height, on a CPU whose vector choice is AVX-512.
void choose_strip_rows(VectorChoice& c) {
  if (const int rows = env_value("ATTNX_CPU_STRIP_ROWS", {6, 12}); rows > 0) {
    c.strip_rows = rows;
    c.strip_how = rows == 6 ? "ATTNX_CPU_STRIP_ROWS=6" : "ATTNX_CPU_STRIP_ROWS=12";
    return;
  }
  double tall = std::numeric_limits<double>::infinity(), low = tall;
  for (int r = 0; r < kVectorRounds; ++r) {
    tall = std::min(tall, panel_gemm_seconds(true, 12));
    low = std::min(low, panel_gemm_seconds(true, 6));
  }
  c.strip_rows = low < (1.0 - kStripMargin) * tall ? 6 : 12;
  c.strip_how = "measured";
  c.tall_s = tall, c.short_s = low;
}

VectorChoice choose_vector_isa() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
    return {"baseline", "no AVX2 and FMA"};
  }
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (!avx512) return {"avx2", "no AVX-512"};
  switch (env_flag("ATTNX_CPU_AVX512")) {
    case 0: return {"avx2", "ATTNX_CPU_AVX512=0"};
    case 1: return {"avx512", "ATTNX_CPU_AVX512=1"};
    default: break;
  }
  double wide = std::numeric_limits<double>::infinity(), narrow = wide;
  for (int r = 0; r < kVectorRounds; ++r) {
    wide = std::min(wide, panel_gemm_seconds(true, 6));
    narrow = std::min(narrow, panel_gemm_seconds(false, 6));
  }
  const bool keep = narrow >= (1.0 - kMargin) * wide;
  return {keep ? "avx512" : "avx2", "measured", wide, narrow};
#else
  return {"baseline", "not x86"};
#endif
}

VectorChoice choose_vector() {
  VectorChoice c = choose_vector_isa();
  if (std::string(c.isa) == "avx512") choose_strip_rows(c);
  return c;
}

EngineChoice choose_engine() {
  if (!panels_supported()) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
    return {false, env_flag("ATTNX_CPU_PANELS") == 0 ? "ATTNX_CPU_PANELS=0" : "no AVX2 and FMA"};
#else
    return {false, "not x86"};
#endif
  }
  if (env_flag("ATTNX_CPU_PANELS") == 1) return {true, "ATTNX_CPU_PANELS=1"};
  vector_choice();  // made first, here on this thread, not inside the forwards' parallel regions
  sdpa_step_seconds(true);  // first touches: the kept buffers, the thread pool
  sdpa_step_seconds(false);
  double panels = std::numeric_limits<double>::infinity(), blas = panels;
  for (int r = 0; r < kEngineRounds; ++r) {
    panels = std::min(panels, sdpa_step_seconds(true));
    blas = std::min(blas, sdpa_step_seconds(false));
  }
  return {blas >= (1.0 - kMargin) * panels, "measured", panels, blas};
}

}  // namespace

const VectorChoice& vector_choice() {
  static const VectorChoice chosen = choose_vector();
  return chosen;
}

const EngineChoice& engine_choice() {
  static const EngineChoice chosen = choose_engine();
  return chosen;
}

bool panels_available() { return engine_choice().panels; }

}  // namespace attnx::cpu
