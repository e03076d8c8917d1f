"""Backend choice and the public functional ops: validation, dispatch, reshaping back.

This is the only place that decides which backend runs a call.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.autograd.forward_ad as fwAD
from torch._C._functorch import TransformType

from . import _validate
from ._values import under_functorch
from ._backends import cpu, cuda, reference, triton_backend

_MODULES = {"cuda": cuda, "triton": triton_backend, "cpu": cpu, "reference": reference}
# What `backend=None`/"auto" tries, fastest first, by device type. The Triton interpreter is
# never chosen automatically for CPU tensors: it is for testing, not speed.
_AUTO_ORDER = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpu", "reference")}
# Where an op's fastest backend differs from its device's order. SDPA on CUDA tensors: the
# Triton kernels, measured on an H100 (README; benchmarks/results/gpu-h100-2026-11-26.jsonl):
# forward 1.6-5.6x the cuda kernels' TFLOP/s at every length, head dim and causality measured,
# backward 0.86-1.0x at D128 and 1.4x at D64: forward and backward together 1.15-1.3x at D128.
_AUTO_ORDER_BY_OP = {("sdpa", "cuda"): ("triton", "cuda", "reference")}
# The backends whose backward is nondeterministic (in the last bits), by op: the cuda kernels sum
# dQ (SDPA, varlen) and dK, dvalue (additive) by float32 atomics; Triton's and the CPU's sum in
# a fixed order. Under torch.use_deterministic_algorithms(True) backend=None passes them over
# for calls that record gradients; a forced one raises torch's error in its backward (warn_only:
# warns), as torch's own nondeterministic kernels do.
_NONDETERMINISTIC_BACKWARD = {("cuda", "sdpa"), ("cuda", "varlen"), ("cuda", "additive")}


class BackendStatus(NamedTuple):
    usable: bool
    reason: str  # why not, or "" when usable


class BackendUnavailableError(ValueError):
    """A forced `backend=` cannot serve the given inputs."""


def _module(name: str):
    return _MODULES[name]


def backends() -> dict:
    """Each backend's name -> BackendStatus(usable, reason) on this machine."""
    status = {}
    for name in _MODULES:
        reason = _module(name).availability()
        status[name] = BackendStatus(reason is None, reason or "")
    return status


# The backends of the ops that not every backend has yet (the others' modules never see them).
_SERVED = {"kvcache": ("cuda", "cpu", "triton", "reference"),
           "varlen": ("cuda", "cpu", "triton", "reference")}
# The backends that compute the score modifiers (softcap, alibi_slopes, sinks), by op; a call
# with one goes to no other (backend=None falls back to these: for CUDA tensors, triton where
# cuda lacks them).
_SERVED_MODIFIERS = {"sdpa": ("cuda", "cpu", "triton", "reference"),
                     "kvcache": ("cuda", "cpu", "triton", "reference"),
                     "varlen": ("cuda", "cpu", "triton", "reference")}


def _is_empty(op: str, call) -> bool:
    keys = call.k_cache if op == "kvcache" else call.k
    return call.q.numel() == 0 or keys.numel() == 0 or call.q.shape[-1] == 0


def _unsupported(name: str, op: str, call):
    if name not in _SERVED.get(op, _MODULES):
        return f"it has no {op} kernel yet (served by: {', '.join(_SERVED[op])})"
    mods = getattr(call, "mods", None)
    if mods is not None and mods.any() and name not in _SERVED_MODIFIERS.get(op, ()):
        served = ", ".join(_SERVED_MODIFIERS.get(op, ())) or "none"
        return (f"it does not compute {', '.join(mods.names())} in {op} yet "
                f"(served by: {served})")
    if name != "reference" and op != "kvcache" and _has_tangents(call):
        return "it has no forward-mode AD (the reference backend has)"
    return _module(name).unsupported(op, call)


def _has_tangents(call) -> bool:
    """Whether some input of `call` is a forward-AD dual tensor with a tangent: the kernels'
    ops would drop it silently (no tangent out), where torch.func.jvp and forward_ad expect one.
    Under a torch.func forward-mode transform enclosing a reverse-mode one (jvp of grad, jacfwd of
    jacrev: Hessians) the tangents reach the call inside grad's wrappers, where unpack_dual does
    not see them: such a call is taken to have them."""
    if under_functorch(TransformType.Jvp):
        return True
    if fwAD._current_level < 0:  # no dual level open: nothing to look at
        return False
    return any(fwAD.unpack_dual(t).tangent is not None for t in reference.call_tensors(call)[1])


