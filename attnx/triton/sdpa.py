"""Scaled dot-product attention in Triton, FlashAttention-2 style.

Forward: one program per (query block, b * Hq + h) streams the key blocks of its band with an
online softmax (exp2, the scale folded into its multiply) and saves the row log-sum-exp;
key blocks wholly inside the band run a loop without mask arithmetic, the edge blocks another.
Backward: one pre-pass per query block gives delta = rowsum(dO * O) and dO / r (common.HUGE_LSE);
one kernel per (key block, b * Hkv + kv head, slice of its GQA group) accumulates dK and dV in
key-major tiles (K Q^T, as Triton's fused-attention tutorial does: nothing transposed in
registers) over the query heads of its slice (no atomics, K/V never copied) and writes the
float-mask gradient; a third kernel per query block accumulates dQ.
The constexpr VARLEN mode serves packed sequences (varlen.py): the batch index is a sequence
whose rows, lengths and bottom-right band the kernels read from cu_seqlens (CU_Q, CU_K; lse
(Hq, TOTAL_Q)); the ops here pass q, q, 0 for those three, never read.
Slow paths, launched every call and returning at once unless a device-side flag is set: the
forward's rows whose scores passed float32's range (sdpa_fwd_rerun.py) and the backward's
overflows (sdpa_bwd_rerun.py), both in float64.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _second_order
from .._ops import (call, contiguous_grads, no_double_backward, or_zeros, register_autograd,
                    same_device)
from . import common
from .common import (FP32_DOT, LN2, LOG2E, LSE_LIMIT, OVERFLOW_SHIFT, RERUN_BLOCK_N, admit,
                     admitted, dot, dot_acc, flag_nonfinite, huge_rows, inner_range, key_range,
                     load_tile, modified, negated, offsets, overflowed, query_range,
                     scores_overflowed, second_chunk, shift_exponent, softmax_start, store_out,
                     store_rows, tile_and_head)
from .rng import keep, keep_t, mix32, rng_words, row_key, row_keys

# Pruned per launch by common.pruner; the small configs are what fits wide fp32 heads on
# sm_80, the 8-warp ones what fits 128-wide heads in registers.
_FWD_SHAPES = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4),
               (128, 32, 4, 4), (64, 64, 4, 2), (64, 32, 8, 2), (32, 32, 4, 2), (32, 16, 4, 1)]
_DKDV_SHAPES = [(64, 128, 8, 3), (32, 128, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3),
                (32, 64, 8, 3), (32, 64, 4, 4), (64, 128, 8, 2), (16, 64, 8, 2), (32, 32, 4, 2),
                (16, 32, 4, 2), (16, 16, 4, 1)]
_DQ_SHAPES = [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 64, 8, 3), (64, 32, 8, 3),
              (64, 32, 4, 4), (128, 64, 8, 2), (32, 32, 4, 2), (16, 32, 4, 2), (16, 16, 4, 1)]
_SUMS_SHAPES = [(128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 4), (32, 16, 4, 2)]
_FWD = common.configs(_FWD_SHAPES, small=(16, 16))
_DKDV = common.configs(_DKDV_SHAPES, small=(16, 16))
_DQ = common.configs(_DQ_SHAPES, small=(16, 16))
_SUMS = common.configs(_SUMS_SHAPES, small=(16, 16))
# Tuned once per power-of-two bucket of the lengths (common.length_bucket), not per length.
_KEY = ["LQ_BUCKET", "LK_BUCKET", "BLOCK_D", "BLOCK_D2", "BLOCK_DV", "BLOCK_DV2", "MASK_KIND",
        "DROPOUT", "GROUPS", "SOFTCAP", "ALIBI", "VARLEN"]
_JIT = triton.jit(do_not_specialize=["LQ_BUCKET", "LK_BUCKET"])  # read by the autotuner only


# What each kernel's tiles take, for common.pruner (element counts of a config).
def _fwd_tiles(m):
    """K^T and V staged; q and p through shared memory; acc and s/p fp32 in registers (and the
    mask or dropout's tile where there is one; one more under VARLEN, whose lengths, band and
    row bases are registers, not kernel arguments: bf16 d128 with dropout 64x32 4-warp spilled
    232 B on sm_80 without it), q held. Head dims count both chunks."""
    mm, n = m["BLOCK_M"], m["BLOCK_N"]
    d, dv = m["BLOCK_D"] + m["BLOCK_D2"], m["BLOCK_DV"] + m["BLOCK_DV2"]
    tiles = 1 + m["MASK_KIND"] + bool(m["DROPOUT"]) + bool(m["VARLEN"])  # float mask: 2
    return dict(staged=n * (d + dv), mask=mm * n, resident=mm * (d + n), acc=mm * (dv + tiles * n),
                held=mm * d, rows=mm)


def _prep_tiles(m):
    """K^T staged (rows of huge lse only); q and s through shared memory; s and the O and dO
    rows fp32 in registers, q held."""
    mm, n, d, dv = m["BLOCK_M"], m["BLOCK_N"], m["BLOCK_D"], m["BLOCK_DV"]
    return dict(staged=n * d, mask=mm * n, resident=mm * (d + n), acc=mm * (n + 2 * dv),
                held=mm * d, rows=mm)


def _dkdv_tiles(m):
    """q^T and dO staged; k, v, p^T and ds^T through shared memory; dk, dv and six score-sized
    fp32 tiles in registers (p^T, dp^T, ds^T, the band's compares and the three loops' live
    ranges; four more for the dropout hash and kept p, one for a bool mask, three for a float
    mask and its gradient's store, five for a GQA group's loop: the compile test's spill
    figures, 16x64 8-warp with a float mask spilled 12 B at d128 on sm_80 counting it as one),
    k and v held. Head dims count both chunks (_head_blocks)."""
    mm, n = m["BLOCK_M"], m["BLOCK_N"]
    d, dv = m["BLOCK_D"] + m["BLOCK_D2"], m["BLOCK_DV"] + m["BLOCK_DV2"]
    tiles = 6 + 4 * bool(m["DROPOUT"]) + (0, 1, 3)[m["MASK_KIND"]] + 5 * (m["GROUPS"] > 1)
    return dict(staged=mm * (d + dv), mask=mm * n, resident=n * (d + dv + 2 * mm),
                acc=n * (d + dv) + tiles * mm * n, held=n * (d + dv), rows=n)


def _dq_tiles(m):
    """k^T and v^T staged; q, dO and ds through shared memory; dq and seven score-sized fp32
    tiles in registers (p, dp, ds and the three loops' live ranges: 64x64 with 8 warps at head
    dim 64 spills 220 B on sm_80 when counted as three), q and dO held."""
    mm, n = m["BLOCK_M"], m["BLOCK_N"]
    d, dv = m["BLOCK_D"] + m["BLOCK_D2"], m["BLOCK_DV"] + m["BLOCK_DV2"]
    return dict(staged=n * (d + dv), mask=mm * n, resident=mm * (d + dv + n),
                acc=mm * d + 7 * mm * n, held=mm * (d + dv), rows=mm)


# Configs over the register rule that compile without spills on sm_90, for fp16/bf16 head blocks
# up to 128 (benchmarks/results/triton-sm90-backward-configs.md: every flag set, Triton 3.6 and
# 3.8; tests/test_triton_compile.py holds the CI set to it). The rule counts every operand tile
# in registers where wgmma reads them from shared memory, and kept dK/dV 16 queries and dQ 64 x
# 32 there: 16- and 32-wide wgmma products. dK/dV's loop over a GQA group's query heads spills
# in these tiles (there _gqa_split gives each program one head); its widest tile per head block
# (32 x 128 at 128, 64 x 64 and 64 x 128 at 64) spills with masks, dropout and modifiers
# together.
def _wide_tiles_apply(arch: int, element_size: int, head: int) -> bool:
    """Where the tables below hold: sm_90, fp16/bf16, the wider head (or its blocks) <= 128."""
    return arch == 90 and element_size == 2 and head <= 128


def _head(m) -> int:
    """The wider of a config's head-dim blocks (both chunks)."""
    return max(m["BLOCK_D"] + m["BLOCK_D2"], m["BLOCK_DV"] + m["BLOCK_DV2"])


def _sm90_half(m, arch) -> bool:
    return _wide_tiles_apply(arch, m["Q"].element_size(), _head(m))


def _shape(m) -> tuple:
    return m["BLOCK_M"], m["BLOCK_N"], m["num_warps"], m["num_stages"]


def _dkdv_sm90_fits(m, arch) -> bool:
    if not _sm90_half(m, arch) or m["PER"] > 1:
        return False
    if _head(m) <= 64:
        every_flag, plain_only = (32, 128, 8, 3), ((64, 64, 8, 3), (64, 128, 8, 3))
    else:
        every_flag, plain_only = (32, 64, 8, 3), ((32, 128, 8, 3),)
    plain = not (m["MASK_KIND"] or m["DROPOUT"] or m["SOFTCAP"] or m["ALIBI"])
    return _shape(m) == every_flag or (plain and _shape(m) in plain_only)


