"""Decoding against a KV cache on Triton (attention_with_kvcache): split-K over the cache, as
flash-decoding does, for contiguous and paged caches.

Grid (B * Hkv * row tiles, splits). A program takes the Lq * G query rows of the G query heads
that share one kv head (row r: head g * G + r // Lq, query r % Lq), so each K/V tile of the
cache is read once for the whole group, and the keys of one split: positions
[s * S, (s + 1) * S) below the sequence's length n, S a multiple of BLOCK_N. Splits let a
batch of few sequences still fill the GPU; positions past n are never read. In a paged cache
each key position finds its block through the block table. A program keeps its output rows
normalised as it goes (acc = sum_j P_j v_j / l: a convex combination of values, which cannot
overflow where the unnormalised sum of bf16 or fp32 values near their largest over a few keys
passed fp32's range) and writes them and their lse (fp32); `merge` combines the splits by their
lse. Softcap and ALiBi
change each split's scores; a sink joins the denominator once, in the merge. Rows whose scores
pass float32's range (finite inputs near 1e19) get a NaN partial lse, which the merge carries to
the row, and decode_rerun.py computes them in float64.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import common, decode_rerun
from .._ops import same_device

MAX_ROWS = 64  # BLOCK_M cap: query rows (G * Lq) beyond it take more row tiles
PROGRAMS = 264  # what the splits aim at: two waves of an H100's 132 SMs


@triton.jit
def _split_kernel(Q, K, V, LENS, TABLE, O_PART, LSE_PART, SLOPES, FLAG,
                  sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, stb, stn, sab, sah,
                  Hkv, Lq, E, Ev, page, scale, window_lo, window_hi, split_len, splits, cap,
                  GROUP: tl.constexpr, PAGED: tl.constexpr, SOFTCAP: tl.constexpr,
                  ALIBI: tl.constexpr, DOT_PREC: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr):
    rows_total = GROUP * Lq
    tiles = tl.cdiv(rows_total, BLOCK_M)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    # every product with a stride or a length in int64: a cache passes 2^31 elements early
    bg, tile = pid // tiles, pid % tiles
    b, g = (bg // Hkv).to(tl.int64), (bg % Hkv).to(tl.int64)
    split64 = split.to(tl.int64)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < rows_total
    h = g * GROUP + rows // Lq
    i = (rows % Lq).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)

    q_rows = b * sqb + h * sqh + i * sqm
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :] * sqd,
                mask=row_ok[:, None] & (offs_d[None, :] < E), other=0.0)
    n = tl.load(LENS + b)
    d = n - Lq  # bottom-right: query i's diagonal is key i + d
    # The keys this split holds that some row's band reaches: [start, end)
    start = tl.maximum(split64 * split_len, d + window_lo)
    end = tl.minimum(tl.minimum((split64 + 1) * split_len, n), d + Lq - 1 + window_hi + 1)
    start = tl.maximum(start, 0) // BLOCK_N * BLOCK_N  # still within the split: S % BLOCK_N == 0
    slope = 0.0
    if ALIBI:  # each row's head's slope
        slope = tl.load(SLOPES + b * sab + h * sah, mask=row_ok, other=0.0)[:, None]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        j = n0 + offs_n
        valid = j < end
        if PAGED:
            block = tl.load(TABLE + b * stb + (j // page) * stn, mask=valid, other=0).to(tl.int64)
            k_base = block * skb + (j % page) * skn
            v_base = block * svb + (j % page) * svn
        else:
            k_base = b * skb + j * skn
            v_base = b * svb + j * svn
        k = tl.load(K + g * skh + k_base[None, :] + offs_d[:, None] * skd,
                    mask=valid[None, :] & (offs_d[:, None] < E), other=0.0)
        diff = j[None, :] - (i[:, None] + d)
        # +-inf scores (past float32's range) as NaN: flagged below, not taken as they are
        s, _ = common.modified(common.admitted(common.dot(q, k, DOT_PREC) * scale), cap, slope,
                               diff, 0, SOFTCAP, ALIBI, DOT_PREC == common.FP32_DOT)
        if ALIBI:
            s = common.admitted(s)
        ok = valid[None, :] & row_ok[:, None] & (diff >= window_lo) & (diff <= window_hi)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no exp(-inf - -inf)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_new = l_i * alpha + tl.sum(p, 1)
        inv = tl.where(l_new > 0.0, 1.0 / l_new, 0.0)  # (0 until the row admits a key)
        v = tl.load(V + g * svh + v_base[:, None] + offs_dv[None, :] * svd,
                    mask=valid[:, None] & (offs_dv[None, :] < Ev), other=0.0)
        acc = (acc * (alpha * l_i * inv)[:, None]
               + common.dot((p * inv[:, None]).to(v.dtype), v, DOT_PREC))
        l_i = l_new
        m_i = m_new

    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    lse = tl.where(has, m_i + tl.log(l_safe), float("-inf"))
    redo = common.scores_overflowed(m_i, l_i, row_ok)  # a NaN lse: decode_rerun redoes the row
    if tl.max(redo.to(tl.int32), 0) > 0:
        tl.store(FLAG, 1)
        lse = tl.where(redo, float("nan"), lse)
    # partials: O_PART (B, Hq, Lq, splits, Ev), LSE_PART (B, Hq, Lq, splits), contiguous
    part = ((b * Hkv * GROUP + h) * Lq + i) * splits + split64
    tl.store(O_PART + part[:, None] * Ev + offs_dv[None, :], acc,
             mask=row_ok[:, None] & (offs_dv[None, :] < Ev))
    tl.store(LSE_PART + part, lse, mask=row_ok)


def merge(o_part: torch.Tensor, lse_part: torch.Tensor, dtype: torch.dtype,
          sinks: Optional[torch.Tensor] = None):
    """The splits' outputs (B, H, Lq, splits, Ev) weighted by exp(lse_s - lse): (out, lse); rows
    that no split admitted anything for give zeros and -inf (the sink's lse with sinks (H,):
    their term joins the denominator here, once). The weights are normalised by their sum
    (w_s / total, from the largest term) before the sum of outputs, a convex combination:
    exp(lse_s - lse) summed to 1 only within lse's rounding (1% at |lse| ~ 3e5), which moved
    the output as much and took outputs near the dtype's max past it (inf)."""
    terms = lse_part
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*lse_part.shape[:-1], 1)
        terms = torch.cat([lse_part, sink], dim=-1)
    top = terms.amax(-1, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp(terms - top)  # exp(-inf) = 0 for empty splits
    total = w.sum(-1, keepdim=True)
    lse = (top + torch.log(total)).squeeze(-1)  # -inf where total is 0
    w = w[..., :lse_part.shape[-1]] / torch.where(total > 0, total, torch.ones_like(total))
    return (w.unsqueeze(-1) * o_part).sum(-2).to(dtype), lse


def key_block(dtype: torch.dtype, block_d: int, block_dv: int) -> int:
    """Keys per tile: 64, fewer where one pipeline stage's K and V tiles would pass 32 KiB of
    shared memory (fp32, whose tf32x3 products split each operand in two, and wide heads;
    tests/test_triton_compile.py holds the launches to sm_80's and sm_90's limits)."""
    per_key = torch.finfo(dtype).bits // 8 * (block_d + block_dv) * (2 if dtype == torch.float32 else 1)
    return max(16, min(64, triton.next_power_of_2(32 * 1024 // per_key + 1) // 2))


def _splits(programs: int, capacity: int, block_n: int) -> tuple[int, int]:
    """(splits, keys per split): enough programs to fill the GPU, at least a tile each. Under
    the interpreter, which runs programs one by one, two splits at most (still exercising the
    merge)."""
    if common.interpreting():
        split_len = max(block_n, triton.cdiv(capacity, 2 * block_n) * block_n)
    else:
        want = max(1, min(triton.cdiv(PROGRAMS, programs), triton.cdiv(capacity, block_n)))
        split_len = triton.cdiv(triton.cdiv(capacity, want), block_n) * block_n
    return triton.cdiv(max(capacity, 1), split_len), split_len


@common.register_op("triton_kvcache_fwd")
def kvcache_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                seqlens: torch.Tensor, block_table: Optional[torch.Tensor], scale: float,
                window_lo: int, window_hi: int, softcap: Optional[float] = None,
                alibi: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """alibi: float32 (B, Hq) slopes aligned bottom-right; sinks (Hq,)."""
    b, hq, lq, e = q.shape
    hkv, ev = k_cache.shape[1], v_cache.shape[-1]
    group = hq // hkv
    paged = block_table is not None
    page = k_cache.shape[2] if paged else 1
    capacity = block_table.shape[1] * page if paged else k_cache.shape[2]
    # every j - (i + d) lies in [-(capacity - 1), Lq - 1]: far from overflow in i + d + lo
    window_lo, window_hi = common.clamped_band(window_lo, window_hi, capacity + lq, capacity + lq)
    block_m = min(MAX_ROWS, max(16, triton.next_power_of_2(group * lq)))
    programs = b * hkv * triton.cdiv(group * lq, block_m)
    block_d, block_dv = common.head_block(e), common.head_block(ev)
    block_n = key_block(q.dtype, block_d, block_dv)
    splits, split_len = _splits(programs, capacity, block_n)
    o_part = q.new_empty((b, hq, lq, splits, ev), dtype=torch.float32)
    lse_part = q.new_empty((b, hq, lq, splits), dtype=torch.float32)
    table = block_table if paged else seqlens  # any int32 tensor: not read unless PAGED
    slopes = q if alibi is None else alibi  # not read without ALIBI
    flag = q.new_zeros((1,), dtype=torch.int32)  # set where scores passed float32's range
    common.launcher(_split_kernel)[(programs, splits)](
        q, k_cache, v_cache, seqlens, table, o_part, lse_part, slopes, flag, *q.stride(),
        *k_cache.stride(), *v_cache.stride(), *(table.stride() if paged else (0, 0)),
        *(alibi.stride() if alibi is not None else (0, 0)), hkv, lq, e, ev, page, scale,
        window_lo, window_hi, split_len, splits, 1.0 if softcap is None else softcap,
        GROUP=group, PAGED=paged, SOFTCAP=common.softcap_kind(softcap), ALIBI=alibi is not None,
        DOT_PREC=common.dot_precision(q.dtype), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, num_warps=4, num_stages=2)
    out, lse = merge(o_part, lse_part, q.dtype, sinks)
    decode_rerun.launch(out, lse, flag, q, k_cache, v_cache, seqlens, table, page, slopes, sinks,
                        scale, window_lo, window_hi, 1.0 if softcap is None else softcap,
                        paged=paged, softcap=softcap is not None, alibi=alibi is not None)
    return out, lse


@kvcache_fwd.register_fake
def _kvcache_fwd_fake(q, k_cache, v_cache, seqlens, block_table, scale, window_lo, window_hi,
                      softcap=None, alibi=None, sinks=None):
    same_device(q, k_cache, v_cache, seqlens, block_table, alibi, sinks)
    b, h, lq, _ = q.shape
    return q.new_empty((b, h, lq, v_cache.shape[-1])), q.new_empty((b, h, lq), dtype=torch.float32)
