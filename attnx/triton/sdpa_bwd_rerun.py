"""The SDPA backward's slow path (sdpa_bwd, varlen_bwd) for values near the dtype's largest.

bf16 and fp32 values near their largest (3.4e38) overflow the backward's float32 dP = dO V^T and
D = rowsum(dO * O) to inf, and dS = P (dP - D) comes out inf - inf or 0 * inf: NaN, where the
true dQ and dK, sums of dS ~ P * 1e39 over attention spread across keys, mostly fit. As the
forward reruns its overflowed rows (sdpa._rerun), the dK/dV and dQ kernels keep their loops and
only check, after them, their dK, dV or dQ accumulator (a non-finite dS always reaches it: inf and
NaN propagate through the sums): one holding inf or NaN sets FLAG, one int32 on the device, so
the backward never waits on the host. The two kernels here, launched after them on a fixed grid
of common.multiprocessors() programs, load FLAG first and do nothing unless it is set (their
loops run zero times); set, they recompute the whole call's dQ, dK, dV and float mask gradient
in float64, where dP and D cannot overflow (3.4e38^2 * 256 fits), from the scores and
probabilities the backward kernels form (scale, softcap, ALiBi, band, masks, the dropout hash,
sinks through the lse), each row's divided by their float64 sum r_i (as the first pass does on
huge-lse rows only, common.HUGE_LSE), and write them over the first results, rounded to the
output dtype (inf where the true value exceeds it). dV = P^T dO does not involve V, but a dO
near the largest overflows its float32 sums (the dK/dV kernel flags a non-finite dV too). fp16
values (< 65504) keep dP and D inside float32, but the dK/dV and dQ kernels cast dS to fp16 for
their products: dS past 65504 (values ~3e4, |dP - D| ~1e5 at P ~ 1/2) was inf there, and dQ and
dK came out NaN where their true values were ~200. So every dtype takes the check.

The forward's float64 rerun (sdpa_fwd_rerun) saves lse +inf on rows whose scores passed float32's
range, and lse past float32's largest over log2(e) make the first kernels' exp2 arguments
overflow with no NaN to show it (their probabilities come out 0): the pre-pass
(sdpa._prep_kernel) sets FLAG on such rows (common.LSE_LIMIT). The kernels here never read the
saved lse (_rows_kernel).

Two launches, because dK needs every query row's 1 / r_i and D_i / r_i: _rows_kernel (a program
per query block in turn) writes them to ROWS (float64) with dQ and the mask gradient;
_keys_kernel (a program per key block) reads them for dK and dV. Tiles are RERUN_BLOCK x RERUN_BLOCK,
float64 products on the tensor cores (DMMA, sm_80 and up); speed is not the aim.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import common
from .common import (LSE_LIMIT, admit, dot, key_range, load_tile, modified, offsets, query_range,
                     second_chunk, split_tile)
from .rng import keep, row_keys
from .sdpa import _alibi, _sequence, _varlen_row_keys

RERUN_BLOCK = tl.constexpr(16)  # rows and keys of a float64 tile: tl.dot's least
_OPTIONS = dict(num_warps=4, num_stages=1, maxnreg=common.MAX_REGISTERS)


@triton.jit
def _call_sequence(b, Lq, Lk, window_lo, window_hi, CU_Q, CU_K, VARLEN: tl.constexpr):
    """(first query row, first key row (int64, rows of the packed tensors), Lq, Lk and band) of
    batch b: those of sequence b under VARLEN (sdpa._sequence), the call's otherwise."""
    q0 = tl.full([], 0, tl.int64)
    k0 = q0
    if VARLEN:
        q0, k0, Lq, Lk, window_lo, window_hi = _sequence(CU_Q, CU_K, b, window_lo, window_hi)
    return q0, k0, Lq, Lk, window_lo, window_hi


