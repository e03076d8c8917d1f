"""The SDPA forward's slow path (sdpa_fwd, varlen_fwd) for scores past float32's range.

Finite inputs can make |q . k * scale| pass float32's range (3.4e38): the float32 online softmax
then gives NaN, or an empty-looking row (common.admitted). sdpa._fwd_kernel flags such rows
(common.scores_overflowed): it sets FLAG, one int32 on the device, and writes NaN into their
output and lse, so the forward never waits on the host. The kernel here, launched after it on a
fixed grid of common.multiprocessors() programs, loads FLAG first and does nothing unless it is
set (its loop runs zero times). Set, it walks every query block; a block holding a NaN lse row
computes its rows in float64, where every product and sum of float32 values fits: the row max of
the admitted scores (the sink's logit too), then P = exp(s - max) summed and times V over
RERUN_BLOCK-key tiles, with the scores, modifiers, masks and dropout hash of the backward's rerun
(sdpa_bwd_rerun._scores). It writes the NaN rows' output, rounded to its dtype, and their lse in
float32: +inf where the true lse passes float32's largest, as it does on rows whose scores did,
and float32's lowest where it passes that (-inf stays the mark of a row that admitted no key).
The backward's pre-pass flags such lse rows (common.LSE_LIMIT), and sdpa_bwd_rerun takes each
row's float64 max in place of the saved lse. NaN inputs give NaN rows, which take this path too
and come out NaN again. Speed is not the aim: only such inputs pay for it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common
from .common import dot, key_range, offsets

FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
from .sdpa import _alibi
from .sdpa_bwd_rerun import (_OPTIONS, RERUN_BLOCK, _aranges, _chunks, _dropout_keys, _dropped,
                             _head_chunks, _item, _lse_rows, _narrow, _row_max, _scores, _wide,
                             fits)


@triton.jit
def _forward_kernel(FLAG, Q, K, V, M, O, LSE, RNG, SLOPES, SINKS,
                    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                    smb, smh, smm, smn, sob, soh, som, sod, sab, sah,
                    ITEMS, H, Lq, Lk, E, Ev, GROUPS, scale, window_lo, window_hi, inv_keep, cap,
                    CU_Q, CU_K, TOTAL_Q,
                    MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr,
                    ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, VARLEN: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_DV2: tl.constexpr):
    """Each query block of each head in turn (ITEMS: B x Hq x blocks of Lq): the rows whose lse
    the first pass left NaN, in float64 (module docstring)."""
    rows, offs_d, offs_d2, offs_dv, offs_dv2 = _aranges(BLOCK_D, BLOCK_D2, BLOCK_DV, BLOCK_DV2)
    items = tl.where(tl.load(FLAG) != 0, ITEMS, 0)  # none unless flagged
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        m0, bh, b, h, q0, k0, lq, lk, lo, hi = _item(item, Lq, H, Lq, Lk, window_lo, window_hi,
                                                     CU_Q, CU_K, VARLEN)
        offs_m = m0 + rows
        lse_rows = _lse_rows(b, h, H, Lq, q0, offs_m, TOTAL_Q, VARLEN)
        redo = offs_m < lq
        saved = tl.load(LSE + lse_rows, mask=redo, other=0.0)
        redo = redo & (saved != saved)
        if tl.max(redo.to(tl.int32), 0) > 0:
            k_base = K + b * skb + (h // GROUPS) * skh + k0 * skn
            v_base = V + b * svb + (h // GROUPS) * svh + k0 * svn
            m_base = M + b * smb + h * smh
            q, q2 = _chunks(Q + b * sqb + h * sqh + q0 * sqm, offs_m, offs_d, offs_d2, sqm, sqd,
                            lq, E, False, BLOCK_D2)
            slope, shift = _alibi(SLOPES, b, h, sab, sah, lq, lk, ALIBI, VARLEN)
            key_row, threshold = _dropout_keys(RNG, b, h, bh, offs_m, DROPOUT, VARLEN)
            start, end = key_range(m0, lq, lk, lo, hi, RERUN_BLOCK, RERUN_BLOCK)
            ref, total = _sums_start(
                _row_max(q, q2, k_base, m_base, offs_m, start, end, offs_d, offs_d2, skn, skd, lq,
                         lk, E, smm, smn, scale, lo, hi, cap, slope, shift, SINKS, h, MASK_KIND,
                         SOFTCAP, ALIBI, HAS_SINKS, BLOCK_D2), SINKS, h, HAS_SINKS)
            acc = tl.zeros([RERUN_BLOCK, BLOCK_DV], tl.float64)
            acc2 = tl.zeros([RERUN_BLOCK, offs_dv2.shape[0]], tl.float64)
            for n0 in range(start, end, RERUN_BLOCK):
                offs_n = n0 + rows
                kt, kt2 = _chunks(k_base, offs_n, offs_d, offs_d2, skn, skd, lk, E, True,
                                  BLOCK_D2)
                v, v2 = _chunks(v_base, offs_n, offs_dv, offs_dv2, svn, svd, lk, Ev, False,
                                BLOCK_DV2)
                s = _scores(q, q2, kt, kt2, m_base, offs_m, offs_n, lq, lk, smm, smn, scale, lo,
                            hi, cap, slope, shift, MASK_KIND, SOFTCAP, ALIBI, BLOCK_D2)[0]
                p = tl.exp(s - ref[:, None])  # (no clamp at 0, whose fmin takes NaN to 1)
                total += tl.sum(p, 1)
                pz = _wide(_dropped(p, key_row, threshold, offs_n, inv_keep, DROPOUT))
                acc += dot(pz, v, "ieee")
                if BLOCK_DV2 > 0:
                    acc2 += dot(pz, v2, "ieee")
            inv, lse = _sums_end(ref, total)
            tl.store(LSE + lse_rows, lse, mask=redo)
            o_base = O + b * sob + h * soh + q0 * som
            _store_rows(o_base, acc * inv[:, None], offs_m, offs_dv, som, sod, redo, Ev)
            if BLOCK_DV2 > 0:
                _store_rows(o_base, acc2 * inv[:, None], offs_m, offs_dv2, som, sod, redo, Ev)


@triton.jit
def _sums_start(row_max, SINKS, h, HAS_SINKS: tl.constexpr):
    """(each row's reference for its exponentials: its float64 max, 0 where -inf (a row that
    admits nothing); the row sums' start: the sink's term exp(sink - ref))."""
    ref = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.zeros_like(ref)
    if HAS_SINKS:
        total += tl.exp(tl.load(SINKS + h).to(tl.float64) - ref)
    return ref, total


@triton.jit
def _sums_end(ref, total):
    """(1 / the row sums, 0 where none; the rows' lse in float32): +inf past float32's largest,
    saturated at its lowest past that, -inf only for a row that admitted no key."""
    has = total > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, total, 1.0), 0.0)
    lse = tl.where(has, tl.maximum(ref + tl.log(tl.where(has, total, 1.0)), -FLOAT32_MAX),
                   float("-inf"))
    return inv, lse.to(tl.float32)


@triton.jit
def _store_rows(base, x, rows, cols, sr, sc, redo, C):
    """The redo rows of x (float64) into the (rows, cols) tile at base, in its element type."""
    tl.store(base + offsets(rows, cols, sr, sc), _narrow(x, base),
             mask=redo[:, None] & (cols[None, :] < C))


def launch(out: torch.Tensor, lse: torch.Tensor, flag: torch.Tensor, inputs: tuple,
           strides: tuple, sizes: tuple, band: tuple, cu: tuple, *, mask_kind: int,
           dropout: bool, softcap: bool, alibi: bool, has_sinks: bool, varlen: bool) -> None:
    """Launches the kernel after the forward's (it does nothing unless `flag` is set), which
    rewrites the flagged rows of out and lse. inputs: q, k, v, mask, rng words, slopes, sinks
    (the kernels' dummies where absent); strides: q, k, v, mask, out (4 each), the slopes' 2;
    sizes: B (sequences under varlen), Hq, Hkv, Lq, Lk, E, Ev (the longest lengths under
    varlen); band: scale, window, inv_keep, softcap; cu: cu_seqlens_q, cu_seqlens_k, total_q.
    Nothing is launched where the device does not hold the kernel (sdpa_bwd_rerun.fits: head dims
    over 128 on 99 KiB parts); the flagged rows stay NaN there."""
    q, k, v, m, rng, slopes, sinks = inputs
    b, h, hkv, lq, lk, e, ev = sizes
    if not fits(e, ev):
        return
    scale, window_lo, window_hi, inv_keep, cap = band
    (d1, d2), (dv1, dv2) = _head_chunks(e), _head_chunks(ev)
    common.launcher(_forward_kernel)[(common.multiprocessors(),)](
        flag, q, k, v, m, out, lse, rng, slopes, sinks, *strides,
        b * h * triton.cdiv(lq, RERUN_BLOCK.value), h, lq, lk, e, ev, h // hkv, scale, window_lo,
        window_hi, inv_keep, cap, *cu, MASK_KIND=mask_kind, DROPOUT=dropout, SOFTCAP=softcap,
        ALIBI=alibi, HAS_SINKS=has_sinks, VARLEN=varlen, BLOCK_D=d1, BLOCK_D2=d2, BLOCK_DV=dv1,
        BLOCK_DV2=dv2, **_OPTIONS)
