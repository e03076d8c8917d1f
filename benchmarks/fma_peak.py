"""The CPU's float32 FMA ceiling: every thread running independent FMAs from registers at the
widest vector width the CPU has (16 lanes with AVX-512F, else 8 with AVX2/FMA), no memory
traffic. No fp32 kernel (GEMM or attention) can beat it; on shared 2-core machines it
also shows what the neighbours leave, since it moves with them as the GEMM rate does.

x86-64 with AVX2/FMA and a C compiler (`cc`, or $CC) only; elsewhere `fma_peak` returns None.
The width is the CPU's own (cpuid, through the compiler's __builtin_cpu_supports), not the
build machine's: an 8-wide probe reads half the ceiling of a CPU with two 512-bit FMA units.

    python benchmarks/fma_peak.py [--repeats N] [--threads T]
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import tempfile

import torch

# 12 accumulators: Zen 3 and recent Intel cores need 8 FMAs in flight (2 pipes x 4 cycles).
SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* 12 independent chains of one vector type; the sum keeps them live. */
#define CHAINS(NAME, ATTR, VEC, SET1, FMA, ADD, STORE, LANES)                   \
  ATTR static float NAME(long steps) {                                        \
    VEC acc[12];                                                              \
    const VEC x = SET1(0.9999999f), y = SET1(1e-7f);                          \
    for (int i = 0; i < 12; ++i) acc[i] = SET1((float)i);                     \
    for (long s = 0; s < steps; ++s) {                                        \
      _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) acc[i] = FMA(acc[i], x, y); \
    }                                                                         \
    float out[LANES];                                                         \
    for (int i = 1; i < 12; ++i) acc[0] = ADD(acc[0], acc[i]);                \
    STORE(out, acc[0]);                                                       \
    return out[0];                                                            \
  }

CHAINS(chains8, __attribute__((target("avx2,fma"))), __m256, _mm256_set1_ps, _mm256_fmadd_ps,
       _mm256_add_ps, _mm256_storeu_ps, 8)
CHAINS(chains16, __attribute__((target("avx512f"))), __m512, _mm512_set1_ps, _mm512_fmadd_ps,
       _mm512_add_ps, _mm512_storeu_ps, 16)

int main(int argc, char** argv) {
  const long steps = atol(argv[1]);
  const int repeats = atoi(argv[2]);
  const int lanes = __builtin_cpu_supports("avx512f") ? 16 : 8;
  for (int r = 0; r < repeats; ++r) {
    float sink = 0.0f;
    const double t = now();
#pragma omp parallel reduction(+ : sink)
    sink += lanes == 16 ? chains16(steps) : chains8(steps);
    const double dt = now() - t;
    /* flops: threads x steps x 12 chains x lanes x 2 (multiply and add) */
    printf("%.3f %d %g\n", omp_get_max_threads() * steps * 12.0 * lanes * 2.0 / dt / 1e9, lanes,
           sink);
  }
  return 0;
}
"""


def fma_peak(repeats: int = 5, threads: int | None = None) -> dict | None:
    """{"gflops": median, "min", "max", "threads", "lanes"} over `repeats` runs of ~0.3 s (0.15 s
    at 16 lanes), or None where the probe cannot be built here."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    threads = threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "fma_peak.c"), os.path.join(tmp, "fma_peak")
        with open(src, "w") as f:
            f.write(SOURCE)
        cc = os.environ.get("CC", "cc")
        try:
            subprocess.run([cc, "-O2", "-fopenmp", src, "-o", exe],
                           check=True, capture_output=True, timeout=60)
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            out = subprocess.run([exe, str(100_000_000), str(repeats)], check=True,
                                 capture_output=True, text=True, env=env, timeout=120).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    rows = [line.split() for line in out.splitlines()]
    rates = [float(row[0]) for row in rows]
    return {"gflops": statistics.median(rates), "min": min(rates), "max": max(rates),
            "threads": threads, "lanes": int(rows[0][1])}


if __name__ == "__main__":
    import argparse

    from attnx.cli import positive_int

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive_int, default=5, help="runs of the probe (default 5)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="OpenMP threads (default: torch's thread count)")
    args = parser.parse_args()
    print(fma_peak(args.repeats, args.threads)
          or "no probe on this machine (x86-64 with AVX2/FMA and a C compiler needed)")