@triton.jit
def _lse_rows(b, h, H, Lq, q0, offs_m, TOTAL_Q, VARLEN: tl.constexpr):
    """The rows of LSE (and of ROWS) of query rows offs_m of head h: (B, Hq, Lq), or (Hq,
    total_q) under VARLEN."""
    if VARLEN:
        return h * TOTAL_Q + q0 + offs_m
    return (b * H + h) * Lq + offs_m


@triton.jit
def _wide(x):
    """The tile x in float64 for tl.dot: through a sum over a size-1 axis, where Triton's
    compiler stops following x's elementwise ops back to the loads it came from (AccelerateMatmul's
    computeOrigBitWidth): from a 16-bit load (the inputs', a mask's) it laid out the float64
    operands for 16-bit MMAs and failed ("fp64 don't support largeK MMA", Triton 3.8)."""
    return tl.sum(x.to(tl.float64)[:, :, None], 2)


@triton.jit
def _operand(base, rows, cols, sr, sc, R, C):
    """The (rows, cols) tile at base (strides sr, sc; zeros past R, C) as a float64 operand."""
    return _wide(load_tile(base + offsets(rows, cols, sr, sc), rows, cols, R, C, True, True))


@triton.jit
def _chunks(base, idx, offs, offs2, s_idx, s_off, L, D, TRANSPOSED: tl.constexpr,
            BLOCK2: tl.constexpr):
    """The head-dim chunks (offs, then offs2 where BLOCK2 > 0, else the first again) of rows idx
    (< L) of base, float64: (idx, dims) tiles, (dims, idx) where TRANSPOSED."""
    if TRANSPOSED:
        x = _operand(base, offs, idx, s_off, s_idx, D, L)
    else:
        x = _operand(base, idx, offs, s_idx, s_off, L, D)
    x2 = x
    if BLOCK2 > 0:
        if TRANSPOSED:
            x2 = _operand(base, offs2, idx, s_off, s_idx, D, L)
        else:
            x2 = _operand(base, idx, offs2, s_idx, s_off, L, D)
    return x, x2


@triton.jit
def _dot2(a, a2, b, b2, BLOCK2: tl.constexpr):
    """a @ b in float64, plus a2 @ b2 (second head-dim chunks) where BLOCK2 > 0."""
    c = dot(a, b, "ieee")
    if BLOCK2 > 0:
        c += dot(a2, b2, "ieee")
    return c


@triton.jit
def _scores(q, q2, kt, kt2, m_base, offs_m, offs_n, Lq, Lk, smm, smn, scale, window_lo,
            window_hi, cap, slope, shift, MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr,
            ALIBI: tl.constexpr, BLOCK_D2: tl.constexpr):
    """(scores s and the softcap's tanh, float64) of query rows q and keys kt (transposed), as
    the first passes form them: -inf past the band, the keys, the rows and a bool mask."""
    s, t = modified(_dot2(q, q2, kt, kt2, BLOCK_D2) * scale, cap, slope, offs_m[:, None] + shift,
                    offs_n[None, :], SOFTCAP, ALIBI, False)  # (float64: the exp form suffices)
    return admit(s, m_base, offs_m, offs_n, Lq, Lk, smm, smn, window_lo, window_hi,
                 MASK_KIND), t


@triton.jit
def _probs(q, q2, kt, kt2, lse, m_base, offs_m, offs_n, Lq, Lk, smm, smn, scale, window_lo,
           window_hi, cap, slope, shift, MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr,
           ALIBI: tl.constexpr, BLOCK_D2: tl.constexpr):
    """(P = exp(min(s - lse, 0)) and the softcap's tanh, float64) of a tile (_scores), as
    sdpa._probs forms them: clamped at 1, 0 where s is -inf; lse +inf on empty rows."""
    s, t = _scores(q, q2, kt, kt2, m_base, offs_m, offs_n, Lq, Lk, smm, smn, scale, window_lo,
                   window_hi, cap, slope, shift, MASK_KIND, SOFTCAP, ALIBI, BLOCK_D2)
    return tl.exp(tl.minimum(s - lse[:, None], 0.0)), t


