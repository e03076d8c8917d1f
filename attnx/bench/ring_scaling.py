"""Strong scaling of attnx.distributed.ring_attention on CPU processes (gloo, 1 thread each):
`attnx bench --world N` and `benchmarks/ring_scaling.py` both run `measure`.

For each world size W, sequence length L and layout (causal attention, fp32, B=1, H heads,
head dim D, forward): every rank's time per call (median of `repeats`), against the
single-process kernel on the whole sequence (1 thread) and the ideal time single / W. The
communication share is what the ring costs a rank beyond running its own kernel calls: each
rank also times its schedule's kernel calls alone (the same blocks, no messages), and
share = (ring time - compute time) / ring time, i.e. the communication that compute did not
hide, plus the merge and the waits for slower ranks. Each rank's CPU time is recorded too: on
a machine shared with other jobs it still shows the work per rank (CPU speed-up = the single
call's CPU time over the busiest rank's). On a machine with fewer cores than W the ranks share
cores: the times then show the schedule's balance, not speed-up.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import tempfile
import time

import torch

import attnx

from . import machine

LAYOUTS = ("zigzag", "contiguous")
BENCHMARK = "ring_attention strong scaling (forward, causal, fp32)"


def check(lengths, worlds) -> None:
    """ValueError naming what cannot run: a world below 1, or a length that does not cut into
    2W equal chunks (the zigzag layout's; the contiguous one needs W)."""
    for w in worlds:
        if w < 1:
            raise ValueError(f"world: expected at least 1 process, got {w}")
        for n in lengths:
            if n < 1 or n % (2 * w):
                raise ValueError(f"sequence length: expected a positive multiple of 2 x world "
                                 f"= {2 * w} (zigzag cuts it into 2W chunks), got {n}")


def _inputs(length, heads, dim):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, length, dim, generator=g) for _ in range(3)]


def _median_time(fn, repeats, sync=None):
    """(wall s, CPU s of this process) per call, medians. On a machine shared with other jobs
    the CPU time still says how much work a rank did; the wall time adds the waiting."""
    fn()  # warm-up
    walls, cpus = [], []
    for _ in range(repeats):
        if sync:
            sync()
        t, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def _compute_only(rank, world, length, layout, heads, dim, q):
    """This rank's kernel calls of the ring schedule, on stand-in shards, without messages."""
    from attnx.distributed import blocks
    from attnx.distributed.ring import _Ring  # the schedule, to time its kernels alone
    n = length // world
    ring = _Ring(None, rank, world, n, layout, -length, 0, dim ** -0.5,
                 blocks.kernels("cpu", None), None, 0.0)
    kv = torch.randn(1, heads, n, dim)
    todo = [(b, kv) for t in range(world) for s in [(rank - t) % world]
            if t <= ring.reach(s) for b in ring.blocks(rank, s)]

    def run():
        for b, x in todo:
            ring.kernels.fwd(q[:, :, b.q0:b.q1], x[:, :, b.k0:b.k1], x[:, :, b.k0:b.k1],
                             ring.scale, b.lo, b.hi)
    return run


