"""The `cpu` backend: the fused C++ kernels of `csrc/cpu/`, the default for CPU tensors."""

from __future__ import annotations

from typing import Optional

import torch

from . import native
from .native import additive, kvcache, sdpa, varlen  # noqa: F401

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
# The decoding kernel reads the cache where it lies: no float32 copy of a bfloat16 cache per
# step (which would cost more than the attention), so it takes what it reads natively.
KVCACHE_DTYPES = (torch.float32, torch.float64)


def availability() -> Optional[str]:
    return native.missing_kernel("sdpa", "CPU")


def unsupported(op: str, call) -> Optional[str]:
    if call.q.device.type != "cpu":
        return f"the cpu backend takes CPU tensors, got device {call.q.device}"
    if call.q.dtype not in DTYPES:
        return f"the cpu backend takes float32, float64 and bfloat16, got {call.q.dtype}"
    if op == "kvcache" and call.q.dtype not in KVCACHE_DTYPES:
        return f"the cpu backend's kvcache kernel takes float32 and float64, got {call.q.dtype}"
    if op in ("sdpa", "kvcache", "varlen") and call.mods.any():
        return native.missing_kernel(op + "_mod", "CPU")
    return native.missing_kernel(op, "CPU")
