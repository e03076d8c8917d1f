"""PNG figures of a results document: throughput, peak memory, additive against naive."""

from __future__ import annotations

import os
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

from .report import unit  # noqa: E402

PASS_TITLES = {"forward": "forward", "backward": "backward", "forward_backward": "forward + backward"}


def _series(doc, op, pass_, causal, value):
    """(provider, fixed-shape label) -> sorted [(seqlen, y)] of results that have a y."""
    lines = defaultdict(list)
    for r in doc["results"]:
        c = r["case"]
        if c["op"] != op or r["pass"] != pass_ or c["causal"] != causal:
            continue
        y = value(r)
        if y is None:
            continue
        dims = f"D{c['head_dim']}" if op == "sdpa" else f"A{c['head_dim']}"
        lines[(r["provider"], f"{dims} {c['dtype']}")].append((c["seqlen_q"], y))
    return {k: sorted(v) for k, v in lines.items()}


def _throughput(div):
    """(median, lowest, highest) throughput: the spread comes from the max and min times."""
    def value(r):
        if "error" in r["time"]:
            return None
        t = r["time"]
        return (r["flops"] / (t["median_ms"] * 1e-3) / div, r["flops"] / (t["max_ms"] * 1e-3) / div,
                r["flops"] / (t["min_ms"] * 1e-3) / div)
    return value


def _memory(r):
    mem = r.get("memory") or {}
    return (mem["bytes"] / 2**20, None, None) if "bytes" in mem else None


def _log2_x(ax, xs):
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(xs))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_locator(ticker.NullLocator())


