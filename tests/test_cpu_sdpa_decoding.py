"""The CPU SDPA forward on the decoding kernel: one query row, or up to 8 against 64 keys or
more, 16 against 256, 32 against 512 (csrc/cpu/sdpa_cpu.cpp, `decoding_rows`), float32,
bfloat16 and float16 without dropout
run on csrc/cpu/decode_cpu.cpp, with the SDPA contract's masks (bool and float, any broadcast),
top-left band, modifiers, fully-masked rows and float32 overflow reruns. Every shape here takes
that route; the backward (the tile kernels, which rerun the tile forward for the lse of their
own scores) is checked too, through lse as well.

The kernel computes rows in three ways, all exercised: four rows a call of one query head
group (Lq = 1, GQA), consecutive rows of one head (G = 1, Lq > 1), and rows as the lanes of a
vector (G x Lq > 8: AVX-512's 16 lanes, AVX2's 8, rerun below under ATTNX_CPU_AVX512=0).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

import attnx
from attnx import _ops
from tests._compare import assert_within
from tests import test_cpu_sdpa as sdpa
from tests import test_modifiers as modifiers
from tests._rerun import rerun_under, skip_unless_avx512

pytestmark = pytest.mark.skipif(_ops.has_kernel("sdpa_fwd", "CPU") is False,
                                reason="attnx._C is not built")

SHAPES = [  # b, hq, hkv, lq, lk, e, ev
    (1, 1, 1, 1, 1, 16, 16),
    (2, 4, 1, 1, 37, 16, 16),  # GQA 4 at Lq = 1: four rows a call
    (1, 2, 2, 5, 1030, 16, 24),  # one head's 5 queries grouped, Ev != E
    (1, 8, 2, 4, 1025, 32, 32),  # 16 rows a kv head: lanes
    (2, 3, 3, 16, 1100, 20, 12),  # 16 queries of one head: lanes, dims off the vector width
    (1, 6, 2, 3, 1024, 8, 8),  # 9 rows: one partial lane group (AVX2: 8 lanes and one row)
    (1, 4, 2, 32, 1024, 16, 16),  # 64 rows a kv head: four lane groups (AVX2: eight)
    (2, 3, 1, 25, 1050, 24, 8),  # 75 rows: lane groups whose queries wrap, rows left over
    (1, 8, 2, 4, 64, 32, 32),  # lanes against the fewest keys that take this route at Lq <= 8
    (2, 2, 1, 7, 97, 64, 64),  # 14 rows at D = 64: 32-key blocks, a partial lane group
    (1, 2, 2, 16, 256, 128, 128),  # 16 queries of one head at 256 keys, D = 128
    (1, 2, 1, 32, 517, 8, 8),  # 64 rows at 517 keys, D = 8: 64-key blocks, the last partial
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mode", list(sdpa.MODES))  # none, causal, window, causal_window, scale
def test_matches_reference(shape, mode):
    sdpa._check(torch.float32, *sdpa._inputs(*shape), **sdpa.MODES[mode])


def test_lse_gradient_with_a_float_mask():
    """A loss on lse as well as out where the forward runs on the decoding kernel and the
    backward reruns the tile forward: GQA, a float mask (its gradient too) with a row under a
    huge bias, peaked scores (scale 0.3 at E = 128)."""
    q, k, v, dout = sdpa._inputs(2, 8, 2, 4, 300, 128, 64)
    g = torch.Generator().manual_seed(9)
    mask = torch.randn(1, 1, 4, 300, generator=g, dtype=torch.float64)
    mask[..., 1, :] = torch.finfo(torch.float32).min
    dlse = torch.randn(2, 8, 4, generator=g, dtype=torch.float64)

    def grads(backend, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, mask)]
        out, lse = attnx.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3], scale=0.3,
                                                      enable_gqa=True, return_lse=True,
                                                      backend=backend)
        loss = (out * dout.to(dtype)).sum() + (lse * dlse.float()).sum()
        return torch.autograd.grad(loss, leaves)

    golden = grads("reference", torch.float64)
    actual, baseline = grads("cpu", torch.float32), grads("reference", torch.float32)
    for name, a, gd, b in zip(("dq", "dk", "dv", "dmask"), actual, golden, baseline):
        assert_within(a, gd, b, factor=3.0, floor=1e-5, what=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(2, 4, 1, 1, 37, 16, 16), (1, 8, 2, 4, 1025, 32, 24),
                                   (1, 8, 2, 4, 1025, 19, 21)], ids=str)
def test_half_precision(shape, dtype):
    """16-bit keys and values read as they lie, widened block by block, computed in float32
    (four-row products at Lq = 1, lanes at 16 rows; head dims off the vector width), with a
    key-padding mask."""
    q, k, v, dout = sdpa._inputs(*shape)
    pad = torch.ones(shape[0], 1, 1, shape[4], dtype=torch.bool)
    pad[0, ..., :5] = False
    sdpa._check(dtype, q, k, v, dout)
    sdpa._check(dtype, q, k, v, dout, mask=pad)


def test_lower_right_causal_as_in_decoding():
    """What a model's decoding step with a few new tokens asks: lower-right causal."""
    q, k, v, dout = sdpa._inputs(2, 8, 2, 4, 1030, 16, 16)
    sdpa._check(torch.float32, q, k, v, dout, mask=causal_lower_right(4, 1030))


