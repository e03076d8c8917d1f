"""GPU benchmark of the `cuda` backend, for one device call.

Measures, in one run on one GPU: a dense bf16 GEMM rate (the machine's ceiling), SDPA forward
and forward+backward in bf16 (D 64 and 128, L 1k-16k with B*L = 16k tokens and H*D = 2048,
causal and not) for attnx's cuda backend and torch SDPA's flash, efficient and cuDNN backends,
and additive attention forward+backward (B=64, L=256, A=256) for attnx cuda, attnx triton
(when usable) and the naive formula. FLOPs follow flash-attention's benchmarks: forward
4*B*H*Lq*Lk*D (halved when causal), backward 2.5x forward. Times are medians of CUDA-event
timings. Results go to benchmarks/results/<gpu-name>-<date>.json.

On the device machine, from the repository root:

    ATTNX_CUDA=1 MAX_JOBS=16 python setup.py build_ext --inplace && python benchmarks/cuda_gpu.py && compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/cuda_gpu.py --sanitize

(`--sanitize` runs only small odd-sized cases of every kernel, with masks, windows, GQA and
dropout, forward and backward, so that compute-sanitizer finishes in seconds; `--quick` runs
the benchmark at L <= 4k only.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import attnx  # noqa: E402

DTYPE = torch.bfloat16
TOKENS, HIDDEN = 16384, 2048


def time_ms(fn, warmup: int = 5, reps: int = 20) -> float:
    """Median milliseconds of fn() over `reps` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def gemm_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=DTYPE)
    b = torch.randn(n, n, device="cuda", dtype=DTYPE)
    return 2 * n**3 / time_ms(lambda: a @ b) / 1e9


def sdpa_runners():
    def attnx_cuda(q, k, v, causal):
        return attnx.scaled_dot_product_attention(q, k, v, is_causal=causal, backend="cuda")

    def torch_backend(kind):
        def run(q, k, v, causal):
            with sdpa_kernel([kind]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return run

    return {"attnx_cuda": attnx_cuda,
            "torch_flash": torch_backend(SDPBackend.FLASH_ATTENTION),
            "torch_efficient": torch_backend(SDPBackend.EFFICIENT_ATTENTION),
            "torch_cudnn": torch_backend(SDPBackend.CUDNN_ATTENTION)}


def bench_sdpa(lengths, rows):
    for d in (64, 128):
        h = HIDDEN // d
        for length in lengths:
            b = max(1, TOKENS // length)
            for causal in (False, True):
                flops = 4 * b * h * length * length * d / (2 if causal else 1)
                q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=DTYPE,
                                       requires_grad=True) for _ in range(3))
                dout = torch.randn(b, h, length, d, device="cuda", dtype=DTYPE)
                for name, run in sdpa_runners().items():
                    row = dict(op="sdpa", impl=name, B=b, H=h, L=length, D=d, causal=causal)
                    try:
                        fwd = time_ms(lambda: run(q, k, v, causal))
                        both = time_ms(lambda: torch.autograd.grad(run(q, k, v, causal),
                                                                   (q, k, v), dout))
                        row.update(fwd_ms=fwd, fwd_bwd_ms=both, fwd_tflops=flops / fwd / 1e9,
                                   bwd_tflops=2.5 * flops / max(both - fwd, 1e-6) / 1e9,
                                   fwd_bwd_tflops=3.5 * flops / both / 1e9)
                    except Exception as exc:  # a torch backend may not serve this shape/GPU
                        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del q, k, v, dout
                torch.cuda.empty_cache()


def naive_additive(q, k, value, v):
    s = (torch.tanh(q.unsqueeze(3) + k.unsqueeze(2)) * v.view(1, -1, 1, 1, v.shape[-1])).sum(-1)
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ value


def bench_additive(rows):
    b, h, length, a, ev = 64, 1, 256, 256, 256
    q, k = (torch.randn(b, h, length, a, device="cuda", dtype=DTYPE, requires_grad=True)
            for _ in range(2))
    value = torch.randn(b, h, length, ev, device="cuda", dtype=DTYPE, requires_grad=True)
    v = torch.randn(h, a, device="cuda", dtype=DTYPE, requires_grad=True)
    dout = torch.randn(b, h, length, ev, device="cuda", dtype=DTYPE)
    impls = {"naive_torch": lambda: naive_additive(q, k, value, v)}
    status = attnx.backends()
    for name in ("cuda", "triton"):
        if status[name].usable:
            impls[f"attnx_{name}"] = (lambda n: lambda: attnx.additive_attention(
                q, k, value, v, backend=n))(name)
        else:
            rows.append(dict(op="additive", impl=f"attnx_{name}", error=status[name].reason))
    for name, run in impls.items():
        row = dict(op="additive", impl=name, B=b, H=h, L=length, A=a, Ev=ev)
        try:
            fwd = time_ms(run)
            both = time_ms(lambda: torch.autograd.grad(run(), (q, k, value, v), dout))
            row.update(fwd_ms=fwd, fwd_bwd_ms=both)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)


def sanitize_cases():
    """Small odd-sized calls of every kernel, forward and backward, for compute-sanitizer."""
    torch.manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.float16, requires_grad=True)

    for e in (59, 128, 256):
        q, k, v = t(2, 4, 97, e), t(2, 2, 33, e), t(2, 2, 33, e)
        mask = t(2, 1, 97, 33)
        out = attnx.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.2, enable_gqa=True,
                                                 window=(40, 3), backend="cuda")
        torch.autograd.grad(out.sum(), (q, k, v, mask))
        bmask = torch.rand(97, 33, device="cuda") > 0.5
        out = attnx.scaled_dot_product_attention(q, k, v, bmask, enable_gqa=True, backend="cuda")
        torch.autograd.grad(out.sum(), (q, k, v))
    q, k, value, v = t(3, 2, 17, 70), t(3, 2, 45, 70), t(3, 2, 45, 19), t(70)
    mask = t(3, 2, 17, 45)
    out, w = attnx.additive_attention(q, k, value, v, mask, dropout_p=0.1, window=(5, 9),
                                      backend="cuda", return_weights=True)
    torch.autograd.grad(out.sum() + (w * w).sum(), (q, k, value, v, mask))  # reads grad_weights
    torch.cuda.synchronize()
    print("sanitize cases ran")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sanitize", action="store_true", help="small cases only")
    parser.add_argument("--quick", action="store_true", help="L <= 4k only")
    args = parser.parse_args()
    if args.sanitize:
        sanitize_cases()
        return
    name = torch.cuda.get_device_name()
    rows = [dict(op="gemm_bf16", n=8192, tflops=gemm_tflops())]
    print(json.dumps(rows[0]), flush=True)
    lengths = (1024, 2048, 4096) if args.quick else (1024, 2048, 4096, 8192, 16384)
    bench_sdpa(lengths, rows)
    bench_additive(rows)
    result = dict(gpu=name, torch=torch.__version__, cuda=torch.version.cuda,
                  attnx=attnx.__version__, build=attnx._ops.build_info(), dtype=str(DTYPE),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(), rows=rows)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{slug}-{datetime.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
