"""The `cuda` backend: the CUDA C++ kernels of `csrc/cuda/`, the default for CUDA tensors."""

from __future__ import annotations

from typing import Optional

import torch

from . import native
from .native import additive, sdpa  # noqa: F401

DTYPES = (torch.float16, torch.bfloat16)
SDPA_HEAD_DIMS = (32, 64, 96, 128, 256)


def availability() -> Optional[str]:
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    return native.missing_kernel("sdpa", "CUDA")


def unsupported(op: str, call) -> Optional[str]:
    if call.q.device.type != "cuda":
        return f"the cuda backend takes CUDA tensors, got device {call.q.device}"
    if call.q.dtype not in DTYPES:
        return f"the cuda backend takes float16 and bfloat16, got {call.q.dtype}"
    if op == "sdpa":
        dims = (call.q.shape[-1], call.v.shape[-1])
        if any(d not in SDPA_HEAD_DIMS for d in dims):
            return f"the cuda backend takes head dims {SDPA_HEAD_DIMS}, got (E, Ev) = {dims}"
    return native.missing_kernel(op, "CUDA")
