"""attnx.distributed: ring attention across gloo processes on this machine, against the
single-process op; the schedule's bookkeeping without processes."""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnx
from attnx import _dispatch
from attnx._backends import reference
from attnx.distributed import blocks, layout, merge

import _ring_worker
from _rerun import rerun_under

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without "
                                "torch.distributed")

DEADLINE_S = 180  # a world that has not finished by then is killed and the test fails


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, checks: list, timeout_s: float = _ring_worker.PG_TIMEOUT_S) -> None:
    """Run `checks` on `world` spawned ranks (process group timeout `timeout_s`); fail (and
    kill them) past DEADLINE_S."""
    ctx = mp.spawn(_ring_worker.run, args=(world, _free_port(), checks, timeout_s),
                   nprocs=world, join=False)
    end = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=max(0.0, end - time.monotonic())):  # raises a rank's error
        if time.monotonic() >= end:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"a world of {world} ranks did not finish within {DEADLINE_S} s")


F64 = torch.float64


def _triton_interpreting() -> bool:
    from attnx.triton import common  # imports Triton, which backends() found usable
    return common.interpreting()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gloo_world(world):
    """Each rank's ring_attention out, lse and gradients == the single-process op, sliced (both
    layouts, causal, windows, GQA, odd head dims, float64); in the world of 2 also: bad input
    on one rank raising on every rank, shard/unshard, soft-capping, autocast, a Transformer
    trained under DistributedDataParallel and a context-parallel attention block
    (tests/_ring_worker.py)."""
    checks = {
        1: [("ring_matches", dict(layout="zigzag", is_causal=True)),
            ("no_second_order", dict(layout="contiguous")),
            ("ring_matches", dict(layout="contiguous", hq=3, hk=3, e=9, ev=2))],
        2: [("ring_matches", dict(layout=lay, is_causal=c))
            for lay in ("zigzag", "contiguous") for c in (False, True)] + [
            ("ring_matches", dict(layout="zigzag", window=(2, 1), hq=2, hk=1, e=3, ev=6)),
            ("ring_matches", dict(layout="contiguous", is_causal=True, dtype=F64,
                                  backend="reference", scale=0.3)),
            # scores in the hundreds: |lse| > 256, where the kernels' backward renormalizes a
            # row by its own sum (csrc/cpu/huge_lse.h), which a block of the ring is not
            ("ring_matches", dict(layout="zigzag", is_causal=True, dtype=F64, huge_lse=True)),
            # float32 scores past 3.4e38 from finite inputs: the whole ring in float64
            ("ring_matches", dict(layout="zigzag", overflow=True)),
            ("ring_matches", dict(layout="contiguous", is_causal=True, overflow=True,
                                  backend="cpu")),
            # soft-capping on the cpu kernels (forced: no fallback to the reference), GQA
            ("ring_matches", dict(layout="zigzag", is_causal=True, softcap=1.5, backend="cpu")),
            ("ring_matches", dict(layout="contiguous", is_causal=True, softcap=1.5,
                                  backend="cpu")),
            ("shard_roundtrip", dict(layout="zigzag")),
            ("nan_on_one_rank_keeps_the_float64_ring", dict(layout="contiguous")),
            ("bad_input_everywhere", {}),
            ("softcap_matches", dict(layout="zigzag")),
            ("ring_under_autocast", dict(layout="zigzag")),
            ("ring_under_torch_func", dict(layout="zigzag")),
            ("ddp_transformer_matches", {}),
            ("context_parallel_matches", {})],
        3: [("ring_matches", dict(layout="zigzag", is_causal=True, window=(5, 0))),
            ("ring_matches", dict(layout="contiguous", is_causal=True, hq=6, hk=2, e=7, ev=3)),
            ("no_second_order", dict(layout="zigzag")),
            ("ring_under_torch_func", dict(layout="contiguous")),
            ("ring_matches", dict(layout="zigzag", is_causal=True, hq=6, hk=2, softcap=0.8,
                                  backend="cpu")),
            ("ring_matches", dict(layout="contiguous", is_causal=True, softcap=0.8, e=7,
                                  backend="cpu")),
            ("ring_matches", dict(layout="zigzag", softcap=0.8, dtype=F64,
                                  backend="reference")),
            ("shard_roundtrip", dict(layout="contiguous")),
            ("nan_on_one_rank_keeps_the_float64_ring", dict(layout="zigzag")),
            ("outside_a_subgroup", {})],
        4: [("ring_matches", dict(layout="zigzag", is_causal=True, hq=4, hk=1, e=11, ev=5)),
            # a window shorter than a shard: shards stop after one hop
            ("ring_matches", dict(layout="contiguous", is_causal=True, window=(3, 0),
                                  per_rank=6)),
            ("ring_matches", dict(layout="zigzag", window=(1, 4), per_rank=6, dtype=F64)),
            ("ring_matches", dict(layout="zigzag", is_causal=True, dtype=torch.bfloat16))],
    }[world]
    _spawn(world, checks)


