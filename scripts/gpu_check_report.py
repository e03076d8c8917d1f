"""The records and the JSON document of scripts/gpu_check.sh (stdlib only; torch optional).

    gpu_check_report.py record STEPS.jsonl NAME STATUS RC SECONDS TIMEOUT OUTPUT_FILE -- COMMAND...
    gpu_check_report.py finish OUTDIR SCRATCH BUDGET_S STEPS [--no-gpu REASON] [--dry-run]
    gpu_check_report.py merge -o OUT.json RUN1.json RUN2.json ...
    gpu_check_report.py compare NEW OLD

`record` appends one step (what ran, how it ended, a summary of its output: pytest's counts and
failures, compute-sanitizer's summaries, the last lines of a step that did not pass). `finish`
writes OUTDIR/gpu_check.json (schema "attnx-gpu-check/1"): {"schema", "date", "status"
("passed", "failed" or "skipped": no GPU), "reason", "budget_s", "steps_requested", "machine",
"steps": [{"name", "status" (passed, failed, timed_out, skipped), "rc", "seconds", "timeout_s",
"command", "summary"}], "check": attnx check's JSON or null, "bench": {"meta", "results",
"end"} or null, "profile": scripts/gpu_profile_report.py's summary or null} and prints a summary. `merge` joins runs made in separate device calls (say
one for the tests and one for the benchmark) into one document: steps in run order, the last
run's check and profile, every run's benchmark results. `compare` sets the benchmark results of
NEW against OLD (each a gpu_check JSON or a benchmarks/gpu.py JSONL, such as a committed
benchmarks/results/gpu-*.jsonl), case by case: TFLOP/s then and now and their ratio, "slower"
or "faster" where the two runs' sample ranges do not overlap and the medians differ by more than
MACHINE_NOISE; it exits 1 when a case got slower,
2 when the files hold no benchmark or came from different devices (timings compare only on one).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys

SCHEMA = "attnx-gpu-check/1"
STATUSES = ("passed", "failed", "timed_out", "skipped")
# "nodeid STATUS" (pytest -v), "[gw0] [ 5%] STATUS nodeid" (-v with xdist), "STATUS nodeid - why"
# (the short summary): the last one seen for a test counts.
PYTEST_RESULT = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
PYTEST_RESULT_FIRST = re.compile(
    r"^(?:\[gw\d+\]\s+\[\s*\d+%\]\s+)?(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+::\S+)")
PYTEST_SUMMARY = re.compile(r"^=+ (.*\d+ (?:passed|failed|skipped|error|errors|deselected).*) =+$")
SANITIZER = re.compile(r"^=+ ((?:ERROR|RACECHECK|LEAK) SUMMARY: .*)$")
TAIL_LINES = 30
# Two sessions' machines of one kind differ by a few percent: torch's own kernels moved 1-4%
# between the H200 runs of 2026-11-26 and 2026-12-04, each run's sample ranges tight and apart.
MACHINE_NOISE = 0.05


def summarize(text: str, rc: int) -> dict:
    """What the output says: pytest's per-test results, compute-sanitizer's summary lines."""
    out = {}
    results = {}
    for line in text.splitlines():
        m = PYTEST_RESULT.match(line.strip())
        if m:
            results[m.group(1)] = m.group(2)
        m = PYTEST_RESULT_FIRST.match(line.strip())
        if m:
            results[m.group(2)] = m.group(1)
    counts, failed = {}, [t for t, r in results.items() if r in ("FAILED", "ERROR")]
    for r in results.values():
        counts[r.lower()] = counts.get(r.lower(), 0) + 1
    if counts:
        out["tests"] = counts
        out["failed_tests"] = failed
    summaries = [m.group(1) for m in map(PYTEST_SUMMARY.match, text.splitlines()) if m]
    if summaries:
        out["pytest"] = summaries[-1]
    sanitizer = [m.group(1) for m in map(SANITIZER.match, text.splitlines()) if m]
    if sanitizer:
        out["sanitizer"] = sanitizer
        out["sanitizer_errors"] = sum(int(n) for s in sanitizer
                                      for n in re.findall(r"(\d+) errors?", s))
    if rc != 0:
        out["tail"] = text.splitlines()[-TAIL_LINES:]
    return out


def step_status(rc: int, summary: dict, timed_out: bool) -> str:
    if timed_out:
        return "timed_out"
    if rc != 0:
        return "failed"
    if "tests" in summary and not summary["tests"].get("passed"):
        return "failed"  # every test skipped: on a GPU machine that hides a broken setup
    return "passed"


def record(path, name, rc, seconds, timeout_s, output_file, command) -> dict:
    try:
        with open(output_file, errors="replace") as f:
            text = f.read()
    except OSError:
        text = ""
    timed_out = rc in (124, 137)
    summary = summarize(text, rc)
    if timed_out:
        summary["note"] = f"stopped by its {timeout_s} s timeout"
    status = step_status(rc, summary, timed_out)
    entry = {"name": name, "status": status, "rc": rc, "seconds": seconds, "timeout_s": timeout_s,
             "command": command, "summary": summary}
    append(path, entry)
    return entry


def skip(path, name, reason, command) -> dict:
    entry = {"name": name, "status": "skipped", "rc": None, "seconds": 0, "timeout_s": None,
             "command": command, "summary": {"note": reason}}
    append(path, entry)
    return entry


def append(path, entry: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def read_jsonl(path) -> list:
    rows = []
    try:
        with open(path) as f:
            for text in f:
                try:
                    rows.append(json.loads(text))
                except json.JSONDecodeError:
                    break  # a line cut off by a kill
    except OSError:
        pass
    return rows


def _run(cmd) -> str | None:
    # 120 s: importing torch, Triton and attnx took over 30 s on a loaded 2-core machine
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def machine() -> dict:
    """GPU, driver, toolkit and library versions, each where it can be read."""
    doc = {"nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                               "--format=csv,noheader"]),
           "nvcc": (_run(["nvcc", "--version"]) or "").splitlines()[-1:] or None,
           "python": sys.version.split()[0]}
    code = ("import json, torch\n"
            "d = {'torch': torch.__version__, 'cuda': torch.version.cuda,"
            " 'gpu': torch.cuda.get_device_name() if torch.cuda.is_available() else None,"
            " 'capability': list(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None}\n"
            "try:\n import triton; d['triton'] = triton.__version__\nexcept ImportError: d['triton'] = None\n"
            "try:\n import attnx; d['attnx'] = attnx.__version__; d['attnx_build'] = attnx._ops.build_info();"
            " d['attnx_backends'] = {k: s.reason or 'usable' for k, s in attnx.backends().items()}\n"
            "except Exception as e: d['attnx'] = repr(e)\n"
            "print(json.dumps(d))")
    text = _run([sys.executable, "-c", code])
    doc.update(json.loads(text.splitlines()[-1]) if text else {"torch": None})
    return doc


def _load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def bench_doc(rows: list):
    if not rows:
        return None
    return {"meta": next((r for r in rows if r.get("kind") == "meta"), None),
            "results": [r for r in rows if r.get("kind") == "result"],
            "autotune": [r for r in rows if r.get("kind") == "autotune"],
            "end": next((r for r in rows if r.get("kind") == "end"), None)}


def finish(outdir, scratch, budget_s, steps_requested, no_gpu=None) -> dict:
    steps = read_jsonl(os.path.join(scratch, "steps.jsonl"))
    if no_gpu:
        status = "skipped"
    else:
        status = "passed" if steps and all(s["status"] == "passed" for s in steps) else "failed"
    doc = {"schema": SCHEMA,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "status": status, "reason": no_gpu, "budget_s": budget_s,
           "steps_requested": steps_requested, "machine": machine(), "steps": steps,
           "check": _load_json(os.path.join(scratch, "check.json")),
           "bench": bench_doc(read_jsonl(os.path.join(scratch, "bench.jsonl"))),
           "profile": _load_json(os.path.join(scratch, "profile.json"))}
    write(os.path.join(outdir, "gpu_check.json"), doc)
    return doc


def merge(docs: list) -> dict:
    """One document of several runs (in the order given)."""
    steps = [dict(s, run=i) for i, d in enumerate(docs) for s in d["steps"]]
    statuses = [d["status"] for d in docs]
    benches = [d["bench"] for d in docs if d.get("bench")]
    checks = [d["check"] for d in docs if d.get("check")]
    profiles = [d["profile"] for d in docs if d.get("profile")]
    return {"schema": SCHEMA, "date": max(d["date"] for d in docs),
            "status": ("failed" if "failed" in statuses else
                       "passed" if "passed" in statuses else "skipped"),
            "reason": "; ".join(d["reason"] for d in docs if d.get("reason")) or None,
            "budget_s": sum(d["budget_s"] for d in docs),
            "steps_requested": [s for d in docs for s in d["steps_requested"]],
            "machine": docs[-1]["machine"], "runs": [d["date"] for d in docs], "steps": steps,
            "check": checks[-1] if checks else None,
            "profile": profiles[-1] if profiles else None,
            "bench": {"meta": benches[-1]["meta"],
                      "results": [r for b in benches for r in b["results"]],
                      "autotune": [r for b in benches for r in b.get("autotune", [])],
                      "end": [b["end"] for b in benches]} if benches else None}


def bench_rows(path) -> tuple:
    """(device name, result rows) of a gpu_check JSON or a benchmark JSONL; (None, []) for
    neither."""
    doc = _load_json(path)
    if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
        bench = doc.get("bench") or {}
        meta, results = bench.get("meta"), bench.get("results", [])
    else:
        try:
            rows = read_jsonl(path)
        except (OSError, json.JSONDecodeError):
            return None, []
        meta = next((r for r in rows if r.get("kind") == "meta"), None)
        results = [r for r in rows if r.get("kind") == "result"]
    return ((meta or {}).get("device") or {}).get("name"), results


def _case_key(row) -> tuple:
    return row["provider"], row["pass"], json.dumps(row["case"], sort_keys=True)


def _case_name(row) -> str:
    c = row["case"]
    name = (f"{c.get('op')} B{c.get('batch')} H{c.get('heads')} "
            f"L{c.get('seqlen_q')}x{c.get('seqlen_k')} D{c.get('head_dim')} {c.get('dtype')}")
    return name + (" causal" if c.get("causal") else "")


def compare(new_rows: list, old_rows: list) -> list:
    """[(provider, pass, case name, old TFLOP/s, new, new / old, verdict)] of the cases both
    measured; verdict "slower" / "faster" where the sample ranges (tflops_min_max) are apart
    and the ratio is past MACHINE_NOISE, else "" (within the runs' spread or the machines')."""
    measured = lambda r: r.get("tflops") and r.get("tflops_min_max")  # noqa: E731
    old = {_case_key(r): r for r in old_rows if measured(r)}  # a case measured twice: the last
    out = []
    for r in new_rows:
        o = old.get(_case_key(r)) if measured(r) else None
        if o is None:
            continue
        (new_lo, new_hi), (old_lo, old_hi) = r["tflops_min_max"], o["tflops_min_max"]
        ratio = r["tflops"] / o["tflops"]
        verdict = ("slower" if new_hi < old_lo and ratio < 1 - MACHINE_NOISE else
                   "faster" if new_lo > old_hi and ratio > 1 + MACHINE_NOISE else "")
        out.append((r["provider"], r["pass"], _case_name(r), o["tflops"], r["tflops"], ratio,
                    verdict))
    return out


def write(path, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def report(doc: dict) -> str:
    lines = [f"gpu_check: {doc['status']}" + (f" ({doc['reason']})" if doc.get("reason") else "")]
    for s in doc["steps"]:
        detail = s["summary"].get("pytest") or s["summary"].get("note") or ""
        if s["summary"].get("sanitizer"):
            detail = "; ".join(s["summary"]["sanitizer"])
        elif not detail and s["summary"].get("tail"):
            detail = next((t for t in reversed(s["summary"]["tail"]) if t.strip()), "")
        lines.append(f"  {s['name']:<10} {s['status']:<9} {s['seconds']:>6} s  {detail}"[:200])
    if doc.get("check"):
        res = doc["check"]["results"]
        lines.append(f"  attnx check: {len(res)} checks, {sum(not r['passed'] for r in res)} failed")
    if doc.get("bench"):
        lines.append(f"  benchmark: {len(doc['bench']['results'])} measurements")
    if doc.get("profile"):
        lines.append(f"  profile: {len(doc['profile']['kernels'])} kernels")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("steps_file")
    r.add_argument("name")
    r.add_argument("rc", type=int)
    r.add_argument("seconds", type=int)
    r.add_argument("timeout_s", type=int)
    r.add_argument("output_file")
    r.add_argument("command", nargs=argparse.REMAINDER)
    s = sub.add_parser("skip")
    s.add_argument("steps_file")
    s.add_argument("name")
    s.add_argument("reason")
    s.add_argument("command", nargs=argparse.REMAINDER)
    f = sub.add_parser("finish")
    f.add_argument("outdir")
    f.add_argument("scratch")
    f.add_argument("budget_s", type=int)
    f.add_argument("steps", help="comma-separated")
    f.add_argument("--no-gpu", metavar="REASON")
    m = sub.add_parser("merge")
    m.add_argument("-o", "--out", required=True)
    m.add_argument("runs", nargs="+")
    c = sub.add_parser("compare")
    c.add_argument("new")
    c.add_argument("old")
    args = p.parse_args(argv)
    if args.cmd == "compare":
        (new_device, new_rows), (old_device, old_rows) = bench_rows(args.new), bench_rows(args.old)
        if not new_rows or not old_rows:
            print(f"compare: no benchmark results in {args.new if not new_rows else args.old}",
                  file=sys.stderr)
            return 2
        if new_device != old_device:
            print(f"compare: timings from different devices ({new_device} now, {old_device} "
                  "then) do not compare", file=sys.stderr)
            return 2
        rows = compare(new_rows, old_rows)
        print(f"{len(rows)} cases measured in both ({new_device}); TFLOP/s then -> now")
        for provider, pas, name, then, now, ratio, verdict in rows:
            print(f"  {provider:<14} {pas:<17} {name:<47} {then:8.1f} -> {now:8.1f}  "
                  f"{ratio:5.2f}x {verdict}")
        return 1 if any(r[-1] == "slower" for r in rows) else 0
    if args.cmd == "record":
        command = " ".join(a for a in args.command if a != "--")
        entry = record(args.steps_file, args.name, args.rc, args.seconds, args.timeout_s,
                       args.output_file, command)
        print(f"=== {entry['name']}: {entry['status']} (rc {entry['rc']}, {entry['seconds']} s)")
        return 0
    if args.cmd == "skip":
        skip(args.steps_file, args.name, args.reason, " ".join(a for a in args.command if a != "--"))
        print(f"=== {args.name}: skipped ({args.reason})")
        return 0
    if args.cmd == "finish":
        doc = finish(args.outdir, args.scratch, args.budget_s, args.steps.split(","), args.no_gpu)
    else:
        docs = [_load_json(path) for path in args.runs]
        bad = [path for path, d in zip(args.runs, docs) if not d or d.get("schema") != SCHEMA]
        if bad:
            print(f"merge: not gpu_check results: {bad}", file=sys.stderr)
            return 2
        doc = merge(docs)
        write(args.out, doc)
    print(report(doc))
    return 0 if doc["status"] in ("passed", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
