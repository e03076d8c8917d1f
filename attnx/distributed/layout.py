"""Which positions of the sequence each rank holds, and cutting/gathering full tensors.

A rank's shard is one or more segments of the global sequence, concatenated in order:
`contiguous` gives rank r the one segment [r L/W, (r+1) L/W); `zigzag` cuts the sequence into
2W chunks and gives rank r chunks r and 2W-1-r, so that under a causal mask every rank holds one
early and one late chunk and does the same amount of work.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

LAYOUTS = ("zigzag", "contiguous")


class Segment(NamedTuple):
    start: int  # first global position
    local: int  # where it begins in the rank's shard
    length: int


def check_layout(layout) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"layout: expected one of {LAYOUTS}, got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def check_divisible(name: str, length: int, world: int, layout: str) -> None:
    parts = world * chunks_per_rank(layout)
    if length % parts:
        raise ValueError(
            f"{name}: expected a sequence length divisible by {parts} ({layout} layout over "
            f"{world} ranks), got {length}")


def segments(rank: int, world: int, local_len: int, layout: str) -> tuple:
    """The segments of rank `rank`'s shard when every shard holds `local_len` positions."""
    if layout == "contiguous" or world == 1:  # one rank: its two zigzag chunks are adjacent
        return (Segment(rank * local_len, 0, local_len),)
    c = local_len // 2
    return (Segment(rank * c, 0, c), Segment((2 * world - 1 - rank) * c, c, c))


class NotInGroup(ValueError):
    """A process group that does not hold the calling rank."""


def group_info(group) -> tuple:
    """(rank, world size) in `group`, or a clear error before torch.distributed is set up or
    where `group` does not hold this rank (torch gives it rank -1 and world size -1 there)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("attnx.distributed: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise NotInGroup(f"group: expected None or a process group of this rank, got one "
                         f"without it (rank {dist.get_rank()} of the default group): only its "
                         f"ranks call with it")
    return rank, dist.get_world_size(group)


def member(group) -> tuple:
    """(rank, world size, group, error): this rank's place in `group`, or, where `group` is no
    process group, its place in the default group and that error, for the caller to report
    through its agreement there, where the other ranks (the default group's) wait for it. A
    group without this rank raises here: its ranks never wait for this one."""
    try:
        return (*group_info(group), group, None)
    except NotInGroup:
        raise
    except Exception as exc:  # any: the default group's own failure (not initialized) raises
        error = ValueError(f"group: expected None or a process group of this rank, got "
                           f"{group!r} ({exc})")
        return (*group_info(None), None, error)


def unsupported_arguments(fn: str, positional: tuple, keywords: dict) -> None:
    """A TypeError for arguments `fn` does not take, raised inside its agreement's try (not by
    Python's call, which would leave the other ranks waiting for this one)."""
    if positional:
        raise TypeError(f"{fn}: expected its tensors as the only positional arguments and the "
                        f"rest by keyword, got {len(positional)} more positional")
    if keywords:
        raise TypeError(f"{', '.join(sorted(keywords))}: {fn} takes no such argument (see "
                        "API.md, attnx.distributed)")


def _dim(x: torch.Tensor, dim: int, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: expected a dim of a {x.dim()}-D {name}, got {dim}")
    return dim % x.dim()


def shard(x: torch.Tensor, *, group=None, layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """This rank's shard of the full tensor `x` along `dim` (differentiable)."""
    layout = check_layout(layout)
    dim = _dim(x, dim, "x")
    rank, world, _, error = member(group)  # (no other rank waits: shard sends nothing)
    if error is not None:
        raise error
    check_divisible("x", x.shape[dim], world, layout)
    local = x.shape[dim] // world
    parts = [x.narrow(dim, s.start, s.length) for s in segments(rank, world, local, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


class _Gather(torch.autograd.Function):
    """All-gather of equal shards; its backward sums the full gradient over the ranks (each
    rank's loss may read every position) and keeps this rank's shard of it."""

    @staticmethod
    def forward(x, group, layout, dim):
        import torch.distributed as dist

        from .checks import GATHER_DTYPES
        rank, world = group_info(group)
        sent = x.contiguous()
        # other dtypes (float8, uint16, ...) travel as their bytes: gloo gathers none of them
        wire = sent if x.dtype in GATHER_DTYPES else sent.view(torch.uint8)
        pieces = [torch.empty_like(wire) for _ in range(world)]
        dist.all_gather(pieces, wire, group=group)
        pieces = [p.view(x.dtype) for p in pieces]
        local = x.shape[dim]
        full = list(x.shape)
        full[dim] = local * world
        out = x.new_empty(full)
        for r, piece in enumerate(pieces):
            for s in segments(r, world, local, layout):
                out.narrow(dim, s.start, s.length).copy_(piece.narrow(dim, s.local, s.length))
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):  # (torch.func's transforms need it apart)
        ctx.args = inputs[1:]

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist
        group, layout, dim = ctx.args
        # a copy: the all-reduce sums in place, and grad may be the caller's tensor (or one
        # autograd also hands to other branches: a residual beside unshard got W times its own)
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=group)
        return shard(grad, group=group, layout=layout, dim=dim), None, None, None


def unshard(x_local: torch.Tensor, *positional, group=None, layout: str = "zigzag",
            dim: int = -2, **unsupported) -> torch.Tensor:
    """The full tensor gathered from every rank's shard along `dim` (differentiable). The ranks
    first agree on their shards (checks.agree_gather): bad input on one rank (another argument,
    a `group` that is none), or shards that differ, raise on every rank."""
    from .checks import agree_gather, check_device  # checks imports this module
    rank, world, group, error = member(group)
    try:
        if error is not None:
            raise error
        unsupported_arguments("unshard", positional, unsupported)
        layout = check_layout(layout)
        dim = _dim(x_local, dim, "x_local")
        check_device("x_local", x_local)
        if layout == "zigzag" and x_local.shape[dim] % 2:
            raise ValueError(f"x_local: expected an even shard length (zigzag holds two "
                             f"chunks), got {x_local.shape[dim]}")
        error = None
    except Exception as exc:  # any: told to every rank before this one raises it
        error = exc
    agree_gather(x_local if error is None else None, dim, layout, error, rank, world, group)
    return _Gather.apply(x_local, group, layout, dim)
