"""The modules' checks of their tensor arguments, made before any projection runs, so that bad
input raises ValueError/TypeError naming the argument rather than an error from deep inside
nn.Linear or a view."""

from __future__ import annotations

import torch

from .._validate import _check_dense


def check_tensor(name: str, x, optional: bool = False) -> None:
    """A dense floating-point tensor (or None where `optional`)."""
    if x is None and optional:
        return
    if not isinstance(x, torch.Tensor):
        expected = "a Tensor or None" if optional else "a Tensor"
        raise TypeError(f"{name}: expected {expected}, got {type(x).__name__}")
    _check_dense(name, x)
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")


def check_features(name: str, x: torch.Tensor, size: int, what: str) -> None:
    """The last dim of x is the module's `what` (embed_dim, kdim, ...)."""
    if x.shape[-1] != size:
        raise ValueError(f"{name}: expected a last dim of {what}={size}, got shape {tuple(x.shape)}")