@pytest.mark.parametrize("shape", [(2, 3, 3, 1, 53), (1, 8, 2, 4, 1030)], ids=str)
@pytest.mark.parametrize("kind", ["full", "row", "key", "head", "query"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64], ids=["bool", "float"])
def test_masks(shape, kind, mask_dtype):
    b, hq, hkv, lq, lk = shape
    q, k, v, dout = sdpa._inputs(b, hq, hkv, lq, lk, 16, 16)
    sdpa._check(torch.float32, q, k, v, dout, mask=sdpa._mask(kind, b, hq, lq, lk, mask_dtype))


def test_key_padding_inside_a_window():
    """Left padding (a generate() batch) and a sliding window: the mask bits read at every
    offset of a 16-key block."""
    b, hq, hkv, lq, lk = 3, 8, 2, 2, 1100
    q, k, v, dout = sdpa._inputs(b, hq, hkv, lq, lk, 16, 16)
    pad = torch.ones(b, 1, 1, lk, dtype=torch.bool)
    pad[0, ..., :7] = False
    pad[1, ..., :700] = False
    sdpa._check(torch.float32, q, k, v, dout, mask=pad, window=(500, 1098))


def test_fully_masked_rows_are_zero():
    """Rows with no admitted key, among rows with some, in every way of computing them (GQA
    Lq = 1, lanes): zero output, lse -inf, zero dq; float -inf rows alike."""
    for b, hq, hkv, lq, lk in ((2, 4, 1, 1, 45), (1, 8, 2, 4, 1027)):
        q, k, v, dout = sdpa._inputs(b, hq, hkv, lq, lk, 16, 16)
        mask = torch.rand(b, hq, lq, lk, generator=torch.Generator().manual_seed(2)) > 0.5
        mask[0, 1] = False
        mask[-1, 2, lq - 1] = False
        out, lse, dq, *_ = sdpa._check(torch.float32, q, k, v, dout, mask=mask)
        assert (out[0, 1] == 0).all() and torch.isneginf(lse[0, 1]).all() and (dq[0, 1] == 0).all()
        assert (out[-1, 2, lq - 1] == 0).all() and torch.isneginf(lse[-1, 2, lq - 1])
        fmask = torch.zeros(b, hq, lq, lk, dtype=torch.float64)
        fmask[0, 3] = float("-inf")
        out, lse, *_ = sdpa._check(torch.float32, q, k, v, dout, mask=fmask)
        assert (out[0, 3] == 0).all() and torch.isneginf(lse[0, 3]).all()


def test_rows_under_a_huge_finite_bias():
    """Every key of some rows biased by finfo.min (padding by a float mask): those rows are a
    softmax over their own scores, not empty (float32's sums fall to -inf and rerun)."""
    q, k, v, dout = sdpa._inputs(2, 8, 2, 3, 1030, 16, 8)
    big = torch.finfo(torch.float32).min
    mask = torch.zeros(2, 8, 3, 1030, dtype=torch.float64)
    mask[0, :, 1] = big
    mask[1, 5, 2, 100:] = big
    mask[1, 6, 0] = big
    mask[1, 6, 0, 7] = big / 2
    sdpa._check(torch.float32, q, k, v, dout, mask=mask)


def test_scores_overflowing_to_minus_inf_rerun():
    """A score whose float32 dot product overflows to -inf part way (q.k = +7e39 exactly) must
    not drop its key silently: the call reruns in float64, in the lanes (16 rows a kv head)
    and in the four-row products alike."""
    for b, hq, hkv, lq, lk in ((1, 4, 1, 1, 3), (1, 8, 2, 4, 1024)):
        q, k, v, _ = sdpa._inputs(b, hq, hkv, lq, lk, 2, 1)
        q[0, 0, 0] = torch.tensor([1e20, 1e20])
        k[0, 0, 1] = torch.tensor([-1e20, 2e20])
        q, k, v = (t.float().double() for t in (q, k, v))  # the values float32 holds
        got = sdpa._run("cpu", torch.float32, q, k, v, torch.ones(b, hq, lq, 1))
        gold = sdpa._run("reference", torch.float64, q, k, v, torch.ones(b, hq, lq, 1))
        for name, a, g in zip(sdpa.NAMES[:2], got, gold):
            assert torch.allclose(a.double(), g.to(a.dtype).double(), rtol=1e-6, atol=1e-6), name


