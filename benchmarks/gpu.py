"""The GPU benchmark: attnx's cuda and triton backends against torch's SDPA kernels.

attnx-cuda and attnx-triton against torch's flash, memory-efficient and cuDNN SDPA kernels
(each forced with torch.nn.attention.sdpa_kernel), bf16 and fp16, head dims 128 and 64,
L = 512 .. 16k with batch x L = 16k tokens and heads x D = 2048 (flash-attention's benchmark
setup), causal and not, forward and backward. FLOPs as flash-attention counts them
(attnx/bench/flops.py): forward 4*B*H*Lq*Lk*D, halved when causal; backward 2.5x forward.
Timing is attnx bench's (attnx/bench/timing.py): warm-up (Triton's autotuning included) outside
the timed blocks, providers interleaved round-robin, CUDA events, the median over repeats with
the min and max.

Each measurement is appended to --out as one JSON line as soon as it is taken, so a run stopped
by a time limit keeps what it measured; with --deadline-s it stops starting new measurements
in time, and lists what it left out. The most important cases come first (bf16, D=128).

    python benchmarks/gpu.py --out bench.jsonl [--deadline-s 240]   # needs a CUDA GPU
    python benchmarks/gpu.py --plan                                # the cases; no GPU needed
    python benchmarks/gpu.py --table bench.jsonl                   # the tables of a results file
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from attnx.bench import flops  # noqa: E402
from attnx.bench.shapes import Case  # noqa: E402

PROVIDERS = ("attnx-cuda", "attnx-triton", "torch-flash", "torch-efficient", "torch-cudnn")
PASSES = ("forward", "backward")
SHORT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "bfloat16": "bfloat16", "float16": "float16"}


def _csv(kind):
    return lambda text: tuple(kind(x) for x in text.split(",") if x.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON-lines file the measurements are appended to")
    p.add_argument("--deadline-s", type=float, help="start no measurement after this many seconds")
    p.add_argument("--dtypes", type=_csv(str), default=("bf16", "fp16"))
    p.add_argument("--head-dims", type=_csv(int), default=(128, 64))
    p.add_argument("--seqlens", type=_csv(int), default=(512, 1024, 2048, 4096, 8192, 16384))
    p.add_argument("--passes", type=_csv(str), default=PASSES)
    p.add_argument("--providers", type=_csv(str), default=PROVIDERS)
    p.add_argument("--tokens", type=int, default=16384, help="batch x L, held constant")
    p.add_argument("--hidden", type=int, default=2048, help="heads x head dim, held constant")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per measurement")
    p.add_argument("--time-scale", type=float, default=0.5,
                   help="scales attnx bench's warm-up and block durations")
    p.add_argument("--plan", action="store_true", help="print the cases and exit")
    p.add_argument("--table", metavar="JSONL", help="print the tables of a results file and exit")
    return p


def validate(args, p: argparse.ArgumentParser) -> None:
    unknown = [d for d in args.dtypes if d not in SHORT_DTYPES]
    if unknown:
        p.error(f"--dtypes: unknown {unknown}; choose from bf16, fp16")
    unknown = [x for x in args.passes if x not in PASSES]
    if unknown:
        p.error(f"--passes: unknown {unknown}; choose from {', '.join(PASSES)}")
    unknown = [x for x in args.providers if x not in PROVIDERS]
    if unknown:
        p.error(f"--providers: unknown {unknown}; choose from {', '.join(PROVIDERS)}")
    if any(x <= 0 for x in args.head_dims + args.seqlens) or args.tokens <= 0 or args.hidden <= 0:
        p.error("--head-dims, --seqlens, --tokens, --hidden: expected positive sizes")


def work(args) -> list:
    """(Case, pass) pairs in the order they are measured: by dtype, head dim, length, causal."""
    out = []
    for dtype in args.dtypes:
        for d in args.head_dims:
            heads = max(1, args.hidden // d)
            for length in args.seqlens:
                batch = max(1, args.tokens // length)
                for causal in (False, True):
                    case = Case("sdpa", batch, heads, length, length, d, d, causal,
                                SHORT_DTYPES[dtype], "cuda")
                    out += [(case, pass_) for pass_ in args.passes]
    return out


def result_row(case: Case, pass_: str, provider: str, timing: dict) -> dict:
    """One measurement as it goes to the JSON-lines file."""
    count = flops.count(case, pass_)
    row = {"kind": "result", "provider": provider, "pass": pass_, "case": case.as_dict(),
           "flops": count, "time": timing}
    if "median_ms" in timing:
        row["tflops"] = count / (timing["median_ms"] * 1e-3) / 1e12
        row["tflops_min_max"] = [count / (timing["max_ms"] * 1e-3) / 1e12,
                                 count / (timing["min_ms"] * 1e-3) / 1e12]
    return row


def run(items, measure, write, deadline_s=None, clock=time.monotonic) -> dict:
    """measure(case, pass_) -> [row] for each item, each row passed to write(row) at once;
    after `deadline_s` seconds the remaining items are listed, not measured."""
    start, done, left = clock(), 0, []
    for case, pass_ in items:
        if deadline_s is not None and clock() - start > deadline_s:
            left.append(f"{case.label()} {pass_}")
            continue
        for row in measure(case, pass_):
            write(row)
        done += 1
    end = {"kind": "end", "measured": done, "not_measured": left,
           "seconds": round(clock() - start, 1)}
    write(end)
    return end


def _gpu_measure(args):
    """The measuring function on this GPU: attnx bench's providers, steps and timing."""
    import torch

    from attnx.bench import providers, timing
    from attnx.bench.workload import make_step

    found = {p.name: p for p in providers.discover("cuda", probe_flex=False, probe_compile=False) if p.op == "sdpa"}
    chosen = [found.get(name) or providers.Provider(name, "sdpa", reason="not a provider here")
              for name in args.providers]

    def measure(case, pass_):
        steps, rows = {}, []
        for p in chosen:
            if not p.available:
                rows.append(result_row(case, pass_, p.name, {"error": p.reason}))
                continue
            try:
                steps[p.name] = make_step(p, case, pass_)
            except Exception as exc:  # e.g. a kernel that rejects the shape or runs out of memory
                rows.append(result_row(case, pass_, p.name,
                                       {"error": f"{type(exc).__name__}: {exc}"[:300]}))
        timings = timing.interleaved(steps, "cuda", args.repeats, args.time_scale)
        rows += [result_row(case, pass_, name, t.as_dict()) for name, t in timings.items()]
        steps.clear()  # frees the inputs and retained graphs before the next case
        torch.cuda.empty_cache()
        for r in rows:
            print(line(r), flush=True)
        return rows
    return measure


