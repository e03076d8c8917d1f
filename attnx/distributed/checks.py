"""Validation of a ring_attention call: locally, then across the ranks in one small
all-gather, before any other collective.

The all-gather carries each rank's call summary (or the fact that its input was rejected), so
that bad input on one rank makes every rank raise instead of leaving the others waiting on a
ring that will never turn, and inputs that disagree between ranks (shapes, dtypes, flags) are
caught before they could hang or mix.
"""

from __future__ import annotations

import struct
from dataclasses import astuple, dataclass, fields
from typing import Optional

import torch

from .. import _validate
from .layout import check_divisible, check_layout, member, unsupported_arguments  # noqa: F401 (ring.py)

_DTYPES = tuple(_validate.FLOAT_DTYPES)
_LAYOUTS = ("zigzag", "contiguous")
_BACKENDS = tuple(_validate.BACKEND_NAMES)


@dataclass(frozen=True)
class Spec:
    """What every rank must agree on (all ints, as they travel in one int64 tensor)."""
    batch: int
    heads_q: int
    heads_kv: int
    local_len: int
    head_dim: int
    value_dim: int
    dtype: int
    is_causal: int
    layout_id: int
    lo: int  # the band over the full sequence
    hi: int
    scale_bits: int
    softcap_bits: int  # 0 for None
    backend_id: int
    lead_id: int  # the leading dims (hashed: equal batch sizes from different dims differ)
    grad: int  # 1 when the call records a graph: then every rank must, or a backward ring hangs

    @property
    def layout(self) -> str:
        return _LAYOUTS[self.layout_id]

    @property
    def softcap(self) -> Optional[float]:
        return None if self.softcap_bits == 0 else _from_bits(self.softcap_bits)


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def local_spec(call, world: int, is_causal, window, layout, backend: str) -> Spec:
    """This rank's Spec, raising ValueError/TypeError for what is wrong with its own input
    (the rest of the checks: attnx._validate.sdpa_call, which made `call`)."""
    layout = check_layout(layout)
    is_causal = _validate._check_bool("is_causal", is_causal)
    b, hq, lq, e = call.q.shape
    hk, lk, ev = call.k.shape[1], call.k.shape[2], call.v.shape[-1]
    if lk != lq:
        raise ValueError(f"k: expected this rank's shard of q's sequence, of length "
                         f"{lq}, got shape {tuple(call.k.shape)}")
    if layout == "zigzag" and lq % 2:
        raise ValueError(f"q: expected an even shard length (zigzag holds two chunks; the "
                         f"full sequence must divide into {2 * world}), got {lq}")
    check_divisible("q", lq * world, world, layout)
    total = lq * world
    softcap = call.mods.softcap
    lo, hi = _validate._band(is_causal, None, window)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (call.q, call.k, call.v))
    return Spec(b, hq, hk, lq, e, ev, _DTYPES.index(call.q.dtype), int(is_causal),
                _LAYOUTS.index(layout), lo, hi, _bits(call.scale),
                0 if softcap is None else _bits(softcap), _BACKENDS.index(backend),
                hash(tuple(call.prefix)), int(grad))


def check_device(name: str, x: torch.Tensor) -> None:
    """The collectives move real data: a tensor on a CPU or a GPU, dense (a meta or sparse
    one is refused here, before any of them, rather than failing inside one on this rank
    alone)."""
    if x.device.type not in ("cpu", "cuda"):
        raise TypeError(f"{name}: expected a CPU or CUDA tensor, got device {x.device}")
    _validate._check_dense(name, x)


def _device(group) -> torch.device:
    import torch.distributed as dist
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(spec: Optional[Spec], error: Optional[Exception], rank: int, world: int,
          group, extremes: tuple = ()) -> tuple:
    """Raise on every rank if any rank's input was rejected or the ranks' calls differ; else
    the largest of each of this rank's `extremes` (floats >= 0) over the ranks, carried in
    the same all-gather."""
    n = len(fields(Spec))
    mine = [0, *astuple(spec)] if error is None else [1] + [0] * n
    table = _table(mine + [_bits(float(x)) for x in extremes], world, group)
    _raise_rejected("ring_attention", table, error, rank)
    for i, field in enumerate(fields(Spec), start=1):
        values = [row[i] for row in table]
        if len(set(values)) > 1:
            raise ValueError(_mismatch(field.name, values))
    return tuple(max(_from_bits(row[1 + n + i]) for row in table) for i in range(len(extremes)))


def _table(row: list, world: int, group) -> list:
    """Every rank's `row` (equal-length lists of ints), gathered in one all-gather."""
    import torch.distributed as dist
    if world == 1:
        return [row]
    mine = torch.tensor(row, dtype=torch.int64, device=_device(group))
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return torch.stack(every).cpu().tolist()


