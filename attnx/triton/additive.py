"""Additive (Bahdanau) attention in Triton, fused: the (Lq, Lk, A) tanh terms are never stored.

score[i, j] = sum_a w[h, a] * tanh(q[i, a] + k[j, a]) is built tile by tile, looping over A in
chunks of BLOCK_A inside the kernel; the softmax is the online one of the SDPA kernel. The
backward recomputes the scores and then, in a second pass over A, the tanh terms it needs:

    dq[i, a] = w[a] * sum_j ds[i, j] * (1 - t[i, j, a]^2)     (one kernel per query block)
    dk[j, a] = w[a] * sum_i ds[i, j] * (1 - t[i, j, a]^2)     (one kernel per key block,
    dw[a]    = sum_ij ds[i, j] * t[i, j, a]                     which also gives dvalue, dmask)

Each program owns its rows of dq / dk (and one slot of dw partial sums), accumulated in fp32
scratch across its loop, so the result is deterministic with no atomics. Here `w` is the
op's `v` (H, A), renamed to keep it apart from the values.

bf16 and fp32 values near their largest overflow the backward's float32 dP and delta, and an
fp16 output past 65504 (saved as inf) makes delta inf: NaN in dS. The dK and dQ kernels then set
a device flag after their loops, and additive_bwd_rerun redoes dq, dk, dw and the float mask's
gradient in float64 (nothing runs while it is unset).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _second_order
from .._ops import (call, contiguous_grads, no_double_backward, or_zeros, register_autograd,
                    same_device, weights_grads)
from . import common
from .common import (admit, dot, flag_nonfinite, huge_rows, key_range, offsets, query_range,
                     score_grad, softmax_start, softmax_step, split_tile,
                     store_normalised_rows, tile_and_head)
from .rng import keep, rng_words, row_keys


def _blocks(a: int) -> dict:
    """Fixed tiles (the backward accumulates in scratch, which autotuning reruns would spoil)."""
    if common.interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_A=min(32, triton.next_power_of_2(a)))
    return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_A=4, num_warps=4, maxnreg=common.MAX_REGISTERS)


@triton.jit
def _chunk(q_base, k_base, w_base, offs_m, offs_n, offs_a, Lq, Lk, A, sqm, sqa, skn, ska, swa,
           DTYPE: tl.constexpr):
    """tanh(q[i, a] + k[j, a]) as (rows, keys, BLOCK_A) and w[a], both in DTYPE (fp32 here,
    float64 in additive_bwd_rerun; 0 past A). float32 inputs take common.tanh's exact small
    branch (|q|, |k| ~ 1e-3 erred 90x torch's float32 without it); fp16 and bf16 inputs, whose
    rounding dominates, the exp form alone."""
    a_ok = offs_a < A
    qa = tl.load(q_base + offsets(offs_m, offs_a, sqm, sqa),
                 mask=(offs_m[:, None] < Lq) & a_ok[None, :], other=0.0).to(DTYPE)
    ka = tl.load(k_base + offsets(offs_n, offs_a, skn, ska),
                 mask=(offs_n[:, None] < Lk) & a_ok[None, :], other=0.0).to(DTYPE)
    wa = tl.load(w_base + offs_a.to(tl.int64) * swa, mask=a_ok, other=0.0).to(DTYPE)
    return common.tanh(qa[:, None, :] + ka[None, :, :], q_base.dtype.element_ty == tl.float32), wa


@triton.jit
def _scores(q_base, k_base, w_base, offs_m, offs_n, Lq, Lk, A, sqm, sqa, skn, ska, swa,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr):
    s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for a0 in range(0, A, BLOCK_A):
        t, wa = _chunk(q_base, k_base, w_base, offs_m, offs_n, a0 + tl.arange(0, BLOCK_A),
                       Lq, Lk, A, sqm, sqa, skn, ska, swa, tl.float32)
        s += tl.sum(t * wa[None, None, :], 2)
    return s


@triton.jit
def _fwd_kernel(Q, K, VAL, W, M, O, LSE, RNG,
                sqb, sqh, sqm, sqa, skb, skh, skn, ska, svb, svh, svn, svd, swh, swa,
                smb, smh, smm, smn, sob, soh, som, sod,
                H, Lq, Lk, A, Ev, window_lo, window_hi, inv_keep,
                MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_A: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m0, bh = tile_and_head(Lq, BLOCK_M)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + h * skh
    v_base = VAL + b * svb + h * svh
    w_base = W + h * swh
    m_base = M + b * smb + h * smh
    key_row, threshold = None, None
    if DROPOUT:
        key_row, threshold = row_keys(RNG, bh, offs_m)
    m_i, l_i, acc = softmax_start(BLOCK_M, BLOCK_DV)
    start, end = key_range(m0, Lq, Lk, window_lo, window_hi, BLOCK_M, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        s = _scores(q_base, k_base, w_base, offs_m, offs_n, Lq, Lk, A, sqm, sqa, skn, ska, swa,
                    BLOCK_M, BLOCK_N, BLOCK_A)
        s = admit(s, m_base, offs_m, offs_n, Lq, Lk, smm, smn, window_lo, window_hi, MASK_KIND)
        val = tl.load(v_base + offsets(offs_n, offs_dv, svn, svd),
                      mask=(offs_n[:, None] < Lk) & (offs_dv[None, :] < Ev), other=0.0)
        m_i, l_i, acc = softmax_step(s, val, m_i, l_i, acc, key_row, threshold, offs_n, DROPOUT,
                                     DOT_PREC)
    if DROPOUT:
        acc = acc * inv_keep  # (softmax_step's rows hold the kept keys' share)
    store_normalised_rows(O + b * sob + h * soh, LSE + bh.to(tl.int64) * Lq, m_i, l_i, acc,
                          offs_m, offs_dv, Lq, Ev, som, sod)


@triton.jit
def _probs(q_base, k_base, w_base, m_base, LSE, bh, offs_m, offs_n, Lq, Lk, A,
           sqm, sqa, skn, ska, swa, smm, smn, window_lo, window_hi,
           MASK_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_A: tl.constexpr):
    """Probabilities of a tile from the saved lse (+inf on empty rows, so they come out 0)."""
    lse = tl.load(LSE + bh * Lq + offs_m, mask=offs_m < Lq, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    s = _scores(q_base, k_base, w_base, offs_m, offs_n, Lq, Lk, A, sqm, sqa, skn, ska, swa,
                BLOCK_M, BLOCK_N, BLOCK_A)
    s = admit(s, m_base, offs_m, offs_n, Lq, Lk, smm, smn, window_lo, window_hi, MASK_KIND)
    return tl.exp(s - lse[:, None])


@triton.jit
def _row_sums_kernel(Q, K, W, M, LSE, R,
                     sqb, sqh, sqm, sqa, skb, skh, skn, ska, swh, swa, smb, smh, smm, smn,
                     H, Lq, Lk, A, window_lo, window_hi, huge_lse,
                     MASK_KIND: tl.constexpr, BLOCK_A: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """R = sum_j exp(s_ij - lse_i) on rows of huge |lse| (common.HUGE_LSE), 1 on the others;
    blocks without such rows read nothing but their lse."""
    m0, bh = tile_and_head(Lq, BLOCK_M)
    bh = bh.to(tl.int64)
    b = bh // H
    h = bh % H
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < Lq
    lse = tl.load(LSE + bh * Lq + offs_m, mask=row_ok, other=0.0)
    huge = huge_rows(lse, huge_lse)
    start, end = key_range(m0, Lq, Lk, window_lo, window_hi, BLOCK_M, BLOCK_N)
    end = tl.where(tl.max(huge.to(tl.int32), 0) > 0, end, start)
    total = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        p = _probs(Q + b * sqb + h * sqh, K + b * skb + h * skh, W + h * swh,
                   M + b * smb + h * smh, LSE, bh, offs_m, offs_n, Lq, Lk, A, sqm, sqa, skn, ska,
                   swa, smm, smn, window_lo, window_hi, MASK_KIND, BLOCK_M, BLOCK_N, BLOCK_A)
        total += tl.sum(p, 1)
    tl.store(R + bh * Lq + offs_m, tl.where(huge, total, 1.0), mask=row_ok)


@triton.jit
def _weights_kernel(Q, K, W, M, LSE, RNG, P,
                    sqb, sqh, sqm, sqa, skb, skh, skn, ska, swh, swa, smb, smh, smm, smn,
                    H, Lq, Lk, A, window_lo, window_hi, inv_keep,
                    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_A: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One axis over (query tile, key tile, b * H + h): common.tiles_grid's reason.
    m0, rest = split_tile(tl.program_id(0), Lq, BLOCK_M)
    n0, bh = split_tile(rest, Lk, BLOCK_N)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    bh = bh.to(tl.int64)
    b = bh // H
    h = bh % H
    p = _probs(Q + b * sqb + h * sqh, K + b * skb + h * skh, W + h * swh, M + b * smb + h * smh,
               LSE, bh, offs_m, offs_n, Lq, Lk, A, sqm, sqa, skn, ska, swa, smm, smn,
               window_lo, window_hi, MASK_KIND, BLOCK_M, BLOCK_N, BLOCK_A)
    if DROPOUT:
        key_row, threshold = row_keys(RNG, bh, offs_m)
        p = tl.where(keep(key_row, offs_n, threshold), p * inv_keep, 0.0)
    tl.store(P + (bh * Lq + offs_m[:, None]) * Lk + offs_n[None, :], p.to(P.dtype.element_ty),
             mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk))


@triton.jit
def _dweights(DWEIGHTS, bh, offs_m, offs_n, Lq, Lk, HAS_DWEIGHTS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile of the weights' gradient ((B, H, Lq, Lk) contiguous fp32), zeros for none: both
    branches return a (BLOCK_M, BLOCK_N) fp32 tile, as a GPU compile requires (a scalar 0.0 in
    one branch fails there with "Inconsistent return types"; the interpreter accepts it)."""
    if HAS_DWEIGHTS:
        tile = tl.load(DWEIGHTS + (bh * Lq + offs_m[:, None]) * Lk + offs_n[None, :],
                       mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk), other=0.0)
    else:
        tile = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    return tile


