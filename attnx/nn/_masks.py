"""torch.nn's mask convention -> attnx's.

torch.nn modules take bool masks where True means "may NOT attend" and float masks that are
added to the scores; attnx's ops take bool True = "may attend". Masks are combined as torch
combines them (all bool: a position is out if any mask rules it out; any float: every mask is
made additive, -inf for a ruled-out position, and summed), keeping broadcast dims, so no
per-head copy is made.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from .._validate import _autocast_dtype, _check_dense


def check_mask_type(name: str, mask, dtype: torch.dtype) -> None:
    """None, or a dense bool tensor, or a float one of `dtype` (the inputs'), float32 or, under
    autocast, its dtype: the functional ops' rule (torch adds a float32 mask to half-precision
    scores in float32; autocast casts the others). A
    mask of another float dtype would be rounded to the inputs' on its way, a float64 bias of
    1e300 to inf (NaN out), where torch refuses it."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name}: expected a Tensor or None, got {type(mask).__name__}")
    _check_dense(name, mask)
    if mask.dtype not in (torch.bool, torch.float32, dtype, _autocast_dtype(mask)):
        also = "" if dtype == torch.float32 else f" or {dtype} (that of the inputs)"
        raise TypeError(f"{name}: expected a mask of dtype torch.bool, torch.float32{also}, "
                        f"got {mask.dtype}")


@contextlib.contextmanager
def named_as(**names: str):
    """The ValueErrors and TypeErrors raised inside under the caller's argument names: a layer's
    src_mask reaches its attention as attn_mask, whose checks name that
    (named_as(attn_mask="src_mask")). The checks' messages start with the argument's name."""
    try:
        yield
    except (ValueError, TypeError) as e:
        name, sep, rest = str(e).partition(": ")
        if type(e) not in (ValueError, TypeError) or not sep or name not in names:
            raise
        raise type(e)(f"{names[name]}: {rest}") from e


def check_mask(name: str, mask: Optional[torch.Tensor], shapes: Sequence[tuple],
               dtype: torch.dtype) -> None:
    """torch.nn's rules for a mask argument: None, or a bool or float tensor (check_mask_type)
    of one of `shapes` (an integer 0/1 mask would otherwise be added to the scores as a bias)."""
    if mask is None:
        return
    check_mask_type(name, mask, dtype)
    # compared, never hashed: a traced batch or length is symbolic, and hashing it makes
    # torch.compile specialize to its value (torch.export refuses it outright)
    if not any(tuple(mask.shape) == tuple(s) for s in shapes):
        expected = " or ".join(str(tuple(s)) for s in shapes)
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(mask.shape)}")


def combine(masks: Sequence[Optional[torch.Tensor]], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """torch.nn-convention masks, already shaped to broadcast together -> one attnx mask.
    Float masks are summed in `dtype` (the query's), or in float32 at least where one of them
    is float32: torch adds a float32 mask to half-precision scores in float32. Two finite
    biases whose sum passes the dtype's largest (2e38 + 2e38 in float32) saturate there:
    torch's sum is +inf, and the softmax's NaN. A sum past the most negative stays -inf, as
    torch's: a key masked by two finfo.min masks is out, where one masked once is only
    unlikely (a row masked everywhere spreads its weight over the latter, as torch's does)."""
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    if all(m.dtype == torch.bool for m in masks):
        allowed = ~masks[0]
        for m in masks[1:]:
            allowed = allowed & ~m
        return allowed
    if any(m.dtype == torch.float32 for m in masks):
        dtype = torch.promote_types(dtype, torch.float32)
    total = None
    for m in masks:
        f = (torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
             if m.dtype == torch.bool else m.to(dtype))
        total = f if total is None else total + f
    if sum(m.dtype != torch.bool for m in masks) > 1:
        # +inf from finite terms (a bool mask's ruled-out position is -inf, never +inf)
        overflowed = total == float("inf")
        for m in masks:
            if m.dtype != torch.bool:
                overflowed = overflowed & m.isfinite()
        total = torch.where(overflowed, torch.finfo(dtype).max, total)
    return total
