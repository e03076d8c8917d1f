"""attnx.attention_with_kvcache (API.md) on the reference, cpu and cuda backends (the triton
backend's: tests/test_triton.py).

The golden value is plain torch SDPA in float64 over each sequence's keys gathered from the
cache (slot by slot, through the block table when paged), with the bottom-right band as a bool
mask; the bound is a small multiple of what the same PyTorch computation makes in the tested
dtype. Every slot past a sequence's length holds NaN, so a read of one shows in the output.
The cuda backend runs on a GPU, or without one on CPU tensors through the host harness
(ATTNX_CUDA_ON_CPU=1, csrc/cuda/host/: slow, so its cases are small).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attnx
from attnx import _ops
from attnx._backends import cuda as cuda_backend
from tests._compare import assert_within
from tests._rerun import rerun_under, skip_unless_avx512

HAS_CPU_KERNEL = _ops.has_kernel("kvcache_fwd", "CPU")
BACKENDS = ["reference", pytest.param("cpu", marks=pytest.mark.skipif(
    not HAS_CPU_KERNEL, reason="attnx._C is not built"))]
LENGTHS = [0, 1, 17, 97, 1025]  # tokens cached before the call, one per sequence


class Cache:
    """A contiguous or paged cache with NaN in every slot no sequence uses, and the map from
    (sequence, position) to its slot."""

    def __init__(self, b, hkv, e, ev, capacity, paged, dtype, seed=0, block_size=16):
        g = torch.Generator().manual_seed(seed)
        self.b, self.paged, self.block_size = b, paged, block_size
        if paged:
            per_seq = -(-capacity // block_size)
            blocks = b * per_seq + 3  # spare blocks no sequence owns
            order = torch.randperm(blocks, generator=g)[: b * per_seq]
            self.table = order.view(b, per_seq).to(torch.int32)
            shape = (blocks, hkv, block_size)
        else:
            self.table = None
            shape = (b, hkv, capacity)
        self.k = torch.full(shape + (e,), float("nan"), dtype=dtype)
        self.v = torch.full(shape + (ev,), float("nan"), dtype=dtype)

    def slot(self, b, p):
        """(index of dim 0, index of dim 2) of position p of sequence b."""
        if self.table is None:
            return b, p
        return int(self.table[b, p // self.block_size]), p % self.block_size

    def slots(self, b, n):
        """slot() of positions 0 .. n - 1 of sequence b, as two index tensors."""
        p = torch.arange(n)
        if self.table is None:
            return torch.full((n,), b), p
        return self.table[b].long()[p // self.block_size], p % self.block_size

    def fill(self, lengths, seed=1):
        """Random keys and values at positions 0 .. lengths[b] - 1."""
        g = torch.Generator().manual_seed(seed)
        for b, n in enumerate(lengths):
            i, s = self.slots(b, n)
            for cache in (self.k, self.v):
                cache[i, :, s] = torch.randn(n, cache.shape[1], cache.shape[3], generator=g).to(cache.dtype)

    def gather(self, cache, b, n):
        """(Hkv, n, E) of sequence b."""
        i, s = self.slots(b, n)
        return cache[i, :, s].transpose(0, 1)


def torch_decode(q, keys, values, scale, is_causal, window, dtype):
    """out, lse of plain torch SDPA in `dtype`, one sequence at a time (keys[b]: (Hkv, n, E))."""
    outs, lses = [], []
    lq = q.shape[2]
    for b in range(q.shape[0]):
        qb, k, v = (t.to(dtype) for t in (q[b], keys[b], values[b]))
        n = k.shape[1]
        groups = qb.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        d = torch.arange(n).view(1, n) - torch.arange(lq).view(lq, 1) - (n - lq)  # j - diagonal
        allowed = torch.ones(lq, n, dtype=torch.bool)
        if is_causal:
            allowed &= d <= 0
        if window is not None and window[0] is not None:
            allowed &= d >= -window[0]
        if window is not None and window[1] is not None:
            allowed &= d <= window[1]
        s = (qb @ k.transpose(-1, -2)) * scale
        lse = torch.logsumexp(s.masked_fill(~allowed, float("-inf")), dim=-1)
        out = F.scaled_dot_product_attention(qb, k, v, attn_mask=allowed, scale=scale)
        out = torch.where(allowed.any(-1, keepdim=True), out, 0.0)  # torch gives NaN on empty rows
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def run_case(backend, dtype, *, paged, lq, lnew, is_causal=True, window=None, hq=4, hkv=2,
             e=40, ev=24, lengths=LENGTHS, scale=None, factor=2.0, block_size=16, device="cpu"):
    """The call on `device` (the cache moved there, then back for the checks)."""
    b = len(lengths)
    capacity = max(lengths) + lnew + 3
    cache = Cache(b, hkv, e, ev, capacity, paged, dtype, block_size=block_size)
    cache.fill(lengths)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(b, hq, lq, e, generator=g, dtype=torch.float64)
    k_new = torch.randn(b, hkv, lnew, e, generator=g, dtype=torch.float64)
    v_new = torch.randn(b, hkv, lnew, ev, generator=g, dtype=torch.float64)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    before_k, before_v = cache.k.clone(), cache.v.clone()

    dev = dict(device=device)
    k_cache, v_cache = cache.k.to(**dev), cache.v.to(**dev)
    out, lse = attnx.attention_with_kvcache(
        q.to(dtype=dtype, **dev), k_cache, v_cache, seqlens.to(**dev),
        k_new.to(dtype=dtype, **dev) if lnew else None,
        v_new.to(dtype=dtype, **dev) if lnew else None,
        block_table=None if cache.table is None else cache.table.to(**dev), is_causal=is_causal,
        scale=scale, window=window, backend=backend, return_lse=True)
    cache.k, cache.v, out, lse = (t.cpu() for t in (k_cache, v_cache, out, lse))

    # the new keys and values landed slot by slot, and nothing else changed
    want_k, want_v = before_k.clone(), before_v.clone()
    for i, n in enumerate(lengths):
        for t in range(lnew):
            blk, s = cache.slot(i, n + t)
            want_k[blk, :, s], want_v[blk, :, s] = k_new[i, :, t].to(dtype), v_new[i, :, t].to(dtype)
    torch.testing.assert_close(cache.k, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(cache.v, want_v, rtol=0, atol=0, equal_nan=True)

    total = [n + lnew for n in lengths]
    keys = [cache.gather(cache.k, i, n).double() for i, n in enumerate(total)]
    values = [cache.gather(cache.v, i, n).double() for i, n in enumerate(total)]
    scale_ = 1 / math.sqrt(e) if scale is None else scale
    golden = torch_decode(q, keys, values, scale_, is_causal, window, torch.float64)
    baseline = torch_decode(q.to(dtype), keys, values, scale_, is_causal, window, dtype)
    assert out.dtype == dtype and out.shape == (b, hq, lq, ev)
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, lq)
    floor = {torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 1e-3}.get(dtype, 1e-5)
    assert_within(out, golden[0], baseline[0], factor=factor, floor=floor)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(golden[1])), "lse: empty rows"
    a, gl, bl = (t.nan_to_num(neginf=0.0) for t in (lse, golden[1], baseline[1]))
    assert_within(a, gl, bl, factor=factor, floor=1e-5, what="lse")
    return out


MODES = {
    "causal": dict(is_causal=True),
    "full": dict(is_causal=False),
    "causal_window": dict(is_causal=True, window=(7, None)),
    "window": dict(is_causal=False, window=(30, 2)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("lq", [1, 4, 17])
@pytest.mark.parametrize("mode", list(MODES))
def test_matches_reference(backend, paged, lq, mode):
    """Cache lengths 0-1025 in one batch (the longest split across threads and merged), GQA,
    E and Ev off the vector widths, new keys appended before attending."""
    run_case(backend, torch.float32, paged=paged, lq=lq, lnew=lq, **MODES[mode])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_without_new_keys_and_odd_block_size(backend, paged):
    """No k, v: the queries attend the cache as it is (sequences of length 0 with Lq = 4: rows
    with no key give zeros and lse -inf)."""
    run_case(backend, torch.float32, paged=paged, lq=4, lnew=0, hq=3, hkv=3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("window", [None, (3, None)])
def test_more_queries_than_the_cache_holds(backend, paged, window):
    """Lq past the cache's capacity, not causal: query 0 sits Lq - 1 keys left of the last
    key's diagonal, and still attends every key (an unbounded band ended at the capacity)."""
    run_case(backend, torch.float32, paged=paged, lq=17, lnew=0, is_causal=False, window=window,
             lengths=[0, 2, 5], block_size=4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_llama_shape(backend):
    """The benchmark's shape (Hq 32, Hkv 8, D 128: whole vectors, the 8-vector value path)."""
    run_case(backend, torch.float32, paged=True, lq=2, lnew=1, hq=32, hkv=8, e=128, ev=128,
             lengths=[700, 33], scale=0.05)


# (Hq, Hkv, Lq): rows per kv head R = Hq / Hkv x Lq. The CPU kernel computes rows as the lanes
# of a vector in groups of 16 (AVX-512; 8 on AVX2), a last group where more than half full, and
# the rest four rows at a time: whole groups, a partial one, groups whose queries wrap past
# Lq - 1 (R % Lq != 0 at the group's edge), rows left to the four-row products, Lq = 1.
ROW_GROUPS = [(8, 1, 2), (8, 1, 3), (6, 2, 3), (4, 1, 5), (16, 1, 1), (12, 2, 7)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("mode", ["causal", "window"])
@pytest.mark.parametrize("hq, hkv, lq", ROW_GROUPS,
                         ids=[f"hq{a}-hkv{b}-lq{c}" for a, b, c in ROW_GROUPS])
def test_row_groups(backend, paged, mode, hq, hkv, lq):
    run_case(backend, torch.float32, paged=paged, lq=lq, lnew=min(lq, 2), hq=hq, hkv=hkv,
             lengths=[0, 5, 40, 97], **MODES[mode])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("e", [1, 2, 3, 17, 34])
def test_row_groups_head_dims(backend, e):
    """Lane groups (R = 16: one group of 16 lanes, or two of 8) at head dims that leave an odd
    last column past the lanes' pairs of columns (1, 3, 17) or none (2, 34)."""
    run_case(backend, torch.float32, paged=True, lq=4, lnew=1, hq=8, hkv=2, e=e, ev=5,
             lengths=[0, 5, 40, 97])


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64(backend):
    run_case(backend, torch.float64, paged=True, lq=3, lnew=2, window=(50, None))


@pytest.mark.skipif(not HAS_CPU_KERNEL, reason="attnx._C is not built")
def test_scores_past_float32_range_rerun_in_float64():
    """Finite inputs whose scores overflow float32 give the float64 answer, not NaN."""
    b, hq, hkv, lq, e = 1, 2, 1, 1, 16
    q = torch.full((b, hq, lq, e), 3e18)
    k = torch.randn(b, hkv, 40, e).abs() * 3e18
    v = torch.randn(b, hkv, 40, e)
    out = attnx.attention_with_kvcache(q, k, v, 40, backend="cpu")
    ref = attnx.attention_with_kvcache(q.double(), k.double(), v.double(), 40, backend="reference")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_CPU_KERNEL, reason="attnx._C is not built")
@pytest.mark.parametrize("lq, hq", [(1, 2), (4, 8)], ids=["four-row", "lanes"])
def test_score_summed_past_minus_float32_max_is_kept(lq, hq):
    """One score of 0 whose float32 partial sums can pass -float32 max on the way (products
    -3e38, -3e38, then +3e38, +3e38): a kernel summing in that order gets -inf, which must not
    drop the key as if masked (the call reruns in float64). The lanes (16 rows a kv head) and
    the four-row products each check their own scores."""
    g = torch.Generator().manual_seed(3)
    b, hkv, n, e = 1, 2, 40, 8
    q = torch.randn(b, hq, lq, e, generator=g)
    k = torch.randn(b, hkv, n, e, generator=g)
    v = torch.randn(b, hkv, n, e, generator=g)
    q[0, 0, 0] = 1e19
    k[0, 0] *= 1e-30  # the row's other scores ~0 as well: the key weighs 1/40 of its output
    k[0, 0, 1] = torch.tensor([-3e19, 0, -3e19, 0, 3e19, 0, 3e19, 0])
    out = attnx.attention_with_kvcache(q, k, v, n, is_causal=False, scale=1.0, backend="cpu")
    ref = attnx.attention_with_kvcache(q.double(), k.double(), v.double(), n, is_causal=False,
                                       scale=1.0, backend="reference")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lq, hq", [(1, 4), (4, 8)], ids=["four-row", "lanes"])
@pytest.mark.parametrize("n", [40, 3000], ids=["one-slice", "split"])
def test_nan_in_an_admitted_key_gives_nan_rows(lq, hq, n):
    """A NaN key that a query attends makes that query's rows NaN, as torch's do (not an empty
    row's zeros): the merge of one slice and of several."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, hq, lq, 16, generator=g)
    k, v = torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
    k[0, 0, 5, 3] = float("nan")  # every query admits key 5 (causal, bottom-right)
    out = attnx.attention_with_kvcache(q, k, v, torch.tensor([n], dtype=torch.int32),
                                       backend="cpu")
    group = hq // 2
    assert out[0, :group].isnan().all()
    assert out[0, group:].isfinite().all()


def test_sinks_on_rows_that_admit_no_key_give_zeros():
    """SDPA on the decoding kernel (Lq = 1, four-row products) with sinks, a row whose mask
    refuses every key and a value of inf: zeros and the sink's lse, not the inf times p = 0 the
    products add for refused keys. (Where a row admits keys, such an inf makes NaN, as in torch:
    a refused key's value times 0.)"""
    lq, hq = 1, 4
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, hq, lq, 16, generator=g)
    k, v = torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    v[0, :, 3, 2] = float("inf")
    mask = torch.ones(1, hq, lq, 40, dtype=torch.bool)
    mask[0, :2, 0] = False  # query 0 of the first kv head's heads admits no key
    out, lse = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                                  sinks=torch.zeros(hq), backend="cpu",
                                                  return_lse=True)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))
    assert torch.equal(lse[0, :2], torch.zeros_like(lse[0, :2]))  # the sink's exp(0) alone


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, q_value, k_value, scale", [
    (torch.float32, 1e20, 0.0, 1e30),       # q scale past float32's range, every score 0
    (torch.float32, 1e20, 1e-30, 1e20),     # q scale past float32's range, scores 8e10
    (torch.float64, 1e10, 1e-300, -1e300),  # q scale past float64's range, scores -8e10
    (torch.float64, 1e300, 0.0, 1e30)],
    ids=["f32-zero-keys", "f32", "f64-negative-scale", "f64-zero-keys"])
