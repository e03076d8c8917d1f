"""`python -m triton_compile [--full] [--json PATH] [--resume PATH]` from tests/, without
TRITON_INTERPRET: compiles the CI variant set (or the full cross-product) for sm_80 and sm_90,
writes the rows and a summary as JSON, prints the summary and the broken bounds; exit 1 on any.

The full cross-product takes ~100 minutes of two idle cores. A run cut short leaves its rows in
the JSON (written every 50 units); `--resume` that JSON compiles only the units it lacks, and
only when the kernels' sources (and Triton) are those the rows were compiled from."""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="triton_compile")
    ap.add_argument("--full", action="store_true", help="the full cross-product of variants")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", nargs="+", default=[],
                    help="only the variants whose name contains one of these (e.g. float-mask)")
    ap.add_argument("--resume", help="a JSON of an earlier run (cut short) of the same sources: "
                    "its rows are kept and only the units it lacks are compiled")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"):
        sys.exit("triton_compile: unset TRITON_INTERPRET (the interpreter replaces the kernels)")
    # A fresh cache: a cached kernel runs no ptxas, whose log gives registers and spills.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnx-triton-compile-")
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    return run(args)


_WORK: list = []
# What a row depends on: the kernels and the code that captures, plans and compiles the units.
_SOURCES = sorted((Path(__file__).resolve().parents[2] / "attnx" / "triton").glob("*.py")) + [
    Path(__file__).with_name(n) for n in ("aot.py", "capture.py", "variants.py")]


def sources_digest() -> str:
    h = hashlib.sha256()
    for path in _SOURCES:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def unit_name(kernel: str, variant: str, config: dict, arch: int) -> tuple:
    """Names a unit within one set of sources (a row has the same fields)."""
    return kernel, variant, json.dumps(config, sort_keys=True), arch


def resumable_rows(path: str, mode: str, digest: str) -> dict:
    """unit_name -> row of an earlier run's JSON; SystemExit unless it compiled the same
    sources with the same Triton in the same mode."""
    import triton

    with open(path) as f:
        doc = json.load(f)
    for field, want in (("triton", triton.__version__), ("mode", mode), ("sources", digest)):
        if doc.get(field) != want:
            raise SystemExit(f"--resume {path}: its {field} is {doc.get(field)!r}, this run's is "
                             f"{want!r}: compile from scratch")
    return {unit_name(r["kernel"], r["variant"], r["config"], r["arch"]): r for r in doc["units"]}


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
    args.sources = sources_digest()
    done = resumable_rows(args.resume, _mode(args), args.sources) if args.resume else {}
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
    rows, todo = [], []
    for i, (u, names) in enumerate(_WORK):
        row = done.get(unit_name(u.kernel, u.variant.name, u.config, u.arch))
        if row is None:
            todo.append(i)
        else:  # the variants sharing the unit are this plan's
            rows.append(dict(row, variants=names))
    print(f"{len(_WORK)} units ({len(chosen)} variants) on {args.jobs} processes"
          + (f", {len(rows)} of them from {args.resume}" if args.resume else ""), flush=True)
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        for row in pool.imap(_compile, todo):
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
                           mode=_mode(args), sources=args.sources, complete=complete,
                           units_planned=len(_WORK), arch=args.arch, summary=summary,
                           failures=broken, units=rows), f, indent=1)
    return broken


def _mode(args) -> str:
    return "full" if args.full else "ci"


if __name__ == "__main__":
    sys.exit(main())
