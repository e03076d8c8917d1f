"""The native ops `torch.ops.attnx.*`: loading the extension, fake kernels and autograd.

The schemas live once in C++ (`csrc/ops.cpp`, `TORCH_LIBRARY(attnx, ...)`), each device's
kernels in its own `TORCH_LIBRARY_IMPL`. What is registered here from Python is what the
dispatcher needs around them: shape-only fake kernels (so `torch.compile` and `opcheck` can
trace the ops) and the autograd formula tying each forward op to its backward op.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from . import _second_order

try:
    from . import _C  # noqa: F401  (loading it registers the ops)
    LOAD_ERROR: Optional[str] = None
except ImportError as exc:  # a source checkout that was never built
    _C = None
    LOAD_ERROR = f"attnx._C is not built or failed to load ({exc})"


def kvcache_fwd(ops, *args):
    """ops.kvcache_fwd(*args). attnx's own op on plain tensors, eager, goes through _C's unboxed
    entry to the same dispatcher op (csrc/python_module.cpp): torch.ops's Python entry boxes the
    arguments against the schema, ~50 us of a decoding call once a model's weights have flushed
    the caches (131 against 180 us at 16 keys, Emerald Rapids). What that entry does besides, it
    keeps: tracing (torch.compile), torch-function modes and tensor subclasses' overrides."""
    T = torch.Tensor
    q, k_cache, v_cache, seqlens, table = args[:5]
    if (ops is _ATTNX and type(q) is T and type(k_cache) is T and type(v_cache) is T
            and type(seqlens) is T and (table is None or type(table) is T)
            and not torch._C._is_torch_function_mode_enabled()
            and not torch.compiler.is_compiling()):
        return _C.kvcache_fwd(*args)
    return ops.kvcache_fwd(*args)


_ATTNX = torch.ops.attnx


def build_info() -> dict:
    """What the extension was compiled with (empty when it is not built)."""
    return dict(_C.build_info()) if _C is not None else {}


def _registered(op: str, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"attnx::{op}", key)
    except RuntimeError:  # an extension built before the op existed does not define it
        return False


# Read once at import: the dispatcher query is not traceable by torch.compile, and which kernels
# a built extension holds does not change while it runs.
_KERNELS = frozenset(
    (op, key)
    for op in ("sdpa_fwd", "sdpa_bwd", "additive_fwd", "additive_bwd", "kvcache_fwd",
               "varlen_fwd", "varlen_bwd", "sdpa_mod_fwd", "kvcache_mod_fwd", "varlen_mod_fwd")
    for key in ("CPU", "CUDA")
    if _C is not None and _registered(op, key))


def has_kernel(op: str, dispatch_key: str) -> bool:
    return (op, dispatch_key) in _KERNELS


def _wide_dtype(dtype: torch.dtype) -> torch.dtype:
    # The dtype of the SDPA ops' lse and the additive op's weights (csrc/ops.cpp): float64 for
    # float64 inputs (gradcheck-grade backward), else float32; the public functions round the
    # weights to q's dtype and return the lse float32.
    return torch.float64 if dtype == torch.float64 else torch.float32


def same_device(q: torch.Tensor, *others: Optional[torch.Tensor]) -> None:
    """The check a fake kernel makes where the real one would: a call mixing a meta tensor with
    real ones dispatches to the fake kernel, which must not answer with uninitialised memory."""
    for t in others:
        if t is not None and t.device != q.device:
            raise RuntimeError(
                f"attnx: expected every tensor on q's device {q.device}, got one on {t.device}")


def contiguous_grads(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What a backward op returns for these inputs (fake kernels): gradients of their shapes
    and dtypes, contiguous whatever the inputs' strides, as every backend writes them."""
    return tuple(t.new_empty(t.shape) for t in inputs)


def _empty_grad(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,))


