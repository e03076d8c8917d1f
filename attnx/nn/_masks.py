"""torch.nn's mask convention -> attnx's.

torch.nn modules take bool masks where True means "may NOT attend" and float masks that are
added to the scores; attnx's ops take bool True = "may attend". Masks are combined as torch
combines them (all bool: a position is out if any mask rules it out; any float: every mask is
made additive, -inf for a ruled-out position, and summed), keeping broadcast dims, so no
per-head copy is made.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def combine(masks: Sequence[Optional[torch.Tensor]], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """torch.nn-convention masks, already shaped to broadcast together -> one attnx mask."""
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    if all(m.dtype == torch.bool for m in masks):
        allowed = ~masks[0]
        for m in masks[1:]:
            allowed = allowed & ~m
        return allowed
    total = None
    for m in masks:
        f = (torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
             if m.dtype == torch.bool else m.to(dtype))
        total = f if total is None else total + f
    return total
