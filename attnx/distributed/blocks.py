"""One step of the ring on one rank: which (query, key) blocks the band admits, and running
the backend's kernels on them with the band shifted to the blocks' global offsets.

The band over the full sequence admits key j for query i iff lo <= j - i <= hi (the form of
attnx._validate.SdpaCall). A query segment at global offset q0 against a key segment at k0 sees
the same band shifted by k0 - q0, which is what the dispatcher's ops take as window_lo/hi.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .._backends import reference

EMPTY, PARTIAL, FULL = 0, 1, 2


class Block(NamedTuple):
    q0: int  # local query rows q0:q1
    q1: int
    k0: int  # local key rows k0:k1 of the shard in hand
    k1: int
    lo: int  # the band, shifted to the block
    hi: int


def _pair(qseg, kseg, lo: int, hi: int) -> tuple:
    """(status, lo, hi) of query segment `qseg` against key segment `kseg`."""
    m, n = qseg.length, kseg.length
    shift = kseg.start - qseg.start
    blo, bhi = lo - shift, hi - shift
    if bhi < -(m - 1) or blo > n - 1:
        return EMPTY, blo, bhi
    blo, bhi = max(blo, -m), min(bhi, n)
    return (FULL if blo <= -(m - 1) and bhi >= n - 1 else PARTIAL), blo, bhi


def plan(qsegs: tuple, ksegs: tuple, lo: int, hi: int) -> list:
    """The kernel calls that attend the queries of `qsegs` to the keys of `ksegs`: as few as
    possible (a query segment whose every key segment is wholly admitted takes them in one
    call), none for the pairs the band excludes."""
    n_keys = sum(s.length for s in ksegs)
    pairs = [[_pair(qs, ks, lo, hi) for ks in ksegs] for qs in qsegs]
    n_q = sum(s.length for s in qsegs)
    if all(p[0] == FULL for row in pairs for p in row):
        return [Block(0, n_q, 0, n_keys, -n_q, n_keys)]
    blocks = []
    for qs, row in zip(qsegs, pairs):
        q0, q1 = qs.local, qs.local + qs.length
        if all(p[0] == FULL for p in row):
            blocks.append(Block(q0, q1, 0, n_keys, -qs.length, n_keys))
            continue
        for ks, (status, blo, bhi) in zip(ksegs, row):
            if status != EMPTY:
                blocks.append(Block(q0, q1, ks.local, ks.local + ks.length, blo, bhi))
    return blocks


class Kernels(NamedTuple):
    """A backend's forward (q, k, v, scale, lo, hi) -> (out, lse) and backward
    (dout, q, k, v, out, lse, block_lse, scale, lo, hi, grad_lse) -> (dq, dk, dv) on one block;
    the backward takes the GLOBAL out and lse of the rows, so that its probabilities
    exp(s - lse) and D = rowsum(dout * out) are those of the whole row, and the block's own lse
    (its forward's) for the rows the kernel renormalizes (_with_block_lse). `wide_out`: the
    backward takes out in the ring's accumulation dtype (float32 for half precision: D from
    it, not from its rounding), else in q's."""
    fwd: object
    bwd: object
    wide_out: bool = False


# Rows whose |lse| passes this may have lost log(l) to rounding: the backward kernels then
# renormalize such a row by its own sum of exp(s - lse) (csrc/cpu/huge_lse.h,
# attnx/triton/common.py HUGE_LSE), right for a whole row, wrong for the part of it one block
# holds.
HUGE_LSE = 256.0


