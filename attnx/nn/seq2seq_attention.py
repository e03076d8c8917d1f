"""`Attention`: the alignment scores of RNN sequence-to-sequence models, on attnx's ops.

With query s_i (B, Lq, query_dim), keys h_j (B, Lk, key_dim) and values (the keys by default),
each score below is followed by the masks, a softmax over j and the context
c_i = sum_j a_ij value_j (no output projection: that is the decoder's business).

- "additive" / "concat" (Bahdanau et al. 2015): v^T tanh(W_a s_i + U_a h_j), W_a and U_a
  without bias, projecting to `attn_dim` (default: key_dim). Runs on attnx.additive_attention.
- "dot" (Luong et al. 2015): s_i^T h_j (query_dim == key_dim).
- "general" (Luong): s_i^T W_a h_j, computed as (W_a^T s_i)^T h_j.
- "scaled_dot" (Vaswani et al. 2017): s_i^T h_j / sqrt(d).
- "cosine" (Graves et al. 2014, content addressing): beta * cos(s_i, h_j) with `beta` the
  learnable parameter `sharpness` (a positive scalar, initialised to `sharpness`), i.e.
  softmax of beta * cosine; the op runs with scale=1 on the normalised vectors.
- "location" (Luong): softmax over positions of W_a s_i, keys' content unused. W_a projects
  to `max_len` positions; for Lk keys the first Lk scores are used (the rest are masked out),
  so any Lk <= max_len works. Runs on the SDPA op with zero-width scores and W_a s_i as an
  additive mask.
- `window=(left, right)`: Luong's local attention, "local-m" flavour: the aligned position of
  query i is i itself (monotonic alignment), and only keys i-left..i+right are attended. A
  decoder that runs one step at a time passes its step as `forward(..., query_offset=t)`:
  query i is then position t + i.

Masks follow torch.nn.MultiheadAttention: `key_padding_mask` (B, Lk) and `attn_mask` (Lq, Lk)
or (B, Lq, Lk), bool True = may NOT attend, or float added to the scores. Rows with no
admissible key give a zero context. With `num_heads=H` the projected queries and keys (and the
values) are split into H equal parts, each head attends on its own, and the contexts are
concatenated; the weights then come back as (B, H, Lq, Lk) instead of (B, Lq, Lk). In
training with dropout, the weights are those after dropout (every score alike), so the context
is always the weights times the values.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import attnx
from attnx import _dispatch

from .._validate import _autocast_dtype, _check_dropout, _check_same, _check_tensor, _windowed
from ._inputs import check_dtype, check_features
from ._masks import check_mask, combine
from ._weights import after_dropout, band_mask, dropout_seed, softmax_weights, weight_scores

SCORES = ("additive", "concat", "dot", "general", "scaled_dot", "cosine", "location")


def _attnx_mask(attn_mask, key_padding_mask, dtype, band=None) -> Optional[torch.Tensor]:
    """torch.nn-convention masks (and `band`, (Lq, Lk) bool True = outside the window) -> one
    attnx mask broadcasting to (B, 1, Lq, Lk)."""
    masks = [] if band is None else [band]
    if attn_mask is not None:
        masks.append(attn_mask.unsqueeze(-3) if attn_mask.dim() == 3 else attn_mask)
    if key_padding_mask is not None:
        masks.append(key_padding_mask[:, None, None, :])
    return combine(masks, dtype)


class Attention(nn.Module):
    """Sequence-to-sequence attention with a choice of alignment score (see the module doc)."""

    def __init__(self, query_dim: int, key_dim: int, score: str = "additive",
                 attn_dim: Optional[int] = None, num_heads: int = 1, dropout: float = 0.0,
                 window=None, *, max_len: int = 256, sharpness: float = 1.0):
        super().__init__()
        sizes = [("query_dim", query_dim), ("key_dim", key_dim), ("attn_dim", attn_dim),
                 ("num_heads", num_heads), ("max_len", max_len if score == "location" else None)]
        for name, n in sizes:
            if n is None:
                continue
            # any integer nn.Linear takes (numpy's included), not a bool
            if isinstance(n, bool) or not hasattr(n, "__index__"):
                raise TypeError(f"{name}: expected an int, got {type(n).__name__}")
            if operator.index(n) < 1:
                raise ValueError(f"{name}: expected >= 1, got {n}")
        if score not in SCORES:
            raise ValueError(f"score: expected one of {SCORES}, got {score!r}")
        _windowed(0, 0, window)  # checked here, not at the first forward
        self.score = "additive" if score == "concat" else score
        self.query_dim, self.key_dim, self.num_heads = query_dim, key_dim, num_heads
        self.dropout, self.window, self.max_len = _check_dropout(dropout, "dropout"), window, max_len
        if self.score in ("dot", "scaled_dot", "cosine") and query_dim != key_dim:
            raise ValueError(f"score={score!r}: expected query_dim == key_dim, got {query_dim} and {key_dim}")
        if self.score == "additive":
            self.attn_dim = attn_dim if attn_dim is not None else key_dim
            self.W_a = nn.Linear(query_dim, self.attn_dim, bias=False)
            self.U_a = nn.Linear(key_dim, self.attn_dim, bias=False)
            self.v = nn.Parameter(torch.empty(num_heads, self.attn_dim // num_heads))
            nn.init.uniform_(self.v, -1 / math.sqrt(self.attn_dim), 1 / math.sqrt(self.attn_dim))
            split = self.attn_dim
        elif self.score == "general":
            self.W_a = nn.Linear(query_dim, key_dim, bias=False)
            split = key_dim
        elif self.score == "location":
            self.W_a = nn.Linear(query_dim, num_heads * max_len)
            split = num_heads
        else:
            split = key_dim
        if self.score == "cosine":
            self.sharpness = nn.Parameter(torch.tensor(float(sharpness)))
        if split % num_heads:
            raise ValueError(f"num_heads: expected a divisor of {split} for score={score!r}, got {num_heads}")

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, l, d = x.shape
        return x.view(b, l, self.num_heads, d // self.num_heads).transpose(1, 2)

    def project_key(self, key: torch.Tensor) -> torch.Tensor:
        """The keys as the score consumes them (U_a h for "additive", unit vectors for
        "cosine", h itself otherwise). A decoder that attends to the same keys at every step
        computes this once and passes it as `forward(..., projected_key=...)`."""
        if self.score == "additive":
            return self.U_a(key)
        if self.score == "cosine":  # each head's slice a unit vector, as its queries are
            b, lk, d = key.shape
            heads = key.reshape(b, lk, self.num_heads, d // self.num_heads)
            return F.normalize(heads, dim=-1).reshape(b, lk, d)
        return key

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: Optional[torch.Tensor] = None,
                key_padding_mask: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None, need_weights: bool = False, *,
                projected_key: Optional[torch.Tensor] = None, query_offset: int = 0):
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x is None and name == "value":
                continue
            if _check_tensor(name, x, 0).dim() != 3:
                raise ValueError(f"{name}: expected a (B, L, dim) tensor, got shape {tuple(x.shape)}")
        check_features("query", query, self.query_dim, "query_dim")
        check_features("key", key, self.key_dim, "key_dim")
        if self.score in ("additive", "general", "location"):  # the query meets W_a
            check_dtype("query", query, self.W_a.weight)
        if self.score == "additive":  # U_a meets the key, unless projected_key stands for it,
            # and the op takes every input in v's dtype
            for name, x in (("key", key if projected_key is None else None), ("value", value),
                            ("projected_key", projected_key)):
                if x is not None:
                    check_dtype(name, x, self.W_a.weight)
        if value is None and _autocast_dtype(query) is None:
            _check_same("key", key, query, "query")  # the keys are the values too (autocast
            # casts both: torch's GRU gives float32 beside bf16 projections there)
        b, lq, _ = query.shape
        lk = key.shape[1]
        if key.shape[0] != b:
            raise ValueError(f"key: expected batch size {b} (that of query), got shape {tuple(key.shape)}")
        if value is not None and value.shape[:2] != key.shape[:2]:
            raise ValueError(f"value: expected (B, Lk) = {tuple(key.shape[:2])} leading dims (those of "
                             f"key), got shape {tuple(value.shape)}")
        if projected_key is not None:
            want = (b, lk, self.attn_dim if self.score == "additive" else self.key_dim)
            if tuple(_check_tensor("projected_key", projected_key, 0).shape) != want:
                raise ValueError(f"projected_key: expected shape {want} (project_key(key)'s), got "
                                 f"{tuple(projected_key.shape)}")
        check_mask("attn_mask", attn_mask, [(lq, lk), (b, lq, lk)], query.dtype)
        check_mask("key_padding_mask", key_padding_mask, [(b, lk)], query.dtype)
        if isinstance(query_offset, bool) or not hasattr(query_offset, "__index__"):
            raise TypeError(f"query_offset: expected an int, got {type(query_offset).__name__}")
        if operator.index(query_offset) < 0:
            raise ValueError(f"query_offset: expected >= 0, got {query_offset}")
        value = key if value is None else value
        pk = self.project_key(key) if projected_key is None else projected_key
        if value.shape[-1] % self.num_heads:
            raise ValueError(f"value: expected a last dim divisible by num_heads={self.num_heads}, "
                             f"got shape {tuple(value.shape)}")
        window, band = self.window, None
        if window is not None and query_offset > 0:
            # the ops' windows are relative to query i's own index: a shifted band is a mask
            band, window = ~band_mask(lq, lk, window, query.device, operator.index(query_offset)), None
        mask = _attnx_mask(attn_mask, key_padding_mask, query.dtype, band)
        dropout_p = self.dropout if self.training else 0.0
        vh = self._heads(value)
        weights = None
        # (under autocast the projections come out in its dtype beside the inputs and v as they
        # were: the ops cast them, as torch's SDPA is cast)

        if self.score == "additive":
            qa, ka = self._heads(self.W_a(query)), self._heads(pk)
            res = attnx.additive_attention(qa, ka, vh, self.v, attn_mask=mask, dropout_p=dropout_p,
                                           window=window, return_weights=need_weights)
            out, weights = res if need_weights else (res, None)
        else:
            if self.score == "location":
                if lk > self.max_len:
                    raise ValueError(f"key: expected at most max_len={self.max_len} positions, got {lk}")
                pos = self.W_a(query).view(b, lq, self.num_heads, self.max_len)[..., :lk]
                scores = pos.permute(0, 2, 1, 3)  # (B, H, Lq, Lk), additive mask of zero scores
                mask = scores if mask is None else (
                    scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask)
                q = query.new_zeros(b, self.num_heads, lq, 1)
                k = query.new_zeros(b, self.num_heads, lk, 1)
                if _autocast_dtype(query) is not None:  # the projection's scores as a
                    mask = mask.float()  # float32 mask (added in float32, not autocast's dtype)
                scale = 1.0
            else:
                q = self._heads(self.W_a(query) if self.score == "general" else query)
                k = self._heads(pk)
                scale = None if self.score == "scaled_dot" else 1.0
                if self.score == "cosine":
                    q = F.normalize(q, dim=-1) * self.sharpness
            seed = dropout_seed(dropout_p) if need_weights else None
            out = _dispatch.sdpa_seeded(seed, q, k, vh, attn_mask=mask, dropout_p=dropout_p,
                                        scale=scale, window=window)
            if need_weights:
                s = q.new_zeros(b, self.num_heads, lq, lk) if self.score == "location" else \
                    weight_scores(q, k, q.shape[-1] ** -0.5 if scale is None else scale)
                weights = softmax_weights(s, mask, window, dtype=out.dtype)  # (autocast's)
                weights = after_dropout(weights, dropout_p, seed)
        out = out.transpose(1, 2).reshape(b, lq, value.shape[-1])
        if weights is not None and self.num_heads == 1:
            weights = weights.squeeze(1)
        return out, weights
