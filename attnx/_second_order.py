"""Second-order gradients through the fused backends, by recomputation on the reference backend.

The fused backward ops (csrc/, attnx/triton/) compute first-order gradients, and have no
derivative of their own. A backward that runs with create_graph=True
(`torch.autograd.grad(..., create_graph=True)`, `.backward(create_graph=True)`: a gradient
penalty, MAML's inner steps, a Hessian-vector product) is going to be differentiated again; there
the forward ops' autograd formulas (attnx/_ops.py, attnx/triton/) take their gradients from here
instead: the call recomputed by the reference backend from the saved inputs, differentiable to
any order. It materialises the (B, H, Lq, Lk) scores (additive attention: the (B, H, Lq, Lk, A)
tanh tensor), as torch's math SDPA does where it gives second-order gradients.

Not under torch.func's transforms, whose grad runs every backward with create_graph=True: the
fused backward serves them, and a reverse-over-reverse transform raises (attnx/_ops.py
no_double_backward). Not while torch.compile traces either: its backward runs with grad off.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch

from ._validate import AdditiveCall, Modifiers, SdpaCall, VarlenCall, _check_cu_seqlens

_state = threading.local()


@contextlib.contextmanager
def first_order_only():
    """Around the formulas torch.func's transforms run (attnx/_ops.py _transformable): their
    grad runs every backward with create_graph=True, and inside that backward no transform
    reports itself active any more."""
    before = getattr(_state, "first_order_only", False)
    _state.first_order_only = True
    try:
        yield
    finally:
        _state.first_order_only = before


def wanted() -> bool:
    """Whether the backward formula running now must give gradients that can be differentiated
    again (see the module's docstring)."""
    return (torch.is_grad_enabled() and not getattr(_state, "first_order_only", False)
            and not torch.compiler.is_compiling())


def _mods(softcap: Optional[float], alibi, sinks) -> Modifiers:
    # (the ops take a softcap of 0.0 for none)
    return Modifiers(softcap or None, alibi, sinks)


def _grads(outputs, grad_outputs, inputs) -> list:
    """The gradients of `inputs` (None where one is None or requires none) of the outputs
    against grad_outputs, with create_graph. A tensor given twice (q is k) takes its whole
    gradient once, None the other time: autograd sums what a formula returns per input."""
    pairs = [(o, g.to(o.dtype)) for o, g in zip(outputs, grad_outputs)
             if o is not None and g is not None and o.requires_grad]
    wanted_at = [i for i, t in enumerate(inputs)
                 if t is not None and t.requires_grad and all(t is not u for u in inputs[:i])]
    result = [None] * len(inputs)
    if not pairs or not wanted_at:
        return result
    grads = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted_at],
                                [g for _, g in pairs], create_graph=True, allow_unused=True)
    for i, g in zip(wanted_at, grads):
        result[i] = g
    return result


def _recomputed(op: str, call, grad_outputs, inputs) -> list:
    from ._backends import reference  # (reference imports the modules that import this one)
    kind = call.q.device.type
    # autocast off, as for any backend's forward (_dispatch._run)
    with torch.enable_grad(), torch.autocast(kind, enabled=False):
        return _grads(getattr(reference, op)(call), grad_outputs, inputs)


def sdpa(grad_outputs, q, k, v, mask, scale, lo, hi, p, seed, softcap=None, alibi=None,
         sinks=None) -> list:
    """[dq, dk, dv, dmask, dsinks] of an SDPA op's call (its arguments as the op took them)."""
    call = SdpaCall(q, k, v, mask, scale, lo, hi, p, seed, "reference", tuple(q.shape[:-2]), True,
                    _mods(softcap, alibi, sinks))
    float_mask = mask if mask is not None and mask.is_floating_point() else None
    return _recomputed("sdpa", call, grad_outputs, (q, k, v, float_mask, sinks))


def additive(grad_outputs, q, k, value, v, mask, lo, hi, p, seed, return_weights) -> list:
    """[dq, dk, dvalue, dv, dmask] of an additive op's call; grad_outputs for (out, lse,
    weights)."""
    call = AdditiveCall(q, k, value, v, mask, lo, hi, p, seed, "reference", False, return_weights)
    float_mask = mask if mask is not None and mask.is_floating_point() else None
    return _recomputed("additive", call, grad_outputs, (q, k, value, v, float_mask))


def varlen(grad_outputs, q, k, v, cu_q, cu_k, scale, lo, hi, p, seed, softcap=None, alibi=None,
           sinks=None) -> list:
    """[dq, dk, dv, dsinks] of a varlen op's call."""
    lens = tuple(zip(_check_cu_seqlens("cu_seqlens_q", cu_q, q.shape[0], q.device),
                     _check_cu_seqlens("cu_seqlens_k", cu_k, k.shape[0], q.device)))
    call = VarlenCall(q, k, v, cu_q, cu_k, lens, scale, lo, hi, p, seed, "reference", True,
                      _mods(softcap, alibi, sinks))
    return _recomputed("varlen", call, grad_outputs, (q, k, v, sinks))