def meta(args) -> dict:
    from attnx.bench import machine

    doc = machine.describe("cuda")
    doc.update(kind="meta", argv=sys.argv[1:], repeats=args.repeats, time_scale=args.time_scale,
               flops="forward 4*B*H*Lq*Lk*D, halved when causal; backward 2.5x forward",
               gemm=machine.gemm_rate("cuda", args.repeats))
    return doc


def autotune_choices() -> list:
    """What each attnx Triton autotuner picked on this GPU, per tuning key: rows of kind
    "autotune" (kernel, key, the config's tiles, warps and stages), so that a run's results say
    which tiles won, not only how fast they ran."""
    import triton

    from attnx.triton import additive, decode, sdpa
    rows = []
    for module in (sdpa, additive, decode):
        for name, tuner in sorted(vars(module).items()):
            if not isinstance(tuner, triton.runtime.Autotuner):
                continue
            kernel = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"
            for key, config in getattr(tuner, "cache", {}).items():
                rows.append({"kind": "autotune", "kernel": kernel, "key": [str(k) for k in key],
                             "config": {**config.kwargs, "num_warps": config.num_warps,
                                        "num_stages": config.num_stages}})
    return rows


def line(row: dict) -> str:
    c = row["case"]
    what = (f"{c['dtype']:8} D{c['head_dim']:<4} L{c['seqlen_q']:<6} {'causal' if c['causal'] else '      '}"
            f" {row['pass']:8} {row['provider']:16}")
    if "tflops" not in row:
        return f"{what} error: {row['time'].get('error')}"
    t = row["time"]
    return (f"{what} {t['median_ms']:9.3f} ms ({t['min_ms']:.3f}-{t['max_ms']:.3f})"
            f" {row['tflops']:7.1f} TFLOP/s")


