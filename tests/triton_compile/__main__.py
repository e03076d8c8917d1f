"""`python -m triton_compile [--full] [--json PATH] [--resume PATH]` from tests/, without
TRITON_INTERPRET: compiles the CI variant set (or the full cross-product) for sm_80 and sm_90,
writes the rows and a summary as JSON, prints the summary and the broken bounds; exit 1 on any.

The full cross-product takes ~100 minutes of two idle cores. A run cut short leaves its rows in
the JSON (written every 50 units); `--resume` that JSON compiles only the units it lacks. A row
is reused only for a unit of the same key (Triton's hash of the kernel's source, its jit
dependencies, signature and constexprs, with the compile options and arch) compiled by the same
Triton and analysed by the same aot.py: a changed kernel compiles again, the others do not."""

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
    ap.add_argument("--resume", help="the JSON of an earlier run (cut short): its rows of units "
                    "whose key is unchanged are kept, only the others are compiled")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"):
        sys.exit("triton_compile: unset TRITON_INTERPRET (the interpreter replaces the kernels)")
    # A fresh cache: a cached kernel runs no ptxas, whose log gives registers and spills. It is
    # removed at the end (a full run leaves gigabytes; every CI run compiles twice).
    with tempfile.TemporaryDirectory(prefix="attnx-triton-compile-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
        return run(args)


_WORK: list = []  # (unit, names of the variants sharing it, key digest)


def analysis_digest() -> str:
    """What a row's fields besides the compile depend on: aot.py's analyses of the output."""
    return hashlib.sha256(Path(__file__).with_name("aot.py").read_bytes()).hexdigest()


def key_digest(key: tuple) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:24]


def resumable_rows(path: str, mode: str) -> dict:
    """key digest -> row of an earlier run's JSON; SystemExit unless it ran in the same mode with
    the same Triton and aot.py."""
    import triton

    with open(path) as f:
        doc = json.load(f)
    for field, want in (("triton", triton.__version__), ("mode", mode),
                        ("analysis", analysis_digest())):
        if doc.get(field) != want:
            raise SystemExit(f"--resume {path}: its {field} is {doc.get(field)!r}, this run's is "
                             f"{want!r}: compile from scratch")
    return {r["key"]: r for r in doc["units"]}


def plan(args) -> int:
    """Fills _WORK with the units of the chosen variants, one per key; the number of variants."""
    from . import aot, capture, variants

    chosen = variants.full() if args.full else list(variants.CI)
    if args.only:
        chosen = [v for v in chosen if any(part in v.name for part in args.only)]
    seen: dict = {}
    for arch in args.arch:
        units = [u for v in chosen for u in capture.units(v, arch)]
        if not args.full:
            units = variants.cover(units)
        for u in units:
            key = key_digest(aot.prepare(u)[3])
            if key in seen:
                _WORK[seen[key]][1].append(u.variant.name)
            else:
                seen[key] = len(_WORK)
                _WORK.append((u, [u.variant.name], key))
    if args.full:  # in a seeded random order: the partial results of a run cut short sample it all
        random.Random(0).shuffle(_WORK)
    return len(chosen)


def _compile(i: int) -> dict:
    from .aot import compile_unit
    unit, variants, key = _WORK[i]
    return dict(compile_unit(unit), variants=variants, key=key)


def _line(n: int, row: dict) -> str:
    cfg = ",".join(f"{v}" for v in row["config"].values())
    if row["error"]:
        return f"{n} {row['kernel']} {row['variant']} [{cfg}] sm_{row['arch']}: {row['error']}"
    return (f"{n} {row['kernel']} {row['variant']} [{cfg}] sm_{row['arch']}: "
            f"shared {row['shared']} (est {row['shared_estimate']}) regs {row['registers']} "
            f"spills {row['spill_bytes']} {row['seconds']}s")


def run(args) -> int:
    t0 = time.perf_counter()
    done = resumable_rows(args.resume, _mode(args)) if args.resume else {}
    n_variants = plan(args)
    rows, todo = [], []
    for i, (u, names, key) in enumerate(_WORK):
        if key in done:  # what the plan says of the unit is this plan's
            rows.append(dict(done[key], variant=u.variant.name, config=u.config, grid=list(u.grid),
                             shared_estimate=u.shared_estimate, variants=names))
        else:
            todo.append(i)
    print(f"{len(_WORK)} units ({n_variants} variants) on {args.jobs} processes"
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
                           mode=_mode(args), analysis=analysis_digest(), complete=complete,
                           units_planned=len(_WORK), arch=args.arch, summary=summary,
                           failures=broken, units=rows), f, indent=1)
    return broken


def _mode(args) -> str:
    return "full" if args.full else "ci"


if __name__ == "__main__":
    sys.exit(main())
