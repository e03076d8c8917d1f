"""Small odd-sized calls of every attnx GPU kernel, forward and backward, for compute-sanitizer.

    python scripts/gpu_sanitize_cases.py cuda triton
    compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/gpu_sanitize_cases.py cuda triton

SDPA with a float mask (its gradient too), dropout, GQA and a window; with a bool mask; causal;
head dims off the kernels' tile sizes (59) and at them (128); several key blocks (300 keys); additive attention with a mask,
dropout, a window and its weights' gradient; packed sequences (varlen). Sizes are small so
that a sanitizer run takes seconds. Run it once without the sanitizer first with TRITON_CACHE_AUTOTUNING=1 (as
scripts/gpu_check.sh does): the Triton autotuner then reads its choice from the disk cache
instead of timing every config under the sanitizer (so the sanitizer sees the configs the
autotuner picked, not every config).

Without a GPU, `TRITON_INTERPRET=1` runs the triton cases on CPU tensors in Triton's
interpreter: a check of this script itself (tests/test_gpu_check.py), not of memory safety.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import attnx  # noqa: E402

BACKENDS = ("cuda", "triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tensors(seed: int):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def t(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=torch.float16, generator=gen).requires_grad_()
    return t, gen


def sdpa_cases(backend: str) -> None:
    t, gen = _tensors(0)
    torch.manual_seed(0)  # the dropout seeds
    for e in (59, 128):
        q, k, v = t(2, 4, 97, e), t(2, 2, 33, e), t(2, 2, 33, e)
        mask = t(2, 1, 97, 33)
        out = attnx.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.2, enable_gqa=True,
                                                 window=(40, 3), backend=backend)
        torch.autograd.grad(out.sum(), (q, k, v, mask))
        bmask = torch.rand(97, 33, device=DEVICE, generator=gen) > 0.5
        out = attnx.scaled_dot_product_attention(q, k, v, bmask, enable_gqa=True, backend=backend)
        torch.autograd.grad(out.sum(), (q, k, v))
        out = attnx.scaled_dot_product_attention(q[:, :2, :33], k, v, is_causal=True, backend=backend)
        torch.autograd.grad(out.sum(), (q, k, v))
    # several key blocks of the backward (128 keys on sm_90 at D 64-128), interior ones too
    q, k, v = t(1, 2, 200, 64), t(1, 2, 300, 64), t(1, 2, 300, 64)
    out = attnx.scaled_dot_product_attention(q, k, v, backend=backend)
    torch.autograd.grad(out.sum(), (q, k, v))


def additive_cases(backend: str) -> None:
    t, _ = _tensors(1)
    torch.manual_seed(1)
    q, k, value, w = t(3, 2, 17, 70), t(3, 2, 45, 70), t(3, 2, 45, 19), t(70)
    mask = t(3, 2, 17, 45)
    out, weights = attnx.additive_attention(q, k, value, w, mask, dropout_p=0.1, window=(5, 9),
                                            backend=backend, return_weights=True)
    torch.autograd.grad(out.sum() + (weights * weights).sum(), (q, k, value, w, mask))


def varlen_cases(backend: str) -> None:
    """Packed sequences of odd lengths (an empty one, one without keys, Lq != Lk), causal GQA
    with dropout, then a window with softcap, sinks and (cuda) ALiBi: the kernels' modifier
    instantiations."""
    t, _ = _tensors(2)
    torch.manual_seed(2)
    lens = [(17, 40), (0, 3), (97, 97), (5, 0), (1, 64)]
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n[side] for n in lens)],
                               dtype=torch.int32, device=DEVICE) for side in (0, 1))
    q, k, v = t(int(cu_q[-1]), 4, 59), t(int(cu_k[-1]), 2, 59), t(int(cu_k[-1]), 2, 59)
    out = attnx.varlen_attention(q, k, v, cu_q, cu_k, dropout_p=0.2, is_causal=True,
                                 backend=backend)
    torch.autograd.grad(out.sum(), (q, k, v))
    sinks = torch.zeros(4, device=DEVICE, requires_grad=True)
    # triton takes ALiBi in varlen only where every sequence has Lq == Lk (these do not)
    slopes = torch.full((4,), 0.25, device=DEVICE) if backend == "cuda" else None
    out = attnx.varlen_attention(q, k, v, cu_q, cu_k, window=(20, 0), softcap=5.0,
                                 alibi_slopes=slopes, sinks=sinks, backend=backend)
    torch.autograd.grad(out.sum(), (q, k, v, sinks))


def main(argv=None) -> int:
    """Runs every group of cases of each backend named; one that raises is reported and the
    others still run (so that a compile error in one kernel leaves the rest sanitized)."""
    names = list(sys.argv[1:] if argv is None else argv) or list(BACKENDS)
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        print(f"gpu_sanitize_cases.py: unknown backends {unknown}; choose from {BACKENDS}",
              file=sys.stderr)
        return 2
    status = attnx.backends()
    ran = failed = 0
    for name in names:
        if not status[name].usable:
            print(f"{name}: not run: {status[name].reason}")
            continue
        for group in (sdpa_cases, additive_cases, varlen_cases):
            try:
                group(name)
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                print(f"{name} {group.__name__}: ran")
                ran += 1
            except Exception as exc:
                print(f"{name} {group.__name__}: FAILED: {type(exc).__name__}: {str(exc)[:500]}")
                failed += 1
    return 0 if ran and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
