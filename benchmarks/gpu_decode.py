"""The GPU decoding benchmark: attnx.attention_with_kvcache (the cuda and triton backends' split-K
kernels) against torch's SDPA over the same contiguous cache, and against the GPU's memory bandwidth.

Shapes of issue 23 item 3 on a GPU: Hq=32, Hkv=8, D=128, bf16 and fp16, B in 1, 8, 32, cache
lengths 2k-32k (every sequence full), Lq=1; attnx on a contiguous and on a paged cache (blocks
of 16, shuffled). Decoding reads the whole cache once per step, so the figure that matters is
bandwidth: the K and V bytes (B * Hkv * L * 2D * element size) over the time, against a device
copy of a 1 GiB tensor timed in the same run (2 bytes moved per byte copied). CUDA events,
median of --repeats with min and max; one JSON line per measurement appended to --out at once.

    python benchmarks/gpu_decode.py --out decode.jsonl [--deadline-s 120]   # needs a CUDA GPU
    python benchmarks/gpu_decode.py --plan                                  # the cases; no GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

HQ, HKV, D, BLOCK = 32, 8, 128, 16
BATCHES = (1, 8, 32)
LENGTHS = (2048, 8192, 32768)
DTYPES = ("bf16", "fp16")
PROVIDERS = ("attnx-cuda", "attnx-cuda-paged", "attnx-triton", "attnx-triton-paged", "torch-sdpa")


def cases(dtypes=DTYPES) -> list:
    """(dtype, B, L), the most telling first (bf16, one sequence, long caches)."""
    return [(dt, b, n) for dt, n, b in itertools.product(dtypes, reversed(LENGTHS), BATCHES)]


def kv_bytes(b: int, n: int, element: int = 2) -> int:
    return b * HKV * n * 2 * D * element


def _events_ms(fn, repeats: int) -> dict:
    import torch
    fn()  # warm-up: compiles and autotunes outside the timed runs
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "runs": repeats}


def copy_bandwidth(repeats: int) -> float:
    """GB/s of a device-to-device copy of 1 GiB (read + write)."""
    import torch
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    t = _events_ms(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 2 / (t["median_ms"] / 1e3) / 1e9


def measure(dtype: str, b: int, n: int, repeats: int, peak_gbs: float) -> list:
    import torch
    import torch.nn.functional as F

    import attnx
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, HQ, 1, D, device="cuda", dtype=dt, generator=g)
    k, v = (torch.randn(b, HKV, n, D, device="cuda", dtype=dt, generator=g) for _ in range(2))
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    nb = n // BLOCK
    perm = torch.randperm(b * nb, device="cuda", generator=g)
    pages = []
    for cache in (k, v):
        blocks = cache.view(b, HKV, nb, BLOCK, D).transpose(1, 2).reshape(b * nb, HKV, BLOCK, D)
        shuffled = torch.empty_like(blocks)
        shuffled[perm] = blocks
        pages.append(shuffled)
    table = perm.view(b, nb).to(torch.int32)
    def attnx_call(backend, paged):
        if paged:
            return lambda: attnx.attention_with_kvcache(q, pages[0], pages[1], lens,
                                                        block_table=table, backend=backend)
        return lambda: attnx.attention_with_kvcache(q, k, v, lens, backend=backend)

    fns = {f"attnx-{backend}{'-paged' if paged else ''}": attnx_call(backend, paged)
           for backend in ("cuda", "triton") for paged in (False, True)}
    fns["torch-sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    want = fns["torch-sdpa"]().float()
    rows = []
    for name, fn in fns.items():
        row = {"kind": "result", "dtype": dtype, "B": b, "L": n, "provider": name}
        try:
            err = (fn().float() - want).abs().max().item()
            if not err < 2e-2:  # a benchmark of wrong answers is worth nothing
                raise AssertionError(f"max error {err} against torch")
            row["time"] = _events_ms(fn, repeats)
        except Exception as exc:  # a kernel that rejects the shape or runs out of memory
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            continue
        gbs = kv_bytes(b, n) / (row["time"]["median_ms"] / 1e3) / 1e9
        row.update(bandwidth_gbs=gbs, bandwidth_fraction=gbs / peak_gbs)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON-lines file the measurements are appended to")
    p.add_argument("--deadline-s", type=float, help="start no case after this many seconds")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--plan", action="store_true", help="print the cases and exit")
    args = p.parse_args(argv)
    dtypes = tuple(d for d in args.dtypes.split(",") if d)
    if not set(dtypes) <= set(DTYPES):
        p.error(f"--dtypes: expected some of {DTYPES}, got {dtypes}")
    todo = cases(dtypes)
    if args.plan:
        for dt, b, n in todo:
            print(f"{dt} B={b} L={n}: {kv_bytes(b, n) / 2**20:.0f} MiB of K and V per step")
        print(f"{len(todo)} cases x {len(PROVIDERS)} providers")
        return 0
    import torch
    if not torch.cuda.is_available():
        print("gpu_decode.py: no CUDA device is visible to torch; nothing measured (--plan lists "
              "the cases without one)", file=sys.stderr)
        return 2
    if not args.out:
        p.error("--out: required to measure")
    start = time.monotonic()
    peak = copy_bandwidth(args.repeats)
    left = []
    with open(args.out, "a") as f:
        f.write(json.dumps({"kind": "meta", "device": torch.cuda.get_device_name(),
                            "torch": torch.__version__, "copy_bandwidth_gbs": peak,
                            "shape": {"Hq": HQ, "Hkv": HKV, "D": D, "Lq": 1, "block": BLOCK},
                            "repeats": args.repeats}) + "\n")
        for dt, b, n in todo:
            if args.deadline_s is not None and time.monotonic() - start > args.deadline_s:
                left.append(f"{dt} B={b} L={n}")
                continue
            for row in measure(dt, b, n, args.repeats, peak):
                f.write(json.dumps(row) + "\n")
                f.flush()
                what = f"{row['dtype']} B={row['B']:<3} L={row['L']:<6} {row['provider']:19}"
                print(f"{what} error: {row['error']}" if "error" in row else
                      f"{what} {row['time']['median_ms']:8.3f} ms {row['bandwidth_gbs']:7.0f} GB/s "
                      f"({row['bandwidth_fraction']:.0%} of copy)", flush=True)
            torch.cuda.empty_cache()
        f.write(json.dumps({"kind": "end", "not_measured": left}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