@pytest.mark.parametrize("shape", [(2, 4, 1, 1, 37, 16, 16), (1, 8, 2, 4, 1025, 16, 16),
                                   (1, 2, 2, 5, 1030, 16, 24)], ids=str)
@pytest.mark.parametrize("which", ["softcap", "alibi", "alibi_batch", "sinks", "all"])
@pytest.mark.parametrize("mode", ["none", "causal_window"])
def test_modifiers(shape, which, mode):
    """Softcap, ALiBi (its diagonal top-left, as SDPA's) and sinks, against the contract's
    formula (tests/test_modifiers.py)."""
    q, k, v, dout = modifiers._inputs(*shape)
    kw = {"none": {}, "causal_window": dict(window=(600, 3), scale=0.3)}[mode]
    modifiers.check("cpu", torch.float32, q, k, v, dout,
                    mods=modifiers._modifiers(shape[1], shape[0], modifiers.WHICH[which]), **kw)


def test_modifiers_with_a_mask_and_empty_rows():
    b, hq, hkv, lq, lk = 2, 8, 2, 2, 1024
    q, k, v, dout = modifiers._inputs(b, hq, hkv, lq, lk, 16, 16)
    mask = torch.rand(b, hq, lq, lk, generator=torch.Generator().manual_seed(5)) > 0.4
    mask[1, 3] = False
    dlse = torch.randn(b, hq, lq, dtype=torch.float64)
    modifiers.check("cpu", torch.float32, q, k, v, dout, mask=mask, dlse=dlse,
                    mods=modifiers._modifiers(hq, b, modifiers.WHICH["all"]))


@pytest.mark.parametrize("hq,hkv,lq,e", [(1, 1, 1, 8), (1, 1, 1, 128), (8, 2, 1, 64),
                                         (4, 1, 4, 128)], ids=str)
def test_a_long_cache_of_equal_keys(hq, hkv, lq, e):
    """4M equal keys (stride-0 caches): every weight is 1/L and the output is the value row.
    Each key added to a running sum over its slice lost its low bits (0.13% off at 1M keys,
    49% at 256M); block sums and slices of at most 16k keys keep it near float32's rounding
    (torch's own kernel: 4% off here). Rows: four a call, GQA, lanes (16 rows)."""
    L = 1 << 22
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, hkv, 1, e, generator=gen).expand(1, hkv, L, e)
    v = torch.randn(1, hkv, 1, e, generator=gen).expand(1, hkv, L, e)
    q = torch.randn(1, hq, lq, e, generator=gen)
    out = attnx.attention_with_kvcache(q, k, v, L, is_causal=False, backend="cpu")
    want = v[:, :, :1].repeat_interleave(hq // hkv, dim=1).expand_as(out)
    assert (out - want).abs().max() <= 1e-4 * want.abs().max()


def test_strided_keys_and_values():
    """Keys and values as a model holds them ((B, L, H, E) transposed: read in place) and with
    a strided last dim (copied)."""
    q, k, v, dout = sdpa._inputs(2, 4, 2, 3, 1030, 16, 16)
    kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    sdpa._check(torch.float32, q, kt, vt, dout)
    ks = torch.stack([k, k], dim=-1)[..., 0]
    assert ks.stride(-1) == 2
    sdpa._check(torch.float32, q, ks, v, dout)


def test_avx2_bodies_match_reference():
    """ATTNX_CPU_AVX512=0: the 8-lane bodies (lane groups of 8 rows) on a CPU with AVX-512."""
    skip_unless_avx512()
    rerun_under("ATTNX_CPU_AVX512", __file__, "not avx2 and not blas",
                probe="cpu_vector", expect=("avx2", "baseline"))


def test_blas_engine_backward_matches_reference():
    """ATTNX_CPU_PANELS=0: the forward as before, the backward on the BLAS engine."""
    rerun_under("ATTNX_CPU_PANELS", __file__,
                "(matches_reference or masks or fully_masked or huge_finite) and not avx2"
                " and not blas", probe="cpu_gemm", expect=("blas",))