def or_zeros(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The gradient of an output the loss did not use (None) as zeros."""
    return torch.zeros_like(like) if grad is None else grad


def weights_grads(grad_lse: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                  grad_weights: Optional[torch.Tensor]):
    """(grad_lse, grad_weights) as the additive backward kernels take them (csrc/ops.cpp):
    grad_lse less rowsum(W * dW), the weights' part of the softmax backward's D_i (float64 for
    float64 weights, gradcheck; else float32), and no grad_weights when the forward saved no
    weights (return_weights=False: the output was an empty placeholder)."""
    if weights is None or grad_weights is None:
        return grad_lse, None
    acc = torch.float64 if weights.dtype == torch.float64 else torch.float32
    term = (weights.to(acc) * grad_weights.to(acc)).sum(-1)
    return (-term if grad_lse is None else grad_lse.to(acc) - term), grad_weights


def no_double_backward(ctx, *grads):
    """The autograd of every fused backward op: without it, a second-order gradient through one
    would be silently wrong (torch only warns that the op has no autograd kernel). Reached
    only through calls made under torch.func's transforms (_transformable): elsewhere a
    backward with create_graph=True takes its gradients from the reference backend
    (attnx/_second_order.py), differentiable again."""
    raise NotImplementedError(
        "attnx: second-order gradients through a call made under torch.func's transforms (grad "
        "of grad, hessian, a vmap'd forward) are not implemented by the fused backends (cpu, "
        "cuda, triton); pass backend='reference' for them (elsewhere a backward with "
        "create_graph=True recomputes on the reference backend)")


# The autograd formulas again, per op (its qualified name), for torch.func's transforms: the
# autograd.Function torch.library generates from register_autograd has no setup_context, so
# torch.func.grad, vjp, jacrev and the like refuse it (RuntimeError), where torch's own SDPA works.
_FORMULAS: dict = {}


def register_autograd(op, backward, setup_context=None) -> None:
    """torch.library.register_autograd for `op` (a qualified name, or a torch.library custom op),
    keeping the formula for `call` under torch.func's transforms."""
    if isinstance(op, str):
        torch.library.register_autograd(op, backward, setup_context=setup_context)
    else:
        op.register_autograd(backward, setup_context=setup_context)
    _FORMULAS[_qualname(op)] = (setup_context, backward)


def _qualname(op) -> str:
    if isinstance(op, str):
        return op
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    return op._qualname  # a torch.library custom op (torch.library.CustomOpDef)


@functools.cache
def _transformable(op) -> type:
    """`op` with the autograd formula registered for it, as an autograd.Function with
    setup_context (what torch.func's transforms need; its vmap rule generated, the op itself
    then running under torch's per-sample fallback)."""
    name = _qualname(op)
    setup, backward = _FORMULAS[name]

    def forward(*args):
        return op(*args)  # (below autograd: a Function's forward runs with grad mode off)

    def setup_context(ctx, inputs, output):
        if setup is not None:
            setup(ctx, inputs, output)

    def first_order_backward(ctx, *grads):
        with _second_order.first_order_only():
            return backward(ctx, *grads)

    return type(f"{name.replace('::', '_')}_transformable", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(first_order_backward), "generate_vmap_rule": True})


