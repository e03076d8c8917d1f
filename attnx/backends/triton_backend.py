"""The `triton` backend: the Triton kernels of `attnx/triton/` (not written yet)."""

from __future__ import annotations

from typing import Optional


def availability() -> Optional[str]:
    return "the Triton kernels are not written yet"


def unsupported(op: str, call) -> Optional[str]:
    return availability()
