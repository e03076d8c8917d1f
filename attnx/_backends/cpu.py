"""The `cpu` backend: the fused C++ kernels of `csrc/cpu/`, the default for CPU tensors."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .._validate import AdditiveCall
from . import native
from .native import kvcache, sdpa, varlen  # noqa: F401

# bfloat16 and float16 compute in float32; the decoding kernel (kvcache) reads a 16-bit cache
# where it lies and widens each block of it as it goes.
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def availability() -> Optional[str]:
    return native.missing_kernel("sdpa", "CPU")


def unsupported(op: str, call) -> Optional[str]:
    if not call.q.is_cpu:
        return f"the cpu backend takes CPU tensors, got device {call.q.device}"
    if call.q.dtype not in DTYPES:
        return f"the cpu backend takes float32, float64, bfloat16 and float16, got {call.q.dtype}"
    if op in ("sdpa", "kvcache", "varlen") and call.mods.any():
        return native.missing_kernel(op + "_mod", "CPU")
    return native.missing_kernel(op, "CPU")


def additive(call: AdditiveCall):
    """native.additive, with a v shared by the heads (stride 0 over them: attnx/_validate.py
    expands a v of shape (A,)) going in as float64 where its gradient is wanted. Autograd sums
    the per-head gradients the op returns, in v's dtype: a float32 call whose heads' gradients
    pass float32's range (the op reruns in float64 then) had them rounded to +-inf before that
    sum, NaN where the sum is finite. The kernels read v in their own dtype (exact: the values
    came from q's dtype or float32)."""
    v = call.v
    if (v.dtype != torch.float64 and v.shape[0] > 1 and v.stride(0) == 0 and v.requires_grad
            and torch.is_grad_enabled()):
        call = dataclasses.replace(call, v=v[0].double().expand(v.shape))
    return native.additive(call)