def _dq_sm90_fits(m, arch) -> bool:
    return _sm90_half(m, arch) and _shape(m) in ((128, 64, 8, 3), (128, 64, 8, 2))


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
def _alibi(SLOPES, b, h, sab, sah, Lq, Lk, ALIBI: tl.constexpr, VARLEN: tl.constexpr):
    """(ALiBi's slope for batch b, query head h (0.0, unread, without ALIBI); the shift of its
    diagonal: query i's is key i + shift, 0 (top-left) for SDPA, Lk - Lq (bottom-right, as the
    band) for a packed sequence)."""
    slope = 0.0
    if ALIBI:
        slope = tl.load(SLOPES + b * sab + h * sah)
    shift = 0
    if VARLEN:
        shift = Lk - Lq
    return slope, shift


@triton.jit
def _sequence(CU_Q, CU_K, n, window_lo, window_hi):
    """VARLEN: (first query row, first key row (int64, rows of the packed tensors), Lq, Lk of
    sequence n, and the band shifted by d = Lk - Lq: aligned bottom-right)."""
    q0 = tl.load(CU_Q + n)
    k0 = tl.load(CU_K + n)
    lq = tl.load(CU_Q + n + 1) - q0
    lk = tl.load(CU_K + n + 1) - k0
    return q0.to(tl.int64), k0.to(tl.int64), lq, lk, window_lo + lk - lq, window_hi + lk - lq


@triton.jit
def _varlen_row_keys(RNG, n, h, offs_m):
    """row_keys of sequence n's head h: a batch-1 call (bh = h) with the sequence's seed
    (seed0, mix32(seed1 + n + 1)), as attnx._rng.sequence_seed derives it."""
    s0 = tl.load(RNG).to(tl.uint32)
    s1 = mix32(tl.load(RNG + 1).to(tl.uint32) + (n + 1).to(tl.uint32))
    threshold = tl.load(RNG + 2).to(tl.uint32)
    key_bh = mix32(s0 ^ mix32(h.to(tl.uint32) ^ s1))
    return row_key(key_bh, offs_m), threshold


