"""Scaled dot-product attention in Triton, FlashAttention-2 style.

Forward: one program per (query block, b * Hq + h) streams the key blocks of its band with an
online softmax and saves the row log-sum-exp. Backward recomputes the probabilities from it:
one kernel per (key block, b * Hkv + kv head) accumulates dK and dV over the query heads of its
GQA group (no atomics, K/V never copied) and writes the float-mask gradient; a second kernel
per query block accumulates dQ.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._ops import contiguous_grads, no_double_backward, or_zeros, same_device
from . import common
from .common import (LN2, LOG2E, admit_block, dot, dot_acc, huge_rows, inner_range, key_range,
                     load_tile, offsets, query_range, score_grad, softmax_start, store_rows,
                     tile_and_head)
from .rng import keep, rng_words, row_keys

# Pruned per launch by common.pruner; the small configs are what fits wide fp32 heads on
# sm_80, the 8-warp ones what fits 128-wide heads in registers.
_FWD = common.configs([(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3),
                       (64, 32, 4, 4), (128, 32, 4, 4), (64, 64, 4, 2), (64, 32, 8, 2),
                       (32, 32, 4, 2), (32, 16, 4, 1)], small=(16, 16))
_DKDV = common.configs([(64, 128, 8, 3), (32, 128, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3),
                        (64, 64, 8, 3), (32, 64, 8, 3), (32, 64, 4, 4), (64, 128, 8, 2),
                        (16, 64, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2), (16, 16, 4, 1)],
                       small=(16, 16))
_DQ = common.configs([(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3),
                      (64, 32, 8, 3), (64, 32, 4, 4), (128, 64, 8, 2), (32, 32, 4, 2),
                      (16, 32, 4, 2), (16, 16, 4, 1)], small=(16, 16))
_SUMS = common.configs([(128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 4), (32, 16, 4, 2)],
                      small=(16, 16))
# Tuned once per power-of-two bucket of the lengths (common.length_bucket), not per length.
_KEY = ["LQ_BUCKET", "LK_BUCKET", "BLOCK_D", "BLOCK_DV", "MASK_KIND", "DROPOUT", "GROUPS"]
_JIT = triton.jit(do_not_specialize=["LQ_BUCKET", "LK_BUCKET"])  # read by the autotuner only


# What each kernel's tiles take, for common.pruner (element counts of a config).
def _fwd_tiles(m):
    """K^T and V staged; q and p through shared memory; acc and s/p fp32 in registers (and the
    mask or dropout's tile where there is one), q held."""
    mm, n, d, dv = m["BLOCK_M"], m["BLOCK_N"], m["BLOCK_D"], m["BLOCK_DV"]
    tiles = 1 + m["MASK_KIND"] + bool(m["DROPOUT"])  # a float mask: its load and fp32 copy
    return dict(staged=n * (d + dv), mask=mm * n, resident=mm * (d + n), acc=mm * (dv + tiles * n),
                held=mm * d)


def _sums_tiles(m):
    """K^T staged; q through shared memory; s fp32 in registers, q held."""
    mm, n, d = m["BLOCK_M"], m["BLOCK_N"], m["BLOCK_D"]
    return dict(staged=n * d, mask=mm * n, resident=mm * (d + n), acc=mm * n, held=mm * d)


def _dkdv_tiles(m):
    """q and dO staged; k, v, p^T and ds^T through shared memory; dk, dv and six score-sized
    fp32 tiles in registers (p, dp, ds, their transposes; four more for the dropout hash and
    kept p, one for a mask, five for a GQA group's loop), k and v held."""
    mm, n, d, dv = m["BLOCK_M"], m["BLOCK_N"], m["BLOCK_D"], m["BLOCK_DV"]
    tiles = 6 + 4 * bool(m["DROPOUT"]) + bool(m["MASK_KIND"]) + 5 * (m["GROUPS"] > 1)
    return dict(staged=mm * (d + dv), mask=mm * n, resident=n * (d + dv + 2 * mm),
                acc=n * (d + dv) + tiles * mm * n, held=n * (d + dv))


def _dq_tiles(m):
    """k and v^T staged; q, dO and ds through shared memory; dq and p, dp, ds fp32 in registers,
    q and dO held."""
    mm, n, d, dv = m["BLOCK_M"], m["BLOCK_N"], m["BLOCK_D"], m["BLOCK_DV"]
    return dict(staged=n * (d + dv), mask=mm * n, resident=mm * (d + dv + n),
                acc=mm * d + 3 * mm * n, held=mm * (d + dv))


@triton.jit
def _query_program(H, Lq, GROUPS, BLOCK_M: tl.constexpr):
    """(first query row, b * Hq + h, b, h, kv head) of a program over (query block, b * Hq + h)."""
    m0, bh = tile_and_head(Lq, BLOCK_M)
    b = (bh // H).to(tl.int64)
    h = bh % H
    return m0, bh, b, h.to(tl.int64), (h // GROUPS).to(tl.int64)


@triton.jit
def _head_bases(K, V, M, b, h, hk, skb, skh, svb, svh, smb, smh):
    """Where the keys, values (kv head hk) and mask (query head h) of batch b start."""
    return K + b * skb + hk * skh, V + b * svb + hk * svh, M + b * smb + h * smh


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, m_base, kt_off, v_off, m_off, lo, hi,
                offs_m, row_ok, offs_d, offs_dv, Lk, E, Ev, skn, svn, smn, sc, window_lo,
                window_hi, key_row, threshold, inv_keep,
                EDGE: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
                DOT_PREC: tl.constexpr, PAD_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """The online softmax over key blocks [lo, hi). EDGE blocks reach past the band or the keys:
    they mask scores and loads; the others carry no band or bounds arithmetic (and no masked
    load unless the head dim is padded). Without a float mask the running max m_i is in log2
    units: one FMA per score (qk * scale * LOG2E - m) feeds exp2. A float mask's rows may hold
    finfo.min biases, which times LOG2E would overflow to -inf: there scores and m_i stay in
    natural units, and exp2 takes (s - m) * LOG2E."""
    qk_scale = sc * LOG2E
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + cols
        n = tl.cast(n0, tl.int64)
        kt = load_tile(k_base + n * skn + kt_off, offs_d, offs_n, E, Lk, PAD_D, EDGE)
        qk = dot(q, kt, DOT_PREC)
        if EDGE:
            diff = offs_n[None, :] - offs_m[:, None]
            ok = (row_ok[:, None] & (offs_n[None, :] < Lk) & (diff >= window_lo)
                  & (diff <= window_hi))
        else:
            ok = row_ok[:, None]  # only read by the mask loads
        if MASK_KIND == 2:
            bias = tl.load(m_base + n * smn + m_off, mask=ok, other=0.0).to(tl.float32)
            s = qk * sc + bias
            if EDGE:
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with nothing admissible so far keeps max -inf; subtracting 0 instead keeps
            # exp(-inf - -inf) = NaN out.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2((s - m_safe[:, None]) * LOG2E)
            alpha = tl.math.exp2((m_i - m_safe) * LOG2E)
        else:
            if MASK_KIND == 1:
                ok = ok & (tl.load(m_base + n * smn + m_off, mask=ok, other=0) != 0)
            if EDGE or MASK_KIND == 1:
                t = tl.where(ok, qk * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(t, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(t - m_safe[:, None])
            else:
                m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                m_safe = m_new
                p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(keep(key_row, offs_n, threshold), p * inv_keep, 0.0)
        v = load_tile(v_base + n * svn + v_off, offs_n, offs_dv, Lk, Ev, EDGE, PAD_D)
        acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None], DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_FWD, key=_KEY,
                 prune_configs_by={"early_config_prune": common.pruner(_fwd_tiles)})
@_JIT
def _fwd_kernel(Q, K, V, M, O, LSE, RNG,
                sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                smb, smh, smm, smn, sob, soh, som, sod,
                H, Lq, Lk, E, Ev, GROUPS, scale, window_lo, window_hi, inv_keep,
                LQ_BUCKET, LK_BUCKET,
                MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
                PAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m0, bh, b, h, hk = _query_program(H, Lq, GROUPS, BLOCK_M)
    rows = tl.arange(0, BLOCK_M)
    offs_m = m0 + rows
    row_ok = offs_m < Lq
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m = m0.to(tl.int64)
    k_base, v_base, m_base = _head_bases(K, V, M, b, h, hk, skb, skh, svb, svh, smb, smh)
    q = load_tile(Q + b * sqb + h * sqh + m * sqm + offsets(rows, offs_d, sqm, sqd), offs_m,
                  offs_d, Lq, E, True, PAD_D)
    # scale * (q . k) = |scale| * (-q . k): exp2's FMA needs a positive scale for the row max.
    if scale < 0:
        q = -q
    sc = tl.abs(scale)
    key_row, threshold = None, None
    if DROPOUT:
        key_row, threshold = row_keys(RNG, bh, offs_m)
    m_base = m_base + m * smm
    kt_off = offsets(offs_d, tl.arange(0, BLOCK_N), skd, skn)
    v_off = offsets(tl.arange(0, BLOCK_N), offs_dv, svn, svd)
    m_off = offsets(rows, tl.arange(0, BLOCK_N), smm, smn)
    m_i, l_i, acc = softmax_start(BLOCK_M, BLOCK_DV)
    start, end = key_range(m0, Lq, Lk, window_lo, window_hi, BLOCK_M, BLOCK_N)
    lo, hi = inner_range(m0, Lq, Lk, start, end, window_lo, window_hi, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, m_base, kt_off, v_off, m_off,
                                start, lo, offs_m, row_ok, offs_d, offs_dv, Lk, E, Ev, skn, svn,
                                smn, sc, window_lo, window_hi, key_row, threshold, inv_keep,
                                True, MASK_KIND, DROPOUT, DOT_PREC, PAD_D, BLOCK_N)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, m_base, kt_off, v_off, m_off,
                                lo, hi, offs_m, row_ok, offs_d, offs_dv, Lk, E, Ev, skn, svn,
                                smn, sc, window_lo, window_hi, key_row, threshold, inv_keep,
                                False, MASK_KIND, DROPOUT, DOT_PREC, PAD_D, BLOCK_N)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q, k_base, v_base, m_base, kt_off, v_off, m_off,
                                hi, end, offs_m, row_ok, offs_d, offs_dv, Lk, E, Ev, skn, svn,
                                smn, sc, window_lo, window_hi, key_row, threshold, inv_keep,
                                True, MASK_KIND, DROPOUT, DOT_PREC, PAD_D, BLOCK_N)
    if MASK_KIND != 2:
        m_i = m_i * LN2  # back to natural units (-inf stays -inf)
    store_rows(O + b * sob + h * soh + m * som, LSE + bh.to(tl.int64) * Lq + m0, m_i, l_i, acc,
               rows, offs_dv, Lq - m0, Ev, som, sod)


@triton.jit
def _probs(q, kt, m_base, lse, m0, n0, offs_m, offs_n, Lq, Lk, smm, smn, scale, window_lo,
           window_hi, MASK_KIND: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr):
    """Softmax probabilities of a tile recomputed from the saved lse (+inf on empty rows, so
    they come out 0)."""
    s = dot(q, kt, DOT_PREC) * scale
    s = admit_block(s, m_base, m0, n0, offs_m, offs_n, Lq, Lk, smm, smn, window_lo, window_hi,
                    MASK_KIND, BLOCK_M, BLOCK_N)
    return tl.exp(s - lse[:, None])


@triton.autotune(configs=_SUMS, key=["LQ_BUCKET", "LK_BUCKET", "BLOCK_D", "MASK_KIND", "GROUPS"],
                 prune_configs_by={"early_config_prune": common.pruner(_sums_tiles)})
@_JIT
def _row_sums_kernel(Q, K, M, LSE, R, sqb, sqh, sqm, sqd, skb, skh, skn, skd, smb, smh, smm, smn,
                     H, Lq, Lk, E, GROUPS, scale, window_lo, window_hi, huge_lse,
                     LQ_BUCKET, LK_BUCKET,
                     MASK_KIND: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """R = sum_j exp(s_ij - lse_i) on rows of huge |lse| (common.HUGE_LSE), 1 on the others;
    blocks without such rows read nothing but their lse."""
    m0, bh, b, h, hk = _query_program(H, Lq, GROUPS, BLOCK_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Lq
    lse = tl.load(LSE + bh.to(tl.int64) * Lq + offs_m, mask=row_ok, other=0.0)
    huge = huge_rows(lse, huge_lse)
    k_base, _, m_base = _head_bases(K, K, M, b, h, hk, skb, skh, skb, skh, smb, smh)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < E), other=0.0)
    start, end = key_range(m0, Lq, Lk, window_lo, window_hi, BLOCK_M, BLOCK_N)
    end = tl.where(tl.max(huge.to(tl.int32), 0) > 0, end, start)
    total = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kt = tl.load(k_base + offs_n[None, :] * skn + offs_d[:, None] * skd,
                     mask=(offs_n[None, :] < Lk) & (offs_d[:, None] < E), other=0.0)
        total += tl.sum(_probs(q, kt, m_base, lse, m0, n0, offs_m, offs_n, Lq, Lk, smm, smn,
                               scale, window_lo, window_hi, MASK_KIND, DOT_PREC, BLOCK_M,
                               BLOCK_N), 1)
    tl.store(R + bh.to(tl.int64) * Lq + offs_m, tl.where(huge, total, 1.0), mask=row_ok)


@triton.autotune(configs=_DKDV, key=_KEY,
                 prune_configs_by={"early_config_prune": common.pruner(_dkdv_tiles)})
@_JIT
def _dkdv_kernel(Q, K, V, M, DO, LSE, DELTA, RNG, DK, DV, DM,
                 sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                 smb, smh, smm, smn, sdb, sdh, sdm, sdd,
                 H, Hkv, Lq, Lk, E, Ev, GROUPS, scale, window_lo, window_hi, inv_keep,
                 LQ_BUCKET, LK_BUCKET,
                 MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, MASK_GRAD: tl.constexpr,
                 DOT_PREC: tl.constexpr, PAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    n0, bhk = tile_and_head(Lk, BLOCK_N)
    b = (bhk // Hkv).to(tl.int64)
    hk = (bhk % Hkv).to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_mask = (offs_n[:, None] < Lk) & (offs_d[None, :] < E)
    v_mask = (offs_n[:, None] < Lk) & (offs_dv[None, :] < Ev)
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                mask=k_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                mask=v_mask, other=0.0)
    kt = tl.trans(k)
    vt = tl.trans(v)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    start, end = query_range(n0, Lq, Lk, window_lo, window_hi, BLOCK_M, BLOCK_N)
    for g in range(GROUPS):
        h = hk * GROUPS + g
        bh = b * H + h
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdb + h * sdh
        m_base = M + b * smb + h * smh
        for m0 in range(start, end, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            row_ok = offs_m < Lq
            q = tl.load(q_base + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                        mask=row_ok[:, None] & (offs_d[None, :] < E), other=0.0)
            do = tl.load(do_base + offs_m[:, None] * sdm + offs_dv[None, :] * sdd,
                         mask=row_ok[:, None] & (offs_dv[None, :] < Ev), other=0.0)
            lse = tl.load(LSE + bh * Lq + offs_m, mask=row_ok, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse)
            delta = tl.load(DELTA + bh * Lq + offs_m, mask=row_ok, other=0.0)
            p = _probs(q, kt, m_base, lse, m0, n0, offs_m, offs_n, Lq, Lk, smm, smn, scale,
                       window_lo, window_hi, MASK_KIND, DOT_PREC, BLOCK_M, BLOCK_N)
            ds, p_used = score_grad(p, do, vt, 0.0, delta, RNG, bh, offs_m, offs_n, inv_keep,
                                    DROPOUT, DOT_PREC)
            dv += dot(tl.trans(p_used.to(do.dtype)), do, DOT_PREC)
            if MASK_GRAD:
                tl.store(DM + bh * Lq * Lk + offs_m[:, None] * Lk + offs_n[None, :],
                         ds.to(DM.dtype.element_ty),
                         mask=row_ok[:, None] & (offs_n[None, :] < Lk))
            dk += dot(tl.trans(ds.to(q.dtype)), q, DOT_PREC)
    # dK and dV are contiguous, shaped like K and V.
    base = bhk.to(tl.int64) * Lk
    tl.store(DK + (base + offs_n[:, None]) * E + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=k_mask)
    tl.store(DV + (base + offs_n[:, None]) * Ev + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=v_mask)


@triton.autotune(configs=_DQ, key=_KEY,
                 prune_configs_by={"early_config_prune": common.pruner(_dq_tiles)})
@_JIT
def _dq_kernel(Q, K, V, M, DO, LSE, DELTA, RNG, DQ,
               sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
               smb, smh, smm, smn, sdb, sdh, sdm, sdd,
               H, Lq, Lk, E, Ev, GROUPS, scale, window_lo, window_hi, inv_keep,
               LQ_BUCKET, LK_BUCKET,
               MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
               PAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m0, bh, b, h, hk = _query_program(H, Lq, GROUPS, BLOCK_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Lq
    q_mask = row_ok[:, None] & (offs_d[None, :] < E)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=q_mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_dv[None, :] * sdd,
                 mask=row_ok[:, None] & (offs_dv[None, :] < Ev), other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * Lq + offs_m, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(DELTA + bh.to(tl.int64) * Lq + offs_m, mask=row_ok, other=0.0)
    if DROPOUT:
        key_row, threshold = row_keys(RNG, bh, offs_m)
    k_base, v_base, m_base = _head_bases(K, V, M, b, h, hk, skb, skh, svb, svh, smb, smh)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    start, end = key_range(m0, Lq, Lk, window_lo, window_hi, BLOCK_M, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[:, None] * skn + offs_d[None, :] * skd,
                    mask=(offs_n[:, None] < Lk) & (offs_d[None, :] < E), other=0.0)
        vt = tl.load(v_base + offs_n[None, :] * svn + offs_dv[:, None] * svd,
                     mask=(offs_n[None, :] < Lk) & (offs_dv[:, None] < Ev), other=0.0)
        p = _probs(q, tl.trans(k), m_base, lse, m0, n0, offs_m, offs_n, Lq, Lk, smm, smn, scale,
                   window_lo, window_hi, MASK_KIND, DOT_PREC, BLOCK_M, BLOCK_N)
        dp = dot(do, vt, DOT_PREC)
        if DROPOUT:
            dp = tl.where(keep(key_row, offs_n, threshold), dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        dq += dot(ds.to(k.dtype), k, DOT_PREC)
    tl.store(DQ + (bh.to(tl.int64) * Lq + offs_m[:, None]) * E + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)


def _common_args(q, k, v, mask, dropout_p, seed):
    """Launch arguments shared by the three kernels: (tensors, strides, sizes, keywords: the
    constexprs and the lengths' autotune buckets)."""
    m, m_strides = common.mask_arg(mask, q)
    rng = rng_words(seed, dropout_p, q.device) if dropout_p > 0 else q
    b, h, lq, e = q.shape
    hkv, lk, ev = k.shape[1], k.shape[2], v.shape[-1]
    strides = (*q.stride(), *k.stride(), *v.stride(), *m_strides)
    consts = dict(MASK_KIND=common.mask_kind(mask), DROPOUT=dropout_p > 0,
                  DOT_PREC=common.dot_precision(q.dtype),
                  BLOCK_D=common.head_block(e), BLOCK_DV=common.head_block(ev),
                  PAD_D=common.head_block(e) != e or common.head_block(ev) != ev,
                  LQ_BUCKET=common.length_bucket(lq), LK_BUCKET=common.length_bucket(lk))
    inv_keep = 1.0 / (1.0 - dropout_p)
    return m, rng, strides, (b, h, hkv, lq, lk, e, ev), consts, inv_keep


@common.register_op("triton_sdpa_fwd")
def sdpa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
             scale: float, window_lo: int, window_hi: int, dropout_p: float,
             seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    window_lo, window_hi = common.clamped_band(window_lo, window_hi, q.shape[2], k.shape[2])
    m, rng, strides, (b, h, hkv, lq, lk, e, ev), consts, inv_keep = _common_args(
        q, k, v, mask, dropout_p, seed)
    out = q.new_empty((b, h, lq, ev))
    lse = q.new_empty((b, h, lq), dtype=torch.float32)
    grid = lambda meta: common.tiles_grid(lq, meta["BLOCK_M"], b * h)  # noqa: E731
    common.launcher(_fwd_kernel)[grid](
        q, k, v, m, out, lse, rng, *strides, *out.stride(),
        h, lq, lk, e, ev, h // hkv, scale, window_lo, window_hi, inv_keep, **consts)
    return out, lse


@common.register_op("triton_sdpa_bwd")
def sdpa_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, scale: float,
             window_lo: int, window_hi: int, dropout_p: float, seed: Optional[torch.Tensor],
             mask_grad: bool, grad_lse: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    window_lo, window_hi = common.clamped_band(window_lo, window_hi, q.shape[2], k.shape[2])
    m, rng, strides, (b, h, hkv, lq, lk, e, ev), consts, inv_keep = _common_args(
        q, k, v, mask, dropout_p, seed)
    r = torch.empty_like(lse)
    common.launcher(_row_sums_kernel)[lambda meta: common.tiles_grid(lq, meta["BLOCK_M"], b * h)](
        q, k, m, lse, r, *strides[:8], *strides[12:], h, lq, lk, e, h // hkv, scale, window_lo,
        window_hi, common.HUGE_LSE, consts["LQ_BUCKET"], consts["LK_BUCKET"],
        MASK_KIND=consts["MASK_KIND"], DOT_PREC=consts["DOT_PREC"], BLOCK_D=consts["BLOCK_D"])
    grad_out = common.divide_rows(grad_out, r)
    # With dropout D_i = sum_j P_ij dP_ij still equals rowsum(dO * O): O is built from the
    # dropped P, and dP of the dropped P differs from dP by the same keep / (1 - p) factor.
    delta = (grad_out.float() * out.float()).sum(-1)
    if grad_lse is not None:  # d lse_i / d s_ij = P_ij: the lse gradient only shifts D_i,
        delta = delta - grad_lse.float() / r  # scaled as dO was
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    # Only in-band entries are written: the rest of dmask stays zero.
    dmask = q.new_zeros((b, h, lq, lk)) if mask_grad else q.new_empty((0,))
    sizes = (lq, lk, e, ev, h // hkv, scale, window_lo, window_hi, inv_keep)
    common.launcher(_dkdv_kernel)[
        lambda meta: common.tiles_grid(lk, meta["BLOCK_N"], b * hkv)](
        q, k, v, m, grad_out, lse, delta, rng, dk, dv, dmask, *strides, *grad_out.stride(),
        h, hkv, *sizes, MASK_GRAD=mask_grad, **consts)
    common.launcher(_dq_kernel)[
        lambda meta: common.tiles_grid(lq, meta["BLOCK_M"], b * h)](
        q, k, v, m, grad_out, lse, delta, rng, dq, *strides, *grad_out.stride(),
        h, *sizes, **consts)
    return dq, dk, dv, dmask


# Shape-only versions: triton_op derives them itself on a GPU, custom_op (the interpreter's
# registration) needs them.
@sdpa_fwd.register_fake
def _sdpa_fwd_fake(q, k, v, mask, scale, window_lo, window_hi, dropout_p, seed):
    same_device(q, k, v, mask)
    b, h, lq, _ = q.shape
    return q.new_empty((b, h, lq, v.shape[-1])), q.new_empty((b, h, lq), dtype=torch.float32)


@sdpa_bwd.register_fake
def _sdpa_bwd_fake(grad_out, q, k, v, mask, out, lse, scale, window_lo, window_hi, dropout_p,
                   seed, mask_grad, grad_lse=None):
    same_device(q, grad_out, k, v, mask, out, lse, grad_lse)
    dmask = q.new_empty((*q.shape[:3], k.shape[2]) if mask_grad else (0,))
    return (*contiguous_grads(q, k, v), dmask)


def _setup(ctx, inputs, output):
    q, k, v, mask, scale, lo, hi, p, seed = inputs
    out, lse = output
    ctx.args = (scale, lo, hi, p)
    ctx.save_for_backward(q, k, v, mask, out, lse, seed)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, mask, out, lse, seed = ctx.saved_tensors
    scale, lo, hi, p = ctx.args
    want_mask = mask is not None and mask.dtype != torch.bool and ctx.needs_input_grad[3]
    dq, dk, dv, dmask = sdpa_bwd(or_zeros(grad_out, out), q, k, v, mask, out, lse, scale, lo, hi,
                                 p, seed, want_mask, grad_lse)
    return dq, dk, dv, (dmask if want_mask else None), None, None, None, None, None


sdpa_fwd.register_autograd(_backward, setup_context=_setup)
sdpa_bwd.register_autograd(no_double_backward)
