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
import sys
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch.nn.attention.bias import CausalBias, CausalVariant

from . import _rng

try:  # the plain decoding call's checks in one native call (_plain_kvcache_call)
    from . import _C as _native
except ImportError:  # a source checkout that was never built: the full checks only
    _native = None
from ._values import values_readable

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BACKEND_NAMES = ("auto", "cuda", "triton", "cpu", "reference")
AUTOCAST_DEVICES = ("cpu", "cuda")  # where attnx's kernels run (torch's autocast has more)


class Modifiers(NamedTuple):  # a tuple: torch.compile traces it on every supported torch
    """The score modifiers of API.md, checked. With s the scaled score of query i and key j:
    s <- softcap tanh(s / softcap), then s <- s - alibi[b, h] |i + alibi_offset - j| (0 for SDPA's
    top-left alignment; the KV-cache op aligns bottom-right), then the mask; `sinks[h]` joins
    every row's softmax denominator."""
    softcap: Optional[float] = None
    alibi: Optional[torch.Tensor] = None  # float32 (B, Hq), possibly a stride-0 view of (Hq,)
    sinks: Optional[torch.Tensor] = None  # (Hq,), float32 or q's dtype; may require grad

    def any(self) -> bool:
        return self.softcap is not None or self.alibi is not None or self.sinks is not None

    def names(self) -> tuple:
        """The modifiers given, by their argument names."""
        return tuple(n for n, x in (("softcap", self.softcap), ("alibi_slopes", self.alibi),
                                    ("sinks", self.sinks)) if x is not None)


NO_MODIFIERS = Modifiers()


def _finite(x: float) -> bool:
    """math.isfinite(x), in a form torch.compile traces where x is symbolic (a float argument
    under dynamic=True, or once automatic dynamic shapes made it one): dynamo cannot call
    math.isfinite on a SymFloat, and a comparison becomes a guard. NaN compares false."""
    return abs(x) <= sys.float_info.max


def _is_int(x) -> bool:
    """x is an integer (numbers.Integral) other than a bool, or a torch.SymInt (a size under
    torch.export's non-strict tracing, where dynamo would have made it a constant: a window
    edge from a shape, as transformers' attention computes it). A Python int answers at once:
    the ABC's isinstance took ~13 us of a call once a model's weights had flushed the caches (a
    decoding step's validation asks per layer), an exact type test ~2."""
    return type(x) is int or isinstance(x, torch.SymInt) or (
        isinstance(x, numbers.Integral) and not isinstance(x, bool))


def _is_real(x) -> bool:
    """x is a real number (numbers.Real) other than a bool; a Python float or int at once."""
    return type(x) in (float, int) or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def _to_float(name: str, x: numbers.Real, expected: str) -> float:
    """float(x), where an int too large for a float raises naming the argument (float() raises
    OverflowError with no name)."""
    try:
        return float(x)
    except OverflowError:
        raise ValueError(f"{name}: expected {expected}, got an integer of {int(x).bit_length()} "
                         "bits, too large for a float") from None


def _check_softcap(softcap, dtype: torch.dtype) -> Optional[float]:
    if softcap is None:
        return None
    if not _is_real(softcap):
        raise TypeError(f"softcap: expected None or a float > 0, got {_type_name(softcap)}")
    c = _to_float("softcap", softcap, "a finite float > 0")
    if not (_finite(c) and c > 0):
        raise ValueError(f"softcap: expected a finite float > 0, got {softcap}")
    if dtype != torch.float64 and c > torch.finfo(torch.float32).max:
        raise ValueError(f"softcap: expected a value float32 can hold for {dtype} inputs, got {softcap}")
    if dtype != torch.float64:
        # the kernels cap in float32, where a cap below its smallest normal would round to 0, which
        # they read as "no cap"; at that size every capped score rounds to 0 either way
        c = max(c, torch.finfo(torch.float32).tiny)
    return c


def _check_modifiers(softcap, alibi_slopes, sinks, q: torch.Tensor, b: int, hq: int) -> Modifiers:
    """The modifiers of a call whose (flattened) batch is b with hq query heads."""
    if softcap is None and alibi_slopes is None and sinks is None:
        return NO_MODIFIERS
    cap = _check_softcap(softcap, q.dtype)
    alibi = None
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(f"alibi_slopes: expected None or a float32 torch.Tensor, got {_type_name(alibi_slopes)}")
        _check_dense("alibi_slopes", alibi_slopes)
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes: expected dtype torch.float32, got {alibi_slopes.dtype}")
        if alibi_slopes.device != q.device:
            raise TypeError(f"alibi_slopes: expected device {q.device} (that of the query), got {alibi_slopes.device}")
        if tuple(alibi_slopes.shape) not in ((hq,), (b, hq)):
            raise ValueError(f"alibi_slopes: expected shape ({hq},) or ({b}, {hq}), got {tuple(alibi_slopes.shape)}")
        alibi = alibi_slopes.detach().expand(b, hq)  # constants: no gradient flows to them
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"sinks: expected None or a torch.Tensor, got {_type_name(sinks)}")
        _check_dense("sinks", sinks)
        if sinks.dtype not in (torch.float32, q.dtype):
            also = "" if q.dtype == torch.float32 else f" or {q.dtype} (that of the query)"
            raise TypeError(f"sinks: expected dtype torch.float32{also}, got {sinks.dtype}")
        if sinks.device != q.device:
            raise TypeError(f"sinks: expected device {q.device} (that of the query), got {sinks.device}")
        if tuple(sinks.shape) != (hq,):
            raise ValueError(f"sinks: expected shape ({hq},), got {tuple(sinks.shape)}")
        # The kernels read sinks[h] at h (Triton read a strided view's wrong entries); the
        # copy stays on the caller's graph.
        sinks = sinks.contiguous()
    if cap is None and alibi is None and sinks is None:
        return NO_MODIFIERS
    return Modifiers(cap, alibi, sinks)


