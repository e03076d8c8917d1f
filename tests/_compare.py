"""Error bounds in the style of flash-attention's tests.

A backend's result in some dtype is compared with a float64 golden value; the bound is a small
multiple of the error that plain PyTorch makes on the same inputs in the same dtype (the
baseline), with a floor for dtypes where that error is ~0.
"""

from __future__ import annotations

import torch

import attnx


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def assert_within(actual: torch.Tensor, golden: torch.Tensor, baseline: torch.Tensor,
                  factor: float = 2.0, floor: float = 1e-5, what: str = "output") -> None:
    assert actual.shape == golden.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(golden.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err, base = max_err(actual, golden), max_err(baseline, golden)
    bound = max(floor, factor * base)
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g} (PyTorch's own: {base:.3g})"


def causal_varlen_run(q, k, v, do, cu_q, cu_k, backend, dtype):
    """(out, lse, dq, dk, dv) of a causal `attnx.varlen_attention` on `backend`, its inputs and
    grad_out cast to dtype: the packed past-range tests of test_cuda.py and test_triton.py."""
    leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
    out, lse = attnx.varlen_attention(*leaves, cu_q, cu_k, is_causal=True, backend=backend,
                                      return_lse=True)
    return (out, lse, *torch.autograd.grad(out, leaves, do.to(dtype)))