def _rank(rank, world, port, cases, repeats, out_path):
    """One spawned rank: times every case, rank 0 writes the rows."""
    import torch.distributed as dist
    from attnx.distributed import ring_attention, shard
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        rows = []
        for length, layout, heads, dim in cases:
            q, k, v = (shard(t, layout=layout) for t in _inputs(length, heads, dim))
            ring_t = _median_time(lambda: ring_attention(q, k, v, is_causal=True, layout=layout),
                                  repeats, sync=dist.barrier)
            compute_t = _median_time(_compute_only(rank, world, length, layout, heads, dim, q),
                                     repeats)
            every = [None] * world
            dist.all_gather_object(every, (ring_t, compute_t))
            rows.append(dict(world=world, length=length, layout=layout,
                             ring_s=[r[0] for r, _ in every],
                             ring_cpu_s=[r[1] for r, _ in every],
                             compute_s=[c[0] for _, c in every]))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(lengths, worlds, layouts=LAYOUTS, heads=1, dim=64, repeats=2) -> dict:
    """The results document: the machine (attnx.bench.machine.describe), the shape and one row
    per (world, length, layout). Each world runs as that many spawned gloo processes; a rank
    that fails makes the spawn raise (the others' process group times out, never hangs)."""
    import torch.multiprocessing as mp
    check(lengths, worlds)
    torch.set_num_threads(1)
    single = {}
    for length in lengths:
        q, k, v = _inputs(length, heads, dim)
        single[length] = _median_time(
            lambda: attnx.scaled_dot_product_attention(q, k, v, is_causal=True), repeats)
    cases = [(n, lay, heads, dim) for n in lengths for lay in layouts]
    rows = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rows.json")
            mp.spawn(_rank, args=(world, _free_port(), cases, repeats, path), nprocs=world)
            with open(path) as f:
                rows += json.load(f)
    for row in rows:
        wall, cpu = single[row["length"]]
        row.update(single_s=wall, ideal_s=wall / row["world"], speedup=wall / max(row["ring_s"]),
                   single_cpu_s=cpu, cpu_speedup=cpu / max(row["ring_cpu_s"]),
                   comm_share=[max(0.0, (r - c) / r) for r, c in zip(row["ring_s"],
                                                                     row["compute_s"])])
    doc = machine.describe("cpu")
    cores = doc["device"]["cpu_count"]
    return dict(
        benchmark=BENCHMARK, cpu=doc["device"]["name"], cores=cores, **doc,
        shape=dict(batch=1, heads=heads, head_dim=dim), threads_per_rank=1, repeats=repeats,
        load_average=machine.load_average(),
        note=("worlds larger than the core count "
              f"({cores}) share cores, so their times show balance, not speed-up; on a machine "
              "shared with other jobs the wall times are noisy (the CPU times less so)"),
        rows=rows)


def table(result: dict) -> str:
    lines = [f"{result['benchmark']}: {result['cpu']}, {result['cores']} cores, 1 thread per "
             f"rank; {result['note']}",
             f"{'W':>2} {'L':>6} {'layout':>10} {'single s':>9} {'ideal s':>8} "
             f"{'rank s (min..max)':>18} {'speedup':>7} {'comm share':>15} {'CPU speedup':>11}"]
    for row in result["rows"]:
        lines.append(
            f"{row['world']:>2} {row['length']:>6} {row['layout']:>10} {row['single_s']:>9.3f} "
            f"{row['ideal_s']:>8.3f} {min(row['ring_s']):>8.3f}..{max(row['ring_s']):<8.3f} "
            f"{row['speedup']:>7.2f} {min(row['comm_share']):>6.0%}..{max(row['comm_share']):<6.0%}"
            f" {row['cpu_speedup']:>11.2f}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Time per call against W, per L and layout: the slowest rank's wall time and the busiest
    rank's CPU time, with the ideal single / W (log-log); communication shares: the JSON."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lengths = sorted({r["length"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4 * len(lengths), 3.4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        rows = [r for r in result["rows"] if r["length"] == length]
        worlds = sorted({1, *(r["world"] for r in rows)})
        ax.plot(worlds, [rows[0]["single_s"] / w for w in worlds], "k--",
                label="ideal: single wall / W")
        ax.plot(worlds, [rows[0]["single_cpu_s"] / w for w in worlds], "k:",
                label="ideal: single CPU / W")
        for layout, marker in (("zigzag", "o"), ("contiguous", "s")):
            mine = sorted((r["world"], max(r["ring_s"]), max(r["ring_cpu_s"])) for r in rows
                          if r["layout"] == layout)
            if mine:
                w, wall, cpu = zip(*mine)
                line, = ax.plot(w, wall, marker + "-", label=f"{layout}: wall, slowest rank")
                ax.plot(w, cpu, marker + ":", color=line.get_color(),
                        label=f"{layout}: CPU time, busiest rank")
        ax.set(xscale="log", yscale="log", xticks=worlds, xticklabels=worlds, xlabel="ranks W",
               ylabel="s per call", title=f"causal L={length}")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.legend(fontsize=7)
    fig.suptitle(f"ring_attention forward on {result['cpu']} ({result['cores']} cores, 1 thread "
                 "per rank; shared machine: noisy)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
