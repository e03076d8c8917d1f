"""Packed variable-length attention (attnx.varlen_attention) in Triton: the kernels of sdpa.py in
their VARLEN mode, with the score modifiers (softcap, sinks, and ALiBi slopes (N, Hq), one row
per sequence, its distance |i + Lk_n - Lq_n - j| aligned bottom-right as the band).

A program's batch index is the sequence n: the kernels load its row ranges from cu_seqlens, so
the tensors' batch strides are 0 and their row strides those of the packed (total, H, D) layout.
The grids span the longest sequence's tiles (max_seqlen_*); programs past a shorter sequence's
length exit. The band is shifted per sequence (bottom-right) in the kernels; dropout draws each
sequence as a batch-1 call with its own seed (attnx._rng.sequence_seed).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _second_order
from .._ops import call, no_double_backward, or_zeros, register_autograd, same_device
from . import common, sdpa, sdpa_bwd_rerun, sdpa_fwd_rerun
from .rng import rng_words

def _strides(t: torch.Tensor) -> tuple:
    """The kernels' (batch, head, row, dim) strides of a packed (total, H, D) tensor."""
    return (0, t.stride(1), t.stride(0), t.stride(2))


def _args(q, k, v, max_q, max_k, window_lo, window_hi, dropout_p, seed, softcap, alibi, sinks):
    """(rng words, strides of q, k, v and the absent mask, the clamped band, constexprs, the
    modifiers' arguments (sdpa._modifier_args))."""
    # Shifted by Lk_n - Lq_n in the kernels: the clamp keeps every admissible pair of any
    # sequence and the shifted band within int32.
    lo, hi = common.clamped_band(window_lo, window_hi, max_q + max_k, max_q + max_k)
    rng = rng_words(seed, dropout_p, q.device) if dropout_p > 0 else q
    strides = (*_strides(q), *_strides(k), *_strides(v), 0, 0, 0, 0)
    e, ev = q.shape[-1], v.shape[-1]
    (d1, d2), (dv1, dv2) = sdpa._head_blocks(e), sdpa._head_blocks(ev)
    *mod_args, flags = sdpa._modifier_args(q, softcap, alibi, sinks)
    consts = dict(MASK_KIND=common.MASK_NONE, DROPOUT=dropout_p > 0, **flags, VARLEN=True,
                  DOT_PREC=common.dot_precision(q.dtype),
                  LQ_BUCKET=common.length_bucket(max_q), LK_BUCKET=common.length_bucket(max_k),
                  BLOCK_D=d1, BLOCK_D2=d2, BLOCK_DV=dv1, BLOCK_DV2=dv2,
                  PAD_D=d1 + d2 != e or dv1 + dv2 != ev)
    return rng, strides, lo, hi, consts, tuple(mod_args)


