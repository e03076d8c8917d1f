"""The `reference` backend: plain, differentiable PyTorch; the ground truth of every test.

It materialises the (B, H, Lq, Lk) score matrix (and, for additive attention, the
(B, H, Lq, Lk, A) tanh tensor), so it is for checking and for inputs no fused kernel serves,
not for speed. Half-precision inputs are computed in float32 (float64 where float32 overflows) and rounded
once at the end.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
from torch._C._functorch import TransformType

from .. import _rng
from .._values import under_functorch, values_readable
from .._validate import NO_MODIFIERS, AdditiveCall, KvcacheCall, Modifiers, SdpaCall, VarlenCall


def availability() -> Optional[str]:
    return None


def unsupported(op: str, call) -> Optional[str]:
    return None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _float64_where_float32_overflows(op):
    """op(call, dtype) run in _compute_dtype; where float32 overflows on finite inputs (scores or
    sums past its range: |q| |k| ~ 1e19, values ~ 3e38, a huge v, scale or ALiBi slope; an lse
    of +-inf or NaN, or a non-finite output), it runs again in
    float64, which holds every product of float32 values, as the fused CPU kernels do: finite
    inputs never give NaN. (Non-finite inputs rerun too, and keep their non-finite results.)
    The backward does the same (_GuardedBackward): float32's can overflow where the forward did
    not (dO V^T past the range on rows whose difference dP - D is small)."""

    def forward(call):  # (result, the dtype it was computed in)
        dtype = _compute_dtype(call.q.dtype)
        if dtype != torch.float64 and (under_functorch(TransformType.Vmap)
                                       or torch.compiler.is_compiling()):
            # vmap's batched values and a graph torch.compile traces take no branch on values
            # (values_readable): float64 from the start (float32 and a rerun that never came
            # gave NaN from finite inputs past float32's range in compiled code)
            return op(call, torch.float64), torch.float64
        result = op(call, dtype)
        if call.q.dtype == torch.float64 or not values_readable(call.q):
            return result, dtype
        out, lse = result[0], result[1]
        # lse -inf: a row that admits no key, or one whose every score overflowed to -inf (a
        # huge ALiBi slope or scaled score): float64 tells them apart (empty rows stay zeros)
        if not bool(torch.isfinite(out).all()) or bool((lse.isnan() | lse.isinf()).any()):
            return op(call, torch.float64), torch.float64
        return result, dtype

    @functools.wraps(op)
    def run(call):
        fields, tensors = call_tensors(call)
        if (not any(t.requires_grad for t in tensors) or not torch.is_grad_enabled()
                or not values_readable(call.q)
                or call.q.dtype == torch.float64 or torch._C._are_functorch_transforms_active()
                or torch.autograd.forward_ad._current_level >= 0):
            # plain autograd: nothing to guard, nothing to rerun in, or a transform that takes
            # this backend's plain PyTorch (torch.func, forward-mode AD), not a Function's
            return forward(call)[0]
        return _GuardedBackward.apply(op, forward, call, fields, *tensors)

    return run


def call_tensors(call):
    """The tensors of `call` (its fields and its modifiers'), each once (the same tensor as q,
    k and v takes one gradient, summed), and where each lies: (field path, index)."""
    fields, tensors = [], []
    candidates = [((f.name,), getattr(call, f.name)) for f in dataclasses.fields(call)]
    mods = getattr(call, "mods", NO_MODIFIERS)  # (additive attention takes none)
    candidates += [(("mods", name), x) for name, x in zip(Modifiers._fields, mods)]
    for path, x in candidates:
        if isinstance(x, torch.Tensor):
            index = next((i for i, t in enumerate(tensors) if t is x), None)
            if index is None:
                index = len(tensors)
                tensors.append(x)
            fields.append((path, index))
    return fields, tensors


def _with(call, fields, tensors):
    """`call` with the tensors at `fields` replaced by `tensors` (by index; None: a template
    that holds none)."""
    at = {path: None if tensors is None else tensors[i] for path, i in fields}
    plain = {path[0]: x for path, x in at.items() if len(path) == 1}
    mods = {path[1]: x for path, x in at.items() if len(path) == 2}
    if mods:
        plain["mods"] = call.mods._replace(**mods)
    return dataclasses.replace(call, **plain)


class _GuardedBackward(torch.autograd.Function):
    """A reference op whose backward recomputes it (in the forward's dtype) and takes autograd's
    gradients of that, rerunning in float64 where those come out non-finite from finite inputs
    and output gradients. Differentiable again (create_graph): gradgradcheck holds. Every
    tensor of the call is saved for the backward (version-checked, freed after it); the ctx
    keeps the call without them."""

    @staticmethod
    def forward(ctx, op, forward, call, fields, *tensors):
        result, ctx.dtype = forward(call)
        ctx.op, ctx.template, ctx.fields = op, _with(call, fields, None), fields
        ctx.save_for_backward(*tensors)
        return result  # (additive's weights may be None: untracked, a None gradient)

    @staticmethod
    def backward(ctx, *grad_outputs):
        tensors = ctx.saved_tensors
        wanted = [i for i, t in enumerate(tensors) if ctx.needs_input_grad[4 + i]]
        higher = torch.is_grad_enabled()  # create_graph: the gradients are differentiated again
        grads = _input_grads(ctx, tensors, wanted, ctx.dtype, grad_outputs, higher)
        if (ctx.dtype != torch.float64 and not all_finite(grads)
                and all_finite(tensors) and all_finite(grad_outputs)):
            grads = _input_grads(ctx, tensors, wanted, torch.float64, grad_outputs, higher)
        every = [None] * len(tensors)
        for i, g in zip(wanted, grads):
            every[i] = g
        return (None, None, None, None, *every)


def all_finite(tensors) -> bool:
    """Whether every floating tensor of `tensors` (None and integer ones pass) is finite."""
    return all(t is None or not t.is_floating_point() or bool(torch.isfinite(t).all())
               for t in tensors)


def _input_grads(ctx, tensors, wanted, dtype, grad_outputs, higher: bool):
    # (autocast off, as for the forward (_dispatch._run): a backward called inside an autocast
    # block would otherwise recompute the float32 math in its dtype)
    kind = next(t.device.type for t in tensors if t is not None)
    with torch.enable_grad(), torch.autocast(kind, enabled=False):
        outs = ctx.op(_with(ctx.template, ctx.fields, tensors), dtype)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if o is not None and o.requires_grad]
        return torch.autograd.grad([o for o, _ in pairs], [tensors[i] for i in wanted],
                                   [g for _, g in pairs], create_graph=higher, allow_unused=True)


def band(lq: int, lk: int, lo: int, hi: int, device) -> torch.Tensor:
    """Bool (Lq, Lk): True where i + lo <= j <= i + hi."""
    d = torch.arange(lk, device=device).view(1, lk) - torch.arange(lq, device=device).view(lq, 1)
    return (d >= lo) & (d <= hi)


def modified(s: torch.Tensor, mods: Modifiers, offset: int = 0) -> torch.Tensor:
    """Scaled scores (B, H, Lq, Lk) after softcap and ALiBi (aligned so that query i's
    diagonal is key i + offset); the mask comes after."""
    if mods.softcap is not None:
        s = mods.softcap * torch.tanh(s / mods.softcap)
    if mods.alibi is not None:
        lq, lk = s.shape[-2:]
        dist = (torch.arange(lq, device=s.device).view(lq, 1) + offset
                - torch.arange(lk, device=s.device).view(1, lk)).abs().to(s.dtype)
        slopes = mods.alibi.to(s.dtype).reshape(mods.alibi.shape + (1, 1))
        s = s - slopes * dist
    return s


def sink_logits(mods: Modifiers, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The sinks as (H, 1), to broadcast against a (B, H, Lq) row statistic."""
    return None if mods.sinks is None else mods.sinks.to(dtype).view(-1, 1)


def masked_softmax(s: torch.Tensor, mask: Optional[torch.Tensor], lo: int, hi: int,
                   sink: Optional[torch.Tensor] = None):
    """Softmax over the last dim after the band and mask, with empty rows giving zeros.

    `sink` (broadcasting to s.shape[:-1]): a logit in each row's denominator that attends to
    nothing. Returns (probabilities, lse) with lse = -inf on rows that admit no key (the sink
    where there is one).
    """
    lq, lk = s.shape[-2:]
    allowed = band(lq, lk, lo, hi, s.device)
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            s = s + mask.to(s.dtype)
    s = s.masked_fill(~allowed, float("-inf"))
    if sink is not None:
        return _softmax_with_sink(s, sink)
    if lk == 0:
        return s, s.new_full(s.shape[:-1], float("-inf"))
    empty = s.amax(dim=-1, keepdim=True) == float("-inf")
    # Rows with no admissible key are replaced by zeros before the softmax so that neither the
    # forward nor the backward pass ever sees exp(-inf - (-inf)).
    s = torch.where(empty, torch.zeros_like(s), s)
    # Not torch.logsumexp: its backward, exp(s - lse), is 1 per key, not 1 / l, on a row whose
    # lse rounded to its max (every key under a huge finite bias, csrc/cpu/huge_lse.h).
    m = s.amax(dim=-1, keepdim=True).detach()
    lse = (m + torch.log(torch.exp(s - m).sum(-1, keepdim=True))).squeeze(-1)
    lse = lse.masked_fill(empty.squeeze(-1), float("-inf"))
    p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    return p, lse


def _softmax_with_sink(s: torch.Tensor, sink: torch.Tensor):
    """masked_softmax's rows (refused keys at -inf) with the sink in the denominator:
    p_ij = exp(s_ij) / (exp(sink) + sum_j exp(s_ij)), lse = log of that denominator."""
    sink = sink.expand(s.shape[:-1]).unsqueeze(-1)
    if s.shape[-1] == 0:
        return s, sink.squeeze(-1)
    top = s.amax(dim=-1, keepdim=True)
    empty = top == float("-inf")
    s = torch.where(empty, torch.zeros_like(s), s)  # as masked_softmax: no exp(-inf - (-inf))
    # An empty row's max is its sink's (not the zeroed scores' 0: below -745 exp(sink - 0)
    # underflowed, and the row came out 0 / 0); 0 where the sink too is -inf.
    m = torch.maximum(top, sink)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m).detach()
    e = torch.exp(s - m).masked_fill(empty, 0.0)
    denom = e.sum(-1, keepdim=True) + torch.exp(sink - m)
    # an empty row whose sink is -inf has nothing in its denominator: zeros, lse -inf, and no
    # 0 / 0 or log(0) for the backward either
    none = denom == 0
    denom = denom.masked_fill(none, 1.0)
    return e / denom, (m + torch.log(denom)).masked_fill(none, float("-inf")).squeeze(-1)