@dataclass
class SdpaCall:
    q: torch.Tensor  # (B, Hq, Lq, E)
    k: torch.Tensor  # (B, Hkv, Lk, E)
    v: torch.Tensor  # (B, Hkv, Lk, Ev)
    mask: Optional[torch.Tensor]  # (B, Hq, Lq, Lk) view: bool, float32 or q.dtype
    scale: float
    window_lo: int
    window_hi: int
    dropout_p: float
    seed: Optional[torch.Tensor]  # int64 (2,) on CPU when 0 < dropout_p < 1
    backend: str
    prefix: tuple  # query.shape[:-2] as the caller gave it: outputs are reshaped back to it
    return_lse: bool
    mods: Modifiers = NO_MODIFIERS  # score modifiers: softcap, ALiBi (top-left), sinks


@dataclass
class AdditiveCall:
    q: torch.Tensor  # (B, H, Lq, A)
    k: torch.Tensor  # (B, H, Lk, A)
    value: torch.Tensor  # (B, H, Lk, Ev)
    v: torch.Tensor  # (H, A), possibly a stride-0 view of a (A,) vector
    mask: Optional[torch.Tensor]  # (B, H, Lq, Lk) view: bool, float32 or q.dtype
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


def device_type(x: torch.Tensor) -> str:
    """x.device.type, without building a torch.device for a CPU tensor (a quarter of a
    microsecond each time; a small call asks several times)."""
    return "cpu" if x.is_cpu else x.device.type


