"""The modules' check of their inputs' feature sizes, made before any projection runs, so that
a wrong size raises ValueError naming the argument rather than an error from inside nn.Linear.
(Types, layouts and dtypes: attnx._validate._check_tensor, as the functional ops check them.)"""

from __future__ import annotations

import torch


def check_features(name: str, x: torch.Tensor, size: int, what: str) -> None:
    """The last dim of x is the module's `what` (embed_dim, kdim, ...)."""
    if x.shape[-1] != size:
        raise ValueError(f"{name}: expected a last dim of {what}={size}, got shape {tuple(x.shape)}")
