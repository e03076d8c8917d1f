"""The printed table and the JSON document of `attnx check`.

JSON (schema "attnx-check/1"): {"schema", "date", "passed", "software": {attnx, torch, triton,
cuda}, "devices": [{"type", "name"}], "backends": {name: {"usable", "reason"}},
"skipped": [{"backend", "device", "dtype", "op", "reason"}], "results": [{"backend", "device",
"dtype", "case", "op", "passed", "error", "worst", "seconds", "quantities": {name: {"err",
"bound", "baseline", "ratio", "ok", "why"}}}]}.
"""

from __future__ import annotations

import json

SCHEMA = "attnx-check/1"


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def _worst(row: dict) -> str:
    if row["worst"] is None:
        return "-"
    q = row["quantities"][row["worst"]]
    return f"{q['ratio']:.2f} ({row['worst']})"


def table(doc: dict) -> str:
    """One line per check: error over bound of the worst quantity (<= 1 passes)."""
    head = ("backend", "device", "dtype", "case", "result", "err/bound")
    rows = [(r["backend"], r["device"], r["dtype"], r["case"], "ok" if r["passed"] else "FAIL",
             _worst(r)) for r in doc["results"]]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip()
             for line in [head] + rows]
    for r in doc["results"]:
        if not r["passed"]:
            lines.append(f"FAIL {r['backend']} {r['device']} {r['dtype']} {r['case']}: {r['error']}")
    return "\n".join(lines)


def header(doc: dict) -> str:
    sw = doc["software"]
    devices = ", ".join(f"{d['type']} ({d['name']})" for d in doc["devices"])
    return (f"attnx check: attnx {sw['attnx']}, torch {sw['torch']}, triton {sw['triton']}\n"
            f"devices: {devices}")


def footer(doc: dict) -> str:
    lines = [f"not checked: {' '.join(str(s[k]) for k in ('backend', 'device', 'dtype', 'op') if s[k])}"
             f": {s['reason']}" for s in doc["skipped"]]
    failed = sum(not r["passed"] for r in doc["results"])
    lines.append(f"{len(doc['results'])} checks, {failed} failed"
                 + ("" if doc["results"] else " (nothing was checked)"))
    return "\n".join(lines)