def _autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype torch's autocast runs its SDPA in (one of its lower-precision ops) on x's
    device, or None where autocast is off there."""
    kind = device_type(x)
    if kind not in AUTOCAST_DEVICES or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def _autocast(dtype: Optional[torch.dtype], x, keep_float32: bool = False):
    """x as autocast gives it to torch's SDPA: a floating tensor in `dtype` (None: autocast is
    off), float64 as it is. keep_float32: masks and sinks, which the kernels take in float32 with
    any query dtype (and add more exactly than in `dtype`), stay float32."""
    if (dtype is None or not isinstance(x, torch.Tensor) or isinstance(x, CausalBias)
            or not x.is_floating_point()
            or x.dtype in (dtype, torch.float64) or (keep_float32 and x.dtype == torch.float32)):
        return x
    return x.to(dtype)


def _check_dense(name: str, x: torch.Tensor) -> None:
    if x.is_nested or x.layout != torch.strided:
        kind = "nested" if x.is_nested else str(x.layout)
        raise TypeError(f"{name}: expected a dense (torch.strided) tensor, got a {kind} tensor")


def _check_same(name: str, x: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    if x.dtype != ref.dtype:
        raise TypeError(f"{name}: expected dtype {ref.dtype} (that of {ref_name}), got {x.dtype}")
    if not (x.is_cpu and ref.is_cpu) and x.device != ref.device:
        raise TypeError(f"{name}: expected device {ref.device} (that of {ref_name}), got {x.device}")


def _number(x):
    """A 0-d real tensor as its Python number (torch's functions take one where they take a
    float: scale, dropout_p); anything else as it is, for the checks to judge: one that
    requires grad (torch refuses it too: its gradient would be lost) or a meta one (no value)."""
    if (isinstance(x, torch.Tensor) and x.dim() == 0 and x.dtype != torch.bool
            and not x.is_complex() and not x.requires_grad and x.device.type != "meta"):
        return x.item()
    return x


def _check_dropout(dropout_p, name: str = "dropout_p") -> float:
    if type(dropout_p) is float and 0.0 <= dropout_p <= 1.0:  # the usual case, at once
        return dropout_p
    dropout_p = _number(dropout_p)
    if not _is_real(dropout_p):
        raise TypeError(f"{name}: expected a float, got {_type_name(dropout_p)}")
    p = _to_float(name, dropout_p, f"0 <= {name} <= 1")
    if not (0.0 <= p <= 1.0):
        raise ValueError(f"{name}: expected 0 <= {name} <= 1, got {dropout_p}")
    return p


def _check_backend(backend) -> str:
    if backend is None:
        return "auto"
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected None or one of {BACKEND_NAMES}, got {_type_name(backend)}")
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend: expected None or one of {BACKEND_NAMES}, got {backend!r}")
    return backend


# A band's open edge: a constant, not the lengths (every j - i lies in [-(Lq - 1), Lk - 1]), so
# that a graph torch.compile traces does not specialize to the sequence lengths through the
# ops' int arguments (a recompile per length, then eager past dynamo's limit). Every kernel
# clamps the band to its own shapes before using it (far from overflow in i + lo there).
UNBOUNDED = 1 << 40


def _band(is_causal: bool, causal_offset: Optional[int], window) -> tuple:
    """Fold causal, CausalBias and window into (window_lo, window_hi)."""
    lo, hi = -UNBOUNDED, UNBOUNDED
    if is_causal:
        hi = 0
    if causal_offset is not None:
        hi = min(hi, causal_offset)
    lo, hi = _windowed(lo, hi, window)
    return max(lo, -UNBOUNDED), min(hi, UNBOUNDED)


def _windowed(lo: int, hi: int, window) -> tuple:
    """(lo, hi) narrowed by window=(left, right), checked."""
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"window: expected None or a pair (left, right), got {window!r}")
        left, right = window
        for side, w in (("left", left), ("right", right)):
            if w is None:
                continue
            if not _is_int(w):
                raise TypeError(f"window: expected {side} to be an int >= 0 or None, got {_type_name(w)}")
            if w < 0:
                raise ValueError(f"window: expected {side} >= 0, got {w}")
        if left is not None:
            lo = max(lo, -int(left))
        if right is not None:
            hi = min(hi, int(right))
    return lo, hi


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
    # torch's rule: bool, float32 (added in float32 whatever the query's dtype), or q's dtype
    if attn_mask.dtype not in (torch.bool, torch.float32, q.dtype):
        also = "" if q.dtype == torch.float32 else f" or {q.dtype} (that of query)"
        raise TypeError(f"attn_mask: expected dtype torch.bool, torch.float32{also}, "
                        f"got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise TypeError(f"attn_mask: expected device {q.device} (that of query), got {attn_mask.device}")
    extra = attn_mask.dim() - len(target)
    if extra > 0 and all(n == 1 for n in attn_mask.shape[:extra]):
        # torch accepts leading size-1 dims beyond the inputs' rank (a (1, 1, Lq, Lk) mask
        # with 3-D inputs): they broadcast away
        attn_mask = attn_mask.reshape(attn_mask.shape[extra:])
    if _broadcast(attn_mask.shape, target) != tuple(target):
        raise ValueError(
            f"attn_mask: expected a shape that broadcasts to {tuple(target)}, got {tuple(attn_mask.shape)}")
    return attn_mask.expand(target), None


def _flatten_lead(x: torch.Tensor, lead: tuple) -> torch.Tensor:
    """(*lead, H, L, D) -> (B, H, L, D) without copying where a view suffices."""
    if len(lead) == 1:
        return x
    return x.reshape((math.prod(lead),) + tuple(x.shape[len(lead):]))


def _broadcast(*shapes) -> Optional[tuple]:
    """torch's broadcast of the shapes, or None where they do not broadcast. Plain Python:
    torch.broadcast_shapes goes through its symbolic-shape machinery (~10 us a call, a third
    of a small attention call's validation)."""
    first = tuple(shapes[0])
    if all(tuple(s) == first for s in shapes[1:]):  # the usual case, at a fifth of the cost
        return first
    n = max(len(s) for s in shapes)
    out = []
    for dims in zip(*(((1,) * (n - len(s))) + tuple(s) for s in shapes)):
        size = 1  # (compared, never hashed: export's symbolic sizes are not hashable)
        for d in dims:
            if d != 1:
                if size != 1 and d != size:
                    return None
                size = d
        out.append(size)
    return tuple(out)


def sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
              window, backend, return_lse, seed=None, *, softcap=None, alibi_slopes=None,
              sinks=None, names=("query", "key", "value")) -> SdpaCall:
    """The validated call; `seed` (for 0 < dropout_p < 1) is drawn here unless given. `names`:
    the caller's names of the three tensors, for its messages (ring_attention's q, k, v)."""
    Q, K, V = names
    q = _check_tensor(Q, query, 2)
    k = _check_tensor(K, key, 2)
    v = _check_tensor(V, value, 2)
    amp = _autocast_dtype(q)
    if amp is not None:
        q, k, v = (_autocast(amp, t) for t in (q, k, v))
        attn_mask, sinks = _autocast(amp, attn_mask, True), _autocast(amp, sinks, True)
    _check_same(K, k, q, Q)
    _check_same(V, v, q, Q)
    is_causal = _check_bool("is_causal", is_causal)
    enable_gqa = _check_bool("enable_gqa", enable_gqa)
    return_lse = _check_bool("return_lse", return_lse)
    p = _check_dropout(dropout_p)
    backend = _check_backend(backend)

    # The dims before (L, E) broadcast as in torch's function (its matmul): missing leading
    # dims, size-1 batch dims, a single query or key/value head. (L, E) alone is one head.
    rank = max(q.dim(), k.dim(), v.dim())
    r3 = max(rank, 3)
    if not q.dim() == k.dim() == v.dim() == r3:
        q, k, v = (t if t.dim() == r3 else t.reshape((1,) * (r3 - t.dim()) + tuple(t.shape))
                   for t in (q, k, v))
    lead = _broadcast(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    if lead is None:
        raise ValueError(f"{K}, {V}: expected batch dims that broadcast with {Q}'s "
                         f"{tuple(query.shape)}, got {K} {tuple(key.shape)} and {V} "
                         f"{tuple(value.shape)}")
    hq, lq, e = q.shape[-3:]
    hk, lk, ek = k.shape[-3:]
    hv, lv, ev = v.shape[-3:]
    if hk != hv and 1 in (hk, hv) and 0 not in (hk, hv):  # one key (value) head for every value (key) head
        hk = hv = max(hk, hv)
    if hq == 1 and hk > 1:  # one query head against every key/value head
        hq = hk
    q, k, v = (t if t.shape == shape else t.expand(shape)
               for t, shape in ((q, lead + (hq, lq, e)), (k, lead + (hk, lk, ek)), (v, lead + (hv, lv, ev))))
    prefix = (lead + (hq,))[r3 - rank:]
    if ek != e:
        raise ValueError(f"{K}: expected head dim {e} (that of {Q}), got shape {tuple(key.shape)}")
    if lv != lk:
        raise ValueError(f"{V}: expected sequence length {lk} (that of {K}), got shape {tuple(value.shape)}")
    if hv != hk:
        raise ValueError(f"{V}: expected {hk} heads (those of {K}), got shape {tuple(value.shape)}")
    if hk != hq and hk != 1:  # one key/value head serves every query head, as torch broadcasts
        if not enable_gqa:
            raise ValueError(f"{K}: expected {hq} heads (those of {Q}), got {hk}; "
                             f"pass enable_gqa=True for grouped-query attention")
        if hk == 0 or hq % hk != 0:
            raise ValueError(f"{K}: expected a head count dividing {hq} (that of {Q}) for "
                             f"grouped-query attention, got {hk}")

    scale = _check_scale(scale, e, q.dtype)

    target = lead + (hq, lq, lk)
    mask, causal_offset = _check_mask(attn_mask, q, target, lq, lk)
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask: expected None when is_causal=True (pass one or the other), "
                         f"got {_type_name(attn_mask)}")
    lo, hi = _band(is_causal, causal_offset, window)

    q, k, v = (_flatten_lead(t, lead) for t in (q, k, v))
    if mask is not None:
        mask = _flatten_lead(mask, lead)
    mods = _check_modifiers(softcap, alibi_slopes, sinks, q, q.shape[0], hq)
    seed = (_rng.draw_seed() if seed is None else seed) if 0 < p < 1 else None
    return SdpaCall(q, k, v, mask, scale, lo, hi, p, seed, backend, prefix, return_lse, mods)