def _raise_rejected(what: str, table: list, error: Optional[Exception], rank: int) -> None:
    """This rank's own error, or, where another rank rejected its input (row[0] set), one
    saying so."""
    if error is not None:
        raise error
    bad = [r for r, row in enumerate(table) if row[0]]
    if bad:
        raise ValueError(f"{what}: rank(s) {bad} of the group rejected their input "
                         f"(their own error says why); this rank (rank {rank}) stops too")


# The dtypes the collectives gather as they are; any other travels as its bytes (layout._Gather).
GATHER_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                 torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                 torch.complex64, torch.complex128)
# unshard's agreement sends a dtype as its position here (every dtype of this torch: float8's
# kinds, which travel as the same bytes, must still differ)
_ALL_DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)
_GATHER_DIMS = 8  # shape entries sent as they are; a hash of the whole shape covers the rest


def agree_gather(x: Optional[torch.Tensor], dim: int, layout: str,
                 error: Optional[Exception], rank: int, world: int, group) -> None:
    """unshard's check across the ranks, in one all-gather before its own: every rank raises if
    any rank's input was rejected or the shards differ in shape, dtype, dim, layout, device
    type or gradient recording (an all-gather of unequal shards would fail on some ranks and
    leave the others waiting, as would a backward all-reduce on the ranks that recorded one)."""
    # flag, dims, dim, dtype, layout, device type, graph, shape hash, the first sizes
    width = 8 + _GATHER_DIMS
    row = [1] + [0] * (width - 1)
    if error is None:
        dtype = _ALL_DTYPES.index(x.dtype)
        sizes = list(x.shape[:_GATHER_DIMS])
        graph = torch.is_grad_enabled() and x.requires_grad
        row = [0, x.dim(), dim, dtype, _LAYOUTS.index(layout), int(x.device.type == "cuda"),
               int(graph), hash(tuple(x.shape)), *sizes, *[-1] * (_GATHER_DIMS - len(sizes))]
    table = _table(row, world, group)
    _raise_rejected("unshard", table, error, rank)
    if any(other != table[0] for other in table[1:]):
        per_rank = ", ".join(
            f"rank {r}: shape {tuple(t[8:8 + min(t[1], _GATHER_DIMS)])}"
            f"{'...' if t[1] > _GATHER_DIMS else ''}, dim {t[2]}, {_gather_dtype(t[3])}, "
            f"{_LAYOUTS[t[4]]}, {'cuda' if t[5] else 'cpu'}, graph {'recorded' if t[6] else 'none'}"
            for r, t in enumerate(table))
        raise ValueError(f"unshard: expected the same shard shape, dtype, dim, layout, device "
                         f"and gradient recording on every rank, got {per_rank}")


def _gather_dtype(key: int) -> str:
    return str(_ALL_DTYPES[key])


def _mismatch(name: str, values: list) -> str:
    shown = {
        "dtype": lambda x: str(_DTYPES[x]),
        "layout_id": lambda x: _LAYOUTS[x],
        "backend_id": lambda x: _BACKENDS[x],
        "scale_bits": lambda x: repr(_from_bits(x)),
        "softcap_bits": lambda x: "None" if x == 0 else repr(_from_bits(x)),
        # the band lo <= j - i <= hi, as window=(left, right) and is_causal set it
        "lo": lambda x: "no left bound" if x <= -_validate.UNBOUNDED else f"left {-x}",
        "hi": lambda x: "no right bound" if x >= _validate.UNBOUNDED else f"right {x}",
    }.get(name, str)
    label = {"dtype": "dtype", "layout_id": "layout", "backend_id": "backend",
             "scale_bits": "scale", "softcap_bits": "softcap", "lo": "window/is_causal",
             "hi": "window/is_causal", "local_len": "sequence length of the shard (L must "
             "divide evenly over the ranks)", "lead_id": "leading dims of the query",
             "grad": "gradient recording (inputs that require grad, outside torch.no_grad(); "
             "1 = recorded)"}.get(name, name)
    if name == "lead_id":  # a hash of the dims: which ranks differ from rank 0, not the hashes
        odd = [r for r, x in enumerate(values) if x != values[0]]
        return (f"ring_attention: expected the same {label} on every rank, got other ones on "
                f"rank(s) {odd} than on rank 0")
    per_rank = ", ".join(f"rank {r}: {shown(x)}" for r, x in enumerate(values))
    return f"ring_attention: expected the same {label} on every rank, got {per_rank}"
