"""Argument checking for the public ops: the one place where user input becomes a call record.

Everything a backend receives has been checked here, with errors that name the argument, what
was expected and what was given. Backends may assume: 4-D tensors of one floating dtype on one
device, a mask already broadcast (as a stride-0 view, never copied) to (B, H, Lq, Lk), and the
causal / CausalBias / window constraints folded into one band of admissible keys:

    query i may attend key j  iff  i + window_lo <= j <= i + window_hi
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant

from . import _rng

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BACKEND_NAMES = ("auto", "cuda", "triton", "cpu", "reference")


@dataclass
class SdpaCall:
    q: torch.Tensor  # (B, Hq, Lq, E)
    k: torch.Tensor  # (B, Hkv, Lk, E)
    v: torch.Tensor  # (B, Hkv, Lk, Ev)
    mask: Optional[torch.Tensor]  # (B, Hq, Lq, Lk) view, bool or q.dtype
    scale: float
    window_lo: int
    window_hi: int
    dropout_p: float
    seed: Optional[torch.Tensor]  # int64 (2,) on CPU when 0 < dropout_p < 1
    backend: str
    prefix: tuple  # query.shape[:-2] as the caller gave it: outputs are reshaped back to it
    return_lse: bool


@dataclass
class AdditiveCall:
    q: torch.Tensor  # (B, H, Lq, A)
    k: torch.Tensor  # (B, H, Lk, A)
    value: torch.Tensor  # (B, H, Lk, Ev)
    v: torch.Tensor  # (H, A), possibly a stride-0 view of a (A,) vector
    mask: Optional[torch.Tensor]  # (B, H, Lq, Lk) view, bool or q.dtype
    window_lo: int
    window_hi: int
    dropout_p: float
    seed: Optional[torch.Tensor]
    backend: str
    three_d: bool  # inputs were (B, L, *): drop the head dim on the way out
    return_weights: bool


def _type_name(x) -> str:
    if isinstance(x, CausalBias):
        return f"CausalBias({x.variant.name}, seq_len_q={x.seq_len_q}, seq_len_kv={x.seq_len_kv})"
    if isinstance(x, torch.Tensor):
        return f"Tensor(dtype={x.dtype}, shape={tuple(x.shape)}, device={x.device})"
    t = type(x)  # numpy.bool, not a bare "bool" that reads like Python's own
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _check_bool(name: str, x) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name}: expected a bool, got {_type_name(x)}")
    return x


def _check_tensor(name: str, x, min_dim: int, max_dim: Optional[int] = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {_type_name(x)}")
    _check_dense(name, x)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating dtype (float16, bfloat16, float32, float64), got {x.dtype}")
    if x.dim() < min_dim or (max_dim is not None and x.dim() > max_dim):
        want = f"{min_dim} to {max_dim}" if max_dim and max_dim != min_dim else (
            f"{min_dim}" if max_dim else f"at least {min_dim}")
        raise ValueError(f"{name}: expected {want} dimensions, got shape {tuple(x.shape)}")
    return x


def _check_dense(name: str, x: torch.Tensor) -> None:
    if x.is_nested or x.layout != torch.strided:
        kind = "nested" if x.is_nested else str(x.layout)
        raise TypeError(f"{name}: expected a dense (torch.strided) tensor, got a {kind} tensor")


def _check_same(name: str, x: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if x.dtype != ref.dtype:
        raise TypeError(f"{name}: expected dtype {ref.dtype} (that of {ref_name}), got {x.dtype}")
    if x.device != ref.device:
        raise TypeError(f"{name}: expected device {ref.device} (that of {ref_name}), got {x.device}")


def _check_dropout(dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float, got {_type_name(dropout_p)}")
    p = float(dropout_p)
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"dropout_p: expected 0 <= dropout_p <= 1, got {dropout_p}")
    return p


def _check_backend(backend) -> str:
    if backend is None:
        return "auto"
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected None or one of {BACKEND_NAMES}, got {_type_name(backend)}")
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend: expected None or one of {BACKEND_NAMES}, got {backend!r}")
    return backend


def _band(lq: int, lk: int, is_causal: bool, causal_offset: Optional[int], window) -> tuple:
    """Fold causal, CausalBias and window into (window_lo, window_hi)."""
    lo, hi = -lq, lk  # unbounded: every j - i lies in [-(lq - 1), lk - 1]
    if is_causal:
        hi = 0
    if causal_offset is not None:
        hi = min(hi, causal_offset)
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"window: expected None or a pair (left, right), got {window!r}")
        left, right = window
        for side, w in (("left", left), ("right", right)):
            if w is None:
                continue
            if isinstance(w, bool) or not isinstance(w, numbers.Integral):
                raise TypeError(f"window: expected {side} to be an int >= 0 or None, got {_type_name(w)}")
            if w < 0:
                raise ValueError(f"window: expected {side} >= 0, got {w}")
        if left is not None:
            lo = max(lo, -int(left))
        if right is not None:
            hi = min(hi, int(right))
    return max(lo, -lq), min(hi, lk)


def _check_mask(attn_mask, q: torch.Tensor, target: tuple, lq: int, lk: int):
    """Return (mask tensor or None, causal offset from a CausalBias or None)."""
    if attn_mask is None:
        return None, None
    if isinstance(attn_mask, CausalBias):
        if attn_mask.seq_len_q != lq or attn_mask.seq_len_kv != lk:
            raise ValueError(
                f"attn_mask: expected a CausalBias for (Lq, Lk) = ({lq}, {lk}), got "
                f"({attn_mask.seq_len_q}, {attn_mask.seq_len_kv})")
        offset = 0 if attn_mask.variant == CausalVariant.UPPER_LEFT else lk - lq
        return None, offset
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask: expected None, a Tensor or a CausalBias, got {_type_name(attn_mask)}")
    _check_dense("attn_mask", attn_mask)
    if attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        raise TypeError(f"attn_mask: expected dtype torch.bool or {q.dtype} (that of query), got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise TypeError(f"attn_mask: expected device {q.device} (that of query), got {attn_mask.device}")
    extra = attn_mask.dim() - len(target)
    if extra > 0 and all(n == 1 for n in attn_mask.shape[:extra]):
        # torch accepts leading size-1 dims beyond the inputs' rank (a (1, 1, Lq, Lk) mask
        # with 3-D inputs): they broadcast away
        attn_mask = attn_mask.reshape(attn_mask.shape[extra:])
    try:
        if torch.broadcast_shapes(attn_mask.shape, target) != torch.Size(target):
            raise RuntimeError
    except RuntimeError:
        raise ValueError(
            f"attn_mask: expected a shape that broadcasts to {tuple(target)}, got {tuple(attn_mask.shape)}") from None
    return attn_mask.expand(target), None


def _flatten_lead(x: torch.Tensor, lead: tuple) -> torch.Tensor:
    """(*lead, H, L, D) -> (B, H, L, D) without copying where a view suffices."""
    return x.reshape((math.prod(lead),) + tuple(x.shape[len(lead):]))


def sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
              window, backend, return_lse, seed=None) -> SdpaCall:
    """The validated call; `seed` (for 0 < dropout_p < 1) is drawn here unless given."""
    q = _check_tensor("query", query, 2)
    k = _check_tensor("key", key, 2)
    v = _check_tensor("value", value, 2)
    _check_same("key", k, q, "query")
    _check_same("value", v, q, "query")
    is_causal = _check_bool("is_causal", is_causal)
    enable_gqa = _check_bool("enable_gqa", enable_gqa)
    return_lse = _check_bool("return_lse", return_lse)
    p = _check_dropout(dropout_p)
    backend = _check_backend(backend)

    # The dims before (L, E) broadcast as in torch's function (its matmul): missing leading
    # dims, size-1 batch dims, a single query or key/value head. (L, E) alone is one head.
    rank = max(q.dim(), k.dim(), v.dim())
    q, k, v = (t.reshape((1,) * (max(rank, 3) - t.dim()) + tuple(t.shape)) for t in (q, k, v))
    try:
        lead = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    except RuntimeError:
        raise ValueError(f"key, value: expected batch dims that broadcast with query's "
                         f"{tuple(query.shape)}, got key {tuple(key.shape)} and value "
                         f"{tuple(value.shape)}") from None
    hq, lq, e = q.shape[-3:]
    hk, lk, ek = k.shape[-3:]
    hv, lv, ev = v.shape[-3:]
    if hk != hv and 1 in (hk, hv):  # one key (or value) head for every value (or key) head
        hk = hv = max(hk, hv)
    if hq == 1 and hk > 1:  # one query head against every key/value head
        hq = hk
    q, k, v = q.expand(lead + (hq, lq, e)), k.expand(lead + (hk, lk, ek)), v.expand(lead + (hv, lv, ev))
    prefix = (lead + (hq,))[max(rank, 3) - rank:]
    if ek != e:
        raise ValueError(f"key: expected head dim {e} (that of query), got shape {tuple(key.shape)}")
    if lv != lk:
        raise ValueError(f"value: expected sequence length {lk} (that of key), got shape {tuple(value.shape)}")
    if hv != hk:
        raise ValueError(f"value: expected {hk} heads (those of key), got shape {tuple(value.shape)}")
    if hk != hq and hk != 1:  # one key/value head serves every query head, as torch broadcasts
        if not enable_gqa:
            raise ValueError(f"key: expected {hq} heads (those of query), got {hk}; "
                             f"pass enable_gqa=True for grouped-query attention")
        if hk == 0 or hq % hk != 0:
            raise ValueError(f"key: with enable_gqa=True expected a head count dividing {hq} "
                             f"(that of query), got {hk}")

    if scale is None:  # head dim 0: every score is 0 whatever the scale (torch: uniform weights)
        scale = 1.0 / math.sqrt(e) if e > 0 else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected None or a float, got {_type_name(scale)}")
    elif not math.isfinite(float(scale)):
        raise ValueError(f"scale: expected a finite float, got {scale}")
    scale = float(scale)
    if q.dtype != torch.float64 and abs(scale) > torch.finfo(torch.float32).max:
        # the kernels scale in float32 (float64 only for float64 inputs): inf there, NaN after
        raise ValueError(f"scale: expected a value float32 can hold for {q.dtype} inputs, got {scale}")

    target = lead + (hq, lq, lk)
    mask, causal_offset = _check_mask(attn_mask, q, target, lq, lk)
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask: expected None when is_causal=True (pass one or the other), "
                         f"got {_type_name(attn_mask)}")
    lo, hi = _band(lq, lk, is_causal, causal_offset, window)

    q, k, v = (_flatten_lead(t, lead) for t in (q, k, v))
    if mask is not None:
        mask = _flatten_lead(mask, lead)
    seed = (_rng.draw_seed() if seed is None else seed) if 0 < p < 1 else None
    return SdpaCall(q, k, v, mask, scale, lo, hi, p, seed, backend, prefix, return_lse)


def additive_call(query, key, value, v, attn_mask, dropout_p, is_causal, window, backend,
                  return_weights) -> AdditiveCall:
    q = _check_tensor("query", query, 3, 4)
    k = _check_tensor("key", key, 3, 4)
    val = _check_tensor("value", value, 3, 4)
    vv = _check_tensor("v", v, 1, 2)
    for name, t in (("key", k), ("value", val), ("v", vv)):
        _check_same(name, t, q, "query")
    if not (q.dim() == k.dim() == val.dim()):
        raise ValueError(f"key, value: expected the same number of dimensions as query ({q.dim()}), "
                         f"got key {tuple(k.shape)} and value {tuple(val.shape)}")
    is_causal = _check_bool("is_causal", is_causal)
    return_weights = _check_bool("return_weights", return_weights)
    p = _check_dropout(dropout_p)
    backend = _check_backend(backend)

    three_d = q.dim() == 3
    if three_d:
        q, k, val = q.unsqueeze(1), k.unsqueeze(1), val.unsqueeze(1)
    b, h, lq, a = q.shape
    if a == 0:
        raise ValueError(f"query: expected an attention dim >= 1, got shape {tuple(query.shape)}")
    if tuple(k.shape[:2]) != (b, h) or k.shape[3] != a:
        want = (b, "Lk", a) if three_d else (b, h, "Lk", a)
        raise ValueError(f"key: expected shape {want} to match query, got {tuple(key.shape)}")
    lk = k.shape[2]
    if tuple(val.shape[:3]) != (b, h, lk):
        want = (b, lk, "Ev") if three_d else (b, h, lk, "Ev")
        raise ValueError(f"value: expected shape {want} to match key, got {tuple(value.shape)}")
    if vv.shape[-1] != a or (vv.dim() == 2 and vv.shape[0] != h):
        raise ValueError(f"v: expected shape ({a},) or ({h}, {a}), got {tuple(vv.shape)}")
    vv = vv.expand(h, a)

    target = (b, lq, lk) if three_d else (b, h, lq, lk)
    mask, causal_offset = _check_mask(attn_mask, q, target, lq, lk)
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask: expected None when is_causal=True (pass one or the other), "
                         f"got {_type_name(attn_mask)}")
    if mask is not None and three_d:
        mask = mask.unsqueeze(1)
    lo, hi = _band(lq, lk, is_causal, causal_offset, window)
    seed = _rng.draw_seed() if 0 < p < 1 else None
    return AdditiveCall(q, k, val, vv, mask, lo, hi, p, seed, backend, three_d, return_weights)
