"""Merging attention results over disjoint key sets by their log-sum-exp."""

from __future__ import annotations

import torch


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple:
    """(out, lse) of attention over the union of the key sets that gave (out_a, lse_a) and
    (out_b, lse_b): out = w_a out_a + w_b out_b with w_a = exp(lse_a - lse) = sigmoid(lse_a -
    lse_b) and w_b = sigmoid(lse_b - lse_a).

    The sigmoids sum to 1 (within an ulp each) whatever the rounding of the lse, so out stays a
    convex combination of the two: exp(lse_x - lse) against the rounded merged lse did not,
    where |lse| is so large that its rounding is not small against log of the rows' sums
    (float64 scores near 1e16: weights summing to 1.14, outputs past every value attended).
    A row empty in both (lse = -inf on each side, out = 0) stays out = 0, lse = -inf (its
    difference, -inf - (-inf), is taken as 0 instead of NaN).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    d = lse_a - lse_b
    d = torch.where(torch.isinf(lse_a) & (lse_a == lse_b), torch.zeros_like(d), d).unsqueeze(-1)
    return torch.sigmoid(d) * out_a + torch.sigmoid(-d) * out_b, lse
