"""The GPU packed-batch benchmark: attnx.varlen_attention (the cuda and triton backends) against
torch's own varlen flash kernel and torch's SDPA on the batch padded to its longest sequence.

Issue 23 item 3 on a GPU: a packed batch of mixed lengths (64 .. 2048, --tokens in all, drawn
once from a fixed seed), Hq = 16, Hkv = 4 (GQA), D = 128 and 64, bf16 and fp16, causal, the
forward and a training step (forward + backward). Providers: attnx-cuda, attnx-triton,
torch-varlen (torch.nn.attention.varlen.varlen_attn, where this torch has it; GQA keys repeated
if it takes none) and torch-sdpa-padded (every sequence padded at its end to the longest, one
(N, H, Lmax, D) call with is_causal: a real query then sees only real keys). FLOPs count the
real tokens only, as flash-attention counts them: 4 * Hq * D * sum_n Lq_n Lk_n / 2 forward
(causal), 2.5x that for the backward. CUDA events, median of --repeats with min and max; one
JSON line per measurement appended to --out at once; each provider's output is checked against
torch-sdpa-padded's before it is timed.

    python benchmarks/gpu_varlen.py --out varlen.jsonl [--deadline-s 120]   # needs a CUDA GPU
    python benchmarks/gpu_varlen.py --plan                                  # the cases; no GPU
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_decode import _events_ms  # noqa: E402  (the same timing)

HQ, HKV = 16, 4
HEAD_DIMS = (128, 64)
DTYPES = ("bf16", "fp16")
PASSES = ("forward", "step")
PROVIDERS = ("attnx-cuda", "attnx-triton", "torch-varlen", "torch-sdpa-padded")
SHORTEST, LONGEST = 64, 2048


def lengths(tokens: int, seed: int = 0) -> list:
    """Sequence lengths in [SHORTEST, LONGEST] adding up to `tokens` (the last one takes the
    remainder, at least SHORTEST unless tokens is smaller)."""
    rng, out, left = random.Random(seed), [], tokens
    while left > 0:
        n = rng.randint(SHORTEST, LONGEST)
        if left - n < SHORTEST:
            n = left
        out.append(n)
        left -= n
    return out


def flops(lens: list, d: int, pass_: str) -> float:
    forward = 4 * HQ * d * sum(n * n for n in lens) / 2
    return forward * (3.5 if pass_ == "step" else 1.0)


def cases(dtypes=DTYPES, head_dims=HEAD_DIMS, passes=PASSES) -> list:
    """(dtype, D, pass), the most telling first (bf16, D = 128, the training step)."""
    return [(dt, d, p) for dt in dtypes for d in head_dims for p in reversed(passes)]


def _providers(lens: list, q, k, v):
    """name -> fn(q, k, v) giving the packed (total, Hq, D) output."""
    import torch
    import torch.nn.functional as F

    import attnx
    dev = q.device
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
    longest, n = max(lens), len(lens)
    fns = {f"attnx-{b}": (lambda b: lambda x, y, z: attnx.varlen_attention(
        x, y, z, cu, cu, longest, longest, is_causal=True, backend=b))(b)
        for b in ("cuda", "triton")}
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    if varlen_attn is not None:
        gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters

        def torch_varlen(x, y, z):  # window (-1, 0): causal, flash-attention's convention
            if not gqa:
                y, z = (t.repeat_interleave(HQ // HKV, dim=1) for t in (y, z))
            extra = {"enable_gqa": True} if gqa else {}
            return varlen_attn(x, y, z, cu, cu, longest, longest, window_size=(-1, 0), **extra)
        fns["torch-varlen"] = torch_varlen
    # padded (N, H, Lmax, D): token t of sequence s at [s, :, t]
    seq = torch.repeat_interleave(torch.arange(n, device=dev), torch.tensor(lens, device=dev))
    pos = torch.arange(cu[-1].item(), device=dev) - cu[:-1].long()[seq]

    def padded(x, heads):
        out = x.new_zeros(n, longest, heads, x.shape[-1])
        out[seq, pos] = x
        return out.transpose(1, 2)

    def torch_padded(x, y, z):
        out = F.scaled_dot_product_attention(padded(x, HQ), padded(y, HKV), padded(z, HKV),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)[seq, pos]
    fns["torch-sdpa-padded"] = torch_padded
    return fns


def measure(dtype: str, d: int, pass_: str, lens: list, repeats: int, providers) -> list:
    import torch
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lens)
    q = torch.randn(total, HQ, d, device="cuda", dtype=dt, generator=g)
    k, v = (torch.randn(total, HKV, d, device="cuda", dtype=dt, generator=g) for _ in range(2))
    dout = torch.randn(total, HQ, d, device="cuda", dtype=dt, generator=g)
    every = _providers(lens, q, k, v)
    fns = {name: fn for name, fn in every.items() if name in providers}
    with torch.no_grad():
        want = every["torch-sdpa-padded"](q, k, v).float()
    leaves = [t.detach().requires_grad_(pass_ == "step") for t in (q, k, v)]

    def timed(fn):
        if pass_ == "forward":
            return lambda: fn(*leaves)
        return lambda: torch.autograd.backward(fn(*leaves), dout)

    rows = []
    for name, fn in fns.items():
        row = {"kind": "result", "dtype": dtype, "D": d, "pass": pass_, "provider": name,
               "tokens": total, "sequences": len(lens)}
        try:
            with torch.no_grad():
                err = (fn(q, k, v).float() - want).abs().max().item()
            if not err < 2e-2:  # a benchmark of wrong answers is worth nothing
                raise AssertionError(f"max error {err} against torch-sdpa-padded")
            row["time"] = _events_ms(timed(fn), repeats)
        except Exception as exc:  # a kernel that rejects the shape or runs out of memory
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            continue
        row["tflops"] = flops(lens, d, pass_) / (row["time"]["median_ms"] / 1e3) / 1e12
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="JSON-lines file the measurements are appended to")
    p.add_argument("--deadline-s", type=float, help="start no case after this many seconds")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--tokens", type=int, default=16384, help="tokens in the packed batch")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--plan", action="store_true", help="print the cases and exit")
    args = p.parse_args(argv)
    dtypes = tuple(x for x in args.dtypes.split(",") if x)
    providers = tuple(x for x in args.providers.split(",") if x)
    if not set(dtypes) <= set(DTYPES):
        p.error(f"--dtypes: expected some of {DTYPES}, got {dtypes}")
    if not set(providers) <= set(PROVIDERS):
        p.error(f"--providers: expected some of {PROVIDERS}, got {providers}")
    if args.tokens < 1:
        p.error(f"--tokens: expected >= 1, got {args.tokens}")
    lens, todo = lengths(args.tokens), cases(dtypes)
    if args.plan:
        print(f"{len(lens)} sequences, {sum(lens)} tokens, longest {max(lens)}: {lens}")
        for dt, d, pass_ in todo:
            print(f"{dt} D={d} {pass_}: {flops(lens, d, pass_) / 1e12:.2f} TFLOP")
        print(f"{len(todo)} cases x {len(providers)} providers")
        return 0
    import torch
    if not torch.cuda.is_available():
        print("gpu_varlen.py: no CUDA device is visible to torch; nothing measured (--plan lists "
              "the cases without one)", file=sys.stderr)
        return 2
    if not args.out:
        p.error("--out: required to measure")
    start, left = time.monotonic(), []
    with open(args.out, "a") as f:
        f.write(json.dumps({"kind": "meta", "device": torch.cuda.get_device_name(),
                            "torch": torch.__version__, "lengths": lens,
                            "shape": {"Hq": HQ, "Hkv": HKV, "causal": True},
                            "repeats": args.repeats}) + "\n")
        for dt, d, pass_ in todo:
            if args.deadline_s is not None and time.monotonic() - start > args.deadline_s:
                left.append(f"{dt} D={d} {pass_}")
                continue
            for row in measure(dt, d, pass_, lens, args.repeats, providers):
                f.write(json.dumps(row) + "\n")
                f.flush()
                what = f"{row['dtype']} D={row['D']:<3} {row['pass']:7} {row['provider']:17}"
                print(f"{what} error: {row['error']}" if "error" in row else
                      f"{what} {row['time']['median_ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s",
                      flush=True)
            torch.cuda.empty_cache()
        f.write(json.dumps({"kind": "end", "not_measured": left}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