def call(op, *args):
    """op(*args), through its autograd formula where a gradient can flow, and past its autograd
    kernel where none can (grad off, or no input requiring it: every inference step). That kernel
    (torch.library.register_autograd) is Python, which the dispatcher reaches by boxing every
    argument into Python objects and back: 40-55 us a call warm and ~150 cold (a model's
    decoding step, whose weights have just flushed the caches), more than a short attention
    itself. Under torch.func's grad transforms the formula runs as an autograd.Function of its
    own (_transformable). While torch.compile traces, the op runs as registered (a graph holds
    no private dispatch guard)."""
    if torch.compiler.is_compiling():  # (first: dynamo cannot trace _any_requires_grad)
        return op(*args)
    if torch.is_grad_enabled():
        if torch._C._are_functorch_transforms_active():
            # (whatever the inputs say: vmap's batched tensors do not report their base's
            # requires_grad, and the output of a vmap over tensors requiring it lost its graph)
            return _transformable(op).apply(*args)
        if torch._C._any_requires_grad(*args):
            return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _register(ns: str) -> None:
    """The fake kernels and autograd of the ops of library `ns`: attnx, or attnx_cuda_host (the
    same schemas, the CUDA kernels through the host harness), which so takes the same path."""
    ops = getattr(torch.ops, ns)

    @torch.library.register_fake(f"{ns}::sdpa_fwd")
    def _sdpa_fwd_fake(q, k, v, mask, scale, window_lo, window_hi, dropout_p, seed):
        same_device(q, k, v, mask)
        b, h, lq, _ = q.shape
        out = q.new_empty((b, h, lq, v.shape[-1]))
        return out, q.new_empty((b, h, lq), dtype=_wide_dtype(q.dtype))

    @torch.library.register_fake(f"{ns}::sdpa_bwd")
    def _sdpa_bwd_fake(grad_out, q, k, v, mask, out, lse, scale, window_lo, window_hi,
                       dropout_p, seed, mask_grad, grad_lse=None):
        same_device(q, grad_out, k, v, mask, out, lse, grad_lse)
        dmask = mask.new_empty(mask.shape) if mask_grad else _empty_grad(q)
        return (*contiguous_grads(q, k, v), dmask)

    @torch.library.register_fake(f"{ns}::additive_fwd")
    def _additive_fwd_fake(q, k, value, v, mask, window_lo, window_hi, dropout_p, seed,
                           return_weights):
        same_device(q, k, value, v, mask)
        b, h, lq, _ = q.shape
        out = q.new_empty((b, h, lq, value.shape[-1]))
        lse = q.new_empty((b, h, lq), dtype=torch.float32)
        weights = (q.new_empty((b, h, lq, k.shape[2]), dtype=_wide_dtype(q.dtype))
                   if return_weights else _empty_grad(q))
        return out, lse, weights

    @torch.library.register_fake(f"{ns}::additive_bwd")
    def _additive_bwd_fake(grad_out, q, k, value, v, mask, out, lse, window_lo, window_hi,
                           dropout_p, seed, mask_grad, grad_lse=None, grad_weights=None):
        same_device(q, grad_out, k, value, v, mask, out, lse, grad_lse, grad_weights)
        dmask = mask.new_empty(mask.shape) if mask_grad else _empty_grad(q)
        return (*contiguous_grads(q, k, value, v), dmask)

    def _wants_mask_grad(ctx, mask) -> bool:
        return mask is not None and mask.dtype != torch.bool and ctx.needs_input_grad[4 if ctx.additive else 3]

    def _sdpa_setup(ctx, inputs, output):
        q, k, v, mask, scale, lo, hi, p, seed = inputs
        out, lse = output
        ctx.additive = False
        ctx.args = (scale, lo, hi, p)
        ctx.save_for_backward(q, k, v, mask, out, lse, seed)

    def _sdpa_backward(ctx, grad_out, grad_lse):
        q, k, v, mask, out, lse, seed = ctx.saved_tensors
        scale, lo, hi, p = ctx.args
        if _second_order.wanted():
            dq, dk, dv, dmask, _ = _second_order.sdpa(
                (grad_out, grad_lse), q, k, v, mask, scale, lo, hi, p, seed)
            return dq, dk, dv, dmask, None, None, None, None, None
        want_mask = _wants_mask_grad(ctx, mask)
        dq, dk, dv, dmask = call(
            ops.sdpa_bwd, or_zeros(grad_out, out), q, k, v, mask, out, lse, scale, lo, hi, p,
            seed, want_mask, grad_lse)
        return dq, dk, dv, (dmask if want_mask else None), None, None, None, None, None

    def _additive_setup(ctx, inputs, output):
        q, k, value, v, mask, lo, hi, p, seed, return_weights = inputs
        out, lse, weights = output
        ctx.additive = True
        ctx.args = (lo, hi, p)
        ctx.save_for_backward(q, k, value, v, mask, out, lse, seed,
                              weights if return_weights else None)
        if not return_weights:
            ctx.mark_non_differentiable(weights)  # the empty placeholder

    def _additive_backward(ctx, grad_out, grad_lse, grad_weights):
        q, k, value, v, mask, out, lse, seed, weights = ctx.saved_tensors
        lo, hi, p = ctx.args
        if _second_order.wanted():
            grads = _second_order.additive((grad_out, grad_lse, grad_weights), q, k, value, v,
                                           mask, lo, hi, p, seed, weights is not None)
            return (*grads, None, None, None, None, None)
        want_mask = _wants_mask_grad(ctx, mask)
        grad_lse, grad_weights = weights_grads(grad_lse, weights, grad_weights)
        dq, dk, dvalue, dv, dmask = call(
            ops.additive_bwd, or_zeros(grad_out, out), q, k, value, v, mask, out, lse, lo, hi, p,
            seed, want_mask, grad_lse, grad_weights)
        return dq, dk, dvalue, dv, (dmask if want_mask else None), None, None, None, None, None

    # kvcache_fwd: an inference op, no autograd.
    @torch.library.register_fake(f"{ns}::kvcache_fwd")
    def _kvcache_fwd_fake(q, k_cache, v_cache, seqlens, block_table, scale, window_lo,
                          window_hi):
        same_device(q, k_cache, v_cache, seqlens, block_table)
        b, h, lq, _ = q.shape
        out = q.new_empty((b, h, lq, v_cache.shape[-1]))
        return out, q.new_empty((b, h, lq), dtype=torch.float32)

    register_autograd(f"{ns}::sdpa_fwd", _sdpa_backward, setup_context=_sdpa_setup)
    register_autograd(f"{ns}::additive_fwd", _additive_backward, setup_context=_additive_setup)
    register_autograd(f"{ns}::sdpa_bwd", no_double_backward)
    register_autograd(f"{ns}::additive_bwd", no_double_backward)


