"""The modules' checks of their inputs' feature sizes and dtypes, made before any projection
runs, so that a wrong one raises ValueError / TypeError naming the argument rather than an error
from inside nn.Linear. (Types and layouts: attnx._validate._check_tensor, as the functional ops
check them.)"""

from __future__ import annotations

import torch

from .._validate import _autocast_dtype


def check_features(name: str, x: torch.Tensor, size: int, what: str) -> None:
    """The last dim of x is the module's `what` (embed_dim, kdim, ...)."""
    if x.shape[-1] != size:
        raise ValueError(f"{name}: expected a last dim of {what}={size}, got shape {tuple(x.shape)}")


def check_dtype(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    """x meets the module's weight in a projection: the same dtype, but under autocast, which
    casts both (torch.nn's modules take a bf16 input into float32 weights there)."""
    if x.dtype != weight.dtype and _autocast_dtype(x) is None:
        raise TypeError(f"{name}: expected dtype {weight.dtype} (the module's), got {x.dtype}")
