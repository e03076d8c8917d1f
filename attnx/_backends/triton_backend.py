"""The `triton` backend: the Triton kernels of `attnx/triton/`, as `torch.ops.attnx.triton_*`.

It serves CUDA tensors on a CUDA device, and CPU tensors only under Triton's interpreter
(`TRITON_INTERPRET=1` set before Triton is imported), which exists for testing: the dispatcher
never picks it for CPU tensors on its own.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from .. import _ops
from .._validate import AdditiveCall, KvcacheCall, SdpaCall, VarlenCall

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


# Both answers are fixed for the process; torch.compile takes them as constants rather than
# tracing them: the dispatcher asks on every CUDA SDPA call (backend=None puts triton first),
# and torch 2.11's dynamo cannot trace importlib's find_spec (fullgraph=True failed).
@torch.compiler.assume_constant_result
def _interpreting() -> bool:
    from ..triton import common
    return common.interpreting()


@torch.compiler.assume_constant_result
def availability() -> Optional[str]:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if _interpreting() or torch.cuda.is_available():
        return None
    return ("no CUDA device is visible to torch (TRITON_INTERPRET=1 runs the kernels on CPU "
            "tensors in Triton's interpreter)")


def unsupported(op: str, call) -> Optional[str]:
    reason = availability()
    if reason is not None:
        return reason
    device = call.q.device.type
    if _interpreting():
        if device != "cpu":
            return f"under TRITON_INTERPRET=1 the triton backend takes CPU tensors, got device {call.q.device}"
    elif device != "cuda":
        return (f"the triton backend takes CUDA tensors (CPU ones only under TRITON_INTERPRET=1), "
                f"got device {call.q.device}")
    if call.q.dtype not in DTYPES:
        return f"the triton backend takes float16, bfloat16 and float32, got {call.q.dtype}"
    dims = {"sdpa": lambda: (call.q.shape[-1], call.v.shape[-1]),
            "varlen": lambda: (call.q.shape[-1], call.v.shape[-1]),
            "kvcache": lambda: (call.q.shape[-1], call.v_cache.shape[-1]),
            "additive": lambda: (call.value.shape[-1],)}[op]()
    if max(dims) > MAX_HEAD_DIM:
        return f"the triton backend takes head dims up to {MAX_HEAD_DIM}, got {dims}"
    return None


def sdpa(call: SdpaCall):
    from ..triton import sdpa as kernels  # imports Triton and registers the ops on first use
    mods = call.mods
    return _ops.call(kernels.sdpa_fwd, call.q, call.k, call.v, call.mask, call.scale,
                     call.window_lo, call.window_hi, call.dropout_p, call.seed, mods.softcap,
                     mods.alibi, mods.sinks)


def additive(call: AdditiveCall):
    from ..triton import additive as kernels
    out, lse, weights = _ops.call(kernels.additive_fwd, call.q, call.k, call.value, call.v,
                                  call.mask, call.window_lo, call.window_hi, call.dropout_p,
                                  call.seed, call.return_weights)
    return out, lse, (weights if call.return_weights else None)


def kvcache(call: KvcacheCall):
    from ..triton import decode as kernels
    mods = call.mods
    return kernels.kvcache_fwd(call.q, call.k_cache, call.v_cache, call.seqlens,
                               call.block_table, call.scale, call.window_lo, call.window_hi,
                               mods.softcap, mods.alibi, mods.sinks)


def varlen(call: VarlenCall):
    from ..triton import varlen as kernels
    mods = call.mods
    return _ops.call(kernels.varlen_fwd, call.q, call.k, call.v, call.cu_q, call.cu_k,
                     max(lq for lq, _ in call.lens), max(lk for _, lk in call.lens), call.scale,
                     call.window_lo, call.window_hi, call.dropout_p, call.seed, mods.softcap,
                     mods.alibi, mods.sinks)
