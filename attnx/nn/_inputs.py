"""The modules' checks of their inputs' feature sizes and dtypes, made before any projection
runs, so that a wrong one raises ValueError / TypeError naming the argument rather than an error
from inside nn.Linear. (Types and layouts: attnx._validate._check_tensor, as the functional ops
check them.)"""

from __future__ import annotations

import inspect
import numbers

import torch

from .._validate import _autocast_dtype, _type_name

# Constructor arguments of torch.nn's attention and transformer modules, checked before torch's
# __init__ runs (which asserts, or fails creating a weight of a negative size, or takes a
# float head count): sizes, counts of at least one (an empty stack failed only in forward, with
# an IndexError), rates, activations.
_SIZES = ("embed_dim", "num_heads", "d_model", "nhead", "dim_feedforward", "num_layers",
          "num_encoder_layers", "num_decoder_layers")
_DIVIDES = (("num_heads", "embed_dim"), ("nhead", "d_model"))


def check_init(base: type, args: tuple, kwargs: dict) -> None:
    """The arguments of `base.__init__` (a torch.nn module class) as bound from args, kwargs:
    each one named here holds what torch's constructor needs (a ValueError or TypeError naming
    it, where torch raises AssertionError, RuntimeError or a TypeError of its own). Unknown
    or missing arguments are left to torch's binding errors."""
    try:
        bound = inspect.signature(base.__init__).bind(None, *args, **kwargs).arguments
    except TypeError:
        return
    for name in (*_SIZES, "kdim", "vdim"):
        x = bound.get(name)
        if name not in bound or (x is None and name in ("kdim", "vdim")):
            continue
        if not isinstance(x, numbers.Integral) or isinstance(x, bool):
            raise TypeError(f"{name}: expected an int, got {_type_name(x)}")
        if x < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {x}")
    for heads, dim in _DIVIDES:
        if heads in bound and dim in bound and bound[dim] % bound[heads]:
            raise ValueError(f"{heads}: expected a divisor of {dim}={bound[dim]}, "
                             f"got {bound[heads]}")
    p = bound.get("dropout", 0.0)
    if not isinstance(p, numbers.Real) or isinstance(p, bool):
        raise TypeError(f"dropout: expected a float, got {_type_name(p)}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: expected a probability in [0, 1], got {p}")
    act = bound.get("activation", "relu")
    if not (callable(act) or act in ("relu", "gelu")):
        raise ValueError(f"activation: expected 'relu', 'gelu' or a callable, got {act!r}")
    dtype = bound.get("dtype")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype: expected None or a floating torch.dtype, got {dtype!r}")


def check_features(name: str, x: torch.Tensor, size: int, what: str) -> None:
    """The last dim of x is the module's `what` (embed_dim, kdim, ...)."""
    if x.shape[-1] != size:
        raise ValueError(f"{name}: expected a last dim of {what}={size}, got shape {tuple(x.shape)}")


def check_dtype(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    """x meets the module's weight in a projection: the same dtype, but under autocast, which
    casts both (torch.nn's modules take a bf16 input into float32 weights there)."""
    if x.dtype != weight.dtype and _autocast_dtype(x) is None:
        raise TypeError(f"{name}: expected dtype {weight.dtype} (the module's), got {x.dtype}")
