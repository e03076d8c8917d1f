"""`python -m triton_compile [--full] [--json PATH]` from tests/, without TRITON_INTERPRET:
compiles the CI variant set (or the full cross-product) for sm_80 and sm_90, writes the rows and
a summary as JSON, prints the summary and the broken bounds; exit 1 on any."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import sys
import tempfile
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="triton_compile")
    ap.add_argument("--full", action="store_true", help="the full cross-product of variants")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", nargs="+", default=[],
                    help="only the variants whose name contains one of these (e.g. float-mask)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"):
        sys.exit("triton_compile: unset TRITON_INTERPRET (the interpreter replaces the kernels)")
    # A fresh cache: a cached kernel runs no ptxas, whose log gives registers and spills.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnx-triton-compile-")
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    return run(args)


_WORK: list = []


def _compile(i: int) -> dict:
    from .aot import compile_unit
    unit, variants = _WORK[i]
    row = compile_unit(unit)
    row["variants"] = variants
    return row


def _line(n: int, row: dict) -> str:
    cfg = ",".join(f"{v}" for v in row["config"].values())
    if row["error"]:
        return f"{n} {row['kernel']} {row['variant']} [{cfg}] sm_{row['arch']}: {row['error']}"
    return (f"{n} {row['kernel']} {row['variant']} [{cfg}] sm_{row['arch']}: "
            f"shared {row['shared']} (est {row['shared_estimate']}) regs {row['registers']} "
            f"spills {row['spill_bytes']} {row['seconds']}s")


def run(args) -> int:
    from . import aot, capture, variants

    t0 = time.perf_counter()
    chosen = variants.full() if args.full else list(variants.CI)
    if args.only:
        chosen = [v for v in chosen if any(part in v.name for part in args.only)]
    seen: dict = {}
    for arch in args.arch:
        units = [u for v in chosen for u in capture.units(v, arch)]
        if not args.full:
            units = variants.cover(units)
        for u in units:
            key = aot.prepare(u)[3]
            if key in seen:
                _WORK[seen[key]][1].append(u.variant.name)
            else:
                seen[key] = len(_WORK)
                _WORK.append((u, [u.variant.name]))
    if args.full:  # in a seeded random order: the partial results of a run cut short sample it all
        random.Random(0).shuffle(_WORK)
    print(f"{len(_WORK)} units ({len(chosen)} variants) on {args.jobs} processes", flush=True)
    rows = []
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        for row in pool.imap(_compile, range(len(_WORK))):
            rows.append(row)
            print(_line(len(rows), row), flush=True)
            if args.json and len(rows) % 50 == 0:  # a long --full run leaves partial results
                _write(args, rows, t0, complete=False)
    broken = _write(args, rows, t0, complete=True)
    for line in broken:
        print("FAIL", line)
    return 1 if broken else 0


def _write(args, rows: list, t0: float, complete: bool) -> list:
    """Prints the summary and writes the JSON (if asked); returns the broken bounds."""
    import triton

    from . import checks
    summary = dict(checks.summary(rows), wall_seconds=round(time.perf_counter() - t0, 1))
    broken = checks.failures(rows)
    print(json.dumps(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(triton=triton.__version__, python=platform.python_version(),
                           mode="full" if args.full else "ci", complete=complete,
                           units_planned=len(_WORK), arch=args.arch, summary=summary,
                           failures=broken, units=rows), f, indent=1)
    return broken


if __name__ == "__main__":
    sys.exit(main())
