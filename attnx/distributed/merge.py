"""Merging attention results over disjoint key sets by their log-sum-exp."""

from __future__ import annotations

import torch


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple:
    """(out, lse) of attention over the union of the key sets that gave (out_a, lse_a) and
    (out_b, lse_b): out = w_a out_a + w_b out_b with w = exp(lse_x - lse).

    A row empty in both (lse = -inf on each side) stays out = 0, lse = -inf: its weights are
    taken against 0 instead of -inf, which gives exp(-inf) = 0 and never -inf - (-inf) = NaN.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1)
    w_a = torch.exp(lse_a.unsqueeze(-1) - ref)
    w_b = torch.exp(lse_b.unsqueeze(-1) - ref)
    return w_a * out_a + w_b * out_b, lse
