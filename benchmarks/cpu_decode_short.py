"""Decoding and few-query SDPA calls whose keys fit in cache: attnx against torch, interleaved.

The start of a generation (short KV caches) and prompt chunks of a few tokens: fp32, Hq=32,
Hkv=8, D=128 (--dim), B=1 and 8, Lq=1 and 4 against L=16-1024 cached keys, and Lq=8-32 against
256-512. Three providers a case, timed in turn in one process on the same tensors, which
nothing flushes (K and V of 16 KiB-8 MiB a kv head's group, in L2/L3 between calls on most
CPUs; B = 8 at 1024 keys, 64 MiB, only on large-L3 parts): torch's
F.scaled_dot_product_attention (enable_gqa; a lower-right causal bool mask for Lq > 1),
attnx.attention_with_kvcache on the same cache (`kvcache`), and attnx's
scaled_dot_product_attention with torch's own arguments (`sdpa`: the route a drop-in user
takes). Here the fixed costs of a call weigh: the parallel region, the merge, validation.
No target: the results file records where attnx stands (speedup = torch time / attnx time).

--cold reads 512 MiB (a torch sum) before every timed call, as a model's other layers would
between two attention calls: then the interpreter's, the dispatcher's and the code's lines are
gone too, and a call's fixed costs are those of a real decoding step (~50-70 us for torch's
whole SDPA at 16 keys on a 2-core Zen 5, ~8-10 us warm).

    python benchmarks/cpu_decode_short.py [--repeats N] [--threads T] [--dim D] [--cold] [--out PATH]

Writes benchmarks/results/cpu-decode-short-<date>[-cold][-2, -3, ...].json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.nn.functional as F

import attnx
from attnx.cli import positive_int
from cpu_sdpa_targets import machine, summary, timed, unused_path, write_results

HQ, HKV = 32, 8
CASES = [(b, lq, n) for b in (1, 8) for lq in (1, 4) for n in (16, 64, 256, 1024)] + \
        [(b, lq, n) for b in (1, 8) for lq, n in ((8, 256), (16, 256), (16, 512), (32, 512))]
HERE = os.path.dirname(os.path.abspath(__file__))


def case(b: int, lq: int, n: int, dim: int, repeats: int, sink) -> dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, HQ, lq, dim, generator=g)
    k, v = (torch.randn(b, HKV, n, dim, generator=g) for _ in range(2))
    lens = torch.full((b,), n, dtype=torch.int32)
    mask = torch.ones(lq, n, dtype=torch.bool).tril(n - lq) if lq > 1 else None
    impls = {
        "torch": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
        "kvcache": lambda: attnx.attention_with_kvcache(q, k, v, lens, backend="cpu"),
        "sdpa": lambda: attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                           enable_gqa=True, backend="cpu"),
    }
    with torch.no_grad():
        ref = impls["torch"]()
        for name in ("kvcache", "sdpa"):  # a benchmark of wrong answers is worth nothing
            err = (impls[name]() - ref).abs().max().item()
            assert err < 1e-4, f"{name}: max error {err}"
        times = {name: [] for name in impls}
        for _ in range(repeats):
            for name, fn in impls.items():
                if sink is not None:
                    sink.sum()
                times[name].append(timed(fn))
    row = {"B": b, "Lq": lq, "L": n, "D": dim}
    for name, ts in times.items():
        row[name] = summary(ts)
    for name in ("kvcache", "sdpa"):
        row[f"{name}_speedup"] = row["torch"]["median_s"] / row[name]["median_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive_int, default=51)
    parser.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--cold", action="store_true",
                        help="read 512 MiB before every timed call (a decoding step's caches)")
    parser.add_argument("--out", default=None, help="JSON path (default: results/cpu-decode-short-<date>.json)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sink = torch.ones(128 << 20) if args.cold else None
    print(f"threads: {torch.get_num_threads()}, Hq={HQ}, Hkv={HKV}, D={args.dim}, "
          f"{'cold caches (512 MiB read before each call)' if args.cold else 'warm caches'}")
    header = (f"{'B':>2} {'Lq':>3} {'L':>5} | {'torch us':>9} {'kvcache us':>10} {'sdpa us':>9} | "
              f"{'kvcache':>8} {'sdpa':>8}")
    print(header)
    print("-" * len(header))
    rows = []
    for b, lq, n in CASES:
        r = case(b, lq, n, args.dim, args.repeats, sink)
        rows.append(r)
        print(f"{b:>2} {lq:>3} {n:>5} | {r['torch']['median_s'] * 1e6:>9.1f} "
              f"{r['kvcache']['median_s'] * 1e6:>10.1f} {r['sdpa']['median_s'] * 1e6:>9.1f} | "
              f"{r['kvcache_speedup']:>7.2f}x {r['sdpa_speedup']:>7.2f}x", flush=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {"benchmark": "cpu_decode_short", "date": now.isoformat(), "machine": machine(),
              "torch": torch.__version__, "attnx": attnx.__version__, "repeats": args.repeats,
              "shape": {"Hq": HQ, "Hkv": HKV, "D": args.dim, "dtype": "float32"},
              "caches": "cold: 512 MiB read before each call" if args.cold else "warm",
              "cases": rows}
    name = f"cpu-decode-short-{now:%Y-%m-%d}{'-cold' if args.cold else ''}.json"
    path = args.out or unused_path(os.path.join(HERE, "results", name))
    write_results(path, result)


if __name__ == "__main__":
    main()