@triton.jit
def _fwd_blocks(acc, acc2, l_i, m_i, q, q2, k_base, v_base, m_base, lo, hi, offs_m, row_ok,
                offs_d, offs_d2, offs_dv, offs_dv2, Lk, E, Ev, skn, skd, svn, svd, smm, smn, sc,
                window_lo, window_hi, key_row, threshold, inv_keep, cap, slope, shift, p_shift,
                EDGE: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
                SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                DOT_PREC: tl.constexpr, PAD_D: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D2: tl.constexpr, BLOCK_DV2: tl.constexpr):
    """The online softmax over key blocks [lo, hi). EDGE blocks reach past the band or the keys:
    they mask scores and loads; the others carry no band or bounds arithmetic (and no masked
    load unless the head dim is padded). Without a float mask the running max m_i is in log2
    units: scale * LOG2E multiplies the scores once (in-band: their distance to the tile's
    max, so that no FMA rounds the max's own exponent). A float mask's rows may hold
    finfo.min biases, which times LOG2E would overflow to -inf: there scores and m_i stay in
    natural units, and exp2 takes (s - m) * LOG2E; so do softcap and ALiBi, which change the
    scaled score before the max (no scale to fold into exp2). Head dims in two chunks
    (common.head_blocks) take a second dot each for the scores (q2, k2) and the output
    (acc2, v2). p_shift: the rows' exponent shifts (common.OVERFLOW_SHIFT, in m_i's units; EDGE
    blocks only, as _rerun walks them), None for none."""
    qk_scale = sc * LOG2E
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + cols
        kt = load_tile(k_base + offsets(offs_d, offs_n, skd, skn), offs_d, offs_n, E, Lk, PAD_D,
                       EDGE)
        qk = dot(q, kt, DOT_PREC)
        if BLOCK_D2 > 0:
            kt2 = load_tile(k_base + offsets(offs_d2, offs_n, skd, skn), offs_d2, offs_n, E, Lk,
                            PAD_D, EDGE)
            qk = dot_acc(q2, kt2, qk, DOT_PREC)
        if EDGE:
            diff = offs_n[None, :] - offs_m[:, None]
            ok = (row_ok[:, None] & (offs_n[None, :] < Lk) & (diff >= window_lo)
                  & (diff <= window_hi))
        else:
            ok = row_ok[:, None]  # only read by the mask loads
        if (MASK_KIND == 2 or SOFTCAP) or ALIBI:  # natural units (Triton takes no a or b or c)
            s, _ = modified(admitted(qk * sc), cap, slope, offs_m[:, None] + shift,
                            offs_n[None, :], SOFTCAP, ALIBI, DOT_PREC == FP32_DOT)
            if MASK_KIND == 2:  # -inf biases refuse; a finite one's sum stays admitted
                bias = tl.load(m_base + offsets(offs_m, offs_n, smm, smn), mask=ok,
                               other=0.0).to(tl.float32)
                s = tl.where(bias == float("-inf"), bias, admitted(s + bias))
            else:
                s = admitted(s)
            if MASK_KIND == 1:
                ok = ok & (tl.load(m_base + offsets(offs_m, offs_n, smm, smn), mask=ok,
                                   other=0) != 0)
            if EDGE or MASK_KIND == 1:
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with nothing admissible so far keeps max -inf; subtracting 0 instead keeps
            # exp(-inf - -inf) = NaN out.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(shift_exponent((s - m_safe[:, None]) * LOG2E, p_shift))
            alpha = tl.math.exp2((m_i - m_safe) * LOG2E)
        else:
            if MASK_KIND == 1:
                ok = ok & (tl.load(m_base + offsets(offs_m, offs_n, smm, smn), mask=ok,
                                   other=0) != 0)
            if EDGE or MASK_KIND == 1:
                t = tl.where(ok, admitted(qk * qk_scale), float("-inf"))
                m_new = tl.maximum(m_i, tl.max(t, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(shift_exponent(t - m_safe[:, None], p_shift))
            else:
                # Subtract first, in raw units, from the tile's own max mt: exp2(qk * qk_scale
                # - m_new) compiles to one FMA whose result for the max is the rounding of
                # fl(mt * qk_scale), half an ulp of the scaled max (2^16 and more at scaled
                # scores of 3e8: inf in fp16). (qk - mt) is exact near the max; d <= 0 brings
                # the tile's scale to m_new's (0 where the tile holds the row max, also when
                # a GPU fuses it into an FMA, and for m_i = -inf).
                mt = tl.max(qk, 1)
                mt_scaled = mt * qk_scale
                m_new = tl.maximum(m_i, mt_scaled)
                # A -inf beside finite scores is a dot's partial sum past float32's lowest
                # (common.admitted): exp would drop it unseen. Its row's least score times 0
                # is NaN (0 for any finite one: no select), which reaches alpha, then l_i,
                # which flags the row for the rerun (scores_overflowed). float16's dots cannot
                # pass float32's range (|q k| <= 65504^2 E): no check there.
                if q.dtype == tl.float16:
                    m_safe = m_new
                else:
                    m_safe = m_new + tl.min(qk, 1) * 0.0
                d = tl.minimum(mt_scaled - m_i, 0.0)
                p = tl.math.exp2((qk - mt[:, None]) * qk_scale + d[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(keep(key_row, offs_n, threshold), p * inv_keep, 0.0)
        v = load_tile(v_base + offsets(offs_n, offs_dv, svn, svd), offs_n, offs_dv, Lk, Ev, EDGE,
                      PAD_D)
        p = p.to(v.dtype)
        acc = dot_acc(p, v, acc * alpha[:, None], DOT_PREC)
        if BLOCK_DV2 > 0:
            v2 = load_tile(v_base + offsets(offs_n, offs_dv2, svn, svd), offs_n, offs_dv2, Lk, Ev,
                           EDGE, PAD_D)
            acc2 = dot_acc(p, v2, acc2 * alpha[:, None], DOT_PREC)
        m_i = m_new
    return acc, acc2, l_i, m_i


@triton.jit
def _rerun(q, q2, k_base, v_base, m_base, start, end, bad, offs_m, row_ok, offs_d, offs_d2,
           offs_dv, offs_dv2, Lk, E, Ev, skn, skd, svn, svd, smm, smn, sc, window_lo, window_hi,
           key_row, threshold, inv_keep, cap, slope, shift, MASK_KIND: tl.constexpr,
           DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
           DOT_PREC: tl.constexpr, PAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_DV: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV2: tl.constexpr):
    """(acc, acc2, l_i, m_i) of the program's keys [start, end) again, with the `bad` rows'
    probabilities scaled by 2^-OVERFLOW_SHIFT (common.OVERFLOW_SHIFT): l and acc are that much
    of the true sums, and m_i takes the shift back (l * 2^m_i, or l * e^m_i, stays the row's
    sum, for the lse and a sink's term). In one loop of edge blocks of RERUN_BLOCK_N keys
    (common.RERUN_BLOCK_N): their exponents carry fp32's rounding of the scaled score, as the
    first pass's edge blocks do, where its in-band blocks' carry only that of its distance to
    the max (less accurate at large scaled scores)."""
    p_shift = tl.where(bad, OVERFLOW_SHIFT, 0.0)
    m_i, l_i, acc = softmax_start(BLOCK_M, BLOCK_DV)
    acc2 = tl.zeros([BLOCK_M, offs_dv2.shape[0]], tl.float32)
    acc, acc2, l_i, m_i = _fwd_blocks(
        acc, acc2, l_i, m_i, q, q2, k_base, v_base, m_base, start, end, offs_m, row_ok, offs_d,
        offs_d2, offs_dv, offs_dv2, Lk, E, Ev, skn, skd, svn, svd, smm, smn, sc, window_lo,
        window_hi, key_row, threshold, inv_keep, cap, slope, shift, p_shift, True, MASK_KIND,
        DROPOUT, SOFTCAP, ALIBI, DOT_PREC, PAD_D, RERUN_BLOCK_N, BLOCK_D2, BLOCK_DV2)
    if (MASK_KIND != 2 and not SOFTCAP) and not ALIBI:  # m_i in log2 units
        m_i += p_shift
    else:
        m_i += p_shift * LN2
    return acc, acc2, l_i, m_i


@triton.autotune(configs=_FWD, key=_KEY,
                 prune_configs_by={"early_config_prune": common.pruner(_fwd_tiles)})
@_JIT
def _fwd_kernel(Q, K, V, M, O, LSE, RNG, SLOPES, SINKS, FLAG,
                sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                smb, smh, smm, smn, sob, soh, som, sod, sab, sah,
                H, Lq, Lk, E, Ev, GROUPS, scale, window_lo, window_hi, inv_keep, cap,
                CU_Q, CU_K, TOTAL_Q, LQ_BUCKET, LK_BUCKET,
                MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr,
                ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, VARLEN: tl.constexpr,
                DOT_PREC: tl.constexpr,
                PAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m0, bh, b, h, hk = _query_program(H, Lq, GROUPS, BLOCK_M)
    if VARLEN:  # b is the sequence; Lq, Lk were the longest ones' (the grid's)
        q0, k0, Lq, Lk, window_lo, window_hi = _sequence(CU_Q, CU_K, b, window_lo, window_hi)
        if m0 >= Lq:
            return
    rows = tl.arange(0, BLOCK_M)
    offs_m = m0 + rows
    row_ok = offs_m < Lq
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_d2 = second_chunk(BLOCK_D, BLOCK_D2)
    offs_dv2 = second_chunk(BLOCK_DV, BLOCK_DV2)
    m = m0.to(tl.int64)
    k_base, v_base, m_base = _head_bases(K, V, M, b, h, hk, skb, skh, svb, svh, smb, smh)
    if VARLEN:  # rows of the packed tensors (their batch strides are 0)
        m += q0
        k_base += k0 * skn
        v_base += k0 * svn
    q_base = Q + b * sqb + h * sqh + m * sqm
    q = load_tile(q_base + offsets(rows, offs_d, sqm, sqd), offs_m, offs_d, Lq, E, True, PAD_D)
    q2 = q  # read only with a second chunk
    if BLOCK_D2 > 0:
        q2 = load_tile(q_base + offsets(rows, offs_d2, sqm, sqd), offs_m, offs_d2, Lq, E, True,
                       PAD_D)
    # scale * (q . k) = |scale| * (-q . k): exp2's FMA needs a positive scale for the row max.
    if scale < 0:
        q = negated(q)
        q2 = negated(q2)
    sc = tl.abs(scale)
    key_row, threshold = None, None
    if DROPOUT:
        if VARLEN:
            key_row, threshold = _varlen_row_keys(RNG, b, h, offs_m)
        else:
            key_row, threshold = row_keys(RNG, bh, offs_m)
    slope, shift = _alibi(SLOPES, b, h, sab, sah, Lq, Lk, ALIBI, VARLEN)
    m_i, l_i, acc = softmax_start(BLOCK_M, BLOCK_DV)
    acc2 = tl.zeros([BLOCK_M, offs_dv2.shape[0]], tl.float32)
    start, end = key_range(m0, Lq, Lk, window_lo, window_hi, BLOCK_M, BLOCK_N)
    lo, hi = inner_range(m0, Lq, Lk, start, end, window_lo, window_hi, BLOCK_M, BLOCK_N)
    acc, acc2, l_i, m_i = _fwd_blocks(
        acc, acc2, l_i, m_i, q, q2, k_base, v_base, m_base, start, lo, offs_m, row_ok, offs_d,
        offs_d2, offs_dv, offs_dv2, Lk, E, Ev, skn, skd, svn, svd, smm, smn, sc, window_lo,
        window_hi, key_row, threshold, inv_keep, cap, slope, shift, None, True, MASK_KIND,
        DROPOUT, SOFTCAP,
        ALIBI, DOT_PREC, PAD_D, BLOCK_N, BLOCK_D2, BLOCK_DV2)
    acc, acc2, l_i, m_i = _fwd_blocks(
        acc, acc2, l_i, m_i, q, q2, k_base, v_base, m_base, lo, hi, offs_m, row_ok, offs_d,
        offs_d2, offs_dv, offs_dv2, Lk, E, Ev, skn, skd, svn, svd, smm, smn, sc, window_lo,
        window_hi, key_row, threshold, inv_keep, cap, slope, shift, None, False, MASK_KIND,
        DROPOUT, SOFTCAP,
        ALIBI, DOT_PREC, PAD_D, BLOCK_N, BLOCK_D2, BLOCK_DV2)
    acc, acc2, l_i, m_i = _fwd_blocks(
        acc, acc2, l_i, m_i, q, q2, k_base, v_base, m_base, hi, end, offs_m, row_ok, offs_d,
        offs_d2, offs_dv, offs_dv2, Lk, E, Ev, skn, skd, svn, svd, smm, smn, sc, window_lo,
        window_hi, key_row, threshold, inv_keep, cap, slope, shift, None, True, MASK_KIND,
        DROPOUT, SOFTCAP,
        ALIBI, DOT_PREC, PAD_D, BLOCK_N, BLOCK_D2, BLOCK_DV2)
    # Rows whose scores passed float32's range (common.scores_overflowed): sdpa_fwd_rerun redoes
    # them.
    redo = scores_overflowed(m_i, l_i, row_ok)
    if V.dtype.element_ty != tl.float16:  # rows whose P V overflowed (common.OVERFLOW_SHIFT)
        bad = overflowed(acc, row_ok) & ~redo
        if BLOCK_DV2 > 0:
            bad = bad | (overflowed(acc2, row_ok) & ~redo)
        if tl.max(bad.to(tl.int32), 0) > 0:
            acc, acc2, l_i, m_i = _rerun(
                q, q2, k_base, v_base, m_base, start, end, bad, offs_m, row_ok, offs_d,
                offs_d2, offs_dv, offs_dv2, Lk, E, Ev, skn, skd, svn, svd, smm, smn, sc,
                window_lo, window_hi, key_row, threshold, inv_keep, cap, slope, shift, MASK_KIND,
                DROPOUT, SOFTCAP, ALIBI, DOT_PREC, PAD_D, BLOCK_M, BLOCK_DV, BLOCK_D2, BLOCK_DV2)
            # (its edge blocks take every admitted inf as NaN, which the in-band loop did not)
            redo = redo | scores_overflowed(m_i, l_i, row_ok)
    if (MASK_KIND != 2 and not SOFTCAP) and not ALIBI:
        m_i = m_i * LN2  # back to natural units (-inf stays -inf)
    if HAS_SINKS:  # the sink's term joins the denominator (and the lse), nothing the output
        sink = tl.load(SINKS + h).to(tl.float32)
        m_new = tl.maximum(m_i, sink)
        # (-inf only where the row admitted no key and the sink is -inf: nothing joins, and
        # the row keeps l = 0, so zeros and lse -inf, with no exp(-inf - -inf))
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - ref)  # 0 on rows that admitted no key
        l_i = l_i * alpha + tl.exp(sink - ref)
        acc = acc * alpha[:, None]
        acc2 = acc2 * alpha[:, None]
        m_i = m_new
    if tl.max(redo.to(tl.int32), 0) > 0:  # NaN rows and lse mark them for the rerun
        tl.store(FLAG, 1)
        m_i = tl.where(redo, float("nan"), m_i)
        l_i = tl.where(redo, 1.0, l_i)
        acc = tl.where(redo[:, None], float("nan"), acc)
        acc2 = tl.where(redo[:, None], float("nan"), acc2)
    o_base = O + b * sob + h * soh + m * som
    lse_base = LSE + bh.to(tl.int64) * Lq + m0
    if VARLEN:  # lse (Hq, total_q)
        lse_base = LSE + h * TOTAL_Q + m
    store_rows(o_base, lse_base, m_i, l_i, acc, rows, offs_dv, Lq - m0, Ev, som, sod)
    if BLOCK_DV2 > 0:
        store_out(o_base, l_i, acc2, rows, offs_dv2, Lq - m0, Ev, som, sod)


@triton.jit
def _probs(qk, ok, m_ptrs, lse, sc, cap, slope, offs_i, offs_j, EDGE: tl.constexpr,
           MASK_KIND: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
           FP32_INPUTS: tl.constexpr, FP16_INPUTS: tl.constexpr):
    """(probabilities of a score tile qk (q . k, unscaled) from the saved lse, broadcast to the
    tile's shape (+inf on empty rows, so they come out 0); the softcap's tanh, common.modified).
    ok: admissible pairs on EDGE tiles, else where the mask may be read; offs_i, offs_j: the
    query positions (plus ALiBi's shift, _alibi) and key positions broadcast to the tile (read
    by ALiBi). Without a float mask or a
    modifier one FMA per score feeds exp2; otherwise scores stay in natural units (see
    _fwd_blocks). Exponents are clamped at 0 (P <= 1, as exactly): at scaled scores of 3e8 and
    more a recomputed score's rounding moves them by hundreds, and exp2 overflowed to inf, NaN
    in every gradient; the pre-pass's row sums take the same clamp. The clamp keeps NaN (a score
    past float32's range, inf - inf in a dot: fmin's 0 would give P = 1), so that the gradients
    come out NaN and sdpa_bwd_rerun redoes them; without modifiers an inf score gives NaN there
    too. On the modifier and float-mask path an inf score
    is NaN too (common.admitted, as in the forward): the softcap would take it as +-cap, finite,
    whatever the sign of the true score, where a dot's partial sums overflowed (the lse is then
    ordinary, and nothing else flags the row)."""
    t = qk
    if (MASK_KIND == 2 or SOFTCAP) or ALIBI:
        s, t = modified(admitted(qk * sc), cap, slope, offs_i, offs_j, SOFTCAP, ALIBI,
                        FP32_INPUTS)
        if MASK_KIND == 2:
            s += tl.load(m_ptrs, mask=ok, other=0.0).to(tl.float32)
        if MASK_KIND == 1:
            ok = ok & (tl.load(m_ptrs, mask=ok, other=0) != 0)
        if EDGE or MASK_KIND == 1:
            s = tl.where(ok, s, float("-inf"))
        p = tl.math.exp2(tl.minimum((s - lse) * LOG2E, 0.0, propagate_nan=tl.PropagateNan.ALL))
    else:
        t = qk * (sc * LOG2E)
        # the clamp's 0 as qk * 0: NaN where qk is +-inf (a dot's partial sum past float32's
        # range, as in the forward's in-band loop; a masked pair's too, which only costs the
        # rerun), so that a -inf score is not taken as P = 0 unseen. (t * 0 cost two multiplies
        # a score: LLVM kept t for it beside the FMA of t - lse.) float16's dots cannot pass
        # float32's range: a plain 0 there.
        nan_past_range = 0.0 if FP16_INPUTS else qk * 0.0
        if MASK_KIND == 1:
            ok = ok & (tl.load(m_ptrs, mask=ok, other=0) != 0)
        if EDGE or MASK_KIND == 1:
            t = tl.where(ok, t, float("-inf"))
        p = tl.math.exp2(tl.minimum(t - lse * LOG2E, nan_past_range,
                                    propagate_nan=tl.PropagateNan.ALL))
    return p, t


@triton.jit
def _band(offs_i, offs_j, window_lo, window_hi):
    """Where key j - query i lies in the band (offsets broadcast by the caller: query-major or
    key-major tiles)."""
    diff = offs_j - offs_i
    return (diff >= window_lo) & (diff <= window_hi)


@triton.jit
def _row_stats(lse_base, delta_base, offs_m, row_ok):
    """(lse with empty rows at +inf, so their probabilities come out 0; delta) of rows offs_m."""
    lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
    return tl.where(lse == float("-inf"), float("inf"), lse), delta


@triton.autotune(configs=_SUMS, key=["LQ_BUCKET", "LK_BUCKET", "BLOCK_D", "BLOCK_DV", "MASK_KIND",
                                     "GROUPS", "SOFTCAP", "ALIBI", "VARLEN"],
                 prune_configs_by={"early_config_prune": common.pruner(_prep_tiles)})
@_JIT
def _prep_kernel(Q, K, M, O, DO, GLSE, LSE, DELTA, DOS, SLOPES, SINKS, FLAG,
                 sqb, sqh, sqm, sqd, skb, skh, skn, skd, smb, smh, smm, smn,
                 sob, soh, som, sod, sdb, sdh, sdm, sdd, sab, sah,
                 H, Lq, Lk, E, Ev, GROUPS, scale, window_lo, window_hi, huge_lse, cap,
                 CU_Q, CU_K, TOTAL_Q, LQ_BUCKET, LK_BUCKET,
                 MASK_KIND: tl.constexpr, HAS_GLSE: tl.constexpr, SOFTCAP: tl.constexpr,
                 ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, VARLEN: tl.constexpr,
                 DOT_PREC: tl.constexpr,
                 PAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The backward's one pre-pass over the query rows: DELTA = (rowsum(dO * O) - grad_lse) / r
    and DOS = dO / r in dO's dtype (contiguous), r = sum_j exp(s_ij - lse_i) on rows of huge
    |lse| (common.HUGE_LSE), 1 elsewhere (the sink's exp(sink - lse_i) included); programs
    without such rows read no keys. VARLEN: DELTA as lse (Hq, total_q), DOS (Hq, total_q, Ev).
    Rows of lse past common.LSE_LIMIT (+inf: scores past float32's range,
    sdpa_fwd_rerun), or under its negative in log2 units, set FLAG, for sdpa_bwd_rerun. (In
    natural units an lse near float32's lowest, a row under a bias of float32's lowest as Hugging
    Face's masks hold, is no overflow; a huge row whose r came out 0 is, and sets FLAG too.)"""
    m0, bh, b, h, hk = _query_program(H, Lq, GROUPS, BLOCK_M)
    if VARLEN:  # as in the forward
        q0, k0, Lq, Lk, window_lo, window_hi = _sequence(CU_Q, CU_K, b, window_lo, window_hi)
        if m0 >= Lq:
            return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Lq
    rows = bh.to(tl.int64) * Lq + offs_m
    Qb, Ob, DOb = Q, O, DO
    if VARLEN:
        rows = h * TOTAL_Q + q0 + offs_m
        Qb, Ob, DOb = Q + q0 * sqm, O + q0 * som, DO + q0 * sdm
    lse = tl.load(LSE + rows, mask=row_ok, other=float("inf"))  # not huge, no sink term
    # rows whose exp2 arguments may pass float32's range (common.LSE_LIMIT)
    past = lse > LSE_LIMIT
    if (MASK_KIND != 2 and not SOFTCAP) and not ALIBI:  # log2 units: lse * log2(e) too
        past = past | ((lse < -LSE_LIMIT) & (lse != float("-inf")))
    past = past & row_ok
    if tl.max(past.to(tl.int32), 0) > 0:
        tl.store(FLAG, 1)
    huge = huge_rows(lse, huge_lse)
    k_base, _, m_base = _head_bases(K, K, M, b, h, hk, skb, skh, skb, skh, smb, smh)
    if VARLEN:
        k_base += k0 * skn
    q = load_tile(Qb + b * sqb + h * sqh + offsets(offs_m, offs_d, sqm, sqd), offs_m, offs_d, Lq,
                  E, True, PAD_D)
    start, end = key_range(m0, Lq, Lk, window_lo, window_hi, BLOCK_M, BLOCK_N)
    end = tl.where(tl.max(huge.to(tl.int32), 0) > 0, end, start)
    slope, shift = _alibi(SLOPES, b, h, sab, sah, Lq, Lk, ALIBI, VARLEN)
    total = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        total += tl.exp(tl.load(SINKS + h).to(tl.float32) - lse)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        kt = load_tile(k_base + offsets(offs_d, offs_n, skd, skn), offs_d, offs_n, E, Lk, PAD_D,
                       True)
        s = modified(dot(q, kt, DOT_PREC) * scale, cap, slope, offs_m[:, None] + shift,
                     offs_n[None, :], SOFTCAP, ALIBI, DOT_PREC == FP32_DOT)[0]
        s = admit(s, m_base, offs_m, offs_n, Lq, Lk, smm, smn, window_lo, window_hi, MASK_KIND)
        total += tl.sum(tl.math.exp2(tl.minimum((s - lse[:, None]) * LOG2E, 0.0)), 1)
    # A huge row whose every term came out 0 has scores under float32's lowest (-inf here),
    # its lse saturated there (sdpa_fwd_rerun): in natural units (a float mask, softcap,
    # ALiBi) the test on lse above cannot tell it from a row under Hugging Face's lowest
    # bias, whose largest score is within log(Lk) of its lse (a term of 1 / Lk at least).
    lost = huge & (total == 0.0) & row_ok
    if tl.max(lost.to(tl.int32), 0) > 0:
        tl.store(FLAG, 1)
    r = tl.where(huge & (total > 0.0), total, 1.0)
    o = load_tile(Ob + b * sob + h * soh + offsets(offs_m, offs_dv, som, sod), offs_m, offs_dv,
                  Lq, Ev, True, PAD_D).to(tl.float32)
    do = load_tile(DOb + b * sdb + h * sdh + offsets(offs_m, offs_dv, sdm, sdd), offs_m, offs_dv,
                   Lq, Ev, True, PAD_D).to(tl.float32)
    delta = tl.sum(do * o, 1)
    # With dropout D_i = sum_j P_ij dP_ij still equals rowsum(dO * O): O is built from the
    # dropped P, and dP of the dropped P differs from dP by the same keep / (1 - p) factor.
    if HAS_GLSE:  # d lse_i / d s_ij = P_ij: the lse gradient only shifts D_i
        delta -= tl.load(GLSE + rows, mask=row_ok, other=0.0)
    tl.store(DELTA + rows, delta / r, mask=row_ok)
    tl.store(DOS + rows.to(tl.int64)[:, None] * Ev + offs_dv[None, :],
             (do / r[:, None]).to(DOS.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < Ev))


@triton.jit
def _dkdv_blocks(dk, dk2, dv, dv2, k, k2, v, v2, q_base, do_base, m_base, dm_base, LSE, DELTA,
                 RNG, bh, seq, lo, hi, offs_n, col_ok, offs_d, offs_d2, offs_dv, offs_dv2, Lq, Lk,
                 E, Ev, sqm, sqd, sdm, sdd, smm, smn, sc,
                 window_lo, window_hi, inv_keep, cap, slope, shift,
                 EDGE: tl.constexpr, MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr,
                 MASK_GRAD: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                 VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, PAD_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV2: tl.constexpr):
    """dK and dV of one key block over query blocks [lo, hi) of head bh (VARLEN: query head bh
    of sequence seq, for the dropout's keys), in key-major tiles
    (K Q^T, V dO^T): q and dO are read transposed from memory, so no probability or score
    gradient tile is transposed in registers. EDGE blocks reach past the band or the rows.
    Second head-dim chunks (common.head_blocks) add a dot to each product."""
    rows = tl.arange(0, BLOCK_M)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + rows
        qt = load_tile(q_base + offsets(offs_d, offs_m, sqd, sqm), offs_d, offs_m, E, Lq, PAD_D,
                       EDGE)
        do = load_tile(do_base + offsets(offs_m, offs_dv, sdm, sdd), offs_m, offs_dv, Lq, Ev, EDGE,
                       PAD_D)
        qkt = dot(k, qt, DOT_PREC)
        dpt = dot(v, tl.trans(do), DOT_PREC)
        if BLOCK_D2 > 0:
            qt2 = load_tile(q_base + offsets(offs_d2, offs_m, sqd, sqm), offs_d2, offs_m, E, Lq,
                            PAD_D, EDGE)
            qkt = dot_acc(k2, qt2, qkt, DOT_PREC)
        if BLOCK_DV2 > 0:
            do2 = load_tile(do_base + offsets(offs_m, offs_dv2, sdm, sdd), offs_m, offs_dv2, Lq, Ev,
                            EDGE, PAD_D)
            dpt = dot_acc(v2, tl.trans(do2), dpt, DOT_PREC)
        lse, delta = _row_stats(LSE, DELTA, offs_m, offs_m < Lq)
        if EDGE:
            ok = (col_ok[:, None] & (offs_m[None, :] < Lq)
                  & _band(offs_m[None, :], offs_n[:, None], window_lo, window_hi))
        else:
            ok = col_ok[:, None]  # only read by the mask loads
        pt, tt = _probs(qkt, ok, m_base + offsets(offs_n, offs_m, smn, smm), lse[None, :], sc,
                        cap, slope, offs_m[None, :] + shift, offs_n[:, None], EDGE, MASK_KIND,
                        SOFTCAP, ALIBI, DOT_PREC == FP32_DOT, k.dtype == tl.float16)
        if DROPOUT:
            if VARLEN:
                key_row, threshold = _varlen_row_keys(RNG, seq, bh, offs_m)
            else:
                key_row, threshold = row_keys(RNG, bh, offs_m)
            kept = keep_t(key_row, offs_n, threshold)
            pu = tl.where(kept, pt * inv_keep, 0.0).to(do.dtype)
            dpt = tl.where(kept, dpt * inv_keep, 0.0)
        else:
            pu = pt.to(do.dtype)
        dv = dot_acc(pu, do, dv, DOT_PREC)
        if BLOCK_DV2 > 0:
            dv2 = dot_acc(pu, do2, dv2, DOT_PREC)
        dst = pt * (dpt - delta[None, :])
        if MASK_GRAD:
            tl.store(dm_base + offsets(offs_n, offs_m, 1, Lk), dst.to(dm_base.dtype.element_ty),
                     mask=col_ok[:, None] & (offs_m[None, :] < Lq))
        if SOFTCAP:  # the mask is added after the cap; the scaled score goes through tanh
            dst = dst * (1.0 - tt * tt)
        dst = dst.to(qt.dtype)
        dk = dot_acc(dst, tl.trans(qt), dk, DOT_PREC)
        if BLOCK_D2 > 0:
            dk2 = dot_acc(dst, tl.trans(qt2), dk2, DOT_PREC)
    return dk, dk2, dv, dv2


@triton.autotune(configs=_DKDV, key=_KEY + ["PER"],
                 prune_configs_by={"early_config_prune": common.pruner(
                     _dkdv_tiles, _dkdv_sm90_fits)})
@_JIT
def _dkdv_kernel(Q, K, V, M, DO, LSE, DELTA, RNG, DK, DV, DM, FLAG,
                 sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                 smb, smh, smm, smn, sdb, sdh, sdm, sdd,
                 H, Hkv, Lq, Lk, E, Ev, GROUPS, SPLIT, PER, scale, window_lo, window_hi, inv_keep,
                 SLOPES, sab, sah, cap, CU_Q, CU_K, TOTAL_Q, LQ_BUCKET, LK_BUCKET,
                 MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, MASK_GRAD: tl.constexpr,
                 SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, VARLEN: tl.constexpr,
                 DOT_PREC: tl.constexpr, PAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (key block, b * Hkv + kv head, slice of its GQA group): the group's
    PER = GROUPS / SPLIT query heads in turn (an argument, so that Triton compiles PER = 1 without
    the loop). SPLIT > 1 (_gqa_split) writes fp32 partial sums, one per slice, that the host adds
    up: no atomics, deterministic. VARLEN: b is the sequence; dK, dV (total_k, Hkv, SPLIT, E).
    A dK accumulator holding inf or NaN (an overflowed dP or D in bf16/fp32, a dS past fp16's
    range) sets FLAG (sdpa_bwd_rerun)."""
    n0, prog = tile_and_head(Lk, BLOCK_N)
    part = prog % SPLIT
    bhk = prog // SPLIT
    b = (bhk // Hkv).to(tl.int64)
    hk = (bhk % Hkv).to(tl.int64)
    if VARLEN:  # Lq, Lk were the longest sequences' (the grid's)
        q0, k0, Lq, Lk, window_lo, window_hi = _sequence(CU_Q, CU_K, b, window_lo, window_hi)
        if n0 >= Lk:
            return
    cols = tl.arange(0, BLOCK_N)
    offs_n = n0 + cols
    col_ok = offs_n < Lk
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_d2 = second_chunk(BLOCK_D, BLOCK_D2)
    offs_dv2 = second_chunk(BLOCK_DV, BLOCK_DV2)
    n = n0.to(tl.int64)
    if VARLEN:  # rows of the packed tensors (their batch strides are 0)
        n += k0
    k_base = K + b * skb + hk * skh + n * skn
    v_base = V + b * svb + hk * svh + n * svn
    k = load_tile(k_base + offsets(cols, offs_d, skn, skd), offs_n, offs_d, Lk, E, True, PAD_D)
    v = load_tile(v_base + offsets(cols, offs_dv, svn, svd), offs_n, offs_dv, Lk, Ev, True,
                  PAD_D)
    k2, v2 = k, v  # read only with second chunks
    if BLOCK_D2 > 0:
        k2 = load_tile(k_base + offsets(cols, offs_d2, skn, skd), offs_n, offs_d2, Lk, E, True,
                       PAD_D)
    if BLOCK_DV2 > 0:
        v2 = load_tile(v_base + offsets(cols, offs_dv2, svn, svd), offs_n, offs_dv2, Lk, Ev,
                       True, PAD_D)
    if scale < 0:  # as in the forward: exp2's FMA wants a positive scale
        k = negated(k)
        k2 = negated(k2)
    sc = tl.abs(scale)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    dk2 = tl.zeros([BLOCK_N, offs_d2.shape[0]], tl.float32)
    dv2 = tl.zeros([BLOCK_N, offs_dv2.shape[0]], tl.float32)
    start, end = query_range(n0, Lq, Lk, window_lo, window_hi, BLOCK_M, BLOCK_N)
    # Query blocks wholly inside the band for these keys: inner_range with queries and keys
    # swapped (i - j in [-window_hi, -window_lo]).
    lo, hi = inner_range(n0, Lk, Lq, start, end, -window_hi, -window_lo, BLOCK_N, BLOCK_M)
    for g in range(PER):
        h = hk * GROUPS + part.to(tl.int64) * PER + g
        bh = b * H + h
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdb + h * sdh
        m_base = M + b * smb + h * smh
        dm_base = DM + bh * Lq * Lk
        lse_base = LSE + bh * Lq
        delta_base = DELTA + bh * Lq
        rng_head = bh
        if VARLEN:  # lse and delta (Hq, total_q); the sequence as a batch of one for dropout
            q_base += q0 * sqm
            do_base += q0 * sdm
            lse_base = LSE + h * TOTAL_Q + q0
            delta_base = DELTA + h * TOTAL_Q + q0
            rng_head = h
        slope, shift = _alibi(SLOPES, b, h, sab, sah, Lq, Lk, ALIBI, VARLEN)
        dk, dk2, dv, dv2 = _dkdv_blocks(
            dk, dk2, dv, dv2, k, k2, v, v2, q_base, do_base, m_base, dm_base, lse_base,
            delta_base, RNG, rng_head, b, start, lo,
            offs_n, col_ok, offs_d, offs_d2, offs_dv, offs_dv2, Lq, Lk, E, Ev, sqm, sqd, sdm, sdd,
            smm, smn, sc,
            window_lo, window_hi, inv_keep, cap, slope, shift, True, MASK_KIND, DROPOUT, MASK_GRAD,
            SOFTCAP, ALIBI, VARLEN, DOT_PREC, PAD_D, BLOCK_M, BLOCK_D2, BLOCK_DV2)
        dk, dk2, dv, dv2 = _dkdv_blocks(
            dk, dk2, dv, dv2, k, k2, v, v2, q_base, do_base, m_base, dm_base, lse_base,
            delta_base, RNG, rng_head, b, lo, hi,
            offs_n, col_ok, offs_d, offs_d2, offs_dv, offs_dv2, Lq, Lk, E, Ev, sqm, sqd, sdm, sdd,
            smm, smn, sc,
            window_lo, window_hi, inv_keep, cap, slope, shift, False, MASK_KIND, DROPOUT, MASK_GRAD,
            SOFTCAP, ALIBI, VARLEN, DOT_PREC, PAD_D, BLOCK_M, BLOCK_D2, BLOCK_DV2)
        dk, dk2, dv, dv2 = _dkdv_blocks(
            dk, dk2, dv, dv2, k, k2, v, v2, q_base, do_base, m_base, dm_base, lse_base,
            delta_base, RNG, rng_head, b, hi, end,
            offs_n, col_ok, offs_d, offs_d2, offs_dv, offs_dv2, Lq, Lk, E, Ev, sqm, sqd, sdm, sdd,
            smm, smn, sc,
            window_lo, window_hi, inv_keep, cap, slope, shift, True, MASK_KIND, DROPOUT, MASK_GRAD,
            SOFTCAP, ALIBI, VARLEN, DOT_PREC, PAD_D, BLOCK_M, BLOCK_D2, BLOCK_DV2)
    # (dV: a dO near the largest overflows its sums where dP and D may not; fp16's dK: a dS
    # past 65504, sdpa_bwd_rerun)
    flag_nonfinite(FLAG, dk)
    flag_nonfinite(FLAG, dv)
    if BLOCK_D2 > 0:
        flag_nonfinite(FLAG, dk2)
    if BLOCK_DV2 > 0:
        flag_nonfinite(FLAG, dv2)
    # dK and dV (or their slices' partial sums) are contiguous: (programs' heads, Lk, E); VARLEN:
    # (total_k, Hkv * SPLIT, E), rows of Hkv * SPLIT heads.
    base = prog.to(tl.int64) * Lk + n
    heads = 1
    if VARLEN:
        heads = tl.full([], Hkv, tl.int64) * SPLIT  # 64-bit row strides
        base = n * heads + prog % heads
    _store_cols(DK + base * E, dk * scale, cols, offs_d, col_ok, E, heads * E)
    _store_cols(DV + base * Ev, dv, cols, offs_dv, col_ok, Ev, heads * Ev)
    if BLOCK_D2 > 0:
        _store_cols(DK + base * E, dk2 * scale, cols, offs_d2, col_ok, E, heads * E)
    if BLOCK_DV2 > 0:
        _store_cols(DV + base * Ev, dv2, cols, offs_dv2, col_ok, Ev, heads * Ev)


@triton.jit
def _store_cols(base, x, rows, offs_d, row_ok, D, stride):
    """x into columns offs_d (< D) of the rows (stride apart) of base."""
    tl.store(base + offsets(rows, offs_d, stride, 1), x.to(base.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def _dq_blocks(dq, dq2, q, q2, do, do2, lse, delta, k_base, v_base, m_base, lo, hi, offs_m,
               row_ok, offs_d, offs_d2, offs_dv, offs_dv2, Lk, E, Ev, skn, skd, svn, svd, smm,
               smn, sc, window_lo, window_hi, key_row, threshold,
               inv_keep, cap, slope, shift, EDGE: tl.constexpr, MASK_KIND: tl.constexpr,
               DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
               DOT_PREC: tl.constexpr, PAD_D: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D2: tl.constexpr, BLOCK_DV2: tl.constexpr):
    """dQ of one query block over key blocks [lo, hi) (EDGE: past the band or the keys)."""
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + cols
        kt = load_tile(k_base + offsets(offs_d, offs_n, skd, skn), offs_d, offs_n, E, Lk, PAD_D,
                       EDGE)
        vt = load_tile(v_base + offsets(offs_dv, offs_n, svd, svn), offs_dv, offs_n, Ev, Lk,
                       PAD_D, EDGE)
        qk = dot(q, kt, DOT_PREC)
        dp = dot(do, vt, DOT_PREC)
        if BLOCK_D2 > 0:
            kt2 = load_tile(k_base + offsets(offs_d2, offs_n, skd, skn), offs_d2, offs_n, E, Lk,
                            PAD_D, EDGE)
            qk = dot_acc(q2, kt2, qk, DOT_PREC)
        if BLOCK_DV2 > 0:
            vt2 = load_tile(v_base + offsets(offs_dv2, offs_n, svd, svn), offs_dv2, offs_n, Ev, Lk,
                            PAD_D, EDGE)
            dp = dot_acc(do2, vt2, dp, DOT_PREC)
        if EDGE:
            ok = (row_ok[:, None] & (offs_n[None, :] < Lk)
                  & _band(offs_m[:, None], offs_n[None, :], window_lo, window_hi))
        else:
            ok = row_ok[:, None]
        p, t = _probs(qk, ok, m_base + offsets(offs_m, offs_n, smm, smn), lse[:, None], sc, cap,
                      slope, offs_m[:, None] + shift, offs_n[None, :], EDGE, MASK_KIND, SOFTCAP,
                      ALIBI, DOT_PREC == FP32_DOT, q.dtype == tl.float16)
        if DROPOUT:
            dp = tl.where(keep(key_row, offs_n, threshold), dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        ds = ds.to(kt.dtype)
        dq = dot_acc(ds, tl.trans(kt), dq, DOT_PREC)
        if BLOCK_D2 > 0:
            dq2 = dot_acc(ds, tl.trans(kt2), dq2, DOT_PREC)
    return dq, dq2


@triton.autotune(configs=_DQ, key=_KEY,
                 prune_configs_by={"early_config_prune": common.pruner(
                     _dq_tiles, _dq_sm90_fits)})
@_JIT
def _dq_kernel(Q, K, V, M, DO, LSE, DELTA, RNG, DQ, FLAG,
               sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
               smb, smh, smm, smn, sdb, sdh, sdm, sdd,
               H, Lq, Lk, E, Ev, GROUPS, scale, window_lo, window_hi, inv_keep,
               SLOPES, sab, sah, cap, CU_Q, CU_K, TOTAL_Q, LQ_BUCKET, LK_BUCKET,
               MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr,
               ALIBI: tl.constexpr, VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
               PAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m0, bh, b, h, hk = _query_program(H, Lq, GROUPS, BLOCK_M)
    if VARLEN:  # as in the forward; dQ (total_q, Hq, E)
        q0, k0, Lq, Lk, window_lo, window_hi = _sequence(CU_Q, CU_K, b, window_lo, window_hi)
        if m0 >= Lq:
            return
    rows = tl.arange(0, BLOCK_M)
    offs_m = m0 + rows
    row_ok = offs_m < Lq
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_d2 = second_chunk(BLOCK_D, BLOCK_D2)
    offs_dv2 = second_chunk(BLOCK_DV, BLOCK_DV2)
    m = m0.to(tl.int64)
    if VARLEN:
        m += q0
    q_base = Q + b * sqb + h * sqh + m * sqm
    do_base = DO + b * sdb + h * sdh + m * sdm
    q = load_tile(q_base + offsets(rows, offs_d, sqm, sqd), offs_m, offs_d, Lq, E, True, PAD_D)
    do = load_tile(do_base + offsets(rows, offs_dv, sdm, sdd), offs_m, offs_dv, Lq, Ev, True,
                   PAD_D)
    q2, do2 = q, do  # read only with second chunks
    if BLOCK_D2 > 0:
        q2 = load_tile(q_base + offsets(rows, offs_d2, sqm, sqd), offs_m, offs_d2, Lq, E, True,
                       PAD_D)
    if BLOCK_DV2 > 0:
        do2 = load_tile(do_base + offsets(rows, offs_dv2, sdm, sdd), offs_m, offs_dv2, Lq, Ev,
                        True, PAD_D)
    if scale < 0:  # as in the forward
        q = negated(q)
        q2 = negated(q2)
    sc = tl.abs(scale)
    bh64 = bh.to(tl.int64)
    row0 = bh64 * Lq
    if VARLEN:  # lse and delta (Hq, total_q)
        row0 = h * TOTAL_Q + q0
    lse, delta = _row_stats(LSE + row0, DELTA + row0, offs_m, row_ok)
    key_row, threshold = None, None
    if DROPOUT:
        if VARLEN:
            key_row, threshold = _varlen_row_keys(RNG, b, h, offs_m)
        else:
            key_row, threshold = row_keys(RNG, bh, offs_m)
    k_base, v_base, m_base = _head_bases(K, V, M, b, h, hk, skb, skh, svb, svh, smb, smh)
    if VARLEN:
        k_base += k0 * skn
        v_base += k0 * svn
    slope, shift = _alibi(SLOPES, b, h, sab, sah, Lq, Lk, ALIBI, VARLEN)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq2 = tl.zeros([BLOCK_M, offs_d2.shape[0]], tl.float32)
    start, end = key_range(m0, Lq, Lk, window_lo, window_hi, BLOCK_M, BLOCK_N)
    lo, hi = inner_range(m0, Lq, Lk, start, end, window_lo, window_hi, BLOCK_M, BLOCK_N)
    dq, dq2 = _dq_blocks(dq, dq2, q, q2, do, do2, lse, delta, k_base, v_base, m_base, start, lo,
                         offs_m, row_ok, offs_d, offs_d2, offs_dv, offs_dv2, Lk, E, Ev, skn, skd,
                         svn, svd, smm, smn, sc, window_lo, window_hi, key_row, threshold,
                         inv_keep, cap, slope, shift, True, MASK_KIND, DROPOUT, SOFTCAP, ALIBI,
                         DOT_PREC,
                         PAD_D, BLOCK_N, BLOCK_D2, BLOCK_DV2)
    dq, dq2 = _dq_blocks(dq, dq2, q, q2, do, do2, lse, delta, k_base, v_base, m_base, lo, hi,
                         offs_m, row_ok, offs_d, offs_d2, offs_dv, offs_dv2, Lk, E, Ev, skn, skd,
                         svn, svd, smm, smn, sc, window_lo, window_hi, key_row, threshold,
                         inv_keep, cap, slope, shift, False, MASK_KIND, DROPOUT, SOFTCAP, ALIBI,
                         DOT_PREC,
                         PAD_D, BLOCK_N, BLOCK_D2, BLOCK_DV2)
    dq, dq2 = _dq_blocks(dq, dq2, q, q2, do, do2, lse, delta, k_base, v_base, m_base, hi, end,
                         offs_m, row_ok, offs_d, offs_d2, offs_dv, offs_dv2, Lk, E, Ev, skn, skd,
                         svn, svd, smm, smn, sc, window_lo, window_hi, key_row, threshold,
                         inv_keep, cap, slope, shift, True, MASK_KIND, DROPOUT, SOFTCAP, ALIBI,
                         DOT_PREC,
                         PAD_D, BLOCK_N, BLOCK_D2, BLOCK_DV2)
    flag_nonfinite(FLAG, dq)  # as _dkdv_kernel's
    if BLOCK_D2 > 0:
        flag_nonfinite(FLAG, dq2)
    out = DQ + (bh64 * Lq + m) * E
    stride = E
    if VARLEN:
        out = DQ + (m * H + h) * E
        stride = tl.full([], H, tl.int64) * E  # 64-bit row stride
    _store_cols(out, dq * scale, rows, offs_d, row_ok, E, stride)
    if BLOCK_D2 > 0:
        _store_cols(out, dq2 * scale, rows, offs_d2, row_ok, E, stride)


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
                  LQ_BUCKET=common.length_bucket(lq), LK_BUCKET=common.length_bucket(lk))
    # Head dims as one or two power-of-two chunks (_head_blocks).
    (d1, d2), (dv1, dv2) = _head_blocks(e), _head_blocks(ev)
    consts.update(BLOCK_D=d1, BLOCK_D2=d2, BLOCK_DV=dv1, BLOCK_DV2=dv2,
                  PAD_D=d1 + d2 != e or dv1 + dv2 != ev)
    inv_keep = 1.0 / (1.0 - dropout_p)
    return m, rng, strides, (b, h, hkv, lq, lk, e, ev), consts, inv_keep


def _modifier_args(q, softcap, alibi, sinks):
    """(slopes, sinks: the tensors the kernels read, q where absent; the slopes' (B, Hq)
    strides; the softcap, 1.0 where absent; the constexprs SOFTCAP, ALIBI)."""
    slopes, strides = (q, (0, 0)) if alibi is None else (alibi, tuple(alibi.stride()))
    return (slopes, q if sinks is None else sinks, strides,
            1.0 if softcap is None else softcap,
            dict(SOFTCAP=common.softcap_kind(softcap), ALIBI=alibi is not None))


@common.register_op("triton_sdpa_fwd")
def sdpa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
             scale: float, window_lo: int, window_hi: int, dropout_p: float,
             seed: Optional[torch.Tensor], softcap: Optional[float] = None,
             alibi: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """alibi: float32 (B, Hq) slopes; sinks: (Hq,) logits; lse includes the sink."""
    window_lo, window_hi = common.clamped_band(window_lo, window_hi, q.shape[2], k.shape[2])
    m, rng, strides, (b, h, hkv, lq, lk, e, ev), consts, inv_keep = _common_args(
        q, k, v, mask, dropout_p, seed)
    slopes, sink, a_strides, cap, flags = _modifier_args(q, softcap, alibi, sinks)
    out = q.new_empty((b, h, lq, ev))
    lse = q.new_empty((b, h, lq), dtype=torch.float32)
    flag = q.new_zeros((1,), dtype=torch.int32)  # set where scores passed float32's range
    grid = lambda meta: common.tiles_grid(lq, meta["BLOCK_M"], b * h)  # noqa: E731
    common.launcher(_fwd_kernel)[grid](
        q, k, v, m, out, lse, rng, slopes, sink, flag, *strides, *out.stride(), *a_strides,
        h, lq, lk, e, ev, h // hkv, scale, window_lo, window_hi, inv_keep, cap, q, q, 0,
        HAS_SINKS=sinks is not None, VARLEN=False, **flags, **consts)
    from . import sdpa_fwd_rerun  # (it imports this module's jit functions)
    sdpa_fwd_rerun.launch(
        out, lse, flag, (q, k, v, m, rng, slopes, sink), (*strides, *out.stride(), *a_strides),
        (b, h, hkv, lq, lk, e, ev), (scale, window_lo, window_hi, inv_keep, cap), (q, q, 0),
        mask_kind=consts["MASK_KIND"], dropout=dropout_p > 0, softcap=softcap is not None,
        alibi=alibi is not None, has_sinks=sinks is not None, varlen=False)
    return out, lse


@common.register_op("triton_sdpa_bwd")
def sdpa_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, scale: float,
             window_lo: int, window_hi: int, dropout_p: float, seed: Optional[torch.Tensor],
             mask_grad: bool, grad_lse: Optional[torch.Tensor] = None,
             softcap: Optional[float] = None, alibi: Optional[torch.Tensor] = None,
             sinks: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dmask (empty without mask_grad), dsinks (empty without sinks))."""
    window_lo, window_hi = common.clamped_band(window_lo, window_hi, q.shape[2], k.shape[2])
    m, rng, strides, (b, h, hkv, lq, lk, e, ev), consts, inv_keep = _common_args(
        q, k, v, mask, dropout_p, seed)
    slopes, sink, a_strides, cap, flags = _modifier_args(q, softcap, alibi, sinks)
    consts.update(flags)
    lse = lse.contiguous()  # read by row index (a caller's may be a strided view: the ring's)
    delta = torch.empty_like(lse)
    # dO / r (common.HUGE_LSE), in dO's dtype: what the dK/dV and dQ kernels read as dO.
    dos = grad_out.new_empty((b, h, lq, ev))
    glse = grad_lse.float().contiguous() if grad_lse is not None else lse
    from . import sdpa_bwd_rerun  # (it imports this module's jit functions)
    # Set where scores passed float32's range (the pre-pass), dP or D overflowed (bf16, fp32) or
    # dS passed fp16's range: sdpa_bwd_rerun's kernels then redo dQ, dK and dV.
    flag = q.new_zeros((1,), dtype=torch.int32)
    common.launcher(_prep_kernel)[lambda meta: common.tiles_grid(lq, meta["BLOCK_M"], b * h)](
        q, k, m, out, grad_out, glse, lse, delta, dos, slopes, sink, flag,
        *strides[:8], *strides[12:],
        *out.stride(), *grad_out.stride(), *a_strides, h, lq, lk, e, ev, h // hkv, scale,
        window_lo, window_hi, common.HUGE_LSE, cap, q, q, 0, consts["LQ_BUCKET"],
        consts["LK_BUCKET"], MASK_KIND=consts["MASK_KIND"], HAS_GLSE=grad_lse is not None,
        **flags, HAS_SINKS=sinks is not None, VARLEN=False,
        DOT_PREC=consts["DOT_PREC"], PAD_D=common.head_block(e) != e or common.head_block(ev) != ev,
        BLOCK_D=common.head_block(e), BLOCK_DV=common.head_block(ev))
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    split = _gqa_split(h // hkv, lk, b * hkv, _one_head_per_program(q, e, ev))
    if split == 1:
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    else:  # fp32 partial sums of each slice of a group's query heads
        dk = k.new_empty((b, hkv, split, lk, e), dtype=torch.float32)
        dv = v.new_empty((b, hkv, split, lk, ev), dtype=torch.float32)
    # Only in-band entries are written: the rest of dmask stays zero.
    dmask = mask.new_zeros((b, h, lq, lk)) if mask_grad else q.new_empty((0,))
    sizes = (lq, lk, e, ev, h // hkv)
    band = (scale, window_lo, window_hi, inv_keep, slopes, *a_strides, cap)
    common.launcher(_dkdv_kernel)[
        lambda meta: common.tiles_grid(lk, meta["BLOCK_N"], b * hkv * split)](
        q, k, v, m, dos, lse, delta, rng, dk, dv, dmask, flag, *strides,
        *dos.stride(),
        h, hkv, *sizes, split, h // hkv // split, *band, q, q, 0, MASK_GRAD=mask_grad,
        VARLEN=False, **consts)
    if split > 1:
        dk, dv = dk.sum(2).to(k.dtype), dv.sum(2).to(v.dtype)
    dsinks = q.new_empty((0,)) if sinks is None else common.sink_grad(sinks, lse, delta,
                                                                        (1, h, 1), (0, 2))
    common.launcher(_dq_kernel)[
        lambda meta: common.tiles_grid(lq, meta["BLOCK_M"], b * h)](
        q, k, v, m, dos, lse, delta, rng, dq, flag, *strides,
        *dos.stride(), h, *sizes, *band, q, q, 0, VARLEN=False, **consts)
    rows64 = sdpa_bwd_rerun.launch(
        flag, (q, k, v, m, grad_out, glse, lse, rng, slopes, sink), (dq, dk, dv, dmask),
        (*strides, *grad_out.stride(), *a_strides), (*dq.stride(), *dk.stride(), *dv.stride()),
        (b, h, hkv, lq, lk, e, ev), (scale, window_lo, window_hi, inv_keep, cap), (q, q, 0),
        mask_kind=consts["MASK_KIND"], dropout=dropout_p > 0, mask_grad=mask_grad,
        softcap=softcap is not None, alibi=alibi is not None, has_sinks=sinks is not None,
        has_glse=grad_lse is not None, varlen=False)
    if sinks is not None and rows64 is not None:  # D_i / r_i overflowed too where flagged
        dsinks = torch.where(flag.bool(), common.sink_grad(sinks, *rows64, (1, h, 1), (0, 2)),
                             dsinks)
    return dq, dk, dv, dmask, dsinks


def _head_blocks(d: int) -> tuple[int, int]:
    """The kernels' head-dim chunks: common.head_blocks over 128 (160 = 128 + 32 and 192 =
    128 + 64 unpadded, where one block padded them to 256), one power of two up to 128. In two
    chunks (96 = 64 + 32) the kernels spilled on sm_80 in configs that the padded 128 keeps
    spill-free (the compile test: forward 64x64 4-warp 24 B, dK/dV 32x32 1.5 KB, dQ 64x32 8 B),
    and zero spills is the bound there; over 128 they spill in any case."""
    return common.head_blocks(d) if d > 128 else (common.head_block(d), 0)


def _one_head_per_program(q, e: int, ev: int) -> bool:
    """Whether the dK/dV kernel takes one query head per program: where _dkdv_sm90_fits's wide
    tiles apply (sm_90, fp16/bf16, head dims up to 128), which the loop over a group's heads
    spills. The fp32 partial sums then cost a write and a read of B x Hq x Lk x (E + Ev)
    floats."""
    return (not common.interpreting()
            and _wide_tiles_apply(common.target_arch(), q.element_size(), max(e, ev)))


def _gqa_split(groups: int, lk: int, kv_heads: int, one_head: bool = False) -> int:
    """Into how many slices the dK/dV kernel cuts each GQA group of query heads: one per head
    where `one_head`; else the fewest (a divisor of groups) that give at least two programs per
    SM, counting key blocks of the largest BLOCK_N; one program per kv head left most SMs idle
    under MQA."""
    if one_head:
        return groups
    tiles = triton.cdiv(lk, max(c.kwargs["BLOCK_N"] for c in _DKDV)) * kv_heads
    want = 2 * common.multiprocessors()
    for split in range(1, groups + 1):
        if groups % split == 0 and tiles * split >= want:
            return split
    return groups


# Shape-only versions: triton_op derives them itself on a GPU, custom_op (the interpreter's
# registration) needs them.
@sdpa_fwd.register_fake
def _sdpa_fwd_fake(q, k, v, mask, scale, window_lo, window_hi, dropout_p, seed, softcap=None,
                   alibi=None, sinks=None):
    same_device(q, k, v, mask, alibi, sinks)
    b, h, lq, _ = q.shape
    return q.new_empty((b, h, lq, v.shape[-1])), q.new_empty((b, h, lq), dtype=torch.float32)


@sdpa_bwd.register_fake
def _sdpa_bwd_fake(grad_out, q, k, v, mask, out, lse, scale, window_lo, window_hi, dropout_p,
                   seed, mask_grad, grad_lse=None, softcap=None, alibi=None, sinks=None):
    same_device(q, grad_out, k, v, mask, out, lse, grad_lse, alibi, sinks)
    dmask = mask.new_empty((*q.shape[:3], k.shape[2])) if mask_grad else q.new_empty((0,))
    dsinks = q.new_empty((0,)) if sinks is None else sinks.new_empty(sinks.shape)
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
    dq, dk, dv, dmask, dsinks = call(sdpa_bwd, or_zeros(grad_out, out), q, k, v, mask, out, lse,
                                     scale, lo, hi, p, seed, want_mask, grad_lse, softcap, alibi,
                                     sinks)
    # no gradient for the slopes: constants (attnx/_validate.py)
    return (dq, dk, dv, (dmask if want_mask else None), None, None, None, None, None, None, None,
            dsinks if sinks is not None and ctx.needs_input_grad[11] else None)


register_autograd(sdpa_fwd, _backward, setup_context=_setup)
register_autograd(sdpa_bwd, no_double_backward)
