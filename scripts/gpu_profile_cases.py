"""One call of each kernel whose speed target issue 21 misses, for Nsight Compute (ncu).

    ncu --profile-from-start off --clock-control none -o prof python3 scripts/gpu_profile_cases.py

Each case runs once outside the profiled range (compiles, Triton's autotuning, the caching
allocator's first allocations), then once, forward and backward, between cudaProfilerStart and
cudaProfilerStop: with --profile-from-start off, ncu profiles exactly that call's kernels. The
shapes are the benchmarks' (bf16): additive attention at B=64, L=256, A=Ev=256
(benchmarks/gpu_additive_targets.py), SDPA at 16k tokens and H x D = 2048 with L=4096
(benchmarks/gpu.py), the cuda backend at D=128 and D=64 and triton at D=128 beside it (its
backward reaches FlashAttention-2's speed there, the cuda one 0.77-0.87x of it). scripts/gpu_check.sh's
`profile` step runs this under ncu and summarises the kernels' counters (gpu_check_report.py
profile).

Without a GPU, --small runs every case at a few rows on CPU tensors (the cuda cases through the
host harness, ATTNX_CUDA_ON_CPU=1; the triton one in Triton's interpreter, TRITON_INTERPRET=1):
a check of this script (tests/test_gpu_check.py), nothing profiled.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import attnx  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# name: (backend, kind, shape at full size, shape with --small)
CASES = {
    "additive-cuda": ("cuda", "additive", dict(B=64, L=256, A=256, Ev=256), dict(B=2, L=19, A=40, Ev=24)),
    "sdpa-d128-cuda": ("cuda", "sdpa", dict(B=4, H=16, L=4096, D=128), dict(B=1, H=2, L=70, D=128)),
    "sdpa-d64-cuda": ("cuda", "sdpa", dict(B=4, H=32, L=4096, D=64), dict(B=1, H=2, L=70, D=64)),
    "sdpa-d128-triton": ("triton", "sdpa", dict(B=4, H=16, L=4096, D=128), dict(B=1, H=2, L=70, D=128)),
}


def step(backend: str, kind: str, shape: dict, dtype: torch.dtype):
    """A function running one forward and backward of the case on fresh inputs made once."""
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def make(*dims):
        return torch.randn(*dims, device=DEVICE, dtype=dtype, generator=g).requires_grad_()
    if kind == "additive":
        B, L, A, Ev = shape["B"], shape["L"], shape["A"], shape["Ev"]
        inputs = [make(B, L, A), make(B, L, A), make(B, L, Ev), make(A)]
        d_out = torch.randn(B, L, Ev, device=DEVICE, dtype=dtype, generator=g)

        def call():
            return attnx.additive_attention(*inputs, backend=backend)
    else:
        B, H, L, D = shape["B"], shape["H"], shape["L"], shape["D"]
        inputs = [make(B, H, L, D) for _ in range(3)]
        d_out = torch.randn(B, H, L, D, device=DEVICE, dtype=dtype, generator=g)

        def call():
            return attnx.scaled_dot_product_attention(*inputs, backend=backend)

    def run():
        torch.autograd.grad(call(), inputs, d_out)
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help=f"cases to run (default: all of {list(CASES)})")
    parser.add_argument("--small", action="store_true",
                        help="a few rows each, on CPU tensors without a GPU: checks the script")
    args = parser.parse_args(argv)
    names = args.cases or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"gpu_profile_cases.py: unknown cases {unknown}; choose from {list(CASES)}",
              file=sys.stderr)
        return 2
    if DEVICE == "cpu" and not args.small:
        print("gpu_profile_cases.py: no CUDA GPU here (--small checks the script on CPU tensors)",
              file=sys.stderr)
        return 1
    status = attnx.backends()
    failed = 0
    for name in names:
        backend, kind, full, small = CASES[name]
        if not status[backend].usable:
            print(f"{name}: not run: {status[backend].reason}")
            failed += 1
            continue
        run = step(backend, kind, small if args.small else full, torch.bfloat16)
        try:
            run()  # outside the profiled range
            if DEVICE == "cuda":
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
            run()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
            print(f"{name}: ran")
        except Exception as exc:  # one failing case leaves the others profiled
            print(f"{name}: FAILED: {type(exc).__name__}: {str(exc)[:500]}")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