def _register_varlen(ns: str) -> None:
    """The fake kernels and autograd of `ns`::varlen_fwd / varlen_bwd (packed sequences; ns as
    in _register)."""
    ops = getattr(torch.ops, ns)

    @torch.library.register_fake(f"{ns}::varlen_fwd")
    def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, window_lo, window_hi,
                         dropout_p, seed):
        same_device(q, k, v, cu_seqlens_q, cu_seqlens_k)
        total_q, hq, _ = q.shape
        out = q.new_empty((total_q, hq, v.shape[-1]))
        return out, q.new_empty((hq, total_q), dtype=_wide_dtype(q.dtype))

    @torch.library.register_fake(f"{ns}::varlen_bwd")
    def _varlen_bwd_fake(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, scale,
                         window_lo, window_hi, dropout_p, seed, grad_lse=None):
        same_device(q, grad_out, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, grad_lse)
        return contiguous_grads(q, k, v)

    def _setup(ctx, inputs, output):
        q, k, v, cu_q, cu_k, scale, lo, hi, p, seed = inputs
        out, lse = output
        ctx.args = (scale, lo, hi, p)
        ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse, seed)

    def _backward(ctx, grad_out, grad_lse):
        q, k, v, cu_q, cu_k, out, lse, seed = ctx.saved_tensors
        scale, lo, hi, p = ctx.args
        if _second_order.wanted():
            dq, dk, dv, _ = _second_order.varlen((grad_out, grad_lse), q, k, v, cu_q, cu_k, scale,
                                                 lo, hi, p, seed)
            return dq, dk, dv, None, None, None, None, None, None, None
        dq, dk, dv = call(ops.varlen_bwd, or_zeros(grad_out, out), q, k, v, cu_q, cu_k, out, lse,
                          scale, lo, hi, p, seed, grad_lse)
        return dq, dk, dv, None, None, None, None, None, None, None

    register_autograd(f"{ns}::varlen_fwd", _backward, setup_context=_setup)
    register_autograd(f"{ns}::varlen_bwd", no_double_backward)