def additive_call(query, key, value, v, attn_mask, dropout_p, is_causal, window, backend,
                  return_weights) -> AdditiveCall:
    q = _check_tensor("query", query, 3, 4)
    k = _check_tensor("key", key, 3, 4)
    val = _check_tensor("value", value, 3, 4)
    vv = _check_tensor("v", v, 1, 2)
    amp = _autocast_dtype(q)
    if amp is not None:
        q, k, val, vv = (_autocast(amp, t) for t in (q, k, val, vv))
        attn_mask = _autocast(amp, attn_mask, True)
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
    if vv.dim() == 1 and h > 1 and vv.dtype in (torch.float16, torch.bfloat16):
        # Autograd sums a shared v's per-head gradients (expand's backward) in v's dtype: past
        # float16's range each head's was inf, and their sum NaN where it is finite. In float32
        # the sum is, and the cast to v's dtype comes once, after (the kernels take float32 v).
        vv = vv.float()
    vv = vv.expand(h, a)

    target = (b, lq, lk) if three_d else (b, h, lq, lk)
    mask, causal_offset = _check_mask(attn_mask, q, target, lq, lk)
    if is_causal and attn_mask is not None:
        raise ValueError("attn_mask: expected None when is_causal=True (pass one or the other), "
                         f"got {_type_name(attn_mask)}")
    if mask is not None and three_d:
        mask = mask.unsqueeze(1)
    lo, hi = _band(is_causal, causal_offset, window)
    seed = _rng.draw_seed() if 0 < p < 1 else None
    return AdditiveCall(q, k, val, vv, mask, lo, hi, p, seed, backend, three_d, return_weights)


@dataclass
class KvcacheCall:
    """attention_with_kvcache after validation. Key j of sequence b (0 <= j < seqlens[b]) lies
    at k_cache[b, :, j] (contiguous) or k_cache[block_table[b, j // bs], :, j % bs] (paged);
    query i may attend it iff i + d + window_lo <= j <= i + d + window_hi, d = seqlens[b] - Lq
    (the band aligned bottom-right)."""
    q: torch.Tensor  # (B, Hq, Lq, E)
    k_cache: torch.Tensor  # (B, Hkv, Lmax, E) or (num_blocks, Hkv, block_size, E)
    v_cache: torch.Tensor  # (B, Hkv, Lmax, Ev) or (num_blocks, Hkv, block_size, Ev)
    cache_seqlens: torch.Tensor  # int32 (B,): tokens cached before this call's k, v
    seqlens: torch.Tensor  # int32 (B,): keys attended, cache_seqlens + Lnew
    k: Optional[torch.Tensor]  # (B, Hkv, Lnew, E), written into the cache before attending
    v: Optional[torch.Tensor]
    block_table: Optional[torch.Tensor]  # int32 (B, max_blocks), paged caches only
    scale: float
    window_lo: int
    window_hi: int
    backend: str
    return_lse: bool
    mods: Modifiers = NO_MODIFIERS  # ALiBi aligned bottom-right: offset seqlens[b] - Lq
    # seqlens as Python ints where validation read or was given them (one for every sequence
    # where cache_seqlens was an int); None where it could not (fake or meta lengths)
    lens: Optional[tuple] = None


