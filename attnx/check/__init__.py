"""`attnx check`: every usable backend on every device here against the float64 reference.

For each backend that `attnx.backends()` calls usable, each device this machine has (cpu, and
cuda when torch sees a GPU) and each dtype the backend serves there (asked of the dispatcher),
it runs the problems of `cases.CASES` (forward, backward, bool and float masks with a
fully-masked row, causal, a window, GQA, the dropout pattern) and bounds the error as the test
suite does (compare.py). Prints a table; `--json PATH` writes it; exit status 1 on any failure.
The switches of API.md apply: TRITON_INTERPRET=1 adds the triton backend on CPU tensors and
ATTNX_CUDA_ON_CPU=1 the cuda backend's host harness, when they make those backends usable.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import multiprocessing
import os
import sys

import torch

from .._dispatch import backends
from ..cli import positive_int
from .._version import __version__
from . import cases, report

DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
GOLDEN_ITSELF = "the float64 reference is the golden value itself"


def _csv(text: str) -> tuple:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnx check", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--backends", type=_csv, help="only these, e.g. cpu,triton (default: all usable)")
    p.add_argument("--devices", type=_csv, help="only these, e.g. cuda (default: every device here)")
    p.add_argument("--dtypes", type=_csv, help=f"only these, of {','.join(DTYPES)}")
    p.add_argument("--jobs", type=positive_int, default=1,
                   help="worker processes (on a GPU, Triton compiles each new kernel variant "
                        "on one CPU core: more jobs compile in parallel)")
    return p


def devices() -> list:
    found = [{"type": "cpu", "name": "cpu"}]
    if torch.cuda.is_available():
        found.append({"type": "cuda", "name": torch.cuda.get_device_name()})
    return found


def _triton_version():
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def plan(status: dict, device_types: list, dtypes: list):
    """(targets, skipped): targets are (backend, device, dtype, op) to check; skipped says
    why each other combination is not checked."""
    targets, skipped = [], []
    for name, st in status.items():
        if not st.usable:
            skipped.append({"backend": name, "device": None, "dtype": None, "op": None,
                            "reason": st.reason})
            continue
        for device in device_types:
            for op in ("sdpa", "additive"):
                why = {d: (GOLDEN_ITSELF if (name, d) == ("reference", "float64")
                           else cases.probe(op, name, device, DTYPES[d])) for d in dtypes}
                served = [d for d in dtypes if why[d] is None]
                if not served:  # one line for the whole device: the reason is the same
                    skipped.append({"backend": name, "device": device, "dtype": None, "op": op,
                                    "reason": why[dtypes[0]]})
                    continue
                targets += [(name, device, d, op) for d in served]
                skipped += [{"backend": name, "device": device, "dtype": d, "op": op,
                             "reason": why[d]} for d in dtypes if why[d] is not None]
    return targets, skipped


def _choose(given, known, what: str, p: argparse.ArgumentParser, absent=()) -> list:
    """The entries of `known` that `given` names (all when None). `absent`: names that are
    valid but not on this machine (a device it lacks), refused as such, not as unknown."""
    if given is None:
        return list(known)
    if not given:  # "--dtypes ''": nothing to check (plan indexed the first one)
        p.error(f"--{what}: expected a comma-separated list of {sorted(known)}, got none")
    missing = sorted(set(given) & set(absent) - set(known))
    if missing:
        p.error(f"--{what}: {missing} not on this machine; here: {sorted(known)}")
    unknown = sorted(set(given) - set(known))
    if unknown:
        p.error(f"--{what}: unknown {unknown}; choose from {sorted(known)}")
    return [k for k in known if k in given]


def _check_one(item) -> dict:
    name, device, dtype, index = item
    row = cases.run(cases.CASES[index], name, device, DTYPES[dtype])
    return {"backend": name, "device": device, "dtype": dtype, **row}


def run(args, p: argparse.ArgumentParser) -> dict:
    status = backends()
    here = devices()
    status = {n: s for n, s in status.items() if n in _choose(args.backends, status, "backends", p)}
    device_types = _choose(args.devices, [d["type"] for d in here], "devices", p,
                           absent=("cpu", "cuda"))
    dtypes = _choose(args.dtypes, DTYPES, "dtypes", p)
    if args.jobs < 1:
        p.error(f"--jobs: expected a positive number, got {args.jobs}")
    targets, skipped = plan(status, device_types, dtypes)
    work = [(name, device, dtype, i) for name, device, dtype, op in targets
            for i, c in enumerate(cases.CASES) if c.op == op]
    if args.jobs == 1:
        results = [_check_one(item) for item in work]
    else:  # spawned, not forked: a forked child cannot use the parent's CUDA context
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            results = list(pool.map(_check_one, work))
    return {"schema": report.SCHEMA,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "passed": bool(results) and all(r["passed"] for r in results),
            "software": {"attnx": __version__, "torch": torch.__version__,
                         "triton": _triton_version(), "cuda": torch.version.cuda},
            "devices": [d for d in here if d["type"] in device_types],
            "backends": {n: {"usable": s.usable, "reason": s.reason} for n, s in status.items()},
            "skipped": skipped, "results": results}


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    # refused now, not after every check ran
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        p.error(f"--json: no folder to write {args.json!r} into")
    if args.json and os.path.isdir(args.json):
        p.error(f"--json: expected a file path, got the folder {args.json!r}")
    doc = run(args, p)
    print(report.header(doc))
    print(report.table(doc))
    print(report.footer(doc))
    if args.json:
        report.write_json(args.json, doc)
        print(f"wrote {args.json}")
    return 0 if doc["passed"] else 1
