"""Attention probabilities for `need_weights=True`, computed beside the fused op.

The SDPA kernels return only the output and the lse, so the weights a caller asks for come
from this separate, differentiable softmax over the same scores, mask and band. Rows that
admit no key give zeros, as the fused op does. Under dropout they are the weights after it, as
torch.nn returns them: the op's own keep mask (a hash of a seed the module draws and hands to
the op, see attnx/_rng.py), so that the output is the weights times the values.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _rng
from .._backends import reference
from .._values import values_readable


def band_mask(lq: int, lk: int, window, device, offset: int = 0) -> Optional[torch.Tensor]:
    """Bool (Lq, Lk), True where p - left <= j <= p + right for query i at position p = i +
    offset; None for no window."""
    if window is None:
        return None
    left, right = window
    d = (torch.arange(lk, device=device).view(1, lk)
         - torch.arange(offset, offset + lq, device=device).view(lq, 1))
    keep = torch.ones_like(d, dtype=torch.bool)
    if left is not None:
        keep &= d >= -left
    if right is not None:
        keep &= d <= right
    return keep


def weight_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q k^T * scale, the scores behind the weights; in float64 where the inputs' dtype
    overflows (|q| |k| past its range), as the fused op does: finite inputs never give NaN
    weights. softmax_weights takes either and returns the weights in `dtype`. A graph
    torch.compile traces cannot test the values: float64 there."""
    if torch.compiler.is_compiling() and q.dtype != torch.float64:
        return torch.matmul(q.double() * scale, k.double().transpose(-2, -1))
    s = torch.matmul(q * scale, k.transpose(-2, -1))
    if values_readable(s) and not bool(torch.isfinite(s).all()):
        s = torch.matmul(q.double() * scale, k.double().transpose(-2, -1))
    return s


def softmax_weights(scores: torch.Tensor, mask: Optional[torch.Tensor], window=None,
                    is_causal: bool = False, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """softmax over the last dim of `scores` after an attnx-style mask (bool True = may attend,
    float = added), a window and a causal band; empty rows give zeros. In `dtype` (default:
    that of the scores)."""
    lq, lk = scores.shape[-2:]
    if lk == 0:  # no key at all: every row is empty (and amax would raise)
        return scores.new_zeros(scores.shape)
    s = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        else:
            s = s + mask.to(s.dtype)
    if is_causal:
        window = (None, 0) if window is None else (window[0], 0 if window[1] is None else min(window[1], 0))
    allowed = band_mask(lq, lk, window, s.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    empty = s.amax(dim=-1, keepdim=True) == float("-inf")
    s = torch.where(empty, torch.zeros_like(s), s)
    return torch.softmax(s, dim=-1).masked_fill(empty, 0.0).to(dtype or scores.dtype)


def dropout_seed(p: float) -> Optional[torch.Tensor]:
    """A seed for an op with dropout_p=p (attnx._dispatch.sdpa_seeded), drawn as the op would
    draw it; None when the op draws none (p = 0 or 1)."""
    return _rng.draw_seed() if 0 < p < 1 else None


def after_dropout(weights: torch.Tensor, p: float, seed: Optional[torch.Tensor]) -> torch.Tensor:
    """(B, H, Lq, Lk) weights as the op with dropout_p=p and this seed applied them: kept
    elements scaled by 1 / (1 - p), the others zero."""
    if p == 1:
        return weights * 0
    return reference.apply_dropout(weights, p, seed)