def test_gloo_world_cpu_kernels():
    """The ring on the cpu kernels: float32, bfloat16 and float16 (rerun on the BLAS engine by
    test_blas_engine_ring, whose backward renormalizes every row by its own sum); values or an
    output gradient whose float32 backward overflows (cpu and reference); soft-capped scores
    whose float32 products overflow (the whole ring in float64)."""
    _spawn(2, [("ring_matches", dict(layout="zigzag", is_causal=True, backend="cpu")),
               ("ring_matches", dict(layout="contiguous", backend="cpu", window=(3, 2))),
               ("ring_matches", dict(layout="zigzag", dtype=torch.bfloat16, backend="cpu")),
               ("ring_matches", dict(layout="contiguous", dtype=torch.float16, backend="cpu")),
               ("ring_matches", dict(layout="zigzag", is_causal=True, backend="cpu",
                                     huge_lse=True, dtype=F64)),
               ("ring_matches", dict(layout="zigzag", is_causal=True, huge_values=True,
                                     backend="cpu")),
               ("ring_matches", dict(layout="contiguous", huge_values=True, backend="reference")),
               ("ring_matches", dict(layout="contiguous", huge_dout=True, backend="cpu")),
               ("ring_matches", dict(layout="zigzag", overflow=True, softcap=1.5,
                                     backend="reference"))])


def test_blas_engine_ring():
    """ATTNX_CPU_PANELS=0: the BLAS engine's backward takes each row's max and sum from its
    own recomputed scores, wrong for the part of a row one block holds unless given the
    block's own lse (blocks._with_block_lse): its gradients were off by O(1) before."""
    rerun_under("ATTNX_CPU_PANELS", __file__, "split_keys_with_global_lse or cpu_kernels",
                probe="cpu_gemm", expect=("blas",))


def test_a_rank_that_dies_leaves_the_others_raising_not_hanging():
    _spawn(2, [("peer_dies_mid_ring", dict(timeout_s=10))], timeout_s=10)


def test_only_inputs_that_may_overflow_float32_take_the_float64_ring():
    """ring._may_overflow: scale * E * max|q| * max|k| or Ev * max|v| past 2^100 (the
    ring_matches `overflow` and `huge_values` cases run it); ordinary, large and float64 inputs
    stay as they are."""
    from attnx import _validate
    from attnx.distributed.ring import _extremes, _may_overflow

    def may(q_max, k_max, v_max=1.0, dtype=torch.float32, softcap=None, e=64):
        q = torch.zeros(1, 1, 2, e, dtype=dtype)
        call = _validate.sdpa_call(q, q, q, None, 0.0, False, None, True, None, None, True,
                                   softcap=softcap)
        return _may_overflow(call, q_max, k_max, v_max)

    assert not may(10.0, 10.0) and not may(1e12, 1e12) and not may(1.0, 1.0, 1e20)
    assert may(3e19, 3e19) and may(3e19, 3e19, dtype=torch.bfloat16) and may(float("inf"), 1.0)
    assert not may(3e19, 3e19, 1e38, dtype=torch.float64)
    assert may(3e19, 3e19, softcap=5.0)  # a cap bounds the scores, not inf - inf in the products
    assert may(1.0, 1.0, 1e38)  # dout V^T in the backward
    assert _extremes(torch.tensor([[1.0, -4.0]]), torch.tensor([[2.0]]),
                     torch.tensor([[-3.0]])) == (4.0, 2.0, 3.0)
    assert _extremes(torch.empty(0, 3), torch.ones(2, 3), torch.ones(2, 3)) == (0.0, 0.0, 0.0)
    assert _extremes(torch.ones(2, 3), torch.ones(2, 3), torch.empty(2, 0)) == (1.0, 1.0, 0.0)


