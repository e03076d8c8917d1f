"""Float64 ground truth written straight from the formulas, independent of attnx's code.

Masks are applied as an explicit admissibility matrix and softmax as exp / sum, so a bug in
attnx's band folding or masked softmax cannot hide in a shared helper.
"""

from __future__ import annotations

import math

import torch


def admissible(lq, lk, is_causal=False, lower_right=False, window=None, mask=None):
    """Bool (..., lq, lk) of the (query, key) pairs allowed by causal, CausalBias and window."""
    i = torch.arange(lq).view(lq, 1)
    j = torch.arange(lk).view(1, lk)
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if is_causal:
        ok &= j <= i
    if lower_right:
        ok &= j <= i + (lk - lq)
    if window is not None:
        left, right = window
        if left is not None:
            ok &= j >= i - left
        if right is not None:
            ok &= j <= i + right
    if mask is not None and mask.dtype == torch.bool:
        ok = ok & mask
    return ok


def softmax_rows(s, ok):
    """Softmax over the last dim restricted to `ok`; rows with nothing allowed give zeros."""
    s = s.masked_fill(~ok, -math.inf)
    m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    e = torch.exp(s - m) * ok
    denom = e.sum(-1, keepdim=True)
    return torch.where(denom > 0, e / denom.clamp_min(1e-300), torch.zeros_like(e))


def sdpa(q, k, v, mask=None, is_causal=False, scale=None, lower_right=False, window=None,
         keep=None, dropout_p=0.0):
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(g, dim=-3)
    v = v.repeat_interleave(g, dim=-3)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask.double()
    ok = admissible(q.shape[-2], k.shape[-2], is_causal, lower_right, window, mask)
    ok = ok & torch.isfinite(s)
    p = softmax_rows(s, ok)
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    return p @ v


def additive(q, k, value, v, mask=None, is_causal=False, window=None):
    q, k, value, v = q.double(), k.double(), value.double(), v.double()
    if v.dim() == 2 and q.dim() == 4:
        v = v[None, :, None, None, :]
    s = (torch.tanh(q.unsqueeze(-2) + k.unsqueeze(-3)) * v).sum(-1)
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask.double()
    ok = admissible(q.shape[-2], k.shape[-2], is_causal, False, window, mask) & torch.isfinite(s)
    p = softmax_rows(s, ok)
    return p @ value, p