@triton.jit
def _flag_scratch(FLAG, rows_base, offs, L, A, BLOCK_A: tl.constexpr):
    """Sets FLAG where the rows offs (< L) of a program's fp32 scratch (rows_base: (rows, A))
    hold inf or NaN after its loop: a non-finite dS (dP or delta overflowed) always reaches them
    (additive_bwd_rerun then redoes the gradients)."""
    for a0 in range(0, A, BLOCK_A):
        offs_a = a0 + tl.arange(0, BLOCK_A)
        acc = tl.load(rows_base + offs_a[None, :], mask=(offs[:, None] < L) & (offs_a[None, :] < A),
                      other=0.0)
        flag_nonfinite(FLAG, acc)


@triton.jit
def _dk_kernel(Q, K, VAL, W, M, DO, DWEIGHTS, LSE, DELTA, RNG, DK, DVAL, DW, DM, FLAG,
               sqb, sqh, sqm, sqa, skb, skh, skn, ska, svb, svh, svn, svd, swh, swa,
               smb, smh, smm, smn, sdb, sdh, sdm, sdd,
               H, Lq, Lk, A, Ev, window_lo, window_hi, inv_keep,
               MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, MASK_GRAD: tl.constexpr,
               HAS_DWEIGHTS: tl.constexpr,
               DOT_PREC: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_A: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    n0, bh = tile_and_head(Lk, BLOCK_N)
    bh = bh.to(tl.int64)
    b = bh // H
    h = bh % H
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + h * skh
    w_base = W + h * swh
    m_base = M + b * smb + h * smh
    val_mask = (offs_n[:, None] < Lk) & (offs_dv[None, :] < Ev)
    val_t = tl.trans(tl.load(VAL + b * svb + h * svh + offsets(offs_n, offs_dv, svn, svd),
                             mask=val_mask, other=0.0))
    dk_rows = DK + (bh * Lk + offs_n[:, None]) * A  # fp32 scratch, zeroed, owned here
    dw_slot = DW + (bh * tl.cdiv(Lk, BLOCK_N) + n0 // BLOCK_N) * A
    dval = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    start, end = query_range(n0, Lq, Lk, window_lo, window_hi, BLOCK_M, BLOCK_N)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < Lq
        p = _probs(q_base, k_base, w_base, m_base, LSE, bh, offs_m, offs_n, Lq, Lk, A,
                   sqm, sqa, skn, ska, swa, smm, smn, window_lo, window_hi,
                   MASK_KIND, BLOCK_M, BLOCK_N, BLOCK_A)
        do = tl.load(DO + b * sdb + h * sdh + offsets(offs_m, offs_dv, sdm, sdd),
                     mask=row_ok[:, None] & (offs_dv[None, :] < Ev), other=0.0)
        delta = tl.load(DELTA + bh * Lq + offs_m, mask=row_ok, other=0.0)
        dweights = _dweights(DWEIGHTS, bh, offs_m, offs_n, Lq, Lk, HAS_DWEIGHTS, BLOCK_M,
                               BLOCK_N)
        ds, p_used = score_grad(p, do, val_t, dweights, delta, RNG, bh, offs_m, offs_n, inv_keep,
                                DROPOUT, DOT_PREC)
        dval += dot(tl.trans(p_used.to(do.dtype)), do, DOT_PREC)
        if MASK_GRAD:
            tl.store(DM + (bh * Lq + offs_m[:, None]) * Lk + offs_n[None, :],
                     ds.to(DM.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < Lk))
        for a0 in range(0, A, BLOCK_A):
            offs_a = a0 + tl.arange(0, BLOCK_A)
            t, wa = _chunk(q_base, k_base, w_base, offs_m, offs_n, offs_a, Lq, Lk, A,
                           sqm, sqa, skn, ska, swa, tl.float32)
            g = ds[:, :, None] * t
            ptrs = dk_rows + offs_a[None, :]
            ok = (offs_n[:, None] < Lk) & (offs_a[None, :] < A)
            dk = tl.load(ptrs, mask=ok, other=0.0)
            tl.store(ptrs, dk + (tl.sum(ds[:, :, None] - g * t, 0)) * wa[None, :], mask=ok)
            dw = tl.load(dw_slot + offs_a, mask=offs_a < A, other=0.0)
            tl.store(dw_slot + offs_a, dw + tl.sum(tl.sum(g, 0), 0), mask=offs_a < A)
            tl.debug_barrier()  # the next pass reads what this one stored
    tl.store(DVAL + (bh * Lk + offs_n[:, None]) * Ev + offs_dv[None, :],
             dval.to(DVAL.dtype.element_ty), mask=val_mask)
    _flag_scratch(FLAG, dk_rows, offs_n, Lk, A, BLOCK_A)
    flag_nonfinite(FLAG, dval)  # (a dO near the largest overflows it where dS may not)


@triton.jit
def _dq_kernel(Q, K, VAL, W, M, DO, DWEIGHTS, LSE, DELTA, RNG, DQ, FLAG,
               sqb, sqh, sqm, sqa, skb, skh, skn, ska, svb, svh, svn, svd, swh, swa,
               smb, smh, smm, smn, sdb, sdh, sdm, sdd,
               H, Lq, Lk, A, Ev, window_lo, window_hi, inv_keep,
               MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, HAS_DWEIGHTS: tl.constexpr,
               DOT_PREC: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_A: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m0, bh = tile_and_head(Lq, BLOCK_M)
    bh = bh.to(tl.int64)
    b = bh // H
    h = bh % H
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Lq
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + h * skh
    v_base = VAL + b * svb + h * svh
    w_base = W + h * swh
    m_base = M + b * smb + h * smh
    do = tl.load(DO + b * sdb + h * sdh + offsets(offs_m, offs_dv, sdm, sdd),
                 mask=row_ok[:, None] & (offs_dv[None, :] < Ev), other=0.0)
    delta = tl.load(DELTA + bh * Lq + offs_m, mask=row_ok, other=0.0)
    dq_rows = DQ + (bh * Lq + offs_m[:, None]) * A  # fp32 scratch, zeroed, owned here
    start, end = key_range(m0, Lq, Lk, window_lo, window_hi, BLOCK_M, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        p = _probs(q_base, k_base, w_base, m_base, LSE, bh, offs_m, offs_n, Lq, Lk, A,
                   sqm, sqa, skn, ska, swa, smm, smn, window_lo, window_hi,
                   MASK_KIND, BLOCK_M, BLOCK_N, BLOCK_A)
        val_t = tl.load(v_base + offsets(offs_dv, offs_n, svd, svn),
                        mask=(offs_n[None, :] < Lk) & (offs_dv[:, None] < Ev), other=0.0)
        dweights = _dweights(DWEIGHTS, bh, offs_m, offs_n, Lq, Lk, HAS_DWEIGHTS, BLOCK_M,
                               BLOCK_N)
        ds, _ = score_grad(p, do, val_t, dweights, delta, RNG, bh, offs_m, offs_n, inv_keep,
                           DROPOUT, DOT_PREC)
        for a0 in range(0, A, BLOCK_A):
            offs_a = a0 + tl.arange(0, BLOCK_A)
            t, wa = _chunk(q_base, k_base, w_base, offs_m, offs_n, offs_a, Lq, Lk, A,
                           sqm, sqa, skn, ska, swa, tl.float32)
            ptrs = dq_rows + offs_a[None, :]
            ok = row_ok[:, None] & (offs_a[None, :] < A)
            dq = tl.load(ptrs, mask=ok, other=0.0)
            tl.store(ptrs, dq + tl.sum(ds[:, :, None] * (1.0 - t * t), 1) * wa[None, :], mask=ok)
            tl.debug_barrier()  # the next pass reads what this one stored
    _flag_scratch(FLAG, dq_rows, offs_m, Lq, A, BLOCK_A)


def _launch_args(q, k, value, w, mask, dropout_p, seed):
    m, m_strides = common.mask_arg(mask, q)
    rng = rng_words(seed, dropout_p, q.device) if dropout_p > 0 else q
    strides = (*q.stride(), *k.stride(), *value.stride(), *w.stride(), *m_strides)
    consts = dict(MASK_KIND=common.mask_kind(mask), DROPOUT=dropout_p > 0,
                  DOT_PREC=common.dot_precision(q.dtype),
                  BLOCK_DV=common.head_block(value.shape[-1]), **_blocks(q.shape[-1]))
    return m, rng, strides, consts, 1.0 / (1.0 - dropout_p)


@common.register_op("triton_additive_fwd")
def additive_fwd(q: torch.Tensor, k: torch.Tensor, value: torch.Tensor, v: torch.Tensor,
                 mask: Optional[torch.Tensor], window_lo: int, window_hi: int,
                 dropout_p: float, seed: Optional[torch.Tensor], return_weights: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, weights): weights (B, H, Lq, Lk) float32 after dropout when return_weights,
    else an empty placeholder (csrc/ops.cpp's convention)."""
    window_lo, window_hi = common.clamped_band(window_lo, window_hi, q.shape[2], k.shape[2])
    m, rng, strides, consts, inv_keep = _launch_args(q, k, value, v, mask, dropout_p, seed)
    b, h, lq, a = q.shape
    lk, ev = k.shape[2], value.shape[-1]
    out = q.new_empty((b, h, lq, ev))
    lse = q.new_empty((b, h, lq), dtype=torch.float32)
    grid = common.tiles_grid(lq, consts["BLOCK_M"], b * h)
    common.launcher(_fwd_kernel)[grid](
        q, k, value, v, m, out, lse, rng, *strides, *out.stride(),
        h, lq, lk, a, ev, window_lo, window_hi, inv_keep, **consts)
    if not return_weights:
        return out, lse, q.new_empty((0,))
    return out, lse, _weights(q, k, v, mask, lse, window_lo, window_hi, dropout_p, seed)


def _row_sums(q, k, v, mask, lse, window_lo, window_hi):
    """common.HUGE_LSE's r: sum_j exp(s_ij - lse_i) on rows of huge |lse|, else 1."""
    m, m_strides = common.mask_arg(mask, q)
    b, h, lq, a = q.shape
    blocks = _blocks(a)
    r = torch.empty_like(lse)
    common.launcher(_row_sums_kernel)[common.tiles_grid(lq, blocks["BLOCK_M"], b * h)](
        q, k, v, m, lse, r, *q.stride(), *k.stride(), *v.stride(), *m_strides,
        h, lq, k.shape[2], a, window_lo, window_hi, common.HUGE_LSE,
        MASK_KIND=common.mask_kind(mask), **blocks)
    return r


def _weights(q, k, v, mask, lse, window_lo, window_hi, dropout_p, seed):
    """The attention probabilities after dropout, (B, H, Lq, Lk), from the forward's lse."""
    m, m_strides = common.mask_arg(mask, q)
    rng = rng_words(seed, dropout_p, q.device) if dropout_p > 0 else q
    b, h, lq, a = q.shape
    lk = k.shape[2]
    blocks = _blocks(a)
    weights = q.new_empty((b, h, lq, lk), dtype=torch.float32)
    grid = common.tiles_grid(lq, blocks["BLOCK_M"], triton.cdiv(lk, blocks["BLOCK_N"]) * b * h)
    common.launcher(_weights_kernel)[grid](
        q, k, v, m, lse, rng, weights, *q.stride(), *k.stride(), *v.stride(), *m_strides,
        h, lq, lk, a, window_lo, window_hi, 1.0 / (1.0 - dropout_p),
        MASK_KIND=common.mask_kind(mask), DROPOUT=dropout_p > 0, **blocks)
    return common.divide_rows(weights, _row_sums(q, k, v, mask, lse, window_lo, window_hi))


@common.register_op("triton_additive_bwd")
def additive_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, value: torch.Tensor,
                 v: torch.Tensor, mask: Optional[torch.Tensor], out: torch.Tensor,
                 lse: torch.Tensor, window_lo: int, window_hi: int, dropout_p: float,
                 seed: Optional[torch.Tensor], mask_grad: bool,
                 grad_lse: Optional[torch.Tensor], grad_weights: Optional[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad_lse and grad_weights as in csrc/ops.cpp's additive_bwd (the weights' part of D
    folded into grad_lse by the caller)."""
    window_lo, window_hi = common.clamped_band(window_lo, window_hi, q.shape[2], k.shape[2])
    m, rng, strides, consts, inv_keep = _launch_args(q, k, value, v, mask, dropout_p, seed)
    b, h, lq, a = q.shape
    lk, ev = k.shape[2], value.shape[-1]
    # Everything the backward reads from upstream goes through r, as dO does (common.HUGE_LSE)
    r = _row_sums(q, k, v, mask, lse, window_lo, window_hi)
    raw_grad_out = grad_out
    grad_out = common.divide_rows(grad_out, r)
    delta = (grad_out.float() * out.float()).sum(-1)  # rowsum(dO * O), as in the SDPA backward
    if grad_lse is not None:
        delta = delta - grad_lse.float() / r
    dweights = q  # a placeholder pointer the kernels never read without HAS_DWEIGHTS
    if grad_weights is not None:
        dweights = common.divide_rows(grad_weights.float(), r).contiguous()
    n_blocks = triton.cdiv(lk, consts["BLOCK_N"])
    dq = q.new_zeros((b, h, lq, a), dtype=torch.float32)
    dk = q.new_zeros((b, h, lk, a), dtype=torch.float32)
    dw = q.new_zeros((b, h, n_blocks, a), dtype=torch.float32)
    dvalue = value.new_empty((b, h, lk, ev))
    dmask = mask.new_zeros((b, h, lq, lk)) if mask_grad else q.new_empty((0,))
    sizes = (h, lq, lk, a, ev, window_lo, window_hi, inv_keep)
    has_dw = grad_weights is not None
    from . import additive_bwd_rerun  # (it imports this module's jit functions)
    # Set where dP or delta overflowed (bf16, fp32; fp16 where out passed its range):
    # additive_bwd_rerun then redoes dq, dk, dw.
    flag = q.new_zeros((1,), dtype=torch.int32)
    common.launcher(_dk_kernel)[common.tiles_grid(lk, consts["BLOCK_N"], b * h)](
        q, k, value, v, m, grad_out, dweights, lse, delta, rng, dk, dvalue, dw, dmask,
        flag, *strides, *grad_out.stride(), *sizes, MASK_GRAD=mask_grad, HAS_DWEIGHTS=has_dw,
        **consts)
    common.launcher(_dq_kernel)[common.tiles_grid(lq, consts["BLOCK_M"], b * h)](
        q, k, value, v, m, grad_out, dweights, lse, delta, rng, dq, flag, *strides,
        *grad_out.stride(), *sizes, HAS_DWEIGHTS=has_dw, **consts)
    dq, dk, dw = dq.to(q.dtype), dk.to(k.dtype), dw.sum((0, 2)).to(v.dtype)
    # The caller's dO and weights' gradient: the rerun divides by its own float64 r. Where
    # flagged it writes dq, dk, dvalue and dmask over these, and its dw takes this one's place.
    dw64 = additive_bwd_rerun.launch(
        flag, (q, k, value, v, m, raw_grad_out,
               None if grad_weights is None else grad_weights.float().contiguous(),
               grad_lse, lse, rng),
        (*strides, *raw_grad_out.stride()), (b, h, lq, lk, a, ev),
        (window_lo, window_hi, inv_keep), (dq, dk, dvalue, dmask),
        mask_kind=consts["MASK_KIND"],
        dropout=dropout_p > 0, mask_grad=mask_grad)
    dw = torch.where(flag.bool(), dw64.to(v.dtype), dw)
    return dq, dk, dvalue, dw, dmask


# Shape-only versions (see attnx/triton/sdpa.py for why they are spelled out).
@additive_fwd.register_fake
def _additive_fwd_fake(q, k, value, v, mask, window_lo, window_hi, dropout_p, seed,
                       return_weights):
    same_device(q, k, value, v, mask)
    b, h, lq, _ = q.shape
    weights = (q.new_empty((b, h, lq, k.shape[2]), dtype=torch.float32) if return_weights
               else q.new_empty((0,)))
    return (q.new_empty((b, h, lq, value.shape[-1])),
            q.new_empty((b, h, lq), dtype=torch.float32), weights)


@additive_bwd.register_fake
def _additive_bwd_fake(grad_out, q, k, value, v, mask, out, lse, window_lo, window_hi,
                       dropout_p, seed, mask_grad, grad_lse, grad_weights):
    same_device(q, grad_out, k, value, v, mask, out, lse, grad_lse, grad_weights)
    dmask = mask.new_empty((*q.shape[:3], k.shape[2])) if mask_grad else q.new_empty((0,))
    return (*contiguous_grads(q, k, value, v), dmask)


def _setup(ctx, inputs, output):
    q, k, value, v, mask, lo, hi, p, seed, return_weights = inputs
    out, lse, weights = output
    ctx.args = (lo, hi, p)
    ctx.save_for_backward(q, k, value, v, mask, out, lse, seed,
                          weights if return_weights else None)
    ctx.mark_non_differentiable(lse)
    if not return_weights:
        ctx.mark_non_differentiable(weights)  # the empty placeholder


def _backward(ctx, grad_out, _grad_lse, grad_weights):
    q, k, value, v, mask, out, lse, seed, weights = ctx.saved_tensors
    lo, hi, p = ctx.args
    if _second_order.wanted():
        grads = _second_order.additive((grad_out, None, grad_weights), q, k, value, v, mask, lo,
                                       hi, p, seed, weights is not None)
        return (*grads, None, None, None, None, None)
    want_mask = mask is not None and mask.dtype != torch.bool and ctx.needs_input_grad[4]
    grad_lse, grad_weights = weights_grads(None, weights, grad_weights)  # its lse: a constant
    dq, dk, dvalue, dv, dmask = call(
        additive_bwd, or_zeros(grad_out, out), q, k, value, v, mask, out, lse, lo, hi, p, seed,
        want_mask, grad_lse, grad_weights)
    return dq, dk, dvalue, dv, (dmask if want_mask else None), None, None, None, None, None


register_autograd(additive_fwd, _backward, setup_context=_setup)
register_autograd(additive_bwd, no_double_backward)
