"""The `cpu` backend: the fused C++ kernels of `csrc/cpu/`, the default for CPU tensors."""

from __future__ import annotations

from typing import Optional

import torch

from . import native
from .native import additive, sdpa  # noqa: F401

DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def availability() -> Optional[str]:
    return native.missing_kernel("sdpa", "CPU")


def unsupported(op: str, call) -> Optional[str]:
    if call.q.device.type != "cpu":
        return f"the cpu backend takes CPU tensors, got device {call.q.device}"
    if call.q.dtype not in DTYPES:
        return f"the cpu backend takes float32, float64 and bfloat16, got {call.q.dtype}"
    return native.missing_kernel(op, "CPU")
