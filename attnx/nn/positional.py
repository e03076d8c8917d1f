"""The sinusoidal positional encoding of "Attention Is All You Need" (section 3.5)."""

from __future__ import annotations

import math
import operator

import torch
from torch import nn

from .._validate import _check_dropout, _check_tensor
from ._inputs import check_features


def _table(max_len: int, d_model: int) -> torch.Tensor:
    """PE[:max_len] in float64."""
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos * inv_freq)
    pe[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
    return pe


class PositionalEncoding(nn.Module):
    """x + PE[:L], then dropout, with PE(pos, 2i) = sin(pos / 10000^(2i/d_model)) and
    PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)); an odd d_model drops the last cosine.

    The table is the buffer `pe` of shape (max_len, d_model), in the default dtype until the
    module's dtype changes (then the formula's is rounded from float64 again). Inputs are (L, N, E), or
    (N, L, E) with `batch_first=True`, or (L, E).
    """

    def __init__(self, d_model: int, dropout: float = 0.0, max_len: int = 5000, *,
                 batch_first: bool = False):
        super().__init__()
        for name, n in (("d_model", d_model), ("max_len", max_len)):
            if isinstance(n, bool) or not hasattr(n, "__index__"):  # numpy ints too, not bools
                raise TypeError(f"{name}: expected an int, got {type(n).__name__}")
            if operator.index(n) < 1:
                raise ValueError(f"{name}: expected >= 1, got {n}")
        self.dropout = nn.Dropout(_check_dropout(dropout, "dropout"))
        self.batch_first = batch_first
        self.register_buffer("pe", _table(max_len, d_model).to(torch.get_default_dtype()))

    def _apply(self, fn, *args, **kwargs):
        # A change of dtype (.double(), .half(), .to(dtype)) rounds the formula's table from
        # float64 again, not from its float32 copy: float64 inputs then get a float64-accurate
        # encoding. A table that is not the formula's (loaded, edited) is only cast.
        before = self.pe
        super()._apply(fn, *args, **kwargs)
        if self.pe.dtype != before.dtype and not before.is_meta:
            table = _table(*before.shape)
            if torch.equal(before.cpu(), table.to(before.dtype)):
                self.pe = table.to(self.pe.device, self.pe.dtype)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _check_tensor("x", x, 2).dim() > 3:
            raise ValueError(f"x: expected (L, E), (L, N, E) or (N, L, E), got shape {tuple(x.shape)}")
        check_features("x", x, self.pe.shape[1], "d_model")
        seq_dim = 1 if (self.batch_first and x.dim() == 3) else 0
        length = x.shape[seq_dim]
        if length > self.pe.shape[0]:
            raise ValueError(f"x: expected at most max_len={self.pe.shape[0]} positions, got {length}")
        pe = self.pe[:length].to(x.dtype)
        if x.dim() == 3 and seq_dim == 0:
            pe = pe.unsqueeze(1)
        return self.dropout(x + pe)