def _with_block_lse(bwd, renormalizes_all, up=lambda t: t) -> object:
    """A block backward (dout, q, k, v, out, lse, scale, lo, hi, grad_lse) that renormalizes some
    rows by their own sum of exp(s - lse) (every float32 row: `renormalizes_all(q)`; rows of
    huge |lse|: every kernel), made right for a block of a row: such rows go in with the block's
    own lse lb and dout, grad_lse scaled by w = exp(lb - lse). The kernel's probabilities
    exp(s - lb) are then those of the block (their renormalization changes nothing) and w times
    the row's; dV, dS and D are linear in (dout, grad_lse), so the gradients are exact. `up`:
    how the kernel widens its operands (the CPU kernels take bfloat16 as float32), so that
    w dout is rounded once, to what the kernel computes in."""
    def run(dout, q, k, v, out, lse, block_lse, scale, lo, hi, grad_lse):
        finite = torch.isfinite(lse)
        if not (renormalizes_all(q) or ((lse.abs() > HUGE_LSE) & finite).any()):
            return bwd(dout, q, k, v, out, lse, scale, lo, hi, grad_lse)
        lb = block_lse.to(lse.dtype)
        finite = finite & torch.isfinite(lb)
        w = torch.where(finite, torch.exp(lb - torch.where(finite, lse, lb)), torch.zeros_like(lse))
        wide = up(dout)
        scaled = (wide.to(w.dtype) * w.unsqueeze(-1)).to(wide.dtype)
        return bwd(scaled, q, k, v, out, lb, scale, lo, hi,
                   None if grad_lse is None else grad_lse.to(w.dtype) * w)
    return run


def _native(softcap: Optional[float], up, renormalizes_all, wide_out: bool) -> Kernels:
    """The dispatcher's ops: attnx::sdpa_fwd/bwd, or with soft-capping attnx::sdpa_mod_fwd/bwd
    (the plain ops keep kernels compiled without the modifiers' code)."""
    ops = torch.ops.attnx
    if softcap is None:
        def fwd(q, k, v, scale, lo, hi):
            return ops.sdpa_fwd(up(q), up(k), up(v), None, scale, lo, hi, 0.0, None)

        def bwd(dout, q, k, v, out, lse, scale, lo, hi, grad_lse):
            return ops.sdpa_bwd(up(dout), up(q), up(k), up(v), None, up(out), lse, scale, lo, hi,
                                0.0, None, False, grad_lse)[:3]
        return Kernels(fwd, _with_block_lse(bwd, renormalizes_all, up), wide_out)

    def fwd(q, k, v, scale, lo, hi):
        return ops.sdpa_mod_fwd(up(q), up(k), up(v), None, scale, lo, hi, 0.0, None, softcap,
                                None, None)

    def bwd(dout, q, k, v, out, lse, scale, lo, hi, grad_lse):
        return ops.sdpa_mod_bwd(up(dout), up(q), up(k), up(v), None, up(out), lse, scale, lo,
                                hi, 0.0, None, False, grad_lse, softcap, None, None, False)[:3]
    return Kernels(fwd, _with_block_lse(bwd, renormalizes_all, up), wide_out)


def _cpu_renormalizes_all(q) -> bool:
    """Whether the CPU backward may renormalize every row of q's blocks by their own scores:
    float32 (and 16-bit, computed in it). The BLAS engine does so for every row (its scores
    are not the forward's bit for bit: csrc/cpu/sdpa_cpu.cpp renorm_all), either engine for
    blocks of few query rows (one, or up to 32 against many keys: sdpa_cpu.cpp decoding_rows,
    whose forward ran on the decoding kernel). Told so always, as a kernel that keeps the given
    lse gets the same gradients from the block's own lse (_with_block_lse)."""
    return q.dtype != torch.float64


def _never(q) -> bool:
    return False


def _triton(softcap: Optional[float]) -> Kernels:
    """attnx/triton's ops, whose modifiers are trailing keywords of the plain ones (given only
    when set: the backend is chosen for softcap only where its kernels take it). Gradients:
    the first three outputs, whatever else the backward returns (dmask, dsinks)."""
    from ..triton import sdpa as tk  # imports Triton only when asked for
    mods = {} if softcap is None else {"softcap": softcap}

    def fwd(q, k, v, scale, lo, hi):
        return tk.sdpa_fwd(q, k, v, None, scale, lo, hi, 0.0, None, **mods)

    def bwd(dout, q, k, v, out, lse, scale, lo, hi, grad_lse):
        return tk.sdpa_bwd(dout, q, k, v, None, out, lse, scale, lo, hi, 0.0, None, False,
                           grad_lse, **mods)[:3]
    return Kernels(fwd, _with_block_lse(bwd, _never))