def test_merge_matches_attention_over_the_union_and_keeps_empty_rows_zero():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 6, 4, dtype=F64)
    k, v = torch.randn(1, 2, 10, 4, dtype=F64), torch.randn(1, 2, 10, 3, dtype=F64)
    kern = blocks.kernels("reference", None)
    # causal over keys split 4 | 6: query rows 0-3 see no key of the second part (lse -inf)
    a = kern.fwd(q, k[:, :, :4], v[:, :, :4], 0.5, -6, 0)
    b = kern.fwd(q, k[:, :, 4:], v[:, :, 4:], 0.5, -10, -4)
    assert torch.isneginf(b[1][..., :4]).all()
    out, lse = merge.merge(*a, *b)
    ref_out, ref_lse = kern.fwd(q, k, v, 0.5, -6, 0)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    empty = torch.full_like(lse, float("-inf"))  # rows empty on both sides
    out, lse = merge.merge(torch.zeros_like(out), empty, torch.zeros_like(out), empty)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("dtype,top", [(torch.float32, 900.0), (torch.float64, 1e16)])
def test_merge_is_convex_whatever_the_rounding_of_the_lse(dtype, top):
    """Two parts of a row whose every value is 1 merge to 1, and equal lse to their mean,
    however large the lse: at |lse| near 1e16 (float64) or 900 (float32) the weights exp(lse_x
    - lse) against the rounded merged lse summed to 1.14 (float64: outputs past every value
    attended) or 1 +- 3e-5."""
    lse_a = torch.tensor([top, top, top, -top], dtype=dtype)
    lse_b = lse_a + torch.tensor([0.0, 2.0, 3.0, 0.0], dtype=dtype)
    ones = torch.ones(4, 3, dtype=dtype)
    out, _ = merge.merge(ones, lse_a, ones, lse_b)
    assert (out - 1).abs().max() <= 2 * torch.finfo(dtype).eps
    out, _ = merge.merge(ones, lse_a, 3 * ones, lse_a)
    assert (out - 2).abs().max() <= 4 * torch.finfo(dtype).eps


@pytest.mark.parametrize("lq,lk,split,lo,hi", [(6, 10, 4, -8, 1), (1, 10, 4, -200, 200),
                                                (3, 140, 70, -200, 200)])