def _check_index_tensor(name: str, x, shape: tuple, device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected an int32 torch.Tensor, got {_type_name(x)}")
    _check_dense(name, x)
    if x.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {x.dtype}")
    if x.device != device:
        raise TypeError(f"{name}: expected device {device} (that of q), got {x.device}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
    return x


# The largest |scale| of a float32, bfloat16 or float16 call: float32's max over log2(e).
MAX_FLOAT32_SCALE = torch.finfo(torch.float32).max / math.log2(math.e)


def _check_scale(scale, e: int, dtype: torch.dtype) -> float:
    scale = _number(scale)
    if scale is None:  # head dim 0: every score is 0 whatever the scale (torch: uniform weights)
        return 1.0 / math.sqrt(e) if e > 0 else 1.0
    if not _is_real(scale):
        raise TypeError(f"scale: expected None or a float, got {_type_name(scale)}")
    value = _to_float("scale", scale, "a finite float")
    if not _finite(value):
        raise ValueError(f"scale: expected a finite float, got {scale}")
    if dtype != torch.float64 and abs(value) > MAX_FLOAT32_SCALE:
        # the kernels scale in float32 (float64 only for float64 inputs), the GPU ones times
        # log2(e) (their exponentials are exp2): past this, inf there and NaN after
        raise ValueError(f"scale: expected a value whose product with log2(e) float32 can hold "
                         f"(|scale| <= {MAX_FLOAT32_SCALE:.4g}) for {dtype} inputs, got {scale}")
    return value


_INT32_MAX = 2**31 - 1


def _may_self_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of t may share memory, from shape and strides alone (which
    torch.compile traces with fullgraph=True): dims of more than one element, by increasing
    stride, each stepping past all the smaller dims' span (a dense or permuted tensor, a slice
    of one), or not."""
    if t.is_contiguous():
        return False
    # by increasing stride, picked by comparisons: dynamo's fullgraph refuses sorted() with a
    # key when the strides are symbolic (dynamic=True)
    dims = [(n, st) for n, st in zip(t.shape, t.stride()) if n > 1]
    span = 0  # of the dims taken so far, in elements, less one
    while dims:
        first = 0
        for i in range(1, len(dims)):
            if dims[i][1] < dims[first][1]:
                first = i
        n, st = dims.pop(first)
        if st <= span:
            return True
        span += (n - 1) * st
    return False


def may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b may share memory: the same storage and overlapping byte spans."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))  # strides are >= 0
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def may_share_an_element(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b may share an element: their spans overlap (may_overlap) and, for views
    of equal shape, strides and dtype whose dims each step past the span of those with smaller
    strides (the k and v halves of one (B, 2, H, L, E) or (pages, 2, H, block, E) buffer,
    whose spans interleave), their offset is one of the view's own (sum_n i_n stride_n,
    |i_n| < size_n); other overlapping spans count as sharing."""
    if not may_overlap(a, b):
        return False
    if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
        return True
    offset, size = b.data_ptr() - a.data_ptr(), a.element_size()
    if offset % size:
        return True
    dims = sorted(((st, n) for n, st in zip(a.shape, a.stride()) if n > 1), reverse=True)
    reach = [0] * len(dims)  # how far the dims after each one reach
    for i in range(len(dims) - 1, 0, -1):
        reach[i - 1] = reach[i] + (dims[i][1] - 1) * dims[i][0]
        if dims[i - 1][0] <= reach[i - 1]:
            return True

    def position(rest: int, i: int) -> bool:  # whether rest is sum_{m >= i} i_m stride_m
        if i == len(dims):
            return rest == 0
        stride, n = dims[i]
        # the stride passes what the later dims reach: at most these two candidates
        return any(abs(c) < n and abs(rest - c * stride) <= reach[i]
                   and position(rest - c * stride, i + 1)
                   for c in (rest // stride, rest // stride + 1))

    return position(offset // size, 0)


# The band of a plain decoding call (no window), by is_causal: what _band gives.
_PLAIN_BANDS = {True: (-UNBOUNDED, 0), False: (-UNBOUNDED, UNBOUNDED)}
# The largest block table whose used ids the short path reads (a larger one goes to the full
# checks' slice and reduction): a bound on the time a step spends reading ids.
_PLAIN_TABLE_IDS = 1 << 16


def _plain_kvcache_call(q, k_cache, v_cache, cache_seqlens, k, v, block_table, is_causal, scale,
                        window, softcap, alibi_slopes, sinks, backend,
                        return_lse) -> Optional[KvcacheCall]:
    """The call kvcache_call would return, where the arguments are plainly valid: a decoding
    step's usual call (dense CPU tensors of one floating dtype, a contiguous cache or a paged one
    with a block table of up to _PLAIN_TABLE_IDS ids, lengths within it as int32 or an int, no
    new keys, no window or modifiers, eager); None for anything else, which kvcache_call then
    checks in full (and raises for, naming the argument).

    Why a second reading: a decoding step runs this once per layer, after the layer's weights
    have flushed the caches, where each helper function, torch call and tensor attribute costs
    microseconds of misses. The full checks took ~185 us a call so (Emerald Rapids, after a
    512 MiB read), a sixth of a 16 MiB cache's attention, ~270 us paged; the tensors' checks
    here are one native call (csrc/kvcache_plain_args.cpp), ~50 us in all. Each condition
    implies the full path's check of it, so that the two give the same call
    (tests/test_kvcache_plain_call.py compares them)."""
    T = torch.Tensor
    given = type(cache_seqlens) is int  # (HF's decoding step passes the cache's length)
    if not (k is None and v is None and window is None and softcap is None
            and alibi_slopes is None and sinks is None
            and type(q) is T and type(k_cache) is T and type(v_cache) is T
            and (type(cache_seqlens) is T or given and 0 <= cache_seqlens <= _INT32_MAX)
            and (block_table is None or type(block_table) is T)
            and type(is_causal) is bool and type(return_lse) is bool
            and (backend is None or type(backend) is str and backend in BACKEND_NAMES)
            and (scale is None or type(scale) is float and abs(scale) <= MAX_FLOAT32_SCALE)
            and _native is not None and not torch.compiler.is_compiling()):
        return None  # (NaN fails the scale's bound; dynamo cannot trace the native call)
    checked = _native.plain_kvcache_args(q, k_cache, v_cache, None if given else cache_seqlens,
                                         cache_seqlens if given else 0, block_table,
                                         _PLAIN_TABLE_IDS)
    if checked is None:
        return None
    lens, cache_seqlens, seqlens, e = checked
    if scale is None:
        scale = 1.0 / math.sqrt(e) if e > 0 else 1.0
    lo, hi = _PLAIN_BANDS[is_causal]
    return KvcacheCall(q, k_cache, v_cache, cache_seqlens, seqlens, None, None, block_table,
                       scale, lo, hi, "auto" if backend is None else backend, return_lse,
                       NO_MODIFIERS, lens)


def kvcache_call(q, k_cache, v_cache, cache_seqlens, k, v, block_table, is_causal, scale,
                 window, softcap, alibi_slopes, sinks, backend, return_lse) -> KvcacheCall:
    """The validated call. Everything, the cache's capacity and the block table's ids included,
    is checked here, before the caller writes k and v into the cache."""
    call = _plain_kvcache_call(q, k_cache, v_cache, cache_seqlens, k, v, block_table, is_causal,
                               scale, window, softcap, alibi_slopes, sinks, backend, return_lse)
    if call is not None:
        return call
    q = _check_tensor("q", q, 4, 4)
    k_cache = _check_tensor("k_cache", k_cache, 4, 4)
    v_cache = _check_tensor("v_cache", v_cache, 4, 4)
    _check_same("k_cache", k_cache, q, "q")
    _check_same("v_cache", v_cache, q, "q")
    is_causal = _check_bool("is_causal", is_causal)
    return_lse = _check_bool("return_lse", return_lse)
    backend = _check_backend(backend)
    b, hq, lq, e = q.shape
    slots, hkv, depth, ek = k_cache.shape  # depth: Lmax, or block_size when paged
    ev = v_cache.shape[-1]
    if ek != e:
        raise ValueError(f"k_cache: expected head dim {e} (that of q), got shape {tuple(k_cache.shape)}")
    if tuple(v_cache.shape[:3]) != (slots, hkv, depth):
        raise ValueError(f"v_cache: expected shape {(slots, hkv, depth, 'Ev')} (that of k_cache), "
                         f"got {tuple(v_cache.shape)}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"k_cache: expected a head count dividing {hq} (that of q), got {hkv}")

    if block_table is None:
        if slots != b:
            raise ValueError(f"k_cache: expected batch size {b} (that of q) for a contiguous cache, "
                             f"got shape {tuple(k_cache.shape)}")
        capacity = depth
    else:
        if not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table: expected None or an int32 torch.Tensor, got {_type_name(block_table)}")
        if block_table.dim() != 2 or block_table.shape[0] != b:
            raise ValueError(f"block_table: expected shape ({b}, max_blocks), got {tuple(block_table.shape)}")
        block_table = _check_index_tensor("block_table", block_table, tuple(block_table.shape), q.device)
        if depth == 0:
            raise ValueError(f"k_cache: expected a block size >= 1, got shape {tuple(k_cache.shape)}")
        capacity = block_table.shape[1] * depth

    lens = None  # the lengths as Python ints, where known without reading a tensor
    if _is_int(cache_seqlens):
        if not 0 <= cache_seqlens <= min(capacity, _INT32_MAX):  # (the tensor holds int32)
            raise ValueError(f"cache_seqlens: expected an int in [0, {min(capacity, _INT32_MAX)}] "
                             f"(the cache's capacity, within int32), got {cache_seqlens}")
        lens = [int(cache_seqlens)]  # every sequence's (not one per row: b may be symbolic)
        cache_seqlens = torch.full((b,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    else:
        cache_seqlens = _check_index_tensor("cache_seqlens", cache_seqlens, (b,), q.device)

    if (k is None) != (v is None):
        raise ValueError(f"k, v: expected both or neither, got k {_type_name(k)} and v {_type_name(v)}")
    lnew = 0
    if k is not None:
        k = _check_tensor("k", k, 4, 4)
        v = _check_tensor("v", v, 4, 4)
        _check_same("k", k, q, "q")
        _check_same("v", v, q, "q")
        lnew = k.shape[2]
        if tuple(k.shape) != (b, hkv, lnew, e):
            raise ValueError(f"k: expected shape {(b, hkv, 'Lnew', e)}, got {tuple(k.shape)}")
        if tuple(v.shape) != (b, hkv, lnew, ev):
            raise ValueError(f"v: expected shape {(b, hkv, lnew, ev)}, got {tuple(v.shape)}")
        if values_readable(k_cache) and may_share_an_element(k_cache, v_cache):
            # v's write would overwrite k's (a traced graph, meta and fake tensors cannot say
            # where their storage lies)
            raise ValueError("v_cache: expected memory apart from k_cache's to write k, v into, "
                             "got caches that overlap")
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            # slots sharing memory (an expanded cache, an as_strided view) would each take
            # several sequences' or positions' new keys, the last write winning
            if _may_self_overlap(cache):
                raise ValueError(f"{name}: expected a cache whose slots do not share memory to "
                                 f"write k, v into, got strides {cache.stride()} for shape "
                                 f"{tuple(cache.shape)}")

    # Python ints, one read for every check (a decoding step runs these per layer per token:
    # tensor reductions here cost more than a short cache's attention); an int needs none, so
    # that torch.compile traces such a call (transformers' decoding steps) without reading
    # values. Meta and fake lengths hold none: shapes only (while torch.compile traces, the
    # read stays, a graph break).
    if lens is None and (torch.compiler.is_compiling() or values_readable(cache_seqlens)):
        lens = cache_seqlens.tolist()
    if b > 0 and lens is not None:
        if min(lens) < 0:
            raise ValueError(f"cache_seqlens: expected values >= 0, got {lens}")
        if max(lens) + lnew > capacity:
            raise ValueError(f"cache_seqlens: cached tokens plus the {lnew} new ones must fit the "
                             f"cache's capacity of {capacity} positions, got cache_seqlens {lens}")
        if max(lens) + lnew > _INT32_MAX:  # the kernels' lengths (a stride-0 table's capacity)
            raise ValueError(f"cache_seqlens: cached tokens plus the {lnew} new ones must stay "
                             f"within int32 ({_INT32_MAX}), got cache_seqlens {lens}")
    seqlens = cache_seqlens + lnew if lnew else cache_seqlens.contiguous()  # kernels index it
    if block_table is not None and b > 0 and lens is not None:
        # only the blocks that hold some key of the sequence: tables are often padded with -1.
        # Where every sequence uses as many (B = 1, a batch of equal lengths) one slice and one
        # reduction: a decoding step runs this per layer, and in a model's step each tensor op
        # costs tens of microseconds (cold caches), as much as a short cache's attention.
        used = [-(-(n + lnew) // depth) for n in lens]
        if min(used) == max(used):
            ids = block_table[:, :used[0]]
        else:
            counts = torch.tensor(used, dtype=torch.int64).view(-1, 1)
            ids = block_table.to("cpu")[torch.arange(block_table.shape[1]).view(1, -1) < counts]
        # (fake and meta tensors hold no ids to read: FakeTensorMode makes the table's slice
        # fake; while torch.compile traces, the read stays, a graph break)
        if ids.numel() and (torch.compiler.is_compiling() or values_readable(ids)):
            # (two int() calls, not a generator over the pair: while torch.compile traced, the
            # generator's graph break let fake values through and the check passed, the ids -1
            # then indexing the cache's last block)
            low, high = torch.aminmax(ids)
            low, high = int(low), int(high)
            if low < 0 or high >= slots:
                raise ValueError(f"block_table: expected block ids in [0, {slots}) where the "
                                 f"sequences have keys, got ids from {low} to {high}")

    scale = _check_scale(scale, e, q.dtype)
    mods = _check_modifiers(softcap, alibi_slopes, sinks, q, b, hq)
    # The band relative to the bottom-right diagonal d = n - Lq (every j - (i + d) lies in
    # [-(n - 1), Lq - 1]); the kernels clamp it to [-(capacity + Lq), capacity + Lq]
    lo, hi = _band(is_causal, None, window)
    return KvcacheCall(q, k_cache, v_cache, cache_seqlens, seqlens, k, v, block_table, scale,
                       lo, hi, backend, return_lse, mods,
                       None if lens is None else tuple(n + lnew for n in lens))


@dataclass
class VarlenCall:
    """varlen_attention after validation. Sequence n is query rows cu_q[n]:cu_q[n+1] and key rows
    cu_k[n]:cu_k[n+1]; its query i (local) may attend its key j (local) iff
    i + d + window_lo <= j <= i + d + window_hi, d = Lk_n - Lq_n (the band aligned
    bottom-right in each sequence). Tokens of different sequences never attend to each other."""
    q: torch.Tensor  # (total_q, Hq, E)
    k: torch.Tensor  # (total_k, Hkv, E)
    v: torch.Tensor  # (total_k, Hkv, Ev)
    cu_q: torch.Tensor  # int32 (N + 1,), on q's device
    cu_k: torch.Tensor
    lens: tuple  # ((Lq_n, Lk_n), ...) as Python ints, read once here
    scale: float
    window_lo: int
    window_hi: int
    dropout_p: float
    seed: Optional[torch.Tensor]
    backend: str
    return_lse: bool
    mods: Modifiers = NO_MODIFIERS  # alibi (N, Hq): one row per sequence, aligned bottom-right


def _check_cu_seqlens(name: str, cu, total: int, device) -> list:
    """The prefix sums as a list of ints: int32, 1-D, from 0, non-decreasing, ending at total."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name}: expected an int32 torch.Tensor, got {_type_name(cu)}")
    _check_dense(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype torch.int32, got {cu.dtype}")
    if cu.device != device:
        raise TypeError(f"{name}: expected device {device} (that of q), got {cu.device}")
    if cu.dim() != 1 or cu.numel() == 0:
        raise ValueError(f"{name}: expected shape (N + 1,) with N >= 0, got {tuple(cu.shape)}")
    if cu.device.type == "meta":  # the call's shapes depend on the values
        raise TypeError(f"{name}: expected a tensor with values, got one on the meta device")
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name}: expected to start at 0, got {values[0]}")
    steps = [b - a for a, b in zip(values, values[1:])]
    if any(s < 0 for s in steps):
        n = next(i for i, s in enumerate(steps) if s < 0)
        raise ValueError(f"{name}: expected non-decreasing values, got {values[n]} then {values[n + 1]} "
                         f"at positions {n} and {n + 1}")
    if values[-1] != total:
        raise ValueError(f"{name}: expected to end at the total number of tokens, {total}, got {values[-1]}")
    return steps


def _check_max_seqlen(name: str, hint, lens: list) -> None:
    if hint is None:
        return
    if not _is_int(hint):
        raise TypeError(f"{name}: expected None or an int, got {_type_name(hint)}")
    longest = max(lens, default=0)
    if hint < longest:
        raise ValueError(f"{name}: expected at least the longest sequence's {longest} tokens, got {hint}")


def varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                is_causal, scale, window, softcap, alibi_slopes, sinks, backend,
                return_lse) -> VarlenCall:
    q = _check_tensor("q", q, 3, 3)
    k = _check_tensor("k", k, 3, 3)
    v = _check_tensor("v", v, 3, 3)
    amp = _autocast_dtype(q)
    if amp is not None:
        q, k, v = (_autocast(amp, t) for t in (q, k, v))
        sinks = _autocast(amp, sinks, True)
    _check_same("k", k, q, "q")
    _check_same("v", v, q, "q")
    is_causal = _check_bool("is_causal", is_causal)
    return_lse = _check_bool("return_lse", return_lse)
    p = _check_dropout(dropout_p)
    backend = _check_backend(backend)
    total_q, hq, e = q.shape
    total_k, hkv, ek = k.shape
    if ek != e:
        raise ValueError(f"k: expected head dim {e} (that of q), got shape {tuple(k.shape)}")
    if tuple(v.shape[:2]) != (total_k, hkv):
        raise ValueError(f"v: expected shape {(total_k, hkv, 'Ev')} (that of k), got {tuple(v.shape)}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"k: expected a head count dividing {hq} (that of q), got {hkv}")
    lens_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, q.device)
    lens_k = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, q.device)
    if len(lens_q) != len(lens_k):
        raise ValueError(f"cu_seqlens_k: expected {len(lens_q) + 1} entries (as cu_seqlens_q), "
                         f"got {len(lens_k) + 1}")
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, lens_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, lens_k)
    scale = _check_scale(scale, e, q.dtype)
    mods = _check_modifiers(softcap, alibi_slopes, sinks, q, len(lens_q), hq)
    # The band relative to each sequence's bottom-right diagonal d = Lk - Lq: every j - (i + d)
    # lies in [-(Lk - 1), Lq - 1], so unbounded is [-(Lk + Lq), Lk + Lq] of the longest.
    bound = max(lens_q, default=0) + max(lens_k, default=0)
    lo, hi = _windowed(-bound, 0 if is_causal else bound, window)
    seed = _rng.draw_seed() if 0 < p < 1 else None
    # The kernels read cu[n] at n: a strided view (valid values) made Triton read past it.
    return VarlenCall(q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
                      tuple(zip(lens_q, lens_k)), scale, max(lo, -bound), min(hi, bound), p, seed,
                      backend, return_lse, mods)
