"""`MultiheadAttention`: torch.nn.MultiheadAttention with its attention on attnx's op.

It subclasses the torch class and only replaces `forward`, so the constructor, the parameter
names, `state_dict` and initialisation are torch's own (the same seed gives the same weights).

Differences from torch, all where torch itself is inconsistent or undefined:
- A query row whose keys are all masked returns zeros (torch gives NaN on its slow path and
  zeros or NaN on its fast paths, depending on version and device).
- Under dropout, attnx's keep mask is its own hash of a seed drawn from torch's generator, not
  torch's random stream: the same `torch.manual_seed` drops other elements than torch does.
  `need_weights=True` returns the weights after that dropout, as torch returns them after its.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from attnx import _dispatch

from .._validate import _check_tensor
from ._inputs import check_dtype, check_features, check_init
from ._masks import check_mask, check_mask_type, combine
from ._weights import after_dropout, dropout_seed, softmax_weights, weight_scores


def merge_masks(attn_mask: Optional[torch.Tensor], key_padding_mask: Optional[torch.Tensor],
                batch: int, heads: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """torch.nn masks -> one attnx mask that broadcasts to (N, H, L, S).

    `attn_mask` is (L, S) or (N*H, L, S), `key_padding_mask` (N, S), both in torch.nn's
    convention (bool True = may NOT attend). The result is bool (True = may attend) when both
    are bool, else float; it keeps size-1 dims where the inputs do, so a 2-D mask and a padding
    mask become (N, 1, L, S), never a per-head copy.
    """
    if attn_mask is not None:
        attn_mask = (attn_mask.view(batch, heads, *attn_mask.shape[-2:]) if attn_mask.dim() == 3
                     else attn_mask.view(1, 1, *attn_mask.shape))
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.view(batch, 1, 1, key_padding_mask.shape[-1])
    return combine([attn_mask, key_padding_mask], dtype)


def _pad_key_column(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """One more admissible key (bias_k or the zero key) at the end of a torch.nn mask."""
    if mask is None:
        return None
    return F.pad(mask, (0, 1), value=False if mask.dtype == torch.bool else 0.0)


class MultiheadAttention(torch.nn.MultiheadAttention):
    """Drop-in torch.nn.MultiheadAttention (same signature, parameters and outputs) whose
    attention runs on `attnx.scaled_dot_product_attention`; see this module's docstring for
    the two documented differences (fully-masked rows, dropout's random stream)."""

    def __init__(self, *args, **kwargs):
        check_init(torch.nn.MultiheadAttention, args, kwargs)
        super().__init__(*args, **kwargs)

    __init__.__signature__ = inspect.signature(torch.nn.MultiheadAttention.__init__)
    __init__.__doc__ = torch.nn.MultiheadAttention.__init__.__doc__

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False):
        for name, x in (("query", query), ("key", key), ("value", value)):
            _check_tensor(name, x, 0)  # the ranks: torch's _mha_shape_check below
        check_mask_type("key_padding_mask", key_padding_mask, query.dtype)
        check_mask_type("attn_mask", attn_mask, query.dtype)
        try:
            is_batched = F._mha_shape_check(query, key, value, key_padding_mask, attn_mask,
                                            self.num_heads)
        except AssertionError as e:  # torch's rank checks are asserts: their words, as ValueError
            raise ValueError(str(e)) from None
        if is_causal and attn_mask is None:
            raise ValueError("attn_mask: expected a mask with the is_causal hint (torch.nn's "
                             "rule; Transformer.generate_square_subsequent_mask makes one), got None")
        # on the caller's tensors, whose shapes the messages give (the last dim is the same below)
        check_features("query", query, self.embed_dim, "embed_dim")
        check_features("key", key, self.kdim, "kdim")
        check_features("value", value, self.vdim, "vdim")
        if not is_batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        n, lq, e = query.shape
        h, d = self.num_heads, self.head_dim
        ls = key.shape[1]
        if key.shape[0] != n or value.shape[0] != n:
            raise ValueError(f"key, value: expected batch size {n} (that of query), got key "
                             f"{tuple(key.shape)} and value {tuple(value.shape)} (batch-first)")
        if value.shape[1] != ls:
            raise ValueError(f"value: expected sequence length {ls} (that of key), got "
                             f"{tuple(value.shape)} (batch-first)")
        weight = self.in_proj_weight if self._qkv_same_embed_dim else self.q_proj_weight
        for name, x in (("query", query), ("key", key), ("value", value)):
            check_dtype(name, x, weight)
        check_mask("attn_mask", attn_mask, [(lq, ls), (n * h, lq, ls)], query.dtype)
        check_mask("key_padding_mask", key_padding_mask, [(n, ls)], query.dtype)

        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None,) * 3
        q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

        # torch replaces the mask by is_causal only in this case; elsewhere the mask is used.
        use_causal = is_causal and key_padding_mask is None and not need_weights
        if use_causal:
            attn_mask = None
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.expand(n, 1, e)], dim=1)
            v = torch.cat([v, self.bias_v.expand(n, 1, e)], dim=1)
            attn_mask, key_padding_mask = _pad_key_column(attn_mask), _pad_key_column(key_padding_mask)
        q = q.view(n, lq, h, d).transpose(1, 2)
        k = k.view(n, k.shape[1], h, d).transpose(1, 2)
        v = v.view(n, v.shape[1], h, d).transpose(1, 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(n, h, 1, d)], dim=2)
            v = torch.cat([v, v.new_zeros(n, h, 1, d)], dim=2)
            attn_mask, key_padding_mask = _pad_key_column(attn_mask), _pad_key_column(key_padding_mask)
        mask = merge_masks(attn_mask, key_padding_mask, n, h, q.dtype)

        dropout_p = self.dropout if self.training else 0.0
        seed = dropout_seed(dropout_p) if need_weights else None
        out = _dispatch.sdpa_seeded(seed, q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                    is_causal=use_causal)
        out = F.linear(out.transpose(1, 2).reshape(n, lq, e), self.out_proj.weight, self.out_proj.bias)

        weights = None
        if need_weights:
            weights = softmax_weights(weight_scores(q, k, d ** -0.5), mask, dtype=q.dtype)
            weights = after_dropout(weights, dropout_p, seed)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not is_batched:
                weights = weights.squeeze(0)
        if not is_batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights
