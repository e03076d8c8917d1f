"""Benchmark attnx's triton backend against PyTorch's SDPA kernels on a GPU.

SDPA: attnx triton vs torch's flash, memory-efficient and cuDNN backends (forced one at a time
with torch.nn.attention.sdpa_kernel), bf16, head dims 64/128, L = 1k..16k, causal and not, with
the setup of the FlashAttention papers (batch x L = 16k tokens, hidden 2048 = H x D) and their
FLOP count (forward 4·B·H·L²·D, halved when causal; backward 2.5x, forward+backward 3.5x).
Additive: attnx triton vs the naive formula that materialises the (B, Lq, Lk, A) tanh tensor,
at NMT-like sizes.

    python benchmarks/triton_gpu.py                 # everything, writes the JSON
    python benchmarks/triton_gpu.py --plan          # list the cases, run nothing (no GPU needed)
    python benchmarks/triton_gpu.py --dims 128 --lengths 4096 --modes fwd

Results go to benchmarks/results/<gpu-name>-triton-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import platform
import re
import sys

import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SDPA_IMPLS = ("attnx-triton", "torch-flash", "torch-efficient", "torch-cudnn")
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128], help="SDPA head dims")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                    help="SDPA sequence lengths (Lq = Lk)")
    ap.add_argument("--tokens", type=int, default=16384, help="batch x L, kept constant")
    ap.add_argument("--hidden", type=int, default=2048, help="heads x head dim, kept constant")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--modes", nargs="+", choices=sorted(MODE_FLOP_FACTOR), default=["fwd", "fwd_bwd"])
    ap.add_argument("--impls", nargs="+", choices=SDPA_IMPLS, default=list(SDPA_IMPLS))
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--additive-batch", type=int, default=64)
    ap.add_argument("--additive-lengths", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--additive-dims", type=int, nargs="+", default=[256, 512, 1024],
                    help="attention dims A (value dim = A)")
    ap.add_argument("--no-additive", action="store_true")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="JSON path (default: results/)")
    ap.add_argument("--plan", action="store_true", help="print the cases and exit")
    return ap.parse_args(argv)


def sdpa_cases(args):
    causal = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    for d in args.dims:
        for length in args.lengths:
            b, h = max(1, args.tokens // length), max(1, args.hidden // d)
            for is_causal in causal:
                for mode in args.modes:
                    yield dict(op="sdpa", B=b, H=h, L=length, D=d, causal=is_causal, mode=mode)


def additive_cases(args):
    if args.no_additive:
        return
    for length in args.additive_lengths:
        for a in args.additive_dims:
            for mode in args.modes:
                yield dict(op="additive", B=args.additive_batch, H=1, L=length, A=a, mode=mode)


def sdpa_flops(case) -> float:
    f = 4.0 * case["B"] * case["H"] * case["L"] ** 2 * case["D"]
    return f / (2 if case["causal"] else 1) * MODE_FLOP_FACTOR[case["mode"]]


def _sdpa_fn(impl, is_causal):
    import attnx
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as torch_sdpa

    if impl == "attnx-triton":
        return lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v, is_causal=is_causal,
                                                                  backend="triton")
    backend = {"torch-flash": SDPBackend.FLASH_ATTENTION,
               "torch-efficient": SDPBackend.EFFICIENT_ATTENTION,
               "torch-cudnn": SDPBackend.CUDNN_ATTENTION}[impl]

    def run(q, k, v):
        with sdpa_kernel(backend):
            return torch_sdpa(q, k, v, is_causal=is_causal)
    return run


def _timed(fn, inputs, mode, args):
    """Milliseconds for one forward, one backward or one forward+backward."""
    import triton.testing

    if mode == "fwd":
        with torch.no_grad():
            return triton.testing.do_bench(lambda: fn(*inputs), warmup=args.warmup, rep=args.rep)
    for t in inputs:
        t.requires_grad_(True)
    out = fn(*inputs)
    grad = torch.randn_like(out)
    if mode == "bwd":
        return triton.testing.do_bench(lambda: out.backward(grad, retain_graph=True),
                                       warmup=args.warmup, rep=args.rep, grad_to_none=inputs)
    return triton.testing.do_bench(lambda: fn(*inputs).backward(grad), warmup=args.warmup,
                                   rep=args.rep, grad_to_none=inputs)


def bench_sdpa(case, args, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (case["B"], case["H"], case["L"], case["D"])
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    rows = []
    reference = None
    for impl in args.impls:
        row = dict(case, impl=impl)
        fn = _sdpa_fn(impl, case["causal"])
        try:
            with torch.no_grad():
                out = fn(q, k, v)
            if reference is None:
                reference = out
            row["max_abs_diff_vs_first"] = (out.float() - reference.float()).abs().max().item()
            ms = _timed(fn, [t.detach().clone() for t in (q, k, v)], case["mode"], args)
            row.update(ms=ms, tflops=sdpa_flops(case) / ms * 1e-9)
        except Exception as exc:  # an impl that cannot run this case is recorded, not fatal
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.empty_cache()
        rows.append(row)
        print(_format(row), flush=True)
    return rows


def _naive_additive(q, k, value, w):
    t = torch.tanh(q.unsqueeze(3) + k.unsqueeze(2))  # (B, H, Lq, Lk, A): what fusing avoids
    return torch.softmax((t * w).sum(-1), dim=-1) @ value


def bench_additive(case, args, dtype):
    import attnx

    gen = torch.Generator(device="cuda").manual_seed(0)
    b, h, length, a = case["B"], case["H"], case["L"], case["A"]
    q, k, value = (torch.randn((b, h, length, a), device="cuda", dtype=dtype, generator=gen)
                   for _ in range(3))
    w = torch.randn((a,), device="cuda", dtype=dtype, generator=gen) / math.sqrt(a)
    impls = {"attnx-triton": lambda q, k, value, w: attnx.additive_attention(
                 q, k, value, w, backend="triton"),
             "naive": _naive_additive}
    rows = []
    for impl, fn in impls.items():
        row = dict(case, impl=impl)
        try:
            torch.cuda.reset_peak_memory_stats()
            ms = _timed(fn, [t.detach().clone() for t in (q, k, value, w)], case["mode"], args)
            row.update(ms=ms, peak_mem_mb=torch.cuda.max_memory_allocated() / 2**20)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.empty_cache()
        rows.append(row)
        print(_format(row), flush=True)
    return rows


def _format(row) -> str:
    shape = " ".join(f"{k}={row[k]}" for k in ("B", "H", "L", "D", "A", "causal") if k in row)
    if "error" in row:
        return f"{row['op']:8} {row['mode']:7} {shape:42} {row['impl']:16} {row['error']}"
    extra = f"{row['tflops']:7.1f} TFLOP/s" if "tflops" in row else f"{row['peak_mem_mb']:9.0f} MB"
    return f"{row['op']:8} {row['mode']:7} {shape:42} {row['impl']:16} {row['ms']:9.3f} ms {extra}"


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = list(sdpa_cases(args)) + list(additive_cases(args))
    if args.plan:
        for case in cases:
            print(case)
        print(f"{len(cases)} cases x implementations")
        return 0
    if not torch.cuda.is_available():
        print("triton_gpu.py: no CUDA device (use --plan to list the cases)", file=sys.stderr)
        return 1
    import triton

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows = []
    for case in cases:
        bench = bench_sdpa if case["op"] == "sdpa" else bench_additive
        rows.extend(bench(case, args, dtype))
    gpu = torch.cuda.get_device_name()
    today = datetime.date.today().isoformat()
    out = args.out or RESULTS / f"{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}-triton-{today}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=gpu, date=today, torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                python=platform.python_version(), dtype=args.dtype, argv=sys.argv[1:],
                flops="forward 4*B*H*L^2*D (halved when causal); bwd 2.5x, fwd_bwd 3.5x")
    out.write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