@triton.jit
def _row_max(q, q2, k_base, m_base, offs_m, start, end, offs_d, offs_d2, skn, skd, Lq, Lk, E,
             smm, smn, scale, window_lo, window_hi, cap, slope, shift, SINKS, h,
             MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
             HAS_SINKS: tl.constexpr, BLOCK_D2: tl.constexpr):
    """Each of query rows q's float64 max of its admitted scores (_scores) over keys [start,
    end) and of head h's sink logit: -inf where there is none."""
    rows = tl.arange(0, RERUN_BLOCK)
    row_max = tl.full([RERUN_BLOCK], float("-inf"), tl.float64)
    for n0 in range(start, end, RERUN_BLOCK):
        offs_n = n0 + rows
        kt, kt2 = _chunks(k_base, offs_n, offs_d, offs_d2, skn, skd, Lk, E, True, BLOCK_D2)
        s = _scores(q, q2, kt, kt2, m_base, offs_m, offs_n, Lq, Lk, smm, smn, scale, window_lo,
                    window_hi, cap, slope, shift, MASK_KIND, SOFTCAP, ALIBI, BLOCK_D2)[0]
        row_max = tl.maximum(row_max, tl.max(s, 1))
    if HAS_SINKS:
        row_max = tl.maximum(row_max, tl.load(SINKS + h).to(tl.float64))
    return row_max


@triton.jit
def _dropped(x, key_row, threshold, offs_n, inv_keep, DROPOUT: tl.constexpr):
    """z x: dropout's keep / (1 - p) times x (x itself without dropout)."""
    if DROPOUT:
        x = tl.where(keep(key_row, offs_n, threshold), x * inv_keep, 0.0)
    return x


@triton.jit
def _dprobs(do, do2, vt, vt2, offs_n, key_row, threshold, inv_keep, DROPOUT: tl.constexpr,
            BLOCK_DV2: tl.constexpr):
    """z dP = z dO V^T of a tile (float64), z dropout's keep / (1 - p)."""
    return _dropped(_dot2(do, do2, vt, vt2, BLOCK_DV2), key_row, threshold, offs_n, inv_keep,
                    DROPOUT)


@triton.jit
def _dscores(q, q2, do, do2, kt, kt2, vt, vt2, lse, rinv, dlt, m_base, offs_m, offs_n, Lq, Lk,
             smm, smn, scale, window_lo, window_hi, cap, slope, shift, key_row, threshold,
             inv_keep, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr,
             ALIBI: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV2: tl.constexpr):
    """(dS of the scores after the softcap: the float mask's gradient; dS of q . k * scale, as
    a float64 operand) of a tile: (P / r) (z dP - D) = P (z dP / r - D / r), from the rows'
    rinv = 1 / r and dlt = D / r (_rows_kernel)."""
    p, t = _probs(q, q2, kt, kt2, lse, m_base, offs_m, offs_n, Lq, Lk, smm, smn, scale,
                  window_lo, window_hi, cap, slope, shift, MASK_KIND, SOFTCAP, ALIBI, BLOCK_D2)
    zdp = _dprobs(do, do2, vt, vt2, offs_n, key_row, threshold, inv_keep, DROPOUT, BLOCK_DV2)
    ds = p * (zdp * rinv[:, None] - dlt[:, None])
    dsc = ds
    if SOFTCAP:  # the mask is added after the cap; the scaled score goes through tanh
        dsc = ds * (1.0 - t * t)
    return ds, _wide(dsc)


@triton.jit
def _store(base, x, rows, cols, sr, sc, R, C):
    """x (float64) into the (rows, cols) tile at base, in its element type (< R, C only)."""
    tl.store(base + offsets(rows, cols, sr, sc), _narrow(x, base),
             mask=(rows[:, None] < R) & (cols[None, :] < C))


