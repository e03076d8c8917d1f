"""The KV-cache decoding's slow path (decode.kvcache_fwd) for scores past float32's range.

As in the SDPA forward (sdpa_fwd_rerun.py): decode._split_kernel takes admitted scores of +-inf
as NaN (common.admitted), flags the rows whose scores passed float32's range
(common.scores_overflowed) by a NaN partial lse, and sets FLAG, one int32 on the device;
decode.merge carries the NaN into the row's output and lse. The kernel here, launched after the
merge on a fixed grid of common.multiprocessors() programs, does nothing unless FLAG is set; set,
it computes each NaN row again in float64 over its cache (contiguous or paged; the band, softcap,
ALiBi and sink as the split kernel takes them), in two passes over RERUN_BLOCK-key tiles (the
row max, then exp(s - max) summed and times V), and writes the row's output, rounded to its
dtype, and its lse in float32, saturated as sdpa_fwd_rerun's. Speed is not the aim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common
from .common import dot, modified, second_chunk, split_tile
from .sdpa_bwd_rerun import _OPTIONS, RERUN_BLOCK, _dot2, _head_chunks, _narrow, _wide, fits
from .sdpa_fwd_rerun import _sums_end, _sums_start


@triton.jit
def _cache_tile(C, b, g, j, valid, offs, TABLE, stb, stn, page, scb, sch, scn, scd, D,
                PAGED: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Cache rows j (where valid) of kv head g, columns offs (< D), float64: an (offs, j) tile
    where TRANSPOSED, else (j, offs); a paged cache's rows through its block table."""
    j = j.to(tl.int64)  # (products with strides: a cache passes 2^31 elements early)
    if PAGED:
        block = tl.load(TABLE + b * stb + (j // page) * stn, mask=valid, other=0).to(tl.int64)
        base = block * scb + (j % page) * scn
    else:
        base = b * scb + j * scn
    if TRANSPOSED:
        x = tl.load(C + g * sch + base[None, :] + offs[:, None] * scd,
                    mask=valid[None, :] & (offs[:, None] < D), other=0.0)
    else:
        x = tl.load(C + g * sch + base[:, None] + offs[None, :] * scd,
                    mask=valid[:, None] & (offs[None, :] < D), other=0.0)
    return _wide(x)


@triton.jit
def _scores(q, q2, K, b, g, i, d, j, valid, offs_d, offs_d2, TABLE, stb, stn, page, skb, skh,
            skn, skd, Lq, E, scale, window_lo, window_hi, cap, slope, PAGED: tl.constexpr,
            SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, BLOCK_D2: tl.constexpr):
    """Scores (float64) of query rows i (diagonal key i + d) against cache keys j, as the split
    kernel forms them: scaled, modified, -inf outside the band and the cache's length."""
    kt = _cache_tile(K, b, g, j, valid, offs_d, TABLE, stb, stn, page, skb, skh, skn, skd, E,
                     PAGED, True)
    kt2 = kt
    if BLOCK_D2 > 0:
        kt2 = _cache_tile(K, b, g, j, valid, offs_d2, TABLE, stb, stn, page, skb, skh, skn, skd,
                          E, PAGED, True)
    diff = j[None, :] - (i[:, None] + d)
    s, _ = modified(_dot2(q, q2, kt, kt2, BLOCK_D2) * scale, cap, slope, diff, 0, SOFTCAP, ALIBI,
                    False)  # (float64: the exp form's 1e-16 suffices)
    ok = valid[None, :] & (i[:, None] < Lq) & (diff >= window_lo) & (diff <= window_hi)
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _rerun_kernel(FLAG, Q, K, V, LENS, TABLE, OUT, LSE, SLOPES, SINKS,
                  sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, stb, stn, sab, sah,
                  ITEMS, Hq, Lq, E, Ev, GROUP, page, scale, window_lo, window_hi, cap,
                  PAGED: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                  HAS_SINKS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
                  BLOCK_DV: tl.constexpr, BLOCK_DV2: tl.constexpr):
    """Each block of RERUN_BLOCK query rows of each head in turn (ITEMS: B x Hq x blocks of Lq):
    its rows of NaN lse, in float64 (module docstring). OUT (B, Hq, Lq, Ev) and LSE (B, Hq, Lq),
    contiguous: the merge's."""
    rows = tl.arange(0, RERUN_BLOCK)
    offs_d, offs_d2 = tl.arange(0, BLOCK_D), second_chunk(BLOCK_D, BLOCK_D2)
    offs_dv, offs_dv2 = tl.arange(0, BLOCK_DV), second_chunk(BLOCK_DV, BLOCK_DV2)
    items = tl.where(tl.load(FLAG) != 0, ITEMS, 0)  # none unless flagged
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        i0, bh = split_tile(item, Lq, RERUN_BLOCK)
        b = (bh // Hq).to(tl.int64)
        h = (bh % Hq).to(tl.int64)
        g = h // GROUP
        i = i0 + rows
        out_rows = bh.to(tl.int64) * Lq + i
        redo = i < Lq
        saved = tl.load(LSE + out_rows, mask=redo, other=0.0)
        redo = redo & (saved != saved)
        if tl.max(redo.to(tl.int32), 0) > 0:
            q_base = Q + b * sqb + h * sqh + i.to(tl.int64)[:, None] * sqm
            row_ok = (i < Lq)[:, None]
            q = _wide(tl.load(q_base + offs_d[None, :] * sqd,
                              mask=row_ok & (offs_d[None, :] < E), other=0.0))
            q2 = q
            if BLOCK_D2 > 0:
                q2 = _wide(tl.load(q_base + offs_d2[None, :] * sqd,
                                   mask=row_ok & (offs_d2[None, :] < E), other=0.0))
            n = tl.load(LENS + b).to(tl.int64)  # (n + the band's reach may pass int32)
            d = n - Lq  # bottom-right: query i's diagonal is key i + d
            lo = tl.maximum(d + i0 + window_lo, 0) // RERUN_BLOCK * RERUN_BLOCK
            hi = tl.minimum(n, d + i0 + RERUN_BLOCK + window_hi)
            slope = 0.0
            if ALIBI:
                slope = tl.load(SLOPES + b * sab + h * sah)
            row_max = tl.full([RERUN_BLOCK], float("-inf"), tl.float64)
            for n0 in range(lo, hi, RERUN_BLOCK):
                j = n0 + rows
                s = _scores(q, q2, K, b, g, i, d, j, j < hi, offs_d, offs_d2, TABLE, stb, stn,
                            page, skb, skh, skn, skd, Lq, E, scale, window_lo, window_hi, cap,
                            slope, PAGED, SOFTCAP, ALIBI, BLOCK_D2)
                row_max = tl.maximum(row_max, tl.max(s, 1))
            if HAS_SINKS:
                row_max = tl.maximum(row_max, tl.load(SINKS + h).to(tl.float64))
            ref, total = _sums_start(row_max, SINKS, h, HAS_SINKS)
            acc = tl.zeros([RERUN_BLOCK, BLOCK_DV], tl.float64)
            acc2 = tl.zeros([RERUN_BLOCK, offs_dv2.shape[0]], tl.float64)
            for n0 in range(lo, hi, RERUN_BLOCK):
                j = n0 + rows
                s = _scores(q, q2, K, b, g, i, d, j, j < hi, offs_d, offs_d2, TABLE, stb, stn,
                            page, skb, skh, skn, skd, Lq, E, scale, window_lo, window_hi, cap,
                            slope, PAGED, SOFTCAP, ALIBI, BLOCK_D2)
                p = tl.exp(s - ref[:, None])
                total += tl.sum(p, 1)
                p = _wide(p)
                acc += dot(p, _cache_tile(V, b, g, j, j < hi, offs_dv, TABLE, stb, stn, page, svb,
                                          svh, svn, svd, Ev, PAGED, False), "ieee")
                if BLOCK_DV2 > 0:
                    acc2 += dot(p, _cache_tile(V, b, g, j, j < hi, offs_dv2, TABLE, stb, stn, page,
                                               svb, svh, svn, svd, Ev, PAGED, False), "ieee")
            inv, lse = _sums_end(ref, total)
            tl.store(LSE + out_rows, lse, mask=redo)
            o_base = OUT + out_rows[:, None] * Ev
            tl.store(o_base + offs_dv[None, :], _narrow(acc * inv[:, None], OUT),
                     mask=redo[:, None] & (offs_dv[None, :] < Ev))
            if BLOCK_DV2 > 0:
                tl.store(o_base + offs_dv2[None, :], _narrow(acc2 * inv[:, None], OUT),
                         mask=redo[:, None] & (offs_dv2[None, :] < Ev))


def launch(out: torch.Tensor, lse: torch.Tensor, flag: torch.Tensor, q: torch.Tensor,
           k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor, table, page: int,
           slopes: torch.Tensor, sinks, scale: float, window_lo: int, window_hi: int, cap: float,
           *, paged: bool, softcap: bool, alibi: bool) -> None:
    """Launches the kernel after the merge (it does nothing unless `flag` is set), which rewrites
    the NaN rows of out and lse (the merge's, contiguous). table: the block table, or any int32
    tensor where not paged; slopes and sinks: dummies where absent. Nothing is launched where
    the device does not hold the kernel (sdpa_bwd_rerun.fits); the rows stay NaN there."""
    b, hq, lq, e = q.shape
    hkv, ev = k_cache.shape[1], v_cache.shape[-1]
    if not fits(e, ev):
        return
    (d1, d2), (dv1, dv2) = _head_chunks(e), _head_chunks(ev)
    common.launcher(_rerun_kernel)[(common.multiprocessors(),)](
        flag, q, k_cache, v_cache, seqlens, table, out, lse, slopes,
        q if sinks is None else sinks, *q.stride(), *k_cache.stride(), *v_cache.stride(),
        *(table.stride() if paged else (0, 0)), *(slopes.stride() if alibi else (0, 0)),
        b * hq * triton.cdiv(lq, RERUN_BLOCK.value), hq, lq, e, ev, hq // hkv, page, scale,
        window_lo, window_hi, cap, PAGED=paged, SOFTCAP=softcap, ALIBI=alibi,
        HAS_SINKS=sinks is not None, BLOCK_D=d1, BLOCK_D2=d2, BLOCK_DV=dv1, BLOCK_DV2=dv2,
        **_OPTIONS)
