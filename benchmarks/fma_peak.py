"""The CPU's float32 FMA ceiling: every thread running independent 8-wide FMAs from registers,
no memory traffic. No fp32 kernel (GEMM or attention) can beat it; on shared 2-core machines it
also shows what the neighbours leave, since it moves with them as the GEMM rate does.

x86-64 with AVX2/FMA and a C compiler (`cc`, or $CC) only; elsewhere `fma_peak` returns None.

    python benchmarks/fma_peak.py
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

static float chains(long steps) {
  __m256 acc[12];
  const __m256 x = _mm256_set1_ps(0.9999999f), y = _mm256_set1_ps(1e-7f);
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps((float)i);
  for (long s = 0; s < steps; ++s) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], x, y);
  }
  float out[8];
  for (int i = 1; i < 12; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
  _mm256_storeu_ps(out, acc[0]);
  return out[0];
}

int main(int argc, char** argv) {
  const long steps = atol(argv[1]);
  const int repeats = atoi(argv[2]);
  for (int r = 0; r < repeats; ++r) {
    float sink = 0.0f;
    const double t = now();
#pragma omp parallel reduction(+ : sink)
    sink += chains(steps);
    const double dt = now() - t;
    /* sink keeps the chains live */
    printf("%.3f %g\n", omp_get_max_threads() * steps * 12.0 * 16.0 / dt / 1e9, sink);
  }
  return 0;
}
"""


def fma_peak(repeats: int = 5, threads: int | None = None) -> dict | None:
    """{"gflops": median, "min", "max", "threads"} over `repeats` runs of ~0.3 s, or None where
    the probe cannot be built here."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    threads = threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "fma_peak.c"), os.path.join(tmp, "fma_peak")
        with open(src, "w") as f:
            f.write(SOURCE)
        cc = os.environ.get("CC", "cc")
        try:
            subprocess.run([cc, "-O2", "-mavx2", "-mfma", "-fopenmp", src, "-o", exe],
                           check=True, capture_output=True, timeout=60)
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            out = subprocess.run([exe, str(100_000_000), str(repeats)], check=True,
                                 capture_output=True, text=True, env=env, timeout=120).stdout
        except (OSError, subprocess.SubprocessError):
            return None
    rates = [float(line.split()[0]) for line in out.splitlines()]
    return {"gflops": statistics.median(rates), "min": min(rates), "max": max(rates),
            "threads": threads}


if __name__ == "__main__":
    print(fma_peak() or "no probe on this machine (x86-64 with AVX2/FMA and a C compiler needed)")