def _run(name: str, op: str, call):
    """Backend `name`'s `op` on the validated call. Under autocast (whose casts _validate made)
    it runs with autocast off: the backends' own torch ops (the reference's float32 math, the
    BLAS engine's float32 products) keep the dtypes they chose."""
    fn = getattr(_module(name), op)
    if _validate._autocast_dtype(call.q) is not None:
        with torch.autocast(_validate.device_type(call.q), enabled=False):
            return fn(call)
    return fn(call)


def select(op: str, call) -> str:
    """The backend that will run `call`; raises BackendUnavailableError for a forced one."""
    if _is_empty(op, call):
        return "reference"  # nothing to fuse; the reference handles every empty shape
    if call.backend != "auto":
        reason = _unsupported(call.backend, op, call)
        if reason is not None:
            raise BackendUnavailableError(f"backend: {call.backend!r} cannot run this call: {reason}")
        return call.backend
    device = _validate.device_type(call.q)
    for name in _AUTO_ORDER_BY_OP.get((op, device), _AUTO_ORDER.get(device, ("reference",))):
        if _unsupported(name, op, call) is None and not _nondeterministic(name, op, call):
            return name
    return "reference"


def _nondeterministic(name: str, op: str, call) -> bool:
    """Whether deterministic algorithms are asked for and `name`'s backward of `op`, which this
    call may run (it records gradients), is not one."""
    if ((name, op) not in _NONDETERMINISTIC_BACKWARD
            or not torch.are_deterministic_algorithms_enabled() or not torch.is_grad_enabled()):
        return False
    return any(t.requires_grad for t in reference.call_tensors(call)[1])


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 window=None, softcap=None, alibi_slopes=None, sinks=None,
                                 backend=None, return_lse=False):
    """Scaled dot-product attention, as `torch.nn.functional.scaled_dot_product_attention`.

    Extra keywords: `window=(left, right)` restricts query i to keys i-left..i+right;
    `softcap` caps the scaled scores to softcap * tanh(s / softcap); `alibi_slopes` float32
    (Hq,) or (B, Hq) adds -slope * |i - j|; `sinks` (Hq,) is a per-head logit in every row's
    softmax denominator; `backend` forces "cuda", "triton", "cpu" or "reference";
    `return_lse=True` also returns the float32 log-sum-exp of the scaled scores (the sink
    included), shape (B, H, Lq). See API.md for the contract.
    """
    return sdpa_seeded(None, query, key, value, attn_mask, dropout_p, is_causal, scale,
                       enable_gqa, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                       sinks=sinks, backend=backend, return_lse=return_lse)


def sdpa_seeded(seed, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                scale=None, enable_gqa=False, *, window=None, softcap=None, alibi_slopes=None,
                sinks=None, backend=None, return_lse=False):
    """scaled_dot_product_attention with its dropout seed given (None: drawn from torch's
    generator, as the public function does): the nn modules draw it themselves, so that the
    weights they return went through the very dropout the output did."""
    call = _validate.sdpa_call(query, key, value, attn_mask, dropout_p, is_causal, scale,
                               enable_gqa, window, backend, return_lse, seed, softcap=softcap,
                               alibi_slopes=alibi_slopes, sinks=sinks)
    call, everything_dropped = _without_total_dropout(call)
    out, lse = _run(select("sdpa", call), "sdpa", call)
    if everything_dropped:
        out = _dropped(out)
    if out.shape[:-2] != call.prefix:  # (a reshape to its own shape costs a microsecond)
        out = out.reshape(call.prefix + tuple(out.shape[-2:]))
    if not return_lse:
        return out
    return out, lse.float().reshape(call.prefix + (lse.shape[-1],))


def _without_total_dropout(call):
    """(call, False), or for dropout_p=1 (which the kernels do not take) the call without
    dropout and True: its outputs then go through _dropped."""
    if call.dropout_p != 1.0:
        return call, False
    return dataclasses.replace(call, dropout_p=0.0), True


def _dropped(t):
    """What dropout_p=1 leaves, as torch's function gives it: zeros, and zero gradients for
    whatever made them. (The kernels take p < 1: the call ran without dropout; the lse does not
    depend on dropout.)"""
    return t * 0


