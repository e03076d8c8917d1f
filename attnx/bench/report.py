"""The results file and the printed table.

results.json (schema "attnx-bench/1"): {"schema", "date", "device": {type, name, ...},
"software": {python, torch, cuda, triton, attnx, attnx_git_commit, attnx_backends}, "settings",
"gemm": {shape, dtype, flops, time, flops_per_s}, "providers": [{name, op, available, reason}],
"results": [{"op", "provider", "pass", "case": {...}, "flops", "time": {median_ms, min_ms,
max_ms, samples_ms, calls_per_sample} or {"error"}, "flops_per_s", "fraction_of_gemm",
"memory": {"bytes"} or {"error"}}], "memory_method"}.
"""

from __future__ import annotations

import json

SCHEMA = "attnx-bench/1"


def unit(device: str):
    """(divisor, label) for throughput: GFLOP/s on CPU, TFLOP/s on GPU."""
    return (1e12, "TFLOP/s") if device == "cuda" else (1e9, "GFLOP/s")


def write_json(path, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def _mb(mem: dict) -> str:
    if not mem:
        return "-"
    if "error" in mem:
        return "err"
    return f"{mem['bytes'] / 2**20:.1f}"


def _dims(c: dict) -> str:
    return f"A{c['head_dim']} Ev{c['value_dim']}" if c["op"] == "additive" else f"D{c['head_dim']}"


def _shape(c: dict) -> str:
    if c["op"] == "kvcache":
        size = f"B{c['batch']} Hq{c['heads']}/{c['kv_heads']} Lq{c['seqlen_q']} cache{c['seqlen_k']}"
    elif c["op"] == "varlen":
        lens = c["lengths"]
        size = f"N{len(lens)} H{c['heads']} tokens{c['seqlen_q']} ({min(lens)}-{max(lens)})"
    else:
        size = (f"B{c['batch']} H{c['heads']} L{c['seqlen_q']}"
                + ("" if c["seqlen_q"] == c["seqlen_k"] else f"/{c['seqlen_k']}"))
    return f"{size} {_dims(c)} {c['dtype']}" + (" causal" if c["causal"] else "")


def table(doc: dict) -> str:
    """A markdown table of every result: median time with its min-max, throughput, memory."""
    div, label = unit(doc["device"]["type"])
    head = ["op", "pass", "shape", "provider", "median ms", "min-max ms", label, "% GEMM", "peak MB"]
    rows = []
    for r in doc["results"]:
        c = r["case"]
        shape = _shape(c)
        t = r["time"]
        if "error" in t:
            timing = [f"error: {t['error']}", "", "", ""]
        else:
            timing = [f"{t['median_ms']:.3f}", f"{t['min_ms']:.3f}-{t['max_ms']:.3f}",
                      f"{r['flops_per_s'] / div:.1f}", f"{100 * r['fraction_of_gemm']:.0f}"]
        rows.append([c["op"], r["pass"], shape, r["provider"]] + timing + [_mb(r.get("memory"))])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def header(doc: dict) -> str:
    div, label = unit(doc["device"]["type"])
    g, sw = doc["gemm"], doc["software"]
    out = [f"device: {doc['device']['name']} ({doc['device']['type']}), {doc['date']}",
           f"torch {sw['torch']}, CUDA {sw['cuda']}, Triton {sw['triton']}, attnx {sw['attnx']}"
           f" ({sw['attnx_git_commit'] or 'no git commit'})",
           f"GEMM {'x'.join(map(str, g['shape']))} {g['dtype']}: {g['flops_per_s'] / div:.1f} {label}"]
    off = [f"{p['name']} ({p['op']}): {p['reason']}" for p in doc["providers"] if not p["available"]]
    if off:
        out.append("not run: " + "; ".join(off))
    return "\n".join(out)


def summary(doc: dict) -> str:
    """Throughput pivot: one row per (op, pass, causal, shape, provider), one column per
    sequence length; "err" where the provider failed. (kvcache and varlen cases have shapes of
    their own: the table's rows list them.)"""
    div, label = unit(doc["device"]["type"])
    rows, seqlens = {}, set()
    for r in doc["results"]:
        c = r["case"]
        if c["op"] not in ("sdpa", "additive"):
            continue
        key = (c["op"], r["pass"], "causal" if c["causal"] else "",
               f"H{c['heads']} {_dims(c)} {c['dtype']}", r["provider"])
        seqlens.add(c["seqlen_q"])
        cell = "err" if "error" in r["time"] else f"{r['flops_per_s'] / div:.1f}"
        rows.setdefault(key, {})[c["seqlen_q"]] = cell
    if not rows:
        return ""
    cols = sorted(seqlens)
    head = ["op", "pass", "causal", "shape", "provider"] + [f"L={n}" for n in cols]
    lines = [f"{label} (median; SDPA: batch x L held constant; additive: batch held constant)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in sorted(rows):
        lines.append("| " + " | ".join(list(key) + [rows[key].get(n, "") for n in cols]) + " |")
    return "\n".join(lines)