@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_split_keys_with_global_lse_match_one_call(backend, softcap, lq, lk, split, lo, hi):
    """What each ring step relies on, per backend: a backend's kernels on a split of the keys
    (bands shifted to each part) merged by lse give its one call's out and lse, and its
    backward on each part given the GLOBAL out and lse gives the one call's gradients. GQA, an
    lse gradient, rows that see no key of one part (causal), soft-capping where the backend
    serves it; the parts' lse and its gradient given as strided views, with each part's own
    forward lse for the rows a kernel renormalizes (blocks._with_block_lse). One query row,
    and 3 against 70-key parts: the CPU kernels' decoding shapes, whose backward takes the lse
    of its own scores (its D the given out's: with the part's own, dq, dk, dv were off by ~1)."""
    status = attnx.backends()[backend]
    if not status.usable:
        pytest.skip(f"backend {backend} is not usable here: {status.reason}")
    if backend == "triton" and not _triton_interpreting():
        pytest.skip("CUDA tensors are for the GPU machines; here Triton runs interpreted")
    if softcap is not None and backend not in _dispatch._SERVED_MODIFIERS["sdpa"]:
        pytest.skip(f"backend {backend} does not compute softcap (attnx._dispatch)")
    g = torch.Generator().manual_seed(0)
    q, dout = torch.randn(1, 4, lq, 5, generator=g), torch.randn(1, 4, lq, 3, generator=g)
    k, v = torch.randn(1, 2, lk, 5, generator=g), torch.randn(1, 2, lk, 3, generator=g)
    dlse = torch.randn(1, 4, lq, generator=g)
    kern = blocks.kernels(backend, softcap)
    out, lse = kern.fwd(q, k, v, 0.4, lo, hi)
    parts = [(slice(0, split), 0), (slice(split, lk), split)]
    merged, part_lse = None, []
    for keys, at in parts:
        o, l = kern.fwd(q, k[:, :, keys], v[:, :, keys], 0.4, lo - at, hi - at)
        merged = (o.float(), l.float()) if merged is None else merge.merge(*merged, o, l)
        part_lse.append(l)
    torch.testing.assert_close(merged[0], out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged[1], lse, rtol=1e-5, atol=1e-6)
    whole = kern.bwd(dout, q, k, v, out, lse, lse, 0.4, lo, hi, dlse)

    def strided(t):  # the same values in a view of a wider tensor, as the ring's row slices
        return torch.cat([t, t], -1)[..., :t.shape[-1]]
    dq = torch.zeros_like(q)
    dk, dv = [], []
    for (keys, at), lb in zip(parts, part_lse):
        gq, gk, gv = kern.bwd(dout, q, k[:, :, keys], v[:, :, keys], out, strided(lse), lb, 0.4,
                              lo - at, hi - at, strided(dlse))
        dq = dq + gq
        dk.append(gk)
        dv.append(gv)
    for mine, ref in zip((dq, torch.cat(dk, 2), torch.cat(dv, 2)), whole):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lq,lk,split,lo,hi", [(6, 10, 4, -8, 1), (1, 10, 4, -200, 200),
                                                (3, 140, 70, -200, 200)])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_split_keys_past_float32_range_keep_the_global_out(backend, lq, lk, split, lo, hi):
    """The same split with values near float32's largest, whose float32 backward overflows and
    reruns in float64: D = rowsum(dO O) must still come from the given (whole row's) out, not
    from the part's own float64 forward (cpu: dq, dk off by 0.2-0.7 of their size before)."""
    g = torch.Generator().manual_seed(0)
    q, dout = torch.randn(1, 4, lq, 5, generator=g), 4 * torch.randn(1, 4, lq, 3, generator=g)
    k, v = torch.randn(1, 2, lk, 5, generator=g), torch.randn(1, 2, lk, 3, generator=g)
    v = v / v.abs().max() * 1.5e38
    kern = blocks.kernels(backend, None)
    out, lse = kern.fwd(q, k, v, 0.4, lo, hi)
    whole = kern.bwd(dout, q, k, v, out, lse, lse, 0.4, lo, hi, None)
    dq = torch.zeros_like(q)
    dk, dv = [], []
    for keys, at in [(slice(0, split), 0), (slice(split, lk), split)]:
        part_lse = kern.fwd(q, k[:, :, keys], v[:, :, keys], 0.4, lo - at, hi - at)[1]
        gq, gk, gv = kern.bwd(dout, q, k[:, :, keys], v[:, :, keys], out, lse, part_lse, 0.4,
                              lo - at, hi - at, None)
        dq = dq + gq
        dk.append(gk)
        dv.append(gv)
    for mine, ref in zip((dq, torch.cat(dk, 2), torch.cat(dv, 2)), whole):
        finite = ref.isfinite()  # entries past float32's range are inf in both
        assert torch.equal(mine.isfinite(), finite)
        err = (mine - ref)[finite].abs().max() / ref[finite].abs().max()
        assert err < 1e-5, err  # rounding: the parts' dO is scaled by exp(lb - lse) in float32


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("lay", ["zigzag", "contiguous"])
@pytest.mark.parametrize("band", [(-40, 40), (-40, 0), (-3, 0), (-2, 5), (0, 0)])
def test_blocks_cover_the_band_exactly_once(world, lay, band):
    """Over every (query rank, key rank), the planned blocks cover each admissible (i, j) of
    the full sequence once and nothing else; shards travel at least to every rank that needs
    them (the ring's `reach`)."""
    from attnx.distributed.ring import _Ring
    local = 4
    total = local * world
    ring = _Ring(None, 0, world, local, lay, band[0], band[1], 1.0, None, None, 0.0)
    count = torch.zeros(total, total, dtype=torch.int64)
    for r in range(world):
        qsegs = ring.segs(r)
        pos_q = torch.cat([torch.arange(s.start, s.start + s.length) for s in qsegs])
        for s in range(world):
            pos_k = torch.cat([torch.arange(g.start, g.start + g.length) for g in ring.segs(s)])
            planned = ring.blocks(r, s)
            if planned and r != s:
                assert (r - s) % world <= ring.reach(s)
            for b in planned:
                admitted = reference.band(b.q1 - b.q0, b.k1 - b.k0, b.lo, b.hi, "cpu")
                rows, cols = pos_q[b.q0:b.q1], pos_k[b.k0:b.k1]
                count[rows.view(-1, 1), cols.view(1, -1)] += admitted.long()
    want = reference.band(total, total, band[0], band[1], "cpu").long()
    assert torch.equal(count, want)


def test_layout_positions():
    assert layout.segments(1, 3, 4, "zigzag") == (layout.Segment(2, 0, 2), layout.Segment(8, 2, 2))
    assert layout.segments(2, 3, 4, "contiguous") == (layout.Segment(8, 0, 4),)