def _upcast(t):
    """16-bit operands go in as float32, which the CPU kernels compute in anyway, so that
    each block's output and gradients come back unrounded: a ring sums W of them, and rounding
    each to bfloat16 or float16 would add W roundings where the single call makes one."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def _scores(q, k, scale, softcap):
    """Scaled (and soft-capped) scores in the compute dtype, GQA heads repeated; also the
    tanh of the capping for the backward (None without it)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k = q.to(dtype), k.to(dtype)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if softcap is None:
        return s, None
    t = torch.tanh(s / softcap)
    return softcap * t, t


def _reference(softcap: Optional[float]) -> Kernels:
    """Plain PyTorch (attnx's reference backend's masked softmax), with soft-capping."""
    def fwd(q, k, v, scale, lo, hi):
        s, _ = _scores(q, k, scale, softcap)
        p, lse = reference.masked_softmax(s, None, lo, hi)
        v = v.to(s.dtype).repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return torch.matmul(p, v), lse

    def bwd_in(dtype, dout, q, k, v, out, lse, scale, lo, hi, grad_lse):
        s, t = _scores(q.to(dtype), k.to(dtype), scale, softcap)
        groups = q.shape[1] // k.shape[1]
        allowed = reference.band(s.shape[-2], s.shape[-1], lo, hi, s.device)
        allowed = allowed & torch.isfinite(lse).unsqueeze(-1)
        safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        p = torch.exp(s - safe_lse.unsqueeze(-1).to(dtype)).masked_fill(~allowed, 0.0)
        do, qq = dout.to(dtype), q.to(dtype)
        kk, vv = (x.to(dtype).repeat_interleave(groups, dim=1) for x in (k, v))
        d = (do * out.to(dtype)).sum(-1, keepdim=True)
        if grad_lse is not None:
            d = d - grad_lse.to(dtype).unsqueeze(-1)
        ds = p * (torch.matmul(do, vv.transpose(-2, -1)) - d)
        if t is not None:
            ds = ds * (1 - t * t)
        dq = torch.matmul(ds, kk) * scale
        dk = torch.matmul(ds.transpose(-2, -1), qq) * scale
        dv = torch.matmul(p.transpose(-2, -1), do)
        b, hk = k.shape[:2]
        dk = dk.view(b, hk, groups, *dk.shape[2:]).sum(2)
        dv = dv.view(b, hk, groups, *dv.shape[2:]).sum(2)
        return dq, dk, dv

    def bwd(dout, q, k, v, out, lse, scale, lo, hi, grad_lse):
        """In float32 (float64 inputs: float64), again in float64 where that overflows on
        finite inputs (dout V^T past the range), as the reference backend itself does."""
        args = (dout, q, k, v, out, lse, scale, lo, hi, grad_lse)
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        grads = bwd_in(dtype, *args)
        if (dtype != torch.float64 and not reference.all_finite(grads)
                and reference.all_finite((dout, q, k, v, out, grad_lse))):
            grads = bwd_in(torch.float64, *args)
        return grads
    return Kernels(fwd, _with_block_lse(bwd, _never), wide_out=True)


def kernels(backend: str, softcap: Optional[float]) -> Kernels:
    """The block kernels of `backend`, the one attnx._dispatch.select chose for the call (so
    it serves `softcap`)."""
    if backend == "reference":
        return _reference(softcap)
    if backend == "triton":
        return _triton(softcap)
    # cpu and cuda: the same dispatcher ops, by the tensors' device (the CUDA kernels compute
    # half precision natively: their block results stay in it)
    if backend == "cpu":
        return _native(softcap, _upcast, _cpu_renormalizes_all, wide_out=True)
    return _native(softcap, lambda t: t, _never, wide_out=False)
