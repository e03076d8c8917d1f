"""`attnx bench`: runs a sweep, prints a table, writes results.json and PNG plots."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

from ..cli import positive_int
from . import flops, machine, memory, plots, providers, report, shapes, timing
from .workload import make_step


def _csv(kind):
    def parse(text: str) -> tuple:
        values = tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return values
    return parse


def _pass(name: str) -> str:
    name = shapes.PASS_ALIASES.get(name, name)
    if name not in shapes.PASSES:
        raise argparse.ArgumentTypeError(f"unknown pass {name!r}; choose from {shapes.PASSES}")
    return name


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnx bench", description=(
        "Time attnx's kernels against torch's SDPA kernels, FlexAttention, the naive formulas "
        "and flash-attn/xformers when installed. Prints a table and writes results.json and "
        "PNG plots to --out."))
    p.add_argument("--ops", type=_csv(str), default=("sdpa", "additive"),
                   help="sdpa,additive,kvcache,varlen (kvcache: decoding against a full cache, "
                        "forward only; varlen: one packed batch of mixed lengths against torch "
                        "on it padded); or hf alone: a small Llama-style transformers model, "
                        "attn_implementation attnx against sdpa (forward, generate; tokens/s)")
    p.add_argument("--seqlens", type=_csv(positive_int), help="sequence lengths (Lq = Lk), e.g. 512,1024")
    p.add_argument("--head-dims", type=_csv(positive_int), help="SDPA head dims, e.g. 64,128")
    p.add_argument("--attn-dims", type=_csv(positive_int), help="additive attention dims A, e.g. 256")
    p.add_argument("--dtypes", type=_csv(str), help="float32,bfloat16,float16,float64")
    p.add_argument("--providers", type=_csv(str), help="only these (names as in the table)")
    p.add_argument("--passes", type=_csv(_pass), help="forward,backward,forward_backward")
    p.add_argument("--repeats", type=positive_int, help="timed rounds per measurement")
    p.add_argument("--quick", action="store_true", help="a small sweep that runs in seconds")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    p.add_argument("--world", type=positive_int, metavar="N",
                   help="instead of the kernel sweep: ring_attention's strong scaling on N gloo "
                        "CPU processes of 1 thread each against the single-process kernel "
                        "(causal fp32 forward, both layouts; --seqlens, --head-dims (one), "
                        "--repeats; default L 8192,16384,32768, --quick 1024)")
    p.add_argument("--out", default="bench-results", help="folder for results.json and plots")
    return p


def _sweep(args, device):
    sweep = shapes.default_sweep(device, args.quick)
    if args.seqlens:
        sweep.seqlens = sweep.additive_seqlens = args.seqlens
        # kvcache: these cache lengths for each (B, Lq) of the sweep; varlen: one packed batch
        # of sequences of these lengths
        pairs = dict.fromkeys((b, lq) for b, _, lq in sweep.kvcache_cases)
        sweep.kvcache_cases = tuple((b, n, lq) for b, lq in pairs for n in args.seqlens)
        sweep.varlen_lengths = args.seqlens
    if args.head_dims:
        sweep.head_dims = args.head_dims
        if {"kvcache", "varlen"} & set(args.ops) and len(args.head_dims) != 1:
            raise SystemExit(f"--head-dims: kvcache and varlen take one head dim, got "
                             f"{list(args.head_dims)}")
        sweep.kvcache_dim = sweep.varlen_dim = args.head_dims[0]
    if args.attn_dims:
        sweep.additive_dims = args.attn_dims
    if args.dtypes:  # (names checked by main)
        sweep.dtypes = args.dtypes
    if args.passes:
        sweep.passes = args.passes
    if args.repeats:
        sweep.repeats = args.repeats
    return sweep


class Progress:
    """A plain-text progress line on stderr (rewritten in place on a terminal)."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        width = 24
        filled = width * self.done // max(self.total, 1)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.start:6.1f}s {what}")
        sys.stderr.write(("\r" + line[:150].ljust(150)) if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def _measure(case, pass_, provs, sweep, mem, device) -> list:
    steps, errors = {}, {}
    for p in provs:
        try:
            steps[p.name] = make_step(p, case, pass_)
        except Exception as exc:  # e.g. a kernel that rejects the shape or runs out of memory
            errors[p.name] = timing.Timing(error=f"{type(exc).__name__}: {exc}"[:300])
    timings = {**timing.interleaved(steps, device, sweep.repeats, sweep.time_scale), **errors}
    count = flops.count(case, pass_)
    rows = []
    for p in provs:
        t = timings[p.name]
        row = {"op": case.op, "provider": p.name, "pass": pass_, "case": case.as_dict(),
               "flops": count, "time": t.as_dict()}
        if t.error is None:
            row["flops_per_s"] = count / t.median
            if mem is not None:
                try:
                    row["memory"] = {"bytes": memory.gpu_peak(steps[p.name]) if device == "cuda"
                                     else mem.peak(p.name, case, pass_)}
                except Exception as exc:
                    row["memory"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        rows.append(row)
    steps.clear()  # frees the inputs and retained graphs before the next case
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def run(args, argv) -> dict:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    sweep = _sweep(args, device)
    names = set(args.providers or ())
    probe_flex = "sdpa" in args.ops and (not args.quick or "torch-flex" in names)
    probe_compile = "additive" in args.ops and (not args.quick or "compile-naive" in names)
    found = providers.discover(device, probe_flex=probe_flex, probe_compile=probe_compile)
    try:
        chosen = providers.select(found, args.ops, names)
    except ValueError as exc:
        raise SystemExit(str(exc))
    idle = [op for op in args.ops if not any(p.op == op and p.available for p in chosen)]
    if idle:  # a sweep that would time nothing and still write a results file
        usable = {op: sorted(p.name for p in found if p.op == op and p.available) for op in idle}
        raise SystemExit("--ops/--providers: nothing here runs " + "; ".join(
            f"{op} (providers for it here: {', '.join(here) or 'none'})"
            for op, here in usable.items()))
    untrained = [op for op in args.ops if op not in shapes.TRAINABLE]
    if untrained and "forward" not in sweep.passes:  # (it would drop them without a word)
        raise SystemExit(f"--passes: {', '.join(untrained)} has only a forward pass (an "
                         f"inference op), got {', '.join(sweep.passes)}")
    doc = machine.describe(device)
    doc.update(schema=report.SCHEMA, settings={
        "argv": list(argv), "ops": list(args.ops), "repeats": sweep.repeats,
        "passes": list(sweep.passes), "timing": timing.__doc__.strip().splitlines()[0],
        "block_seconds": timing.BLOCK_SECONDS[device] * sweep.time_scale})
    doc["providers"] = [{"name": p.name, "op": p.op, "available": p.available, "reason": p.reason}
                        for p in chosen]
    doc["memory_method"] = None if args.no_memory else (
        memory.GPU_METHOD if device == "cuda" else memory.CPU_METHOD)
    doc["gemm"] = machine.gemm_rate(device, sweep.repeats, small=args.quick)
    doc["load_average_before"] = machine.load_average()
    work = [(c, p) for op in args.ops for c in shapes.cases(op, sweep, device) for p in sweep.passes
            if op in shapes.TRAINABLE or p == "forward"]
    progress = Progress(len(work))
    results = []
    mem_reason = None if device == "cuda" else memory.rss_supported()
    if mem_reason and not args.no_memory:
        doc["memory_method"] = f"not measured: {mem_reason}"
    with contextlib.ExitStack() as stack:
        mem = None
        if not args.no_memory and mem_reason is None:
            mem = True if device == "cuda" else stack.enter_context(memory.CpuMemory())
        for case, pass_ in work:
            provs = [p for p in chosen if p.op == case.op and p.available]
            results += _measure(case, pass_, provs, sweep, mem, device)
            progress.step(f"{case.label()} {pass_}")
    progress.close()
    gemm_rate = doc["gemm"]["flops_per_s"]
    for r in results:
        if "flops_per_s" in r:
            r["fraction_of_gemm"] = r["flops_per_s"] / gemm_rate
    doc["results"] = results
    doc["load_average_after"] = machine.load_average()
    return doc


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    # what would fail only after a sweep, or deep inside one: refused before any timing
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible to torch")
    if args.dtypes:
        unknown = set(args.dtypes) - set(shapes.DTYPES)
        if unknown:
            p.error(f"--dtypes: unknown {sorted(unknown)}; choose from {sorted(shapes.DTYPES)}")
    unknown_ops = set(args.ops) - set(shapes.OPS) - {"hf"}
    if unknown_ops:  # (before the folder below: a refused run leaves none behind)
        p.error(f"--ops: unknown {sorted(unknown_ops)}; choose from {', '.join(shapes.OPS)}, hf")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out: expected a folder, got the file {args.out!r}")
    try:  # made now: a folder that cannot be made (under a file, read-only) fails before timing
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        p.error(f"--out: cannot make the folder {args.out!r} ({exc.strerror})")
    if not os.access(args.out, os.W_OK):
        p.error(f"--out: the folder {args.out!r} is not writable")
    if args.world is not None:
        return _main_ring(args, argv)
    if "hf" in args.ops:
        return _main_hf(args, argv)
    doc = run(args, argv)
    path = os.path.join(args.out, "results.json")
    report.write_json(path, doc)
    pngs = plots.write_all(doc, args.out)
    print(report.header(doc))
    print(report.table(doc))
    pivot = report.summary(doc)
    if pivot:
        print()
        print(pivot)
    print(f"wrote {path}" + "".join(f"\nwrote {p}" for p in pngs))
    return 0


def _main_hf(args, argv) -> int:
    """`--ops hf`: whole-model timings (attnx.bench.hf_model), a table of their own."""
    if set(args.ops) != {"hf"}:
        raise SystemExit("--ops: hf runs alone (its results are a model's tokens/s, "
                         "not a kernel sweep)")
    given = _given(args, _NOT_HF)
    if given:
        raise SystemExit(f"--ops hf: times one model on the CPU as configured (--quick, "
                         f"--repeats, --threads), without {', '.join(given)}")
    from . import hf_model  # imports transformers
    doc = hf_model.run(args, argv)
    path = os.path.join(args.out, "results.json")
    report.write_json(path, doc)
    print(hf_model.header(doc))
    print(hf_model.table(doc))
    print(f"wrote {path}")
    return 0


def _given(args, names) -> list:
    """The options among `names` the command line set (as `--name`), for a mode without them."""
    defaults = parser()
    return [f"--{name.replace('_', '-')}" for name in names
            if getattr(args, name) != defaults.get_default(name)]


# The kernel sweep's options that mean nothing to the whole-model timings.
_NOT_HF = ("seqlens", "head_dims", "attn_dims", "dtypes", "providers", "passes", "no_memory",
           "device")
# The kernel sweep's options that mean nothing to the ring's strong scaling.
_NOT_RING = ("ops", "attn_dims", "dtypes", "providers", "passes", "threads", "no_memory")


def _main_ring(args, argv) -> int:
    """`--world N`: ring attention's strong scaling (attnx.bench.ring_scaling) on N processes."""
    from . import ring_scaling
    given = _given(args, _NOT_RING)
    if given or args.device == "cuda":
        raise SystemExit(f"--world: runs ring_attention on CPU processes of 1 thread each, "
                         f"without {', '.join(given or ['--device cuda'])}")
    if args.head_dims and len(args.head_dims) != 1:
        raise SystemExit(f"--head-dims: --world takes one head dim, got {list(args.head_dims)}")
    lengths = args.seqlens or ((1024,) if args.quick else (8192, 16384, 32768))
    try:
        ring_scaling.check(lengths, [args.world])
    except ValueError as exc:
        raise SystemExit(f"--world/--seqlens: {exc}")
    result = ring_scaling.measure(lengths, [args.world], dim=(args.head_dims or (64,))[0],
                                  repeats=args.repeats or 2)
    result["settings"] = {"argv": list(argv)}
    path = os.path.join(args.out, "results.json")
    report.write_json(path, result)
    png = os.path.join(args.out, "ring_scaling.png")
    ring_scaling.plot(result, png)
    print(ring_scaling.table(result))
    print(f"wrote {path}\nwrote {png}")
    return 0