def apply_dropout(p: torch.Tensor, dropout_p: float, seed: Optional[torch.Tensor]) -> torch.Tensor:
    if dropout_p == 0.0:
        return p
    b, h, lq, lk = p.shape
    keep = _rng.keep_mask(seed, b, h, lq, lk, dropout_p, p.device)
    return p * keep.to(p.dtype) / (1.0 - dropout_p)


@_float64_where_float32_overflows
def sdpa(call: SdpaCall, dtype: torch.dtype):
    q, k, v = (t.to(dtype) for t in (call.q, call.k, call.v))
    groups = q.shape[1] // max(k.shape[1], 1)
    if groups != 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    s = modified(torch.matmul(q, k.transpose(-2, -1)) * call.scale, call.mods)
    p, lse = masked_softmax(s, call.mask, call.window_lo, call.window_hi,
                            sink_logits(call.mods, dtype))
    p = apply_dropout(p, call.dropout_p, call.seed)
    out = torch.matmul(p, v)
    return out.to(call.q.dtype), lse.float()


@_float64_where_float32_overflows
def additive(call: AdditiveCall, dtype: torch.dtype):
    q, k, value, v = (t.to(dtype) for t in (call.q, call.k, call.value, call.v))
    t = torch.tanh(q.unsqueeze(3) + k.unsqueeze(2))  # (B, H, Lq, Lk, A)
    s = (t * v.view(1, v.shape[0], 1, 1, v.shape[1])).sum(-1)
    p, lse = masked_softmax(s, call.mask, call.window_lo, call.window_hi)
    p = apply_dropout(p, call.dropout_p, call.seed)
    out = torch.matmul(p, value)
    weights = p.to(call.q.dtype) if call.return_weights else None
    return out.to(call.q.dtype), lse.float(), weights