def _register_varlen_modifiers(ns: str) -> None:
    """The fake kernels and autograd of `ns`::varlen_mod_fwd / varlen_mod_bwd (packed
    sequences with softcap, ALiBi and sinks; ns as in _register), tying in the sinks'
    gradient."""
    ops = getattr(torch.ops, ns)

    @torch.library.register_fake(f"{ns}::varlen_mod_fwd")
    def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, window_lo, window_hi, dropout_p,
                  seed, softcap, alibi, sinks):
        same_device(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi, sinks)
        total_q, hq, _ = q.shape
        out = q.new_empty((total_q, hq, v.shape[-1]))
        return out, q.new_empty((hq, total_q), dtype=_wide_dtype(q.dtype))

    @torch.library.register_fake(f"{ns}::varlen_mod_bwd")
    def _bwd_fake(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, scale, window_lo,
                  window_hi, dropout_p, seed, grad_lse, softcap, alibi, sinks, sinks_grad):
        same_device(q, grad_out, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, grad_lse, alibi,
                    sinks)
        dsinks = sinks.new_empty(sinks.shape) if sinks_grad else _empty_grad(q)
        return (*contiguous_grads(q, k, v), dsinks)

    def _setup(ctx, inputs, output):
        q, k, v, cu_q, cu_k, scale, lo, hi, p, seed, softcap, alibi, sinks = inputs
        out, lse = output
        ctx.args = (scale, lo, hi, p, softcap)
        ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse, seed, alibi, sinks)

    def _backward(ctx, grad_out, grad_lse):
        q, k, v, cu_q, cu_k, out, lse, seed, alibi, sinks = ctx.saved_tensors
        scale, lo, hi, p, softcap = ctx.args
        if _second_order.wanted():
            dq, dk, dv, dsinks = _second_order.varlen((grad_out, grad_lse), q, k, v, cu_q, cu_k,
                                                      scale, lo, hi, p, seed, softcap, alibi, sinks)
            return (dq, dk, dv, None, None, None, None, None, None, None, None, None, dsinks)
        want_sinks = sinks is not None and ctx.needs_input_grad[12]
        dq, dk, dv, dsinks = call(
            ops.varlen_mod_bwd, or_zeros(grad_out, out), q, k, v, cu_q, cu_k, out, lse, scale, lo,
            hi, p, seed, grad_lse, softcap, alibi, sinks, want_sinks)
        return (dq, dk, dv, None, None, None, None, None, None, None, None, None,
                (dsinks if want_sinks else None))

    register_autograd(f"{ns}::varlen_mod_fwd", _backward, setup_context=_setup)
    register_autograd(f"{ns}::varlen_mod_bwd", no_double_backward)


