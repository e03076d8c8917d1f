"""A summary of Nsight Compute's counters per profiled kernel (stdlib only).

    gpu_profile_report.py RAW.csv OUT.json

RAW.csv is `ncu --import REPORT --page raw --csv` of a run of scripts/gpu_profile_cases.py
(scripts/gpu_check.sh's `profile` step): a header of metric names, a row of their units, a row
per kernel. OUT.json: {"schema": "attnx-gpu-profile/1", "kernels": [{"kernel", "grid", "block",
"duration_us", "metrics": {name: value} for the few read below where ncu gave them, "pipes":
the five busiest pipes (% of peak), "stalls": the six largest warp stall reasons (warps
stalled for it per issued instruction)}]}, and a table on stdout. Metrics ncu did not collect are left out, not
guessed; the raw file keeps everything else.
"""

from __future__ import annotations

import csv
import json
import re
import sys

SCHEMA = "attnx-gpu-profile/1"
# what a kernel's speed is read from first: label -> ncu's raw metric name
METRICS = {
    "sm_throughput_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "memory_throughput_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_throughput_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "issue_slots_busy_pct": "sm__inst_issued.avg.pct_of_peak_sustained_active",
    "warp_cycles_per_issue": "smsp__average_warp_latency_per_inst_issued.ratio",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "theoretical_occupancy_pct": "sm__maximum_warps_per_active_cycle_pct",
    "registers_per_thread": "launch__registers_per_thread",
    "shared_bytes_per_block": "launch__shared_mem_per_block_dynamic",
    "waves_per_sm": "launch__waves_per_multiprocessor",
    "instructions": "smsp__inst_executed.sum",
}
PIPE = re.compile(r"^sm__(?:inst_executed_pipe|pipe)_(\w+?)(?:_cycles_active)?"
                  r"\.avg\.pct_of_peak_sustained_active$")
# (warps stalled for the reason per issued instruction: they sum to warp_cycles_per_issue)
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")
TIME_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
              "second": 1e6, "s": 1e6}


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _kernel_name(name: str) -> str:
    """The function's name and template arguments, without namespaces and parameters."""
    name = re.sub(r"^void |\(anonymous namespace\)::", "", name)
    head, sep, tail = name.split("(")[0].partition("<")
    return head.rsplit("::", 1)[-1] + sep + tail


def summarize(rows: list) -> list:
    """One summary per kernel row of ncu's raw page (header, units, kernels)."""
    header = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if header is None:
        return []
    names, units = rows[header], rows[header + 1] if header + 1 < len(rows) else []
    col = {n: i for i, n in enumerate(names)}
    out = []
    for row in rows[header + 1:]:
        if len(row) != len(names) or not row[col["Kernel Name"]]:  # the units row, ncu's notes
            continue
        get = lambda name: _number(row[col[name]]) if name in col else None  # noqa: E731
        doc = {"kernel": _kernel_name(row[col["Kernel Name"]]),
               "grid": row[col["Grid Size"]] if "Grid Size" in col else None,
               "block": row[col["Block Size"]] if "Block Size" in col else None}
        t = get("gpu__time_duration.sum")
        unit = units[col["gpu__time_duration.sum"]] if t is not None and units else "nsecond"
        doc["duration_us"] = t * TIME_UNITS.get(unit, 1e-3) if t is not None else None
        doc["metrics"] = {k: get(m) for k, m in METRICS.items() if get(m) is not None}
        for key, pattern, top in (("pipes", PIPE, 5), ("stalls", STALL, 6)):
            found = {}
            for name, i in col.items():
                m = pattern.match(name)
                v = _number(row[i]) if m else None
                if v is not None:
                    found[m.group(1)] = max(v, found.get(m.group(1), v))  # (pipes: two names)
            doc[key] = dict(sorted(found.items(), key=lambda kv: -kv[1])[:top])
        out.append(doc)
    return out


def table(kernels: list) -> str:
    lines = [f"{'kernel':<48} {'us':>9} {'SM%':>5} {'issue%':>6} {'occ%':>5} {'regs':>4}  top stalls"]
    for k in kernels:
        m = k["metrics"]
        fmt = lambda key, w: f"{m[key]:>{w}.0f}" if key in m else " " * (w - 1) + "-"  # noqa: E731
        stalls = ", ".join(f"{n} {v:.1f}" for n, v in list(k["stalls"].items())[:3])
        dur = f"{k['duration_us']:>9.1f}" if k["duration_us"] is not None else " " * 8 + "-"
        lines.append(f"{k['kernel'][:48]:<48} {dur} {fmt('sm_throughput_pct', 5)} "
                     f"{fmt('issue_slots_busy_pct', 6)} {fmt('achieved_occupancy_pct', 5)} "
                     f"{fmt('registers_per_thread', 4)}  {stalls}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    with open(args[0], newline="", errors="replace") as f:
        kernels = summarize(list(csv.reader(f)))
    with open(args[1], "w") as f:
        json.dump({"schema": SCHEMA, "kernels": kernels}, f, indent=1)
        f.write("\n")
    print(table(kernels))
    return 0 if kernels else 1


if __name__ == "__main__":
    sys.exit(main())