@common.register_op("triton_varlen_fwd")
def varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
               window_lo: int, window_hi: int, dropout_p: float, seed: Optional[torch.Tensor],
               softcap: Optional[float] = None, alibi: Optional[torch.Tensor] = None,
               sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (total_q, Hq, Ev), lse (Hq, total_q) float32, the sink included); max_seqlen_*: the
    longest lengths; alibi float32 (N, Hq), sinks (Hq,)."""
    rng, strides, lo, hi, consts, (slopes, sink, a_strides, cap) = _args(
        q, k, v, max_seqlen_q, max_seqlen_k, window_lo, window_hi, dropout_p, seed, softcap,
        alibi, sinks)
    tq, h, e = q.shape
    hkv, ev, n = k.shape[1], v.shape[-1], cu_seqlens_q.shape[0] - 1
    out = q.new_empty((tq, h, ev))
    lse = q.new_empty((h, tq), dtype=torch.float32)
    flag = q.new_zeros((1,), dtype=torch.int32)  # as sdpa_fwd's
    grid = lambda meta: common.tiles_grid(max_seqlen_q, meta["BLOCK_M"], n * h)  # noqa: E731
    inv_keep = 1.0 / (1.0 - dropout_p)
    common.launcher(sdpa._fwd_kernel)[grid](
        q, k, v, q, out, lse, rng, slopes, sink, flag, *strides, *_strides(out), *a_strides,
        h, max_seqlen_q, max_seqlen_k, e, ev, h // hkv, scale, lo, hi, inv_keep,
        cap, cu_seqlens_q, cu_seqlens_k, tq, HAS_SINKS=sinks is not None, **consts)
    sdpa_fwd_rerun.launch(
        out, lse, flag, (q, k, v, q, rng, slopes, sink), (*strides, *_strides(out), *a_strides),
        (n, h, hkv, max_seqlen_q, max_seqlen_k, e, ev), (scale, lo, hi, inv_keep, cap),
        (cu_seqlens_q, cu_seqlens_k, tq), mask_kind=common.MASK_NONE, dropout=dropout_p > 0,
        softcap=softcap is not None, alibi=alibi is not None, has_sinks=sinks is not None,
        varlen=True)
    return out, lse


@common.register_op("triton_varlen_bwd")
def varlen_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
               max_seqlen_k: int, out: torch.Tensor, lse: torch.Tensor, scale: float,
               window_lo: int, window_hi: int, dropout_p: float, seed: Optional[torch.Tensor],
               grad_lse: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
               alibi: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks (empty without sinks)), contiguous; the three passes of sdpa_bwd."""
    rng, strides, lo, hi, consts, (slopes, sink, a_strides, cap) = _args(
        q, k, v, max_seqlen_q, max_seqlen_k, window_lo, window_hi, dropout_p, seed, softcap,
        alibi, sinks)
    tq, h, e = q.shape
    tk, hkv, ev, n = k.shape[0], k.shape[1], v.shape[-1], cu_seqlens_q.shape[0] - 1
    cu = (cu_seqlens_q, cu_seqlens_k, tq)
    lse = lse.contiguous()  # read by row index
    delta = torch.empty_like(lse)
    dos = grad_out.new_empty((h, tq, ev))  # dO / r (sdpa_bwd), rows of each head contiguous
    dos_strides = (0, *dos.stride())
    glse = grad_lse.float().contiguous() if grad_lse is not None else lse
    lengths = (max_seqlen_q, max_seqlen_k, e, ev, h // hkv)
    # Set as in sdpa_bwd: sdpa_bwd_rerun's kernels then redo dQ, dK and dV.
    flag = q.new_zeros((1,), dtype=torch.int32)
    common.launcher(sdpa._prep_kernel)[
        lambda meta: common.tiles_grid(max_seqlen_q, meta["BLOCK_M"], n * h)](
        q, k, q, out, grad_out, glse, lse, delta, dos, slopes, sink, flag,
        *strides[:8],
        *strides[12:], *_strides(out), *_strides(grad_out), *a_strides, h, *lengths, scale, lo,
        hi, common.HUGE_LSE, cap, *cu, consts["LQ_BUCKET"], consts["LK_BUCKET"],
        MASK_KIND=common.MASK_NONE, HAS_GLSE=grad_lse is not None, SOFTCAP=consts["SOFTCAP"],
        ALIBI=consts["ALIBI"], HAS_SINKS=sinks is not None, VARLEN=True,
        DOT_PREC=consts["DOT_PREC"],
        PAD_D=common.head_block(e) != e or common.head_block(ev) != ev,
        BLOCK_D=common.head_block(e), BLOCK_DV=common.head_block(ev))
    split = sdpa._gqa_split(h // hkv, max_seqlen_k, n * hkv,
                            sdpa._one_head_per_program(q, e, ev))
    if split == 1:
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    else:  # fp32 partial sums of each slice of a group's query heads
        dk = k.new_empty((tk, hkv, split, e), dtype=torch.float32)
        dv = v.new_empty((tk, hkv, split, ev), dtype=torch.float32)
    band = (scale, lo, hi, 1.0 / (1.0 - dropout_p), slopes, *a_strides, cap)
    common.launcher(sdpa._dkdv_kernel)[
        lambda meta: common.tiles_grid(max_seqlen_k, meta["BLOCK_N"], n * hkv * split)](
        q, k, v, q, dos, lse, delta, rng, dk, dv, q, flag, *strides,
        *dos_strides,
        h, hkv, *lengths, split, h // hkv // split, *band, *cu, MASK_GRAD=False, **consts)
    if split > 1:
        dk, dv = dk.sum(2).to(k.dtype), dv.sum(2).to(v.dtype)
    dsinks = q.new_empty((0,)) if sinks is None else common.sink_grad(sinks, lse, delta, (h, 1), 1)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    common.launcher(sdpa._dq_kernel)[
        lambda meta: common.tiles_grid(max_seqlen_q, meta["BLOCK_M"], n * h)](
        q, k, v, q, dos, lse, delta, rng, dq, flag, *strides, *dos_strides,
        h, *lengths, *band, *cu, **consts)
    rows64 = sdpa_bwd_rerun.launch(
        flag, (q, k, v, q, grad_out, glse, lse, rng, slopes, sink), (dq, dk, dv, q),
        (*strides, *_strides(grad_out), *a_strides),
        (*_strides(dq), *_strides(dk), *_strides(dv)),
        (n, h, hkv, max_seqlen_q, max_seqlen_k, e, ev), band[:4] + (cap,), cu,
        mask_kind=common.MASK_NONE, dropout=dropout_p > 0, mask_grad=False,
        softcap=softcap is not None, alibi=alibi is not None, has_sinks=sinks is not None,
        has_glse=grad_lse is not None, varlen=True)
    if sinks is not None and rows64 is not None:  # as sdpa_bwd's
        dsinks = torch.where(flag.bool(), common.sink_grad(sinks, *rows64, (h, 1), 1), dsinks)
    return dq, dk, dv, dsinks


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                     window_lo, window_hi, dropout_p, seed, softcap=None, alibi=None, sinks=None):
    same_device(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi, sinks)
    tq, h, _ = q.shape
    return q.new_empty((tq, h, v.shape[-1])), q.new_empty((h, tq), dtype=torch.float32)


@varlen_bwd.register_fake
def _varlen_bwd_fake(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     out, lse, scale, window_lo, window_hi, dropout_p, seed, grad_lse=None,
                     softcap=None, alibi=None, sinks=None):
    same_device(q, grad_out, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, grad_lse, alibi, sinks)
    dsinks = q.new_empty((0,)) if sinks is None else sinks.new_empty(sinks.shape)
    return (*(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)),
            dsinks)


