"""Issue 20's targets for the fused CPU additive attention: speed against torch.compile(naive).

float32, H=1, Ev=256, at B8 L128 A256, B4 L256 A256 and B64 L32 A256 (decoder-sized): attnx's
cpu backend against `torch.compile` of the naive formula (inductor fuses the tanh-sum reduction
and never builds the (B, Lq, Lk, A) tensor: what an informed user runs instead), forward
(inference, no grad) and forward + backward. Each thread count (1 and 2) runs in its own
subprocess (inductor fixes its OpenMP thread count when it compiles); within it both providers
are timed interleaved, median of --reps runs, so a machine shared with other work moves both
alike: quote the ratios.

The term's vector limit: attnx._C.additive_term_seconds runs the forward's per-term instruction
sequence (csrc/cpu/additive_terms.cpp: one FMA for e^{2q} e^{2k} + 1, a reciprocal refined by
one Newton step, one FMA into the sum) on registers only, in the same process, one thread; the
limit for T threads is T times that. Efficiency = B Lq Lk A / forward time / limit.

    python benchmarks/cpu_additive_targets.py [--reps 7] [--threads 1,2] [--out PATH]

Whether an output's pages are fresh (a page fault each, on both sides) depends on glibc's heap,
which the other provider's allocations move: B64 L32's 2 MiB output faults its 512 pages on
some runs, and torch.compile(naive)'s forward+backward (its B x Lq x Lk x A tensor) tens of
thousands a call. `MALLOC_TRIM_THRESHOLD_=268435456 MALLOC_MMAP_THRESHOLD_=268435456` keeps
freed pages in the process: no faults on either side, the peer's forward+backward about twice
as fast, so runs with and without it do not compare (the results file records such settings,
and any allocator preloaded, under allocator_env).

Writes benchmarks/results/cpu-additive-<date>-<n>.json (the first free n) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import attnx  # noqa: E402
from attnx.bench.machine import cpu_kernels, git_commit  # noqa: E402
from cpu_sdpa_targets import machine  # noqa: E402

SHAPES = ((8, 128, 256), (4, 256, 256), (64, 32, 256))  # (B, L, A)
EV = 256
TARGET_SPEEDUP = 5.0
TARGET_EFFICIENCY = 0.30


def naive(q, k, value, v):
    scores = (v * torch.tanh(q.unsqueeze(2) + k.unsqueeze(1))).sum(-1)
    return torch.softmax(scores, dim=-1) @ value


def attnx_cpu(q, k, value, v):
    return attnx.additive_attention(q, k, value, v, backend="cpu")


def make_inputs(b: int, l: int, a: int, grad: bool):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(b, l, a, generator=g), torch.randn(b, l, a, generator=g),
          torch.randn(b, l, EV, generator=g), torch.randn(a, generator=g) / a ** 0.5]
    return [x.requires_grad_(grad) for x in xs], torch.randn(b, l, EV, generator=g)


def step(fn, inputs, d_out, backward: bool) -> None:
    if backward:
        for t in inputs:
            t.grad = None
        fn(*inputs).backward(d_out)
    else:
        with torch.no_grad():
            fn(*inputs)


def time_case(b: int, l: int, a: int, reps: int, compiled) -> dict:
    res = {}
    for mode, backward in (("forward", False), ("forward_backward", True)):
        inputs, d_out = make_inputs(b, l, a, backward)
        providers = {"attnx": attnx_cpu, "compile_naive": compiled}
        for fn in providers.values():  # warm-up: compilation, allocations, thread pool start
            step(fn, inputs, d_out, backward)
            step(fn, inputs, d_out, backward)
        times = {p: [] for p in providers}
        faults = {p: [] for p in providers}
        for _ in range(reps):
            for p, fn in providers.items():
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                step(fn, inputs, d_out, backward)
                times[p].append(time.perf_counter() - t0)
                faults[p].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        med = {p: statistics.median(t) for p, t in times.items()}
        # page faults per call: fresh output pages cost ~2-3 us each on this VM, and whether
        # an output's pages are fresh depends on glibc's heap state, which the other provider's
        # allocations move (B64 L32: attnx's 2 MiB output faults 512 pages = ~1.4 ms after a
        # torch.compile call, none when attnx runs alone)
        res[mode] = {"median_s": med, "runs_s": times,
                     "page_faults_per_call": {p: statistics.median(f) for p, f in faults.items()},
                     "speedup": med["compile_naive"] / med["attnx"]}
    return res


def term_rate() -> float | None:
    """Terms per second of the term's instruction sequence on one thread (None: a build
    without attnx._C.additive_term_seconds)."""
    fn = getattr(attnx._ops._C, "additive_term_seconds", None)
    if fn is None:
        return None
    n = 1 << 26
    fn(n)  # warm-up
    return max(n / fn(n) for _ in range(5))


def child(threads: int, reps: int) -> None:
    torch.set_num_threads(threads)
    rate = term_rate()
    cases = []
    for b, l, a in SHAPES:
        torch._dynamo.reset()
        compiled = torch.compile(naive, dynamic=False)
        r = time_case(b, l, a, reps, compiled)
        terms = b * l * l * a
        r["shape"] = {"B": b, "H": 1, "Lq": l, "Lk": l, "A": a, "Ev": EV}
        r["terms"] = terms
        if rate is not None:
            limit = rate * threads
            r["forward"]["term_efficiency"] = terms / r["forward"]["median_s"]["attnx"] / limit
            # the backward evaluates each term twice more (the score, then the gradients)
            r["forward_backward"]["term_passes_efficiency"] = (
                3 * terms / r["forward_backward"]["median_s"]["attnx"] / limit)
        cases.append(r)
    print(json.dumps({"threads": threads, "term_rate_per_thread": rate, "cases": cases,
                      "load_avg_1m": os.getloadavg()[0]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--out", help="results file (default: benchmarks/results/cpu-additive-<date>-<n>.json)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.reps)
        return

    runs = []
    for t in (int(x) for x in args.threads.split(",")):
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(t),
                              "--reps", str(args.reps)], check=True, capture_output=True, text=True)
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))

    print(f"additive attention float32, H=1 Ev={EV}: attnx cpu vs torch.compile(naive), "
          f"{args.reps} interleaved runs, medians; CPU {machine()['cpu']}, vector {cpu_kernels()['vector']}")
    print(f"{'thr':>3} {'B':>3} {'L':>4} {'A':>4} | {'fwd ms':>7} {'cmp ms':>7} {'ratio':>6} {'eff':>5}"
          f" | {'f+b ms':>7} {'cmp ms':>7} {'ratio':>6} {'eff3':>5} | faults/fwd")
    met = True
    for run in runs:
        for c in run["cases"]:
            s, f, fb = c["shape"], c["forward"], c["forward_backward"]
            eff = f.get("term_efficiency")
            eff3 = fb.get("term_passes_efficiency")
            print(f"{run['threads']:>3} {s['B']:>3} {s['Lq']:>4} {s['A']:>4} | "
                  f"{f['median_s']['attnx'] * 1e3:>7.2f} {f['median_s']['compile_naive'] * 1e3:>7.2f} "
                  f"{f['speedup']:>5.1f}x {'' if eff is None else f'{eff:.0%}':>5} | "
                  f"{fb['median_s']['attnx'] * 1e3:>7.2f} {fb['median_s']['compile_naive'] * 1e3:>7.2f} "
                  f"{fb['speedup']:>5.1f}x {'' if eff3 is None else f'{eff3:.0%}':>5} | "
                  f"{f['page_faults_per_call']['attnx']:>5.0f}")
            met &= f["speedup"] >= TARGET_SPEEDUP and fb["speedup"] >= TARGET_SPEEDUP
            met &= eff is not None and eff >= TARGET_EFFICIENCY
        if run["term_rate_per_thread"]:
            print(f"    term limit ({run['threads']} thr run): "
                  f"{run['term_rate_per_thread'] / 1e9:.2f} G terms/s per thread")
    print(f"targets (>= {TARGET_SPEEDUP}x both modes, forward >= {TARGET_EFFICIENCY:.0%} of the "
          f"term limit): {'met' if met else 'MISSED'}")

    date = datetime.date.today().isoformat()
    record = {
        "benchmark": "cpu-additive-targets", "date": date, "torch": torch.__version__,
        "attnx": attnx.__version__, "commit": git_commit(),
        "machine": {**machine(), "ATTNX_CPU_AVX512": os.environ.get("ATTNX_CPU_AVX512"),
                    "note": "shared with other jobs: compare ratios, not times"},
        # glibc's and torch's allocator settings: whether an output's pages are fresh (page
        # faults, page_faults_per_call) depends on them (glibc's trim threshold in particular)
        "allocator_env": {k: v for k, v in os.environ.items()
                          if k.startswith("MALLOC_")
                          or k in ("THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES", "LD_PRELOAD")},
        "config": {"shapes_BLA": SHAPES, "Ev": EV, "H": 1, "dtype": "float32", "reps": args.reps,
                   "baseline": "torch.compile(naive, dynamic=False)"},
        "targets": {"speedup": TARGET_SPEEDUP, "forward_term_efficiency": TARGET_EFFICIENCY,
                    "met": met},
        "runs": runs,
    }
    path = args.out
    if path is None:
        out_dir = os.path.join(ROOT, "benchmarks", "results")
        os.makedirs(out_dir, exist_ok=True)
        n = 1
        while os.path.exists(path := os.path.join(out_dir, f"cpu-additive-{date}-{n}.json")):
            n += 1
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