def cached_keys(cache: torch.Tensor, block_table: Optional[torch.Tensor], b: int, n: int):
    """The first n positions of sequence b of a contiguous or paged cache: (Hkv, n, E)."""
    if block_table is None:
        return cache[b, :, :n]
    block_size = cache.shape[2]
    used = -(-n // block_size)
    blocks = cache[block_table[b, :used].long()]  # (used, Hkv, block_size, E)
    return blocks.transpose(0, 1).reshape(cache.shape[1], used * block_size, cache.shape[3])[:, :n]


@_float64_where_float32_overflows
def kvcache(call: KvcacheCall, dtype: torch.dtype):
    """One sequence at a time over its gathered keys: slots past its length are never read.
    The lengths validation read (call.lens; while torch.compile traces, no tensor is read
    here); without them (meta or fake lengths) shapes only."""
    lq = call.q.shape[2]
    sink = sink_logits(call.mods, dtype)
    outs, lses = [], []
    lens = call.lens
    if lens is None and values_readable(call.seqlens):
        lens = call.seqlens.tolist()
    if lens is not None and len(lens) != call.q.shape[0]:  # an int length: every sequence's
        lens = lens * call.q.shape[0]
    for b, n in enumerate(lens or ()):
        q = call.q[b].to(dtype)
        k, v = (cached_keys(c, call.block_table, b, n).to(dtype) for c in (call.k_cache, call.v_cache))
        groups = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        offset = n - lq  # bottom-right: query i's diagonal is key i + offset
        mods = call.mods
        if mods.alibi is not None:  # this sequence's slopes, as a batch of one
            mods = mods._replace(alibi=mods.alibi[b:b + 1])
        s = modified(torch.matmul(q, k.transpose(-2, -1)).unsqueeze(0) * call.scale, mods,
                     offset).squeeze(0)
        p, lse = masked_softmax(s, None, call.window_lo + offset, call.window_hi + offset, sink)
        outs.append(torch.matmul(p, v))
        lses.append(lse)
    if not outs:  # B = 0, or no lengths to read
        b, hq, lq, _ = call.q.shape
        return (call.q.new_empty((b, hq, lq, call.v_cache.shape[-1])),
                call.q.new_empty((b, hq, lq), dtype=torch.float32))
    return torch.stack(outs).to(call.q.dtype), torch.stack(lses).float()


@_float64_where_float32_overflows
def varlen(call: VarlenCall, dtype: torch.dtype):
    """One sequence at a time, each a batch-1 SDPA with the band aligned bottom-right and the
    sequence's dropout seed (attnx._rng.sequence_seed)."""
    hq, hkv = call.q.shape[1], call.k.shape[1]
    groups = hq // hkv
    outs, lses = [], []
    q0 = k0 = 0
    for n, (lq, lk) in enumerate(call.lens):
        q = call.q[q0:q0 + lq].transpose(0, 1).to(dtype)  # (Hq, Lq, E)
        k, v = (t[k0:k0 + lk].transpose(0, 1).to(dtype).repeat_interleave(groups, dim=0)
                for t in (call.k, call.v))
        d = lk - lq  # bottom-right: query i's diagonal is key i + d
        mods = call.mods
        if mods.alibi is not None:  # this sequence's slopes, as a batch of one
            mods = mods._replace(alibi=mods.alibi[n:n + 1])
        s = modified(torch.matmul(q, k.transpose(-2, -1)).unsqueeze(0) * call.scale, mods,
                     d).squeeze(0)
        p, lse = masked_softmax(s, None, call.window_lo + d, call.window_hi + d,
                                sink_logits(mods, dtype))
        seed = None if call.seed is None else _rng.sequence_seed(call.seed, n)
        p = apply_dropout(p.unsqueeze(0), call.dropout_p, seed).squeeze(0)
        outs.append(torch.matmul(p, v).transpose(0, 1))
        lses.append(lse)
        q0, k0 = q0 + lq, k0 + lk
    if not outs:  # no sequences: empty results, on the inputs' graph as any call's are
        tie = sum(t[:0].sum() for t in (call.q, call.k, call.v, call.mods.sinks) if t is not None)
        outs.append(call.q.new_zeros((0, hq, call.v.shape[-1]), dtype=dtype) + tie)
        lses.append(call.q.new_zeros((hq, 0), dtype=dtype) + tie)
    return torch.cat(outs).to(call.q.dtype), torch.cat(lses, dim=1).float()
