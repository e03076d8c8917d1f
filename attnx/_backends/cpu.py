"""The `cpu` backend: the fused C++ kernels of `csrc/cpu/`, the default for CPU tensors."""

from __future__ import annotations

from typing import Optional

import torch

from . import native
from .native import additive, kvcache, sdpa, varlen  # noqa: F401

# bfloat16 and float16 compute in float32; the decoding kernel (kvcache) reads a 16-bit cache
# where it lies and widens each block of it as it goes.
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def availability() -> Optional[str]:
    return native.missing_kernel("sdpa", "CPU")


def unsupported(op: str, call) -> Optional[str]:
    if call.q.device.type != "cpu":
        return f"the cpu backend takes CPU tensors, got device {call.q.device}"
    if call.q.dtype not in DTYPES:
        return f"the cpu backend takes float32, float64, bfloat16 and float16, got {call.q.dtype}"
    if op in ("sdpa", "kvcache", "varlen") and call.mods.any():
        return native.missing_kernel(op + "_mod", "CPU")
    return native.missing_kernel(op, "CPU")
