"""The additive backward's slow path (additive.additive_bwd) for values near the dtype's largest.

As in the SDPA backward (sdpa_bwd_rerun, whose reasons hold here): bf16 and fp32 values near
their largest overflow the float32 dP = dO . value_j and delta = rowsum(dO * O) to inf, and
dS = P (z dP - delta) comes out inf - inf or 0 * inf: NaN in dq, dk, dv (the (H, A) weight
vector's gradient) and the float mask's, where the true gradients mostly fit. The dK and dQ
kernels check their scratch after their loops (a non-finite dS always reaches it) and set FLAG,
one int32 on the device; the two kernels here, launched after them on a fixed grid of
common.multiprocessors() programs, do nothing unless it is set. Set, they recompute in float64
(csrc/cuda/additive_bwd_rerun.cu's math): the scores as the additive kernels form them
(sum_a w_a tanh(q_ia + k_ja), band, masks, the dropout hash), each row's probabilities divided
by their float64 sum r_i (what the first pass does on huge-lse rows only, common.HUGE_LSE),
dPd = dO . value_j (+ the weights' gradient), D_i = sum_j (P_ij / r_i) z dO . value_j - grad_lse_i
(grad_lse holds -rowsum(W * dW), _ops.weights_grads) and dS = (P / r) (z dPd - D):

    dq[i, a] = w_a sum_j dS_ij (1 - t_ija^2),   dk[j, a] = w_a sum_i dS_ij (1 - t_ija^2),
    dw[a] = sum_ij dS_ij t_ija,                 dmask[i, j] = dS_ij.

Plain float64 elementwise products and sums (no tl.dot: sdpa_bwd_rerun's `_wide`), in tiles of
RERUN_BLOCK rows x RERUN_BLOCK keys x a chunk of A (or of Ev); speed is not the aim. A block's
dq or dk rows are summed in a (RERUN_BLOCK, A) float64 scratch its program owns, then written
over the first results (as the mask's gradient is); dw sums by float64 atomics in a zeroed
(H, A) buffer, which the host puts in place where FLAG is set (torch.where over (H, A), no
synchronisation). Unflagged, a backward pays two launches, small scratch and that (H, A) pass,
nothing the size of the call. dvalue = P^T dO does not involve the values, but a dO near the largest overflows its
float32 sums (the dK kernel flags a non-finite dvalue too): the key pass writes it again. fp16
values keep dP inside float32, but an output past 65504 (values ~1e4 under dropout 0.99) is saved
as inf, and delta = rowsum(dO * O) from it is inf: every dtype takes the check, and the rerun's
D, summed from P and dP, never reads O.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common
from .additive import _chunk
from .common import admit, key_range, offsets, query_range, split_tile
from .rng import keep, row_keys
from .sdpa_bwd_rerun import _dropped, _narrow


RERUN_BLOCK = tl.constexpr(16)
_OPTIONS = dict(num_warps=4, num_stages=1, maxnreg=common.MAX_REGISTERS)


def _chunk_sizes(a: int, ev: int) -> dict:
    """Chunks of A and Ev in the (RERUN_BLOCK, RERUN_BLOCK, chunk) float64 tiles: 8 on a GPU
    (2048 doubles over 128 threads: 32 registers a tile), 32 in the interpreter (fewer steps)."""
    top = 32 if common.interpreting() else 8
    return dict(BLOCK_A=min(top, triton.next_power_of_2(a)),
                BLOCK_E=min(top, triton.next_power_of_2(ev)))


@triton.jit
def _probs64(q_base, k_base, w_base, m_base, lse, offs_m, offs_n, Lq, Lk, A, sqm, sqa, skn, ska,
             swa, smm, smn, window_lo, window_hi, MASK_KIND: tl.constexpr,
             BLOCK_A: tl.constexpr):
    """exp(min(s - lse, 0)) of a tile in float64 (lse +inf on empty and padded rows: 0 there)."""
    s = tl.zeros([RERUN_BLOCK, RERUN_BLOCK], tl.float64)
    for a0 in range(0, A, BLOCK_A):
        t, wa = _chunk(q_base, k_base, w_base, offs_m, offs_n, a0 + tl.arange(0, BLOCK_A),
                       Lq, Lk, A, sqm, sqa, skn, ska, swa, tl.float64)
        s += tl.sum(t * wa[None, None, :], 2)
    s = admit(s, m_base, offs_m, offs_n, Lq, Lk, smm, smn, window_lo, window_hi, MASK_KIND)
    return tl.exp(tl.minimum(s - lse[:, None], 0.0))


@triton.jit
def _dvalues(do_base, val_base, offs_m, offs_n, Lq, Lk, Ev, sdm, sdd, svn, svd,
             BLOCK_E: tl.constexpr):
    """dO_i . value_j of a tile, float64 (where 3.4e38^2 * Ev cannot overflow)."""
    dp = tl.zeros([RERUN_BLOCK, RERUN_BLOCK], tl.float64)
    for e0 in range(0, Ev, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)
        do = tl.load(do_base + offsets(offs_m, offs_e, sdm, sdd),
                     mask=(offs_m[:, None] < Lq) & (offs_e[None, :] < Ev), other=0.0)
        va = tl.load(val_base + offsets(offs_n, offs_e, svn, svd),
                     mask=(offs_n[:, None] < Lk) & (offs_e[None, :] < Ev), other=0.0)
        dp += tl.sum(do.to(tl.float64)[:, None, :] * va.to(tl.float64)[None, :, :], 2)
    return dp


@triton.jit
def _dscores(q_base, k_base, w_base, m_base, do_base, val_base, DWEIGHTS, bh, lse, rinv, dlt,
             key_row, threshold, offs_m, offs_n, Lq, Lk, A, Ev, sqm, sqa, skn, ska, swa, smm,
             smn, sdm, sdd, svn, svd, window_lo, window_hi, inv_keep,
             MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, HAS_DWEIGHTS: tl.constexpr,
             BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr):
    """(dS = P (z dPd / r - D / r), z P / r: what dvalue takes) of a tile, float64, from the
    rows' rinv = 1 / r and dlt = D / r (_rows_kernel); dPd = dO . value_j + the weights'
    gradient (raw, float32)."""
    p = _probs64(q_base, k_base, w_base, m_base, lse, offs_m, offs_n, Lq, Lk, A, sqm, sqa, skn,
                 ska, swa, smm, smn, window_lo, window_hi, MASK_KIND, BLOCK_A)
    dpd = _dvalues(do_base, val_base, offs_m, offs_n, Lq, Lk, Ev, sdm, sdd, svn, svd, BLOCK_E)
    if HAS_DWEIGHTS:
        dpd += tl.load(DWEIGHTS + (bh * Lq + offs_m[:, None]) * Lk + offs_n[None, :],
                       mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk),
                       other=0.0).to(tl.float64)
    zdp = _dropped(dpd, key_row, threshold, offs_n, inv_keep, DROPOUT)
    return (p * (zdp * rinv[:, None] - dlt[:, None]),
            _dropped(p * rinv[:, None], key_row, threshold, offs_n, inv_keep, DROPOUT))


@triton.jit
def _zero_rows(base, offs, L, A, BLOCK_A: tl.constexpr):
    """Zeros into rows offs (< L) of the (rows, A) float64 scratch at base."""
    for a0 in range(0, A, BLOCK_A):
        offs_a = a0 + tl.arange(0, BLOCK_A)
        tl.store(base + offs.to(tl.int64)[:, None] * A + offs_a[None, :],
                 tl.zeros([RERUN_BLOCK, BLOCK_A], tl.float64),
                 mask=(offs[:, None] < L) & (offs_a[None, :] < A))


@triton.jit
def _write_rows(out_base, scratch, offs, L, A, BLOCK_A: tl.constexpr):
    """The program's (RERUN_BLOCK, A) float64 scratch into rows offs (< L) of the contiguous
    (rows, A) gradient at out_base, in its element type."""
    tl.debug_barrier()  # the scratch as the last pass stored it
    rows = tl.arange(0, RERUN_BLOCK)
    for a0 in range(0, A, BLOCK_A):
        offs_a = a0 + tl.arange(0, BLOCK_A)
        x = tl.load(scratch + rows.to(tl.int64)[:, None] * A + offs_a[None, :],
                    mask=offs_a[None, :] < A)
        tl.store(out_base + offs.to(tl.int64)[:, None] * A + offs_a[None, :], _narrow(x, out_base),
                 mask=(offs[:, None] < L) & (offs_a[None, :] < A))
    tl.debug_barrier()  # read before the next item zeroes it


@triton.jit
def _item(item, L, H, Q, K, VAL, W, M, DO, sqb, sqh, skb, skh, svb, svh, swh, smb, smh, sdb, sdh):
    """A work item's first row (of L: the queries or the keys), b * H + h, h and the bases of
    its head in q, k, value, v, mask and dO."""
    first, bh = split_tile(item, L, RERUN_BLOCK)
    bh = bh.to(tl.int64)
    b = bh // H
    h = bh % H
    return (first, bh, h, Q + b * sqb + h * sqh, K + b * skb + h * skh, VAL + b * svb + h * svh,
            W + h * swh, M + b * smb + h * smh, DO + b * sdb + h * sdh)


@triton.jit
def _rows_kernel(FLAG, Q, K, VAL, W, M, DO, DWEIGHTS, GLSE, LSE, RNG, ROWS, SCRATCH, DW, DQ, DM,
                 sqb, sqh, sqm, sqa, skb, skh, skn, ska, svb, svh, svn, svd, swh, swa,
                 smb, smh, smm, smn, sdb, sdh, sdm, sdd,
                 ITEMS, H, Lq, Lk, A, Ev, window_lo, window_hi, inv_keep,
                 MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, MASK_GRAD: tl.constexpr,
                 HAS_DWEIGHTS: tl.constexpr, HAS_GLSE: tl.constexpr,
                 BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr):
    """Each query block of each head in turn (ITEMS: B x H x blocks of Lq). A first pass over
    its keys sums r_i = sum_j P_ij and sum_j P_ij z dO . value_j, for D_i, stored as 1 / r_i and
    D_i / r_i (ROWS, (B, H, Lq, 2)); a second sums dq in the program's (RERUN_BLOCK, A) float64
    SCRATCH, then written over DQ (the backward's (B, H, Lq, A) result), and adds dw into DW
    ((H, A) float64, zeroed; atomics), and, with MASK_GRAD, writes the float mask's gradient (DM,
    (B, H, Lq, Lk)) over every key: past the band its zeros replace the first pass's."""
    rows = tl.arange(0, RERUN_BLOCK)
    scratch = SCRATCH + tl.program_id(0).to(tl.int64) * RERUN_BLOCK * A
    items = tl.where(tl.load(FLAG) != 0, ITEMS, 0)  # none unless flagged
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        m0, bh, h, q_base, k_base, val_base, w_base, m_base, do_base = _item(
            item, Lq, H, Q, K, VAL, W, M, DO, sqb, sqh, skb, skh, svb, svh, swh, smb, smh, sdb,
            sdh)
        offs_m = m0 + rows
        row_ok = offs_m < Lq
        lse = tl.load(LSE + bh * Lq + offs_m, mask=row_ok, other=float("inf")).to(tl.float64)
        lse = tl.where(lse == float("-inf"), float("inf"), lse)  # empty rows: P = 0
        key_row, threshold = None, None
        if DROPOUT:
            key_row, threshold = row_keys(RNG, bh, offs_m)
        start, end = key_range(m0, Lq, Lk, window_lo, window_hi, RERUN_BLOCK, RERUN_BLOCK)
        r = tl.zeros([RERUN_BLOCK], tl.float64)
        pdp = tl.zeros([RERUN_BLOCK], tl.float64)
        for n0 in range(start, end, RERUN_BLOCK):
            offs_n = n0 + rows
            p = _probs64(q_base, k_base, w_base, m_base, lse, offs_m, offs_n, Lq, Lk, A, sqm,
                         sqa, skn, ska, swa, smm, smn, window_lo, window_hi, MASK_KIND, BLOCK_A)
            zdp = _dropped(_dvalues(do_base, val_base, offs_m, offs_n, Lq, Lk, Ev, sdm, sdd, svn,
                                    svd, BLOCK_E), key_row, threshold, offs_n, inv_keep, DROPOUT)
            r += tl.sum(p, 1)
            pdp += tl.sum(p * zdp, 1)
        r = tl.where(r > 0.0, r, 1.0)  # (rows that admit nothing: P = 0)
        d = pdp / r
        if HAS_GLSE:
            d -= tl.load(GLSE + bh * Lq + offs_m, mask=row_ok, other=0.0).to(tl.float64)
        rinv = 1.0 / r
        dlt = d / r
        tl.store(ROWS + 2 * (bh * Lq + offs_m), rinv, mask=row_ok)
        tl.store(ROWS + 2 * (bh * Lq + offs_m) + 1, dlt, mask=row_ok)
        _zero_rows(scratch, rows, RERUN_BLOCK, A, BLOCK_A)
        tl.debug_barrier()  # the loop below reads what this stored
        if MASK_GRAD:
            start, end = 0, Lk
        for n0 in range(start, end, RERUN_BLOCK):
            offs_n = n0 + rows
            ds, pz = _dscores(q_base, k_base, w_base, m_base, do_base, val_base, DWEIGHTS, bh,
                              lse, rinv, dlt, key_row, threshold, offs_m, offs_n, Lq, Lk, A, Ev,
                              sqm, sqa, skn, ska, swa, smm, smn, sdm, sdd, svn, svd, window_lo,
                              window_hi, inv_keep, MASK_KIND, DROPOUT, HAS_DWEIGHTS, BLOCK_A,
                              BLOCK_E)
            if MASK_GRAD:
                tl.store(DM + (bh * Lq + offs_m[:, None]) * Lk + offs_n[None, :],
                         _narrow(ds, DM), mask=row_ok[:, None] & (offs_n[None, :] < Lk))
            for a0 in range(0, A, BLOCK_A):
                offs_a = a0 + tl.arange(0, BLOCK_A)
                t, wa = _chunk(q_base, k_base, w_base, offs_m, offs_n, offs_a, Lq, Lk, A,
                               sqm, sqa, skn, ska, swa, tl.float64)
                g = ds[:, :, None] * t
                ptrs = scratch + rows.to(tl.int64)[:, None] * A + offs_a[None, :]
                a_ok = offs_a < A
                dq = tl.load(ptrs, mask=a_ok[None, :], other=0.0)
                tl.store(ptrs, dq + tl.sum(ds[:, :, None] - g * t, 1) * wa[None, :],
                         mask=a_ok[None, :])
                tl.atomic_add(DW + h * A + offs_a, tl.sum(tl.sum(g, 0), 0), mask=a_ok)
                tl.debug_barrier()  # the next pass reads what this one stored
        _write_rows(DQ + bh * Lq * A, scratch, offs_m, Lq, A, BLOCK_A)