def test_scale_past_the_range_of_q_times_scale(backend, dtype, q_value, k_value, scale):
    """Scores in range though q times the scale is not: the keys are all alike, so every query
    weighs the values evenly (the cpu kernel once scaled q alone, and its NaN scores came out
    as a silent row of zeros)."""
    g = torch.Generator().manual_seed(5)
    q = torch.full((2, 4, 3, 8), q_value, dtype=dtype)
    k = torch.full((2, 2, 12, 8), k_value, dtype=dtype)
    v = torch.randn(2, 2, 12, 8, generator=g, dtype=torch.float64).to(dtype)
    out = attnx.attention_with_kvcache(q, k, v, 12, is_causal=False, scale=scale,
                                       backend=backend)
    want = v.double().mean(dim=2, keepdim=True).repeat_interleave(2, dim=1).expand(2, 4, 3, 8)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int_seqlens_no_grad_and_auto(backend):
    q = torch.randn(2, 2, 1, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    out = attnx.attention_with_kvcache(q, k, v, 6, backend=backend)
    assert not out.requires_grad  # an inference op: no graph, whatever requires grad
    same = attnx.attention_with_kvcache(q, k, v, torch.tensor([6, 6], dtype=torch.int32))
    torch.testing.assert_close(out, same, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_seqlens(backend):
    """cache_seqlens as a strided view (a column of a bigger table): read by value, not by
    its storage's order; without new keys the kernels get it as it is given."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 1, 16, generator=g)
    k, v = torch.randn(3, 2, 30, 16, generator=g), torch.randn(3, 2, 30, 16, generator=g)
    table = torch.tensor([[5, 99], [30, 99], [0, 99]], dtype=torch.int32)
    out = attnx.attention_with_kvcache(q, k, v, table[:, 0], backend=backend)
    want = attnx.attention_with_kvcache(q, k, v, table[:, 0].contiguous(), backend="reference")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_empty_query():
    q = torch.randn(2, 2, 0, 8)
    k, v = torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    out, lse = attnx.attention_with_kvcache(q, k, v, 3, return_lse=True)
    assert out.shape == (2, 2, 0, 8) and lse.shape == (2, 2, 0)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_empty_batch(paged):
    q = torch.randn(0, 4, 1, 8)
    shape = (3, 2, 4) if paged else (0, 2, 10)
    k, v = torch.randn(*shape, 8), torch.randn(*shape, 6)
    table = torch.zeros(0, 2, dtype=torch.int32) if paged else None
    out, lse = attnx.attention_with_kvcache(q, k, v, torch.zeros(0, dtype=torch.int32),
                                            block_table=table, return_lse=True)
    assert out.shape == (0, 4, 1, 6) and lse.shape == (0, 4, 1) and lse.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("lq", [1, 4])
def test_bfloat16(backend, paged, lq):
    """bfloat16 caches (the CPU kernel reads them where they lie and widens each block to
    float32 as it goes), GQA 4: four-row products at Lq = 1, lanes at Lq = 4."""
    run_case(backend, torch.bfloat16, paged=paged, lq=lq, lnew=lq, hq=8, hkv=2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("lq, e", [(1, 40), (4, 40), (4, 17)])
def test_float16(backend, paged, lq, e):
    """float16 caches (the CPU kernel widens each block to float32 once, F16C's or AVX-512's
    conversion, scalar for a row's last values past a whole vector), GQA 4: four-row products at
    Lq = 1, lanes at Lq = 4."""
    run_case(backend, torch.float16, paged=paged, lq=lq, lnew=lq, hq=8, hkv=2, e=e)


def _errors_case(paged=False):
    cache = Cache(2, 2, 8, 8, 20, paged, torch.float32, block_size=4)
    cache.fill([5, 9])
    q = torch.randn(2, 4, 2, 8)
    k_new, v_new = torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8)
    return cache, q, k_new, v_new


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_capacity_overflow_raises_and_writes_nothing(paged):
    cache, q, k_new, v_new = _errors_case(paged)
    before_k, before_v = cache.k.clone(), cache.v.clone()
    capacity = cache.table.shape[1] * 4 if paged else 20
    seqlens = torch.tensor([5, capacity - 1], dtype=torch.int32)  # the second one overflows by 1
    with pytest.raises(ValueError, match="cache_seqlens.*capacity"):
        attnx.attention_with_kvcache(q, cache.k, cache.v, seqlens, k_new, v_new,
                                     block_table=cache.table)
    torch.testing.assert_close(cache.k, before_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(cache.v, before_v, rtol=0, atol=0, equal_nan=True)


def test_lengths_past_int32_raise_and_write_nothing():
    """A stride-0 block table gives a capacity past int32, which the kernels' lengths are: the
    sum of a length and the new tokens past it raised RuntimeError after writing k and v (a
    tensor of lengths), or from torch.full (an int)."""
    k_cache, v_cache = torch.zeros(1, 1, 8, 4), torch.zeros(1, 1, 8, 4)  # one block of 8 slots
    table = torch.zeros(1, 1, dtype=torch.int32).expand(1, 2**29)  # 2**32 positions
    q, k_new, v_new = torch.randn(1, 1, 1, 4), torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4)
    with pytest.raises(ValueError, match="cache_seqlens: .*within int32"):
        attnx.attention_with_kvcache(q, k_cache, v_cache,
                                     torch.tensor([2**31 - 1], dtype=torch.int32), k_new, v_new,
                                     block_table=table)
    with pytest.raises(ValueError, match=r"cache_seqlens: expected an int in \[0, 2147483647\]"):
        attnx.attention_with_kvcache(q, k_cache, v_cache, 2**31, block_table=table)
    assert not k_cache.any() and not v_cache.any()


def test_caches_whose_slots_overlap_raise_and_write_nothing():
    """Slots sharing memory (an as_strided view, an expanded cache) would each take several new
    keys, the last write winning: refused before writing (only stride 0 was)."""
    base = torch.zeros(64)
    q, k_new = torch.randn(1, 1, 1, 4), torch.arange(1.0, 9.0).view(1, 1, 2, 4)
    for cache in (base.as_strided((1, 1, 8, 4), (64, 64, 1, 1)),  # slot t: elements t..t+3
                  base[:32].view(1, 1, 8, 4).expand(2, 1, 8, 4)):
        q2, k2 = q.expand(cache.shape[0], -1, -1, -1), k_new.expand(cache.shape[0], -1, -1, -1)
        with pytest.raises(ValueError, match="k_cache: expected a cache whose slots do not share"):
            attnx.attention_with_kvcache(q2, cache, torch.zeros(cache.shape), 0, k2, k2.clone())
    assert not base.any()
    # a permuted or sliced cache shares nothing: taken
    ok = torch.zeros(1, 8, 1, 4).transpose(1, 2)[:, :, :6]
    attnx.attention_with_kvcache(q, ok, torch.zeros(1, 1, 6, 4), 0, k_new, k_new.clone())
    torch.testing.assert_close(ok[0, 0, :2], k_new[0, 0])


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_k_and_v_caches_that_overlap_raise_and_write_nothing(backend):
    """One tensor (or overlapping views) as both caches: v's write would overwrite the keys
    just written, and the call attend with the values as keys. Halves of one buffer share
    nothing: taken."""
    q, k_new, v_new = torch.randn(1, 1, 1, 4), torch.ones(1, 1, 1, 4), torch.full((1, 1, 1, 4), 2.0)
    base = torch.zeros(1, 1, 9, 4)
    for k_cache, v_cache in ((base, base), (base[:, :, :8], base[:, :, 1:])):
        with pytest.raises(ValueError, match="v_cache: expected memory apart from k_cache's"):
            attnx.attention_with_kvcache(q, k_cache, v_cache, 0, k_new, v_new, backend=backend)
    assert not base.any()
    kv = torch.zeros(2, 1, 1, 8, 4)
    attnx.attention_with_kvcache(q, kv[0], kv[1], 0, k_new, v_new, backend=backend)
    assert torch.equal(kv[0, 0, 0, 0], k_new[0, 0, 0]) and torch.equal(kv[1, 0, 0, 0], v_new[0, 0, 0])
    # interleaved halves (spans overlap, no element shared): (B, 2, H, L, E) and a paged
    # (pages, 2, H, block, E) buffer, as FlashInfer lays its caches out
    q2, k2, v2 = (t.expand(2, 2, 1, 4) for t in (q, k_new, v_new))
    both = torch.zeros(2, 2, 2, 8, 4)
    attnx.attention_with_kvcache(q2, both[:, 0], both[:, 1], 3, k2, v2, backend=backend)
    assert torch.equal(both[:, 0, :, 3], k2[:, :, 0]) and torch.equal(both[:, 1, :, 3], v2[:, :, 0])
    assert both.count_nonzero() == 2 * 2 * 2 * 4
    pages = torch.zeros(4, 2, 2, 4, 4)
    table = torch.tensor([[3, 0], [1, 2]], dtype=torch.int32)
    attnx.attention_with_kvcache(q2, pages[:, 0], pages[:, 1], 5, k2, v2, block_table=table,
                                 backend=backend)
    assert torch.equal(pages[[0, 2], 0, :, 1], k2[:, :, 0]) and torch.equal(pages[[0, 2], 1, :, 1], v2[:, :, 0])
    # without new keys nothing is written: the same tensor as both caches is a valid read
    attnx.attention_with_kvcache(q, kv[0], kv[0], 1, backend=backend)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("lengths", ["int", "tensor"])
def test_meta_tensors_give_shapes(paged, lengths):
    """Meta tensors hold no lengths to read: the output's shape and dtype (as SDPA's on meta),
    not "Cannot copy out of meta tensor"."""
    meta = torch.device("meta")
    q = torch.empty(2, 4, 3, 8, device=meta)
    cache = torch.empty((6, 2, 4, 8) if paged else (2, 2, 16, 8), device=meta)
    table = torch.empty(2, 3, dtype=torch.int32, device=meta) if paged else None
    seqlens = 5 if lengths == "int" else torch.empty(2, dtype=torch.int32, device=meta)
    k_new = torch.empty(2, 2, 1, 8, device=meta)
    out = attnx.attention_with_kvcache(q, cache, cache.clone(), seqlens, k_new, k_new.clone(),
                                       block_table=table)
    assert out.device == meta and out.shape == (2, 4, 3, 8) and out.dtype == torch.float32


def test_new_keys_read_from_the_cache_itself():
    """New k, v that are views of the caches, over the slots they are written to: the values as
    they were before the call go in (as from copies), k and v alike; the overlapping write had
    raised torch's RuntimeError after writing k."""
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(1, 1, 64, 4), torch.randn(1, 1, 64, 4)
    q = torch.randn(1, 1, 1, 4)
    k_new, v_new = k_cache[:, :, 1:9], v_cache[:, :, 2:10]  # written to slots 3-10
    k_want, v_want = k_cache.clone(), v_cache.clone()
    k_want[:, :, 3:11], v_want[:, :, 3:11] = k_new.clone(), v_new.clone()
    out = attnx.attention_with_kvcache(q, k_cache, v_cache, 3, k_new, v_new)
    torch.testing.assert_close(k_cache, k_want, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_want, rtol=0, atol=0)
    ref = F.scaled_dot_product_attention(q, k_want[:, :, :11], v_want[:, :, :11])
    torch.testing.assert_close(out, ref)


def test_block_ids_out_of_range_raise_and_write_nothing():
    cache, q, k_new, v_new = _errors_case(paged=True)
    before = cache.k.clone()
    table = cache.table.clone()
    table[1, 2] = cache.k.shape[0]  # a block sequence 1 uses (positions 8-11)
    with pytest.raises(ValueError, match="block_table.*block ids"):
        attnx.attention_with_kvcache(q, cache.k, cache.v, torch.tensor([5, 9], dtype=torch.int32),
                                     k_new, v_new, block_table=table)
    torch.testing.assert_close(cache.k, before, rtol=0, atol=0, equal_nan=True)
    table = cache.table.clone()
    table[:, -1] = -1  # padding past the blocks in use is fine
    attnx.attention_with_kvcache(q, cache.k, cache.v, torch.tensor([1, 2], dtype=torch.int32),
                                 k_new, v_new, block_table=table)
    table[0, 2:] = -1  # and where the sequences use different numbers of blocks (1 + 2, 5 + 2 keys)
    attnx.attention_with_kvcache(q, cache.k, cache.v, torch.tensor([1, 5], dtype=torch.int32),
                                 k_new, v_new, block_table=table)
    # sequences of equal lengths (checked as one slice of the table): 5 + 2 keys use blocks 0-1
    equal = torch.tensor([5, 5], dtype=torch.int32)
    table = cache.table.clone()
    table[0, 1] = -1
    before = cache.k.clone()
    with pytest.raises(ValueError, match=r"block_table.*block ids.*got ids from -1 to"):
        attnx.attention_with_kvcache(q, cache.k, cache.v, equal, k_new, v_new, block_table=table)
    torch.testing.assert_close(cache.k, before, rtol=0, atol=0, equal_nan=True)
    table = cache.table.clone()
    table[:, 2:] = -1
    attnx.attention_with_kvcache(q, cache.k, cache.v, equal, k_new, v_new, block_table=table)


def _bad_calls():
    cache, q, k_new, v_new = _errors_case()
    s = torch.tensor([5, 9], dtype=torch.int32)
    kc, vc = cache.k, cache.v
    return [
        (TypeError, "cache_seqlens.*int32", dict(cache_seqlens=s.long())),
        (ValueError, "cache_seqlens.*>= 0", dict(cache_seqlens=torch.tensor([-1, 2], dtype=torch.int32))),
        (ValueError, "cache_seqlens.*shape", dict(cache_seqlens=torch.tensor([1], dtype=torch.int32))),
        (TypeError, "k_cache.*dtype", dict(k_cache=kc.double())),
        (ValueError, "k_cache.*head count", dict(q=torch.randn(2, 3, 2, 8))),
        (ValueError, "k_cache.*head dim", dict(q=torch.randn(2, 4, 2, 6))),
        (ValueError, "v_cache.*shape", dict(v_cache=vc[:, :, :10])),
        (ValueError, "k, v.*both", dict(k=k_new, v=None)),
        (ValueError, "k: expected shape", dict(k=k_new[:, :1], v=v_new[:, :1, :, :1].expand(2, 1, 2, 8))),
        (ValueError, "v: expected shape", dict(k=k_new, v=v_new[:, :, :1])),
        (TypeError, "block_table.*int32", dict(block_table=torch.zeros(2, 5, dtype=torch.int64))),
        (ValueError, "block_table.*shape", dict(block_table=torch.zeros(3, 5, dtype=torch.int32))),
        (ValueError, "softcap.*> 0", dict(softcap=0.0)),
        (ValueError, "alibi_slopes.*shape", dict(alibi_slopes=torch.ones(3))),
        (TypeError, "sinks.*dtype", dict(sinks=torch.zeros(4, dtype=torch.int64))),
        (ValueError, "window", dict(window=(-1, 0))),
        (ValueError, "backend", dict(backend="nope")),
        (ValueError, "cache_seqlens.*int in \\[0, 20\\]", dict(cache_seqlens=2**31)),
        (ValueError, "cache_seqlens.*int in", dict(cache_seqlens=-1)),
        (ValueError, "k_cache.*share memory", dict(k_cache=kc[:1].expand_as(kc))),
        (ValueError, "v_cache.*share memory", dict(v_cache=vc[:, :, :1].expand_as(vc))),
    ], dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=s, k=k_new, v=v_new)


@pytest.mark.parametrize("case", range(len(_bad_calls()[0])))
def test_bad_input_names_the_argument(case):
    errors, base = _bad_calls()
    exc, pattern, change = errors[case]
    kwargs = dict(base, **change)
    before = kwargs["k_cache"].clone()
    with pytest.raises(exc, match=pattern):
        attnx.attention_with_kvcache(**kwargs)
    torch.testing.assert_close(kwargs["k_cache"], before, rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(not HAS_CPU_KERNEL, reason="attnx._C is not built")
def test_avx2_path_matches_reference():
    """ATTNX_CPU_AVX512=0 runs the 8-lane products, what CPUs without AVX-512 get."""
    skip_unless_avx512()
    rerun_under("ATTNX_CPU_AVX512", __file__,
                "(matches_reference or row_groups or llama or odd_block or float32_range"
                " or float16) and cpu and not avx2",
                probe="cpu_vector", expect=("avx2", "baseline"))


@pytest.mark.skipif(not HAS_CPU_KERNEL, reason="attnx._C is not built")
def test_opcheck():
    """The schema, fake kernel and dispatcher registration of attnx::kvcache_fwd agree."""
    cache = Cache(2, 2, 8, 8, 12, True, torch.float32, block_size=4)
    cache.fill([5, 9])
    q = torch.randn(2, 4, 2, 8)
    seqlens = torch.tensor([5, 9], dtype=torch.int32)
    torch.library.opcheck(torch.ops.attnx.kvcache_fwd.default,
                          (q, cache.k, cache.v, seqlens, cache.table, 0.3, -14, 0))
    contiguous = Cache(2, 2, 8, 8, 12, False, torch.float32)
    contiguous.fill([5, 9])
    torch.library.opcheck(torch.ops.attnx.kvcache_fwd.default,
                          (q, contiguous.k, contiguous.v, seqlens, None, 0.3, -14, 12))


# The cuda backend (csrc/cuda/decode.cu): fp16 and bf16, on a GPU or through the host harness.
CUDA_ON_CPU = not torch.cuda.is_available()
CUDA_DEVICE = "cpu" if CUDA_ON_CPU else "cuda"


def _cuda_skip_reason():
    if CUDA_ON_CPU:
        return _ops.cuda_host()  # None once attnx._cuda_host is built and loaded
    return cuda_backend.availability()


needs_cuda = pytest.mark.skipif(_cuda_skip_reason() is not None, reason=str(_cuda_skip_reason()))
CUDA_LENGTHS = [0, 1, 17, 97]  # 97 + Lnew keys: several splits, merged by their lse


@pytest.fixture
def on_cuda(monkeypatch):
    if CUDA_ON_CPU:
        monkeypatch.setenv("ATTNX_CUDA_ON_CPU", "1")


def run_cuda(dtype, **kw):
    return run_case("cuda", dtype, device=CUDA_DEVICE, **dict(dict(lengths=CUDA_LENGTHS), **kw))


@needs_cuda
@pytest.mark.usefixtures("on_cuda")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cuda_more_queries_than_the_cache_holds(paged):
    """As test_more_queries_than_the_cache_holds: query 0 attends every key."""
    run_cuda(torch.float16, paged=paged, lq=17, lnew=0, is_causal=False, lengths=[0, 2, 5],
             block_size=4)


@needs_cuda
@pytest.mark.usefixtures("on_cuda")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("lq", [1, 6])
@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_matches_reference(dtype, paged, lq, mode):
    """GQA (2 query heads per kv head), lengths 0-97 (several splits), E 40 and Ev 24 (16-byte
    loads), the new keys written in place before attending (checked slot by slot)."""
    run_cuda(dtype, paged=paged, lq=lq, lnew=lq, **MODES[mode])


@needs_cuda
@pytest.mark.usefixtures("on_cuda")
def test_cuda_row_tiles_and_query_groups():
    """G * Lq = 4 * 7 = 28 rows: two row tiles of a kv head's group, the first spanning three
    heads, the second part of one (its band's key range narrower); an odd block size."""
    run_cuda(torch.float16, paged=True, lq=7, lnew=3, hq=8, hkv=2, block_size=5,
             is_causal=True, window=(9, None))


@needs_cuda
@pytest.mark.usefixtures("on_cuda")
@pytest.mark.parametrize("e, ev", [(20, 12), (256, 256), (8, 136)])
def test_cuda_head_dims(e, ev):
    """Element loads (E, Ev not multiples of 8), the largest head dims, and two value columns
    per thread (Ev > 128)."""
    run_cuda(torch.bfloat16, paged=True, lq=2, lnew=1, hq=2, hkv=1, e=e, ev=ev,
             lengths=[3, 40], is_causal=False)


@needs_cuda
@pytest.mark.usefixtures("on_cuda")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cuda_one_split_and_empty_rows(paged):
    """A cache of at most 32 keys (one split: the split kernel writes out and lse itself), no
    new keys, and a sequence of length 0: its rows give zeros and lse -inf."""
    run_cuda(torch.float16, paged=paged, lq=3, lnew=0, hq=3, hkv=3, lengths=[0, 5, 21],
             block_size=4)


@needs_cuda
@pytest.mark.usefixtures("on_cuda")
def test_cuda_refuses_what_it_does_not_serve():
    q = torch.randn(1, 2, 1, 8, device=CUDA_DEVICE)
    k, v = (torch.randn(1, 2, 10, 8, device=CUDA_DEVICE) for _ in range(2))
    with pytest.raises(attnx.BackendUnavailableError, match="float16 and bfloat16"):
        attnx.attention_with_kvcache(q, k, v, 7, backend="cuda")
    h = dict(dtype=torch.float16, device=CUDA_DEVICE)
    wide = torch.randn(1, 2, 10, 264, **h)
    with pytest.raises(attnx.BackendUnavailableError, match="head dims up to 256"):
        attnx.attention_with_kvcache(torch.randn(1, 2, 1, 264, **h), wide, wide, 7, backend="cuda")


@needs_cuda
@pytest.mark.usefixtures("on_cuda")
def test_cuda_op_checks_and_reads_inside_the_cache():
    """The op called directly: bad arguments raise; lengths past the capacity and block ids
    outside the cache are clamped and skipped, never read (the harness's buffers end at a
    guard page: a read past them would stop the process)."""
    ops = torch.ops.attnx_cuda_host if CUDA_ON_CPU else torch.ops.attnx
    h = dict(dtype=torch.float16, device=CUDA_DEVICE)
    q = torch.randn(2, 4, 1, 16, **h)
    k, v = torch.randn(3, 2, 4, 16, **h), torch.randn(3, 2, 4, 16, **h)
    table = torch.tensor([[0, 1], [2, 7]], dtype=torch.int32, device=CUDA_DEVICE)
    lens = torch.tensor([8, 100], dtype=torch.int32, device=CUDA_DEVICE)
    with pytest.raises(RuntimeError, match="seqlens: expected int32"):
        ops.kvcache_fwd(q, k, v, lens.long(), table, 0.25, -8, 0)
    with pytest.raises(RuntimeError, match="block_table: expected int32"):
        ops.kvcache_fwd(q, k, v, lens, table.long(), 0.25, -8, 0)
    with pytest.raises(RuntimeError, match="Hq .3. must be a multiple"):
        ops.kvcache_fwd(q[:, :3], k, v, lens, table, 0.25, -8, 0)
    out, lse = ops.kvcache_fwd(q, k, v, lens, table, 0.25, -8, 0)
    # sequence 1 holds 8 keys at most (the capacity), those of block 2 only (7 is no block)
    keys, values = (t[2].float().repeat_interleave(2, 0) for t in (k, v))
    s = q[1].float() @ keys.transpose(-1, -2) * 0.25
    want = torch.softmax(s, -1) @ values
    torch.testing.assert_close(out[1].float().cpu(), want.cpu(), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse[1].cpu(), torch.logsumexp(s, -1).cpu(), rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.usefixtures("on_cuda")
def test_cuda_opcheck():
    """The schema, fake kernel and registration of kvcache_fwd on the cuda kernels agree."""
    ops = torch.ops.attnx_cuda_host if CUDA_ON_CPU else torch.ops.attnx
    cache = Cache(2, 2, 8, 8, 12, True, torch.float16, block_size=4)
    cache.fill([5, 9])
    dev = dict(device=CUDA_DEVICE)
    q = torch.randn(2, 4, 2, 8, dtype=torch.float16, **dev)
    seqlens = torch.tensor([5, 9], dtype=torch.int32, **dev)
    torch.library.opcheck(ops.kvcache_fwd.default, (q, cache.k.to(**dev), cache.v.to(**dev),
                                                    seqlens, cache.table.to(**dev), 0.3, -14, 0))


@pytest.mark.skipif(CUDA_ON_CPU or _cuda_skip_reason() is not None,
                    reason="needs a GPU the cuda backend serves")
def test_cuda_is_chosen_for_cuda_tensors():
    h = dict(dtype=torch.float16, device="cuda")
    q = torch.randn(1, 4, 1, 64, **h)
    k, v = torch.randn(1, 2, 50, 64, **h), torch.randn(1, 2, 50, 64, **h)
    call = attnx._validate.kvcache_call(q, k, v, 40, None, None, None, True, None, None, None,
                                        None, None, None, False)
    assert attnx._dispatch.select("kvcache", call) == "cuda"