def _draw(ax, series, title, ylabel, logy=False, gemm=None, xlabel="sequence length (Lq = Lk)"):
    if gemm is not None:  # the machine's GEMM rate: the ceiling the kernels are read against
        ax.axhline(gemm[0], color="gray", linestyle="--", linewidth=1, label=gemm[1])
    several_shapes = len({s for _, s in series}) > 1
    xs_all = set()
    for (provider, shape), pts in sorted(series.items()):
        xs = [p[0] for p in pts]
        ys = [p[1][0] for p in pts]
        xs_all.update(xs)
        label = f"{provider} ({shape})" if several_shapes else provider
        if pts[0][1][1] is None:
            ax.plot(xs, ys, marker="o", label=label)
        else:  # error bars: the min-max spread over repeats
            err = [[y - p[1][1] for y, p in zip(ys, pts)], [p[1][2] - y for y, p in zip(ys, pts)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
    if xs_all:
        _log2_x(ax, xs_all)
    if logy:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_locator(ticker.NullLocator())
    else:
        ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize=7)


def _grid(doc, op, passes, value, ylabel, suptitle, path, logy=False, gemm=None):
    fig, axes = plt.subplots(2, len(passes), figsize=(5.5 * len(passes), 8.5), squeeze=False)
    for col, pass_ in enumerate(passes):
        for row, causal in enumerate((False, True)):
            ax = axes[row][col]
            _draw(ax, _series(doc, op, pass_, causal, value),
                  f"{PASS_TITLES[pass_]}, {'causal' if causal else 'not causal'}", ylabel, logy, gemm)
    fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(doc: dict, out_dir: str) -> list:
    """Writes the figures the results allow; returns their paths."""
    device = doc["device"]["type"]
    div, label = unit(device)
    passes = [p for p in PASS_TITLES if any(r["pass"] == p for r in doc["results"])]
    ops = [o for o in ("sdpa", "additive") if any(r["case"]["op"] == o for r in doc["results"])]
    where = f"{doc['device']['name']}, torch {doc['software']['torch']}"
    g = doc["gemm"]
    gemm = (g["flops_per_s"] / div, f"GEMM {g['shape'][0]}^3 {g['dtype']}: {g['flops_per_s'] / div:.0f} {label}")
    paths = []
    for op in ops:
        name = "SDPA" if op == "sdpa" else "additive attention"
        paths.append(_grid(doc, op, passes, _throughput(div), f"throughput ({label})",
                           f"{name} throughput ({where})", os.path.join(out_dir, f"throughput_{op}.png"),
                           gemm=gemm))
        mem_passes = [p for p in passes if p != "backward"]
        # (a backward-only sweep has no pass whose memory is measured: no memory plot)
        if mem_passes and any(_memory(r) is not None for r in doc["results"]
                              if r["case"]["op"] == op):
            paths.append(_grid(doc, op, mem_passes, _memory, "peak memory beyond inputs (MiB)",
                               f"{name} peak memory ({where})", os.path.join(out_dir, f"memory_{op}.png"),
                               logy=True))
    if "additive" in ops:
        paths.append(_additive_vs_naive(doc, passes, os.path.join(out_dir, "additive_vs_naive.png"), where))
    if any(r["case"]["op"] == "kvcache" for r in doc["results"]):
        paths.append(_kvcache(doc, div, label, os.path.join(out_dir, "throughput_kvcache.png"), where))
    if any(r["case"]["op"] == "varlen" for r in doc["results"]):
        paths.append(_varlen(doc, div, label, os.path.join(out_dir, "throughput_varlen.png"), where))
    return paths


def _kvcache(doc, div, label, path, where):
    """Decoding throughput against the cache length, a line per provider and (B, Lq)."""
    value, series = _throughput(div), defaultdict(list)
    for r in doc["results"]:
        c = r["case"]
        if c["op"] == "kvcache" and value(r) is not None:
            series[(r["provider"], f"B{c['batch']} Lq{c['seqlen_q']}")].append((c["seqlen_k"], value(r)))
    fig, ax = plt.subplots(figsize=(7, 5))
    _draw(ax, {k: sorted(v) for k, v in series.items()}, "forward (decoding step)",
          f"throughput ({label})", xlabel="cache length (keys per sequence)")
    fig.suptitle(f"attention_with_kvcache throughput ({where})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _varlen(doc, div, label, path, where):
    """Packed-batch throughput per provider (bars), a panel per pass, causal and not side by side."""
    value = _throughput(div)
    passes = [p for p in PASS_TITLES if any(r["pass"] == p and r["case"]["op"] == "varlen"
                                            for r in doc["results"])]
    fig, axes = plt.subplots(1, len(passes), figsize=(5.5 * len(passes), 4.5), squeeze=False)
    for col, pass_ in enumerate(passes):
        ax = axes[0][col]
        bars = {}
        for r in doc["results"]:
            c = r["case"]
            if c["op"] == "varlen" and r["pass"] == pass_ and value(r) is not None:
                bars[(r["provider"], "causal" if c["causal"] else "not causal")] = value(r)
        names = sorted({p for p, _ in bars})
        for i, causal in enumerate(("not causal", "causal")):
            ys = [bars.get((p, causal), (0.0, None, None))[0] for p in names]
            ax.bar([x + 0.4 * i for x in range(len(names))], ys, width=0.4, label=causal)
        ax.set_xticks([x + 0.2 for x in range(len(names))], names, rotation=20, fontsize=7)
        ax.set_title(PASS_TITLES[pass_])
        ax.set_ylabel(f"throughput ({label})")
        ax.legend(fontsize=7)
    c = next(r["case"] for r in doc["results"] if r["case"]["op"] == "varlen")
    lens = c["lengths"]
    fig.suptitle(f"varlen_attention, {len(lens)} sequences of {min(lens)}-{max(lens)} tokens "
                 f"({sum(lens)} in all) ({where})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _additive_vs_naive(doc, passes, path, where):
    """Speed-up of each additive provider over the naive formula (full tanh tensor)."""
    times = {}
    for r in doc["results"]:
        if r["case"]["op"] == "additive" and "error" not in r["time"]:
            times[(r["provider"], r["pass"], tuple(sorted(r["case"].items())))] = r["time"]["median_ms"]
    fig, axes = plt.subplots(1, len(passes), figsize=(5.5 * len(passes), 4.5), squeeze=False)
    for col, pass_ in enumerate(passes):
        ax = axes[0][col]
        lines = defaultdict(list)
        for (provider, p, case), ms in times.items():
            naive = times.get(("naive", p, case))
            if p != pass_ or provider == "naive" or naive is None:
                continue
            c = dict(case)
            lines[(provider, f"A{c['head_dim']}{' causal' if c['causal'] else ''}")].append((c["seqlen_q"], naive / ms))
        for (provider, shape), pts in sorted(lines.items()):
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", label=f"{provider} ({shape})")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        xs_all = {x for pts in lines.values() for x, _ in pts}
        if xs_all:
            _log2_x(ax, xs_all)
        ax.set_title(PASS_TITLES[pass_])
        ax.set_xlabel("sequence length (Lq = Lk)")
        ax.set_ylabel("speed-up over naive (naive time / time)")
        ax.grid(True, which="both", alpha=0.3)
        if lines:
            ax.legend(fontsize=7)
    fig.suptitle(f"additive attention against the naive formula ({where})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
