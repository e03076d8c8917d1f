"""Issue 3's targets for the fused CPU additive attention: speed and memory against naive PyTorch.

Forward + backward at B=8, Lq=Lk=128, A=256, Ev=256, H=1, float32: attnx's cpu backend against
the naive formula that materialises tanh(q + k) as a (B, Lq, Lk, A) tensor (that is attnx's
reference backend). Timings are interleaved in one process (median, min, max). Peak memory is
measured in a fresh subprocess per backend and size, as the growth of the process's peak RSS
(VmHWM) over one forward + backward, at A=256 and A=512 to show which one grows with
A x Lq x Lk. GFLOP/s use attnx.bench.flops' count for additive attention, beside the machine's
float32 GEMM rate measured in the same run.

    python benchmarks/cpu_additive_targets.py [--reps 7]

Writes benchmarks/results/cpu-additive-<date>.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import attnx  # noqa: E402
from attnx.bench import flops  # noqa: E402
from attnx.bench.machine import gemm_rate  # noqa: E402
from attnx.bench.shapes import Case  # noqa: E402

B, L, A, EV = 8, 128, 256, 256
BACKENDS = ("cpu", "reference")
TARGET_SPEEDUP = 5.0


def make_inputs(a: int):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, L, a, generator=g).requires_grad_()
    k = torch.randn(B, L, a, generator=g).requires_grad_()
    value = torch.randn(B, L, EV, generator=g).requires_grad_()
    v = (torch.randn(a, generator=g) / a ** 0.5).requires_grad_()
    d_out = torch.randn(B, L, EV, generator=g)
    return (q, k, value, v), d_out


def step(backend: str, inputs, d_out) -> None:
    for t in inputs:
        t.grad = None
    out = attnx.additive_attention(*inputs, backend=backend)
    out.backward(d_out)


def peak_rss() -> int:
    """This process's peak RSS in bytes.

    VmHWM belongs to the process's own address space; ru_maxrss would not do in a child, as
    Linux carries the parent's peak over into it across fork + exec.
    """
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def peak_rss_growth(backend: str, a: int) -> None:
    """Child-process mode: print the peak-RSS growth (bytes) of one forward + backward."""
    inputs, d_out = make_inputs(a)
    before = peak_rss()
    step(backend, inputs, d_out)
    print(peak_rss() - before)


def measure_memory(backend: str, a: int) -> int:
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--peak-rss", backend, str(a)],
                         check=True, capture_output=True, text=True)
    return int(res.stdout.strip().splitlines()[-1])


def measure_time(reps: int) -> dict:
    inputs, d_out = make_inputs(A)
    for backend in BACKENDS:  # warm-up: first-call allocations, thread pool start
        step(backend, inputs, d_out)
    times = {b: [] for b in BACKENDS}
    for _ in range(reps):
        for backend in BACKENDS:
            t0 = time.perf_counter()
            step(backend, inputs, d_out)
            times[backend].append(time.perf_counter() - t0)
    return times


def machine() -> dict:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": model, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version(),
            "load_avg_1m_at_start": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--peak-rss", nargs=2, metavar=("BACKEND", "A"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_rss:
        peak_rss_growth(args.peak_rss[0], int(args.peak_rss[1]))
        return

    info = machine()
    gemm = gemm_rate("cpu", args.reps)
    times = measure_time(args.reps)
    memory = {f"{b}_A{a}": measure_memory(b, a) for a in (A, 2 * A) for b in BACKENDS}
    stats = {b: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "runs_s": t}
             for b, t in times.items()}
    speedup = stats["reference"]["median_s"] / stats["cpu"]["median_s"]
    case = Case("additive", B, 1, L, L, A, EV, False, "float32", "cpu")
    work = flops.count(case, "forward_backward")
    for s in stats.values():
        s["gflops"] = work / s["median_s"] / 1e9

    print(f"additive attention fwd+bwd, B={B} L={L} A={A} Ev={EV} H=1 float32, "
          f"{info['torch_threads']} threads, {args.reps} interleaved runs")
    print(f"float32 GEMM 2048^3 in the same run: {gemm['flops_per_s'] / 1e9:.1f} GFLOP/s")
    print(f"{'backend':<22}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'GFLOP/s':>9}"
          f"{'peak RSS +MB A=' + str(A):>20}{'A=' + str(2 * A):>8}")
    for b, label in (("cpu", "attnx cpu (fused)"), ("reference", "naive PyTorch")):
        s = stats[b]
        print(f"{label:<22}{s['median_s'] * 1e3:>11.1f}{s['min_s'] * 1e3:>9.1f}{s['max_s'] * 1e3:>9.1f}"
              f"{s['gflops']:>9.1f}"
              f"{memory[f'{b}_A{A}'] / 2**20:>20.1f}{memory[f'{b}_A{2 * A}'] / 2**20:>8.1f}")
    tanh_mb = B * L * L * A * 4 / 2**20
    print(f"speedup (median): {speedup:.2f}x (target >= {TARGET_SPEEDUP}x: "
          f"{'met' if speedup >= TARGET_SPEEDUP else 'MISSED'}); "
          f"one (B, Lq, Lk, A) float32 tanh tensor is {tanh_mb:.0f} MB at A={A}")

    date = datetime.date.today().isoformat()
    record = {
        "benchmark": "cpu-additive-targets", "date": date, "torch": torch.__version__,
        "attnx": attnx.__version__, "machine": info,
        "config": {"B": B, "H": 1, "Lq": L, "Lk": L, "A": A, "Ev": EV, "dtype": "float32",
                   "reps": args.reps, "what": "forward + backward, all inputs require grad"},
        "flops": work, "flop_formula": "attnx.bench.flops, additive: pairs * (16A + 6Ev)",
        "gemm_2048": gemm,
        "time": stats, "speedup_median": speedup, "target_speedup": TARGET_SPEEDUP,
        "peak_rss_growth_bytes": memory,
        "tanh_tensor_bytes": {f"A{a}": B * L * L * a * 4 for a in (A, 2 * A)},
    }
    out_dir = os.path.join(ROOT, "benchmarks", "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"cpu-additive-{date}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