def read_jsonl(path: str) -> list:
    """The records of a results file; a last line cut off by a kill is dropped."""
    rows = []
    with open(path) as f:
        for text in f:
            try:
                rows.append(json.loads(text))
            except json.JSONDecodeError:
                break
    return rows


def table(rows: list) -> str:
    """TFLOP/s medians, one row per (dtype, D, causal, pass, provider), one column per L; then
    each attnx backend over the best torch kernel of the same cell."""
    results = [r for r in rows if r.get("kind") == "result"]
    cells, lengths = {}, set()
    for r in results:
        c = r["case"]
        key = (c["dtype"], c["head_dim"], c["causal"], r["pass"])
        lengths.add(c["seqlen_q"])
        # None: measured but failed ("err"); a length missing from the dict was not measured
        cells.setdefault(key, {}).setdefault(r["provider"], {})[c["seqlen_q"]] = r.get("tflops")
    cols = sorted(lengths)
    head = ["dtype", "D", "causal", "pass", "provider"] + [f"L={n}" for n in cols]
    lines = ["TFLOP/s (median)", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratio_lines = []
    for key in sorted(cells, key=lambda k: (k[0], -k[1], k[2], k[3])):
        by_provider = cells[key]
        for provider in sorted(by_provider):
            vals = by_provider[provider]
            lines.append("| " + " | ".join([key[0], str(key[1]), "yes" if key[2] else "no", key[3],
                                            provider] + [_fmt(vals, n) for n in cols]) + " |")
        best = {n: max((v[n] for p, v in by_provider.items()
                        if p.startswith("torch-") and v.get(n)), default=None) for n in cols}
        for provider in sorted(p for p in by_provider if p.startswith("attnx-")):
            vals = by_provider[provider]
            ratio_lines.append("| " + " | ".join(
                [key[0], str(key[1]), "yes" if key[2] else "no", key[3], provider]
                + [f"{vals[n] / best[n]:.2f}" if vals.get(n) and best[n] else "-" for n in cols]) + " |")
    if ratio_lines:
        lines += ["", "attnx over the best torch kernel (TFLOP/s ratio)",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ratio_lines
    return "\n".join(lines)


def _fmt(vals: dict, length: int) -> str:
    if length not in vals:
        return "-"
    return "err" if vals[length] is None else f"{vals[length]:.1f}"


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    validate(args, p)
    if args.table:
        print(table(read_jsonl(args.table)))
        return 0
    items = work(args)
    if args.plan:
        for case, pass_ in items:
            print(f"{case.label()} {pass_}: {flops.count(case, pass_):.3e} FLOP")
        print(f"{len(items)} measurements x {len(args.providers)} providers")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu.py: no CUDA device is visible to torch; nothing measured (--plan lists the "
              "cases without one)", file=sys.stderr)
        return 2
    if not args.out:
        p.error("--out: required to measure")
    with open(args.out, "a") as f:
        def write(row):
            f.write(json.dumps(row) + "\n")
            f.flush()
        write(meta(args))
        end = run(items, _gpu_measure(args), write, args.deadline_s)
        for row in autotune_choices():
            write(row)
    print(table(read_jsonl(args.out)))
    if end["not_measured"]:
        print(f"out of time: {len(end['not_measured'])} measurements not taken")
    return 0


if __name__ == "__main__":
    sys.exit(main())