@triton.jit
def _narrow(x, ptr):
    """x (float64) in ptr's element type, through float32 (Triton's interpreter casts float64 to
    bfloat16 as 0, 3.8; bf16's range is within float32's). To bfloat16 rounded to nearest even
    on the bits (+ 0x7fff + the kept lowest bit; inf past the largest), which the GPU's cast
    does too but the interpreter's truncates; NaN as it is (the GPU's 0x7fffffff would carry
    into the sign and exponent: -0)."""
    y = x.to(tl.float32)
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = tl.where(y == y, bits.to(tl.float32, bitcast=True), y)
    return y.to(ptr.dtype.element_ty)


@triton.jit
def _dropout_keys(RNG, b, h, bh, offs_m, DROPOUT: tl.constexpr, VARLEN: tl.constexpr):
    """The rows' dropout keys (rng.row_keys; sdpa._varlen_row_keys of sequence b under VARLEN);
    without DROPOUT placeholders nothing reads (Triton 3.6, the GPU machines', cannot return
    None from a jit function)."""
    key_row, threshold = offs_m, 0
    if DROPOUT:
        if VARLEN:
            key_row, threshold = _varlen_row_keys(RNG, b, h, offs_m)
        else:
            key_row, threshold = row_keys(RNG, bh, offs_m)
    return key_row, threshold


@triton.jit
def _aranges(BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
             BLOCK_DV2: tl.constexpr):
    """A tile's rows and the head dims' chunks (_head_chunks): q and k's, then v's."""
    return (tl.arange(0, RERUN_BLOCK), tl.arange(0, BLOCK_D), second_chunk(BLOCK_D, BLOCK_D2),
            tl.arange(0, BLOCK_DV), second_chunk(BLOCK_DV, BLOCK_DV2))


@triton.jit
def _item(item, L, H, Lq, Lk, window_lo, window_hi, CU_Q, CU_K, VARLEN: tl.constexpr):
    """A work item's first row (of L: the queries or the keys; tasks of H heads), b * H + h, b, h
    (int64) and its sequence (_call_sequence)."""
    first, bh = split_tile(item, L, RERUN_BLOCK)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    q0, k0, lq, lk, lo, hi = _call_sequence(b, Lq, Lk, window_lo, window_hi, CU_Q, CU_K, VARLEN)
    return first, bh, b, h, q0, k0, lq, lk, lo, hi