@triton.jit
def _keys_kernel(FLAG, Q, K, VAL, W, M, DO, DWEIGHTS, LSE, RNG, ROWS, SCRATCH, SCRATCH_V, DK,
                 DVALUE,
                 sqb, sqh, sqm, sqa, skb, skh, skn, ska, svb, svh, svn, svd, swh, swa,
                 smb, smh, smm, smn, sdb, sdh, sdm, sdd,
                 ITEMS, H, Lq, Lk, A, Ev, window_lo, window_hi, inv_keep,
                 MASK_KIND: tl.constexpr, DROPOUT: tl.constexpr, HAS_DWEIGHTS: tl.constexpr,
                 BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr):
    """Each key block of each head in turn (ITEMS: B x H x blocks of Lk): dk and dvalue =
    sum_i (P_ij / r_i) z_ij dO_i over the query rows of the band, from _rows_kernel's ROWS,
    summed in the program's SCRATCH (RERUN_BLOCK, A) and SCRATCH_V (RERUN_BLOCK, Ev) and
    written over DK and DVALUE (the backward's (B, H, Lk, A) and (B, H, Lk, Ev) results)."""
    rows = tl.arange(0, RERUN_BLOCK)
    scratch = SCRATCH + tl.program_id(0).to(tl.int64) * RERUN_BLOCK * A
    scratch_v = SCRATCH_V + tl.program_id(0).to(tl.int64) * RERUN_BLOCK * Ev
    items = tl.where(tl.load(FLAG) != 0, ITEMS, 0)  # none unless flagged
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        n0, bh, h, q_base, k_base, val_base, w_base, m_base, do_base = _item(
            item, Lk, H, Q, K, VAL, W, M, DO, sqb, sqh, skb, skh, svb, svh, swh, smb, smh, sdb,
            sdh)
        offs_n = n0 + rows
        _zero_rows(scratch, rows, RERUN_BLOCK, A, BLOCK_A)
        _zero_rows(scratch_v, rows, RERUN_BLOCK, Ev, BLOCK_E)
        tl.debug_barrier()  # the loop below reads what these stored
        start, end = query_range(n0, Lq, Lk, window_lo, window_hi, RERUN_BLOCK, RERUN_BLOCK)
        for m0 in range(start, end, RERUN_BLOCK):
            offs_m = m0 + rows
            row_ok = offs_m < Lq
            lse = tl.load(LSE + bh * Lq + offs_m, mask=row_ok, other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse).to(tl.float64)
            rinv = tl.load(ROWS + 2 * (bh * Lq + offs_m), mask=row_ok, other=1.0)
            dlt = tl.load(ROWS + 2 * (bh * Lq + offs_m) + 1, mask=row_ok, other=0.0)
            key_row, threshold = None, None
            if DROPOUT:
                key_row, threshold = row_keys(RNG, bh, offs_m)
            ds, pz = _dscores(q_base, k_base, w_base, m_base, do_base, val_base, DWEIGHTS, bh,
                              lse, rinv, dlt, key_row, threshold, offs_m, offs_n, Lq, Lk, A, Ev,
                              sqm, sqa, skn, ska, swa, smm, smn, sdm, sdd, svn, svd, window_lo,
                              window_hi, inv_keep, MASK_KIND, DROPOUT, HAS_DWEIGHTS, BLOCK_A,
                              BLOCK_E)
            for e0 in range(0, Ev, BLOCK_E):
                offs_e = e0 + tl.arange(0, BLOCK_E)
                do = tl.load(do_base + offsets(offs_m, offs_e, sdm, sdd),
                             mask=row_ok[:, None] & (offs_e[None, :] < Ev), other=0.0)
                ptrs = scratch_v + rows.to(tl.int64)[:, None] * Ev + offs_e[None, :]
                e_ok = offs_e[None, :] < Ev
                dvalue = tl.load(ptrs, mask=e_ok, other=0.0)
                tl.store(ptrs, dvalue + tl.sum(pz[:, :, None] * do.to(tl.float64)[:, None, :], 0),
                         mask=e_ok)
                tl.debug_barrier()  # the next pass reads what this one stored
            for a0 in range(0, A, BLOCK_A):
                offs_a = a0 + tl.arange(0, BLOCK_A)
                t, wa = _chunk(q_base, k_base, w_base, offs_m, offs_n, offs_a, Lq, Lk, A,
                               sqm, sqa, skn, ska, swa, tl.float64)
                ptrs = scratch + rows.to(tl.int64)[:, None] * A + offs_a[None, :]
                a_ok = offs_a[None, :] < A
                dk = tl.load(ptrs, mask=a_ok, other=0.0)
                tl.store(ptrs, dk + tl.sum(ds[:, :, None] * (1.0 - t * t), 0) * wa[None, :],
                         mask=a_ok)
                tl.debug_barrier()  # the next pass reads what this one stored
        _write_rows(DK + bh * Lk * A, scratch, offs_n, Lk, A, BLOCK_A)
        _write_rows(DVALUE + bh * Lk * Ev, scratch_v, offs_n, Lk, Ev, BLOCK_E)