def _register_modifiers(ns: str) -> None:
    """The fake kernels and autograd of `ns`::sdpa_mod_fwd / sdpa_mod_bwd (SDPA with softcap,
    ALiBi and sinks; ns as in _register), tying in the sinks' gradient."""
    ops = getattr(torch.ops, ns)

    @torch.library.register_fake(f"{ns}::sdpa_mod_fwd")
    def _fwd_fake(q, k, v, mask, scale, window_lo, window_hi, dropout_p, seed, softcap, alibi,
                  sinks):
        same_device(q, k, v, mask, alibi, sinks)
        b, h, lq, _ = q.shape
        out = q.new_empty((b, h, lq, v.shape[-1]))
        return out, q.new_empty((b, h, lq), dtype=_wide_dtype(q.dtype))

    @torch.library.register_fake(f"{ns}::sdpa_mod_bwd")
    def _bwd_fake(grad_out, q, k, v, mask, out, lse, scale, window_lo, window_hi, dropout_p,
                  seed, mask_grad, grad_lse, softcap, alibi, sinks, sinks_grad):
        same_device(q, grad_out, k, v, mask, out, lse, grad_lse, alibi, sinks)
        dmask = mask.new_empty(mask.shape) if mask_grad else _empty_grad(q)
        dsinks = sinks.new_empty(sinks.shape) if sinks_grad else _empty_grad(q)
        return (*contiguous_grads(q, k, v), dmask, dsinks)

    def _setup(ctx, inputs, output):
        q, k, v, mask, scale, lo, hi, p, seed, softcap, alibi, sinks = inputs
        out, lse = output
        ctx.args = (scale, lo, hi, p, softcap)
        ctx.save_for_backward(q, k, v, mask, out, lse, seed, alibi, sinks)

    def _backward(ctx, grad_out, grad_lse):
        q, k, v, mask, out, lse, seed, alibi, sinks = ctx.saved_tensors
        scale, lo, hi, p, softcap = ctx.args
        if _second_order.wanted():
            dq, dk, dv, dmask, dsinks = _second_order.sdpa(
                (grad_out, grad_lse), q, k, v, mask, scale, lo, hi, p, seed, softcap, alibi, sinks)
            return (dq, dk, dv, dmask, None, None, None, None, None, None, None, dsinks)
        want_mask = mask is not None and mask.dtype != torch.bool and ctx.needs_input_grad[3]
        want_sinks = sinks is not None and ctx.needs_input_grad[11]
        dq, dk, dv, dmask, dsinks = call(
            ops.sdpa_mod_bwd, or_zeros(grad_out, out), q, k, v, mask, out, lse, scale, lo, hi, p,
            seed, want_mask, grad_lse, softcap, alibi, sinks, want_sinks)
        return (dq, dk, dv, (dmask if want_mask else None), None, None, None, None, None, None,
                None, (dsinks if want_sinks else None))

    register_autograd(f"{ns}::sdpa_mod_fwd", _backward, setup_context=_setup)
    register_autograd(f"{ns}::sdpa_mod_bwd", no_double_backward)


def _register_kvcache_modifiers(ns: str) -> None:
    """The fake kernel of `ns`::kvcache_mod_fwd (an inference op; ns as in _register)."""

    def _kvcache_fake(q, k_cache, v_cache, seqlens, block_table, scale, window_lo, window_hi,
                      softcap, alibi, sinks):
        same_device(q, k_cache, v_cache, seqlens, block_table, alibi, sinks)
        b, h, lq, _ = q.shape
        out = q.new_empty((b, h, lq, v_cache.shape[-1]))
        return out, q.new_empty((b, h, lq), dtype=torch.float32)

    torch.library.register_fake(f"{ns}::kvcache_mod_fwd", _kvcache_fake)


if _C is not None:
    _register("attnx")
    if has_kernel("varlen_fwd", "CPU"):
        _register_varlen("attnx")  # an extension built before them has no such ops
    if has_kernel("sdpa_mod_fwd", "CPU") and has_kernel("kvcache_mod_fwd", "CPU"):
        _register_modifiers("attnx")  # an extension built before them has no such ops
        _register_kvcache_modifiers("attnx")
    if has_kernel("varlen_mod_fwd", "CPU"):
        _register_varlen_modifiers("attnx")  # an extension built before them has no such ops


@functools.cache
def cuda_host() -> Optional[str]:
    """Loads attnx._cuda_host (the CUDA kernels on CPU tensors through the host harness; tests
    only) and registers its ops' fake kernels and autograd, once; returns why it cannot, or
    None."""
    if _C is None:
        return LOAD_ERROR
    try:
        from . import _cuda_host  # noqa: F401  (loading it registers torch.ops.attnx_cuda_host)
    except ImportError as exc:
        return f"attnx._cuda_host (the CUDA host harness) is not built or failed to load ({exc})"
    _register("attnx_cuda_host")
    _register_modifiers("attnx_cuda_host")
    _register_kvcache_modifiers("attnx_cuda_host")
    _register_varlen("attnx_cuda_host")
    _register_varlen_modifiers("attnx_cuda_host")
    return None
