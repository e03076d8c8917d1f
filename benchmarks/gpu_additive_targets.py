"""Issue 21's target for the CUDA additive kernels: forward + backward >= 20x the naive formula.

At B=64, Lq=Lk=256, A=256, Ev=256, H=1 (bf16 and fp16, all four inputs requiring grad), attnx's
cuda backend against the naive PyTorch formula in the same dtype, which materialises
tanh(q + k) as a (B, Lq, Lk, A) tensor (softmax in float32, as the tests' baseline). Forward
alone and forward + backward, timed as gpu.py times (attnx bench: warm-up outside the timed
blocks, the two providers interleaved, CUDA events, median with min and max).

    python benchmarks/gpu_additive_targets.py [--out additive.json] [--repeats 10]   # needs a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import attnx  # noqa: E402
from attnx.bench import timing  # noqa: E402

B, L, A, EV = 64, 256, 256, 256
TARGET_SPEEDUP = 20.0


def naive(q, k, value, v):
    s = (torch.tanh(q.unsqueeze(2) + k.unsqueeze(1)) * v).sum(-1)  # (B, Lq, Lk, A) in between
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ value


def fused(q, k, value, v):
    return attnx.additive_attention(q, k, value, v, backend="cuda")


def steps(dtype: torch.dtype) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    inputs = [make(B, L, A), make(B, L, A), make(B, L, EV), make(A) / A ** 0.5]
    inputs = [t.requires_grad_() for t in inputs]
    d_out = make(B, L, EV)
    out = {}
    for name, fn in (("attnx-cuda", fused), ("naive", naive)):
        def forward(fn=fn):
            with torch.no_grad():
                fn(*inputs)

        def forward_backward(fn=fn):
            for t in inputs:
                t.grad = None
            fn(*inputs).backward(d_out)
        out[name] = {"forward": forward, "forward_backward": forward_backward}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON file for the results")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_additive_targets.py: no CUDA GPU here")
        return 1
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        by_provider = steps(dtype)
        for pass_ in ("forward", "forward_backward"):
            got = timing.interleaved({n: s[pass_] for n, s in by_provider.items()}, "cuda",
                                     args.repeats)
            row = {"dtype": str(dtype).split(".")[1], "pass": pass_,
                   **{n: t.as_dict() for n, t in got.items()}}
            if all(t.error is None for t in got.values()):
                row["speedup"] = got["naive"].median / got["attnx-cuda"].median
            rows.append(row)
            ms = {n: (f"{t.median * 1e3:9.3f}" if t.error is None else t.error) for n, t in got.items()}
            print(f"{row['dtype']:<9}{pass_:<17} attnx-cuda {ms['attnx-cuda']} ms  naive "
                  f"{ms['naive']} ms  speedup {row.get('speedup', float('nan')):.1f}x", flush=True)
        torch.cuda.empty_cache()
    met = all(r.get("speedup", 0) >= TARGET_SPEEDUP for r in rows if r["pass"] == "forward_backward")
    print(f"target forward+backward >= {TARGET_SPEEDUP}x: {'met' if met else 'MISSED'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "gpu-additive-targets", "device": torch.cuda.get_device_name(),
                       "torch": torch.__version__, "attnx": attnx.__version__,
                       "config": {"B": B, "H": 1, "Lq": L, "Lk": L, "A": A, "Ev": EV},
                       "target_speedup": TARGET_SPEEDUP, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