def launch(flag: torch.Tensor, inputs: tuple, strides: tuple, sizes: tuple, band: tuple,
           outputs: tuple, *, mask_kind: int, dropout: bool, mask_grad: bool) -> torch.Tensor:
    """Launches the two kernels after the backward's others (they do nothing unless `flag` is
    set). inputs: q, k, value, v (the (H, A) weights), mask, dO (the caller's, not divided by r),
    the weights' gradient (float32 contiguous, not divided by r; None for none), grad_lse (None
    for none), lse, rng words (the kernels' dummies where absent); strides: q, k, value, v,
    mask, dO (4, 4, 4, 2, 4, 4); sizes: B, H, Lq, Lk, A, Ev; band: window_lo, window_hi,
    inv_keep; outputs: the first pass's dq, dk, dvalue (contiguous, in q's dtype) and the
    mask's gradient, overwritten where flagged. Returns v's gradient (H, A) in float64, meaningful
    only where flag is set (the host's torch.where puts it in place: an (H, A) pass)."""
    q, k, value, w, m, do, dweights, glse, lse, rng = inputs
    dq, dk, dvalue, dmask = outputs
    b, h, lq, lk, a, ev = sizes
    window_lo, window_hi, inv_keep = band
    blocks = lambda n: triton.cdiv(n, RERUN_BLOCK.value)  # noqa: E731
    programs = common.multiprocessors()
    rows = lse.new_empty((b, h, lq, 2), dtype=torch.float64)  # 1 / r_i, D_i / r_i
    scratch = q.new_empty((programs, RERUN_BLOCK.value, a), dtype=torch.float64)
    scratch_v = q.new_empty((programs, RERUN_BLOCK.value, ev), dtype=torch.float64)
    dw = q.new_zeros((h, a), dtype=torch.float64)
    consts = dict(MASK_KIND=mask_kind, DROPOUT=dropout, HAS_DWEIGHTS=dweights is not None,
                  **_chunk_sizes(a, ev), **_OPTIONS)
    dweights = q if dweights is None else dweights
    common.launcher(_rows_kernel)[(programs,)](
        flag, q, k, value, w, m, do, dweights, q if glse is None else glse, lse, rng, rows,
        scratch, dw, dq, dmask, *strides, b * h * blocks(lq), h, lq, lk, a, ev, window_lo,
        window_hi, inv_keep, MASK_GRAD=mask_grad, HAS_GLSE=glse is not None, **consts)
    common.launcher(_keys_kernel)[(programs,)](
        flag, q, k, value, w, m, do, dweights, lse, rng, rows, scratch, scratch_v, dk, dvalue,
        *strides,
        b * h * blocks(lk), h, lq, lk, a, ev, window_lo, window_hi, inv_keep, **consts)
    return dw
