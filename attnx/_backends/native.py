"""Calls into the compiled ops shared by the `cpu` and `cuda` backends.

Both backends are the same dispatcher ops (`torch.ops.attnx.*`); the dispatcher picks the CPU
or CUDA kernel from the tensors' device. What differs between them is only what each kernel
family can serve, which `cpu.py` and `cuda.py` state. (`ops`: torch.ops.attnx_cuda_host for the
CUDA kernels on CPU tensors through the host harness, same schemas.)
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _ops
from .._validate import AdditiveCall, KvcacheCall, SdpaCall, VarlenCall

OPS = {"sdpa": "sdpa_fwd", "additive": "additive_fwd", "kvcache": "kvcache_fwd",
       "varlen": "varlen_fwd", "sdpa_mod": "sdpa_mod_fwd",
       "kvcache_mod": "kvcache_mod_fwd", "varlen_mod": "varlen_mod_fwd"}


def missing_kernel(op: str, dispatch_key: str) -> Optional[str]:
    if _ops.LOAD_ERROR is not None:
        return _ops.LOAD_ERROR
    if not _ops.has_kernel(OPS[op], dispatch_key):
        return f"attnx._C has no {dispatch_key} kernel for attnx::{OPS[op]}"
    return None


def sdpa(call: SdpaCall, ops=torch.ops.attnx):
    if call.mods.any():  # the plain op keeps kernels compiled without the modifiers' code
        mods = call.mods
        return _ops.call(ops.sdpa_mod_fwd, call.q, call.k, call.v, call.mask, call.scale,
                         call.window_lo, call.window_hi, call.dropout_p, call.seed,
                         mods.softcap or 0.0, mods.alibi, mods.sinks)
    return _ops.call(ops.sdpa_fwd, call.q, call.k, call.v, call.mask, call.scale, call.window_lo,
                     call.window_hi, call.dropout_p, call.seed)


def additive(call: AdditiveCall, ops=torch.ops.attnx):
    out, lse, weights = _ops.call(
        ops.additive_fwd, call.q, call.k, call.value, call.v, call.mask, call.window_lo,
        call.window_hi, call.dropout_p, call.seed, call.return_weights)
    return out, lse, (weights if call.return_weights else None)


def kvcache(call: KvcacheCall, ops=torch.ops.attnx):
    if call.mods.any():  # the plain op keeps kernels compiled without the modifiers' code
        mods = call.mods
        return ops.kvcache_mod_fwd(
            call.q, call.k_cache, call.v_cache, call.seqlens, call.block_table, call.scale,
            call.window_lo, call.window_hi, mods.softcap or 0.0, mods.alibi, mods.sinks)
    return _ops.kvcache_fwd(ops, call.q, call.k_cache, call.v_cache, call.seqlens,
                            call.block_table, call.scale, call.window_lo, call.window_hi)


def varlen(call: VarlenCall, ops=torch.ops.attnx):
    if call.mods.any():  # the plain op keeps kernels compiled without the modifiers' code
        mods = call.mods
        return _ops.call(
            ops.varlen_mod_fwd, call.q, call.k, call.v, call.cu_q, call.cu_k, call.scale,
            call.window_lo, call.window_hi, call.dropout_p, call.seed, mods.softcap or 0.0,
            mods.alibi, mods.sinks)
    return _ops.call(ops.varlen_fwd, call.q, call.k, call.v, call.cu_q, call.cu_k, call.scale,
                     call.window_lo, call.window_hi, call.dropout_p, call.seed)