def _setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, scale, lo, hi, p, seed, softcap, alibi, sinks = inputs
    out, lse = output
    ctx.args = (max_q, max_k, scale, lo, hi, p, softcap)
    ctx.save_for_backward(q, k, v, cu_q, cu_k, out, lse, seed, alibi, sinks)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, cu_q, cu_k, out, lse, seed, alibi, sinks = ctx.saved_tensors
    max_q, max_k, scale, lo, hi, p, softcap = ctx.args
    if _second_order.wanted():
        dq, dk, dv, dsinks = _second_order.varlen((grad_out, grad_lse), q, k, v, cu_q, cu_k, scale,
                                                  lo, hi, p, seed, softcap, alibi, sinks)
        return (dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None,
                dsinks)
    dq, dk, dv, dsinks = call(varlen_bwd, or_zeros(grad_out, out), q, k, v, cu_q, cu_k, max_q,
                              max_k, out, lse, scale, lo, hi, p, seed, grad_lse, softcap, alibi,
                              sinks)
    # no gradient for the slopes: constants (attnx/_validate.py)
    return (dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None,
            dsinks if sinks is not None and ctx.needs_input_grad[14] else None)


register_autograd(varlen_fwd, _backward, setup_context=_setup)
register_autograd(varlen_bwd, no_double_backward)