@triton.jit
def _rows_kernel(FLAG, Q, K, V, M, DO, GLSE, RNG, SLOPES, SINKS, ROWS, DQ, DM,
                 sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, smb, smh, smm, smn,
                 sdb, sdh, sdm, sdd, sgb, sgh, sgm, sgd, sab, sah,
                 ITEMS, H, Lq, Lk, E, Ev, GROUPS, scale, window_lo, window_hi, inv_keep, cap,
                 CU_Q, CU_K, TOTAL_Q,
                 MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, MASK_GRAD: tl.constexpr,
                 SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
                 HAS_GLSE: tl.constexpr, VARLEN: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr):
    """Each query block of each head in turn (ITEMS: B x Hq x blocks of Lq). A first pass over
    its keys finds each row's float64 max (the sink's logit included), which stands in for the
    lse: P_ij = exp(s_ij - max_i). The saved lse will not do: float32 rounds an lse of 3e38 by
    1e31 (and saves +inf where the scores passed float32's range, sdpa_fwd_rerun), and exp of
    such a difference is 0 or 1 for every key. A second pass sums r_i = sum_j P_ij (the sink's
    exp(sink - max_i) included) and sum_j P_ij z dP_ij, for D_i = sum_j (P_ij / r_i) z dP_ij -
    grad_lse_i, stored as 1 / r_i and D_i / r_i with the max (ROWS, (rows of LSE, 3)). P / r is
    the softmax (the first pass divides by r on huge-lse rows only, sdpa._prep_kernel), and D
    from it is the float64 rowsum(dO * O) without O's rounding (that of the forward's shifted
    rerun, sdpa._rerun, 2^-18 in fp32). A third pass gives dQ (DQ,
    strides sg*) and, with MASK_GRAD, the float mask's gradient (DM, (B, Hq, Lq, Lk)) over
    every key: past the band its zeros replace what the first pass left there."""
    rows, offs_d, offs_d2, offs_dv, offs_dv2 = _aranges(BLOCK_D, BLOCK_D2, BLOCK_DV, BLOCK_DV2)
    items = tl.where(tl.load(FLAG) != 0, ITEMS, 0)  # none unless flagged
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        m0, bh, b, h, q0, k0, lq, lk, lo, hi = _item(item, Lq, H, Lq, Lk, window_lo, window_hi,
                                                     CU_Q, CU_K, VARLEN)
        if m0 < lq:
            offs_m = m0 + rows
            row_ok = offs_m < lq
            k_base = K + b * skb + (h // GROUPS) * skh + k0 * skn
            v_base = V + b * svb + (h // GROUPS) * svh + k0 * svn
            m_base = M + b * smb + h * smh
            q, q2 = _chunks(Q + b * sqb + h * sqh + q0 * sqm, offs_m, offs_d, offs_d2, sqm, sqd,
                            lq, E, False, BLOCK_D2)
            do, do2 = _chunks(DO + b * sdb + h * sdh + q0 * sdm, offs_m, offs_dv, offs_dv2, sdm,
                              sdd, lq, Ev, False, BLOCK_DV2)
            lse_rows = _lse_rows(b, h, H, Lq, q0, offs_m, TOTAL_Q, VARLEN)
            slope, shift = _alibi(SLOPES, b, h, sab, sah, lq, lk, ALIBI, VARLEN)
            key_row, threshold = _dropout_keys(RNG, b, h, bh, offs_m, DROPOUT, VARLEN)
            start, end = key_range(m0, lq, lk, lo, hi, RERUN_BLOCK, RERUN_BLOCK)
            lse = _row_max(q, q2, k_base, m_base, offs_m, start, end, offs_d, offs_d2, skn, skd,
                           lq, lk, E, smm, smn, scale, lo, hi, cap, slope, shift, SINKS, h,
                           MASK_KIND, SOFTCAP, ALIBI, HAS_SINKS, BLOCK_D2)
            lse = tl.where(lse == float("-inf"), float("inf"), lse)  # empty rows: P = 0
            r = tl.zeros([RERUN_BLOCK], tl.float64)
            if HAS_SINKS:
                r += tl.exp(tl.load(SINKS + h).to(tl.float64) - lse)
            pdp = tl.zeros([RERUN_BLOCK], tl.float64)
            for n0 in range(start, end, RERUN_BLOCK):
                offs_n = n0 + rows
                kt, kt2 = _chunks(k_base, offs_n, offs_d, offs_d2, skn, skd, lk, E, True,
                                  BLOCK_D2)
                vt, vt2 = _chunks(v_base, offs_n, offs_dv, offs_dv2, svn, svd, lk, Ev, True,
                                  BLOCK_DV2)
                p = _probs(q, q2, kt, kt2, lse, m_base, offs_m, offs_n, lq, lk, smm, smn, scale,
                           lo, hi, cap, slope, shift, MASK_KIND, SOFTCAP, ALIBI, BLOCK_D2)[0]
                r += tl.sum(p, 1)
                pdp += tl.sum(p * _dprobs(do, do2, vt, vt2, offs_n, key_row, threshold,
                                          inv_keep, DROPOUT, BLOCK_DV2), 1)
            r = tl.where(r > 0.0, r, 1.0)  # (rows that admit nothing: P = 0)
            d = pdp / r
            if HAS_GLSE:
                d -= tl.load(GLSE + lse_rows, mask=row_ok, other=0.0).to(tl.float64)
            rinv = 1.0 / r
            dlt = d / r
            tl.store(ROWS + 3 * lse_rows, rinv, mask=row_ok)
            tl.store(ROWS + 3 * lse_rows + 1, dlt, mask=row_ok)
            tl.store(ROWS + 3 * lse_rows + 2, lse, mask=row_ok)
            if MASK_GRAD:
                start, end = 0, lk
            dq = tl.zeros([RERUN_BLOCK, BLOCK_D], tl.float64)
            dq2 = tl.zeros([RERUN_BLOCK, offs_d2.shape[0]], tl.float64)
            for n0 in range(start, end, RERUN_BLOCK):
                offs_n = n0 + rows
                kt, kt2 = _chunks(k_base, offs_n, offs_d, offs_d2, skn, skd, lk, E, True,
                                  BLOCK_D2)
                vt, vt2 = _chunks(v_base, offs_n, offs_dv, offs_dv2, svn, svd, lk, Ev, True,
                                  BLOCK_DV2)
                ds, dsc = _dscores(q, q2, do, do2, kt, kt2, vt, vt2, lse, rinv, dlt, m_base,
                                   offs_m, offs_n, lq, lk, smm, smn, scale, lo, hi, cap, slope,
                                   shift, key_row, threshold, inv_keep, MASK_KIND, DROPOUT,
                                   SOFTCAP, ALIBI, BLOCK_D2, BLOCK_DV2)
                if MASK_GRAD:
                    _store(DM + bh.to(tl.int64) * Lq * Lk, ds, offs_m, offs_n, Lk, 1, lq, lk)
                dq += dot(dsc, tl.trans(kt), "ieee")
                if BLOCK_D2 > 0:
                    dq2 += dot(dsc, tl.trans(kt2), "ieee")
            dq_base = DQ + b * sgb + h * sgh + q0 * sgm
            _store(dq_base, dq * scale, offs_m, offs_d, sgm, sgd, lq, E)
            if BLOCK_D2 > 0:
                _store(dq_base, dq2 * scale, offs_m, offs_d2, sgm, sgd, lq, E)


@triton.jit
def _keys_kernel(FLAG, Q, K, V, M, DO, RNG, SLOPES, ROWS, OUT,
                 sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, smb, smh, smm, smn,
                 sdb, sdh, sdm, sdd, sgb, sgh, sgm, sgd, sab, sah,
                 ITEMS, H, Hkv, Lq, Lk, E, Ev, GROUPS, scale, window_lo, window_hi, inv_keep,
                 cap, CU_Q, CU_K, TOTAL_Q,
                 MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr,
                 ALIBI: tl.constexpr, VARLEN: tl.constexpr, VALUES: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_DV2: tl.constexpr):
    """Each key block of each kv head in turn (ITEMS: B x Hkv x blocks of Lk): dK, or with
    VALUES dV = sum_i (P_ij / r_i) z_ij dO_i, over the query heads of its GQA group and every
    query row of the band (OUT: the final dK or dV, strides sg*), from _rows_kernel's ROWS. Two
    launches rather than both in one: together their float64 tiles took 192 KiB of shared memory
    at head dims over 128 (Triton 3.6), past an A100's 164."""
    rows, offs_d, offs_d2, offs_dv, offs_dv2 = _aranges(BLOCK_D, BLOCK_D2, BLOCK_DV, BLOCK_DV2)
    if VALUES:  # the output's columns
        offs_o, offs_o2, width = offs_dv, offs_dv2, Ev
    else:
        offs_o, offs_o2, width = offs_d, offs_d2, E
    items = tl.where(tl.load(FLAG) != 0, ITEMS, 0)  # none unless flagged
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        n0, bhk, b, hk, q0, k0, lq, lk, lo, hi = _item(item, Lk, Hkv, Lq, Lk, window_lo,
                                                       window_hi, CU_Q, CU_K, VARLEN)
        if n0 < lk:
            offs_n = n0 + rows
            kt, kt2 = _chunks(K + b * skb + hk * skh + k0 * skn, offs_n, offs_d, offs_d2, skn,
                              skd, lk, E, True, BLOCK_D2)
            vt, vt2 = kt, kt2  # (read only for dK)
            if not VALUES:
                vt, vt2 = _chunks(V + b * svb + hk * svh + k0 * svn, offs_n, offs_dv, offs_dv2,
                                  svn, svd, lk, Ev, True, BLOCK_DV2)
            start, end = query_range(n0, lq, lk, lo, hi, RERUN_BLOCK, RERUN_BLOCK)
            acc = tl.zeros([RERUN_BLOCK, offs_o.shape[0]], tl.float64)
            acc2 = tl.zeros([RERUN_BLOCK, offs_o2.shape[0]], tl.float64)
            for g in range(GROUPS):
                h = hk * GROUPS + g
                m_base = M + b * smb + h * smh
                slope, shift = _alibi(SLOPES, b, h, sab, sah, lq, lk, ALIBI, VARLEN)
                for m0 in range(start, end, RERUN_BLOCK):
                    offs_m = m0 + rows
                    row_ok = offs_m < lq
                    q, q2 = _chunks(Q + b * sqb + h * sqh + q0 * sqm, offs_m, offs_d, offs_d2,
                                    sqm, sqd, lq, E, False, BLOCK_D2)
                    do, do2 = _chunks(DO + b * sdb + h * sdh + q0 * sdm, offs_m, offs_dv,
                                      offs_dv2, sdm, sdd, lq, Ev, False, BLOCK_DV2)
                    lse_rows = _lse_rows(b, h, H, Lq, q0, offs_m, TOTAL_Q, VARLEN)
                    lse = tl.load(ROWS + 3 * lse_rows + 2, mask=row_ok, other=float("inf"))
                    rinv = tl.load(ROWS + 3 * lse_rows, mask=row_ok, other=1.0)
                    key_row, threshold = _dropout_keys(RNG, b, h, b * H + h, offs_m, DROPOUT,
                                                       VARLEN)
                    if VALUES:
                        p = _probs(q, q2, kt, kt2, lse, m_base, offs_m, offs_n, lq, lk, smm, smn,
                                   scale, lo, hi, cap, slope, shift, MASK_KIND, SOFTCAP, ALIBI,
                                   BLOCK_D2)[0]
                        pzt = _wide(tl.trans(_dropped(p * rinv[:, None], key_row, threshold,
                                                      offs_n, inv_keep, DROPOUT)))
                        acc += dot(pzt, do, "ieee")
                        if BLOCK_DV2 > 0:
                            acc2 += dot(pzt, do2, "ieee")
                    else:
                        dlt = tl.load(ROWS + 3 * lse_rows + 1, mask=row_ok, other=0.0)
                        dsct = tl.trans(_dscores(
                            q, q2, do, do2, kt, kt2, vt, vt2, lse, rinv, dlt, m_base, offs_m,
                            offs_n, lq, lk, smm, smn, scale, lo, hi, cap, slope, shift, key_row,
                            threshold, inv_keep, MASK_KIND, DROPOUT, SOFTCAP, ALIBI, BLOCK_D2,
                            BLOCK_DV2)[1])
                        acc += dot(dsct, q, "ieee")
                        if BLOCK_D2 > 0:
                            acc2 += dot(dsct, q2, "ieee")
            if not VALUES:
                acc *= scale
                acc2 *= scale
            out_base = OUT + b * sgb + hk * sgh + k0 * sgm
            _store(out_base, acc, offs_n, offs_o, sgm, sgd, lk, width)
            if (BLOCK_DV2 if VALUES else BLOCK_D2) > 0:
                _store(out_base, acc2, offs_n, offs_o2, sgm, sgd, lk, width)


def _head_chunks(d: int) -> tuple[int, int]:
    """A head dim's float64 tiles: one power-of-two block up to 128, two halves of the block
    over it (one 256-wide block spilled 0.9-1 KB on sm_80 and sm_90, the halves 0-128 B)."""
    block = common.head_block(d)
    return (block, 0) if block <= 128 else (block // 2, block // 2)


def shared_bytes(e: int, ev: int) -> int:
    """The shared memory the two kernels take: float64 tiles of RERUN_BLOCK rows, 2.5 times
    those of q, K^T (E's chunks), dO and V^T (Ev's) together: what Triton 3.6 (the GPU machines')
    allocates (40, 80 and 160 KiB at head dims 64, 128 and 256); 3.8 takes the four once and a
    mask's tile. tests/triton_compile holds the sm_80 and sm_90 compiles to it."""
    (d1, d2), (dv1, dv2) = _head_chunks(e), _head_chunks(ev)
    return 8 * RERUN_BLOCK.value * 5 * (d1 + d2 + dv1 + dv2) // 2


def fits(e: int, ev: int) -> bool:
    """Whether the device holds the kernels' shared memory. Not where head dims over 128 meet
    99 KiB parts (sm_86, sm_89): their backwards skip the rerun, so that launches every
    bf16/fp32 backward makes cannot fail there; values near the largest give NaN there."""
    return common.interpreting() or shared_bytes(e, ev) <= common.shared_memory_limit()


def launch(flag: torch.Tensor, inputs: tuple, outputs: tuple, strides: tuple, out_strides: tuple,
           sizes: tuple, band: tuple, cu: tuple, *, mask_kind: int, dropout: bool,
           mask_grad: bool, softcap: bool, alibi: bool, has_sinks: bool, has_glse: bool,
           varlen: bool) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Launches the two kernels after the backward's others (they do nothing unless `flag` is
    set). inputs: q, k, v, mask, dO (the caller's, not divided by r), grad_lse, lse, rng words,
    slopes, sinks (the kernels' dummies where absent); outputs: dq, the final dk and dv (after a
    GQA split's sum), dmask; strides: q, k, v, mask, dO (4 each) and the slopes' 2; out_strides:
    dq's, dk's and dv's 4 each; sizes: B (sequences under varlen), Hq, Hkv, Lq, Lk, E, Ev (the longest
    lengths under varlen); band: scale, window, inv_keep, softcap; cu: cu_seqlens_q, cu_seqlens_k,
    total_q. Returns (the float64 row max that stood in for each row's lse, D_i / r_i), float64
    of lse's shape, meaningful only where flag is set, for dsinks (common.sink_grad: exp(sink -
    max_i) / r_i is the sink's probability); None where the device does not hold the kernels
    (`fits`: nothing launched)."""
    q, k, v, m, do, glse, lse, rng, slopes, sinks = inputs
    dq, dk, dv, dmask = outputs
    b, h, hkv, lq, lk, e, ev = sizes
    if not fits(e, ev):
        return None
    scale, window_lo, window_hi, inv_keep, cap = band
    rows = lse.new_empty((*lse.shape, 3), dtype=torch.float64)  # 1 / r_i, D_i / r_i, lse_i
    (d1, d2), (dv1, dv2) = _head_chunks(e), _head_chunks(ev)
    consts = dict(MASK_KIND=mask_kind, DROPOUT=dropout, SOFTCAP=softcap, ALIBI=alibi,
                  VARLEN=varlen, BLOCK_D=d1, BLOCK_D2=d2, BLOCK_DV=dv1, BLOCK_DV2=dv2)
    grid = (common.multiprocessors(),)
    blocks = lambda n: triton.cdiv(n, RERUN_BLOCK.value)  # noqa: E731
    common.launcher(_rows_kernel)[grid](
        flag, q, k, v, m, do, glse, rng, slopes, sinks, rows, dq, dmask, *strides[:20],
        *out_strides[:4], *strides[20:], b * h * blocks(lq), h, lq, lk, e, ev, h // hkv, scale,
        window_lo, window_hi, inv_keep, cap, *cu, MASK_GRAD=mask_grad, HAS_SINKS=has_sinks,
        HAS_GLSE=has_glse, **consts, **_OPTIONS)
    for values, out, out_stride in ((False, dk, out_strides[4:8]), (True, dv, out_strides[8:])):
        common.launcher(_keys_kernel)[grid](
            flag, q, k, v, m, do, rng, slopes, rows, out, *strides[:20], *out_stride,
            *strides[20:], b * hkv * blocks(lk), h, hkv, lq, lk, e, ev, h // hkv, scale,
            window_lo, window_hi, inv_keep, cap, *cu, VALUES=values, **consts, **_OPTIONS)
    return rows[..., 2], rows[..., 1]