def additive_attention(query, key, value, v, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                       window=None, backend=None, return_weights=False):
    """Bahdanau attention: softmax_j(sum_a v[a] tanh(query[i, a] + key[j, a])) @ value, fused.

    `query`/`key` are already projected, (B, H, L, A) or (B, L, A); `v` is (A,) or (H, A).
    `return_weights=True` also returns the attention probabilities (after dropout).
    """
    call = _validate.additive_call(query, key, value, v, attn_mask, dropout_p, is_causal,
                                   window, backend, return_weights)
    call, everything_dropped = _without_total_dropout(call)
    out, _lse, weights = _run(select("additive", call), "additive", call)
    if weights is not None:  # float32 from the kernels (csrc/ops.cpp: grad_weights)
        weights = weights.to(call.q.dtype)
    if everything_dropped:
        out, weights = _dropped(out), (None if weights is None else _dropped(weights))
    if call.three_d:
        out = out.squeeze(1)
        weights = weights.squeeze(1) if weights is not None else None
    return (out, weights) if return_weights else out


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k=None, v=None, *,
                           block_table=None, is_causal=True, scale=None, window=None,
                           softcap=None, alibi_slopes=None, sinks=None, backend=None,
                           return_lse=False):
    """Decoding attention against a KV cache, contiguous (B, Hkv, Lmax, E) or paged
    (num_blocks, Hkv, block_size, E) with `block_table` (B, max_blocks) int32.

    `k`, `v` (B, Hkv, Lnew, E), if given, are written into the cache in place at positions
    `cache_seqlens[b]...` before attending; `cache_seqlens` itself is not updated. Query i of
    sequence b attends keys 0 .. cache_seqlens[b] + Lnew - 1, with `is_causal` (the default)
    only those up to its bottom-right diagonal. softcap, alibi_slopes (aligned bottom-right:
    -slope * |i + cache_seqlens[b] + Lnew - Lq - j|) and sinks as in scaled_dot_product_attention.
    An inference op: it runs under torch.no_grad(), so its outputs carry no gradient whatever
    requires one. See API.md for the contract.
    """
    if torch.is_grad_enabled():
        # (not `with no_grad()` on every call: a decoding loop runs without grad already, and
        # the context costs tens of microseconds a step once the model's weights have flushed
        # the caches)
        with torch.no_grad():
            return attention_with_kvcache(
                q, k_cache, v_cache, cache_seqlens, k, v, block_table=block_table,
                is_causal=is_causal, scale=scale, window=window, softcap=softcap,
                alibi_slopes=alibi_slopes, sinks=sinks, backend=backend, return_lse=return_lse)
    call = _validate.kvcache_call(q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                                  is_causal, scale, window, softcap, alibi_slopes, sinks,
                                  backend, return_lse)
    name = select("kvcache", call)  # a forced backend that cannot serve it writes nothing
    if call.k is not None:
        _write_new_keys(call)
    out, lse = _run(name, "kvcache", call)
    return (out, lse.float()) if return_lse else out


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                     *, dropout_p=0.0, is_causal=False, scale=None, window=None, softcap=None,
                     alibi_slopes=None, sinks=None, backend=None, return_lse=False):
    """Attention over packed sequences (flash-attention's varlen convention): q (total_q, Hq, E),
    k (total_k, Hkv, E), v (total_k, Hkv, Ev); sequence n is rows cu_seqlens[n]:cu_seqlens[n+1]
    (int32 prefix sums) and attends only to itself, `is_causal` and `window` aligned
    bottom-right in each sequence. Returns (total_q, Hq, Ev), and with `return_lse=True` also
    lse (Hq, total_q) float32. softcap and sinks as in scaled_dot_product_attention;
    alibi_slopes (Hq,) or (N, Hq) aligned bottom-right in each sequence. See API.md.
    """
    call = _validate.varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 dropout_p, is_causal, scale, window, softcap, alibi_slopes, sinks,
                                 backend, return_lse)
    call, everything_dropped = _without_total_dropout(call)
    out, lse = _run(select("varlen", call), "varlen", call)
    if everything_dropped:
        out = _dropped(out)
    return (out, lse.float()) if return_lse else out


def _write_new_keys(call) -> None:
    """k, v into the cache at positions cache_seqlens[b] + t (capacity and block ids were
    checked by the validation)."""
    b, _, lnew, _ = call.k.shape
    if lnew == 0:
        return
    device = call.k_cache.device
    pos = call.cache_seqlens.long().view(b, 1) + torch.arange(lnew, device=device)  # (B, Lnew)
    if call.block_table is None:
        rows, slots = torch.arange(b, device=device).view(b, 1).expand(b, lnew), pos
    else:
        block_size = call.k_cache.shape[2]
        rows, slots = call.block_table.long().gather(1, pos // block_size), pos % block_size
    k, v = call.k, call.v
    if torch.compiler.is_compiling() or any(
            _validate.may_overlap(x, c) for x in (k, v) for c in (call.k_cache, call.v_cache)):
        # new keys read from the cache itself (a view of it): taken before anything is written,
        # where the indexed write refused an overlap after writing k. A traced graph cannot ask
        # where storage lies (fullgraph=True would fail): it copies the few new rows always.
        k, v = k.clone(), v.clone()
    # cache[rows, :, slots] is (B, Lnew, Hkv, E): the indexed dims come first
    call.k_cache[rows, :, slots] = k.transpose(1, 2)
    call.v_cache[rows, :, slots] = v.transpose(1, 2)
