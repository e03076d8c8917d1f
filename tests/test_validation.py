"""Bad input raises ValueError/TypeError naming the argument, before any kernel runs."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right

import attnx

Q = torch.randn(2, 4, 8, 16)
K = torch.randn(2, 4, 10, 16)
V = torch.randn(2, 4, 10, 12)


def assert_raises_naming(fn, over, exc, words):
    """fn(**over) raises exc, and its message contains every one of words."""
    with pytest.raises(exc) as info:
        fn(**over)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def sdpa(**over):
    args = dict(query=Q, key=K, value=V)
    args.update(over)
    return attnx.scaled_dot_product_attention(**args)


SDPA_CASES = [
    # (overrides, exception, words the message must contain)
    (dict(query=Q.numpy()), TypeError, ["query", "Tensor", "ndarray"]),
    (dict(query=Q.int()), TypeError, ["query", "floating", "int32"]),
    (dict(key=K.double()), TypeError, ["key", "float32", "float64"]),
    (dict(value=torch.randn(2, 4, 10)), ValueError, ["value", "sequence length 10", "(2, 4, 10)"]),
    (dict(query=torch.randn(5)), ValueError, ["query", "at least 2"]),
    (dict(key=torch.randn(2, 4, 10, 15)), ValueError, ["key", "head dim 16"]),
    (dict(value=torch.randn(2, 4, 9, 12)), ValueError, ["value", "sequence length 10"]),
    (dict(key=torch.randn(3, 4, 10, 16)), ValueError, ["key", "batch dims"]),
    (dict(key=torch.randn(2, 2, 10, 16), value=torch.randn(2, 2, 10, 12)), ValueError, ["key", "enable_gqa"]),
    (dict(key=torch.randn(2, 3, 10, 16), value=torch.randn(2, 3, 10, 12), enable_gqa=True), ValueError, ["key", "dividing 4"]),
    (dict(value=torch.randn(2, 2, 10, 12)), ValueError, ["value", "4 heads"]),
    # one head broadcasts to any count but zero (torch's matmul broadcasting, then a mismatch)
    (dict(key=torch.randn(2, 0, 10, 16), value=torch.randn(2, 1, 10, 12)), ValueError, ["value", "0 heads"]),
    (dict(key=torch.randn(2, 1, 10, 16), value=torch.randn(2, 0, 10, 12)), ValueError, ["value", "1 heads"]),
    (dict(attn_mask=torch.ones(8, 9, dtype=torch.bool)), ValueError, ["attn_mask", "broadcasts to (2, 4, 8, 10)", "(8, 9)"]),
    (dict(attn_mask=torch.ones(3, 4, 8, 10, dtype=torch.bool)), ValueError, ["attn_mask", "(3, 4, 8, 10)"]),
    (dict(attn_mask=torch.ones(8, 10, dtype=torch.int64)), TypeError, ["attn_mask", "torch.bool", "int64"]),
    (dict(attn_mask=torch.ones(8, 10, dtype=torch.float64)), TypeError, ["attn_mask", "float32", "float64"]),
    (dict(attn_mask=[[True]]), TypeError, ["attn_mask", "list"]),
    (dict(attn_mask=causal_lower_right(8, 11)), ValueError, ["attn_mask", "CausalBias", "(8, 10)", "(8, 11)"]),
    (dict(attn_mask=torch.ones(8, 10, dtype=torch.bool), is_causal=True), ValueError, ["attn_mask", "is_causal"]),
    (dict(is_causal=1), TypeError, ["is_causal", "bool", "int"]),
    (dict(is_causal=np.bool_(True)), TypeError, ["is_causal", "expected a bool, got numpy.bool"]),
    (dict(attn_mask=causal_lower_right(8, 10), is_causal=True), ValueError,
     ["attn_mask", "CausalBias(LOWER_RIGHT, seq_len_q=8, seq_len_kv=10)"]),
    (dict(enable_gqa="yes"), TypeError, ["enable_gqa", "bool", "str"]),
    (dict(dropout_p=1.5), ValueError, ["dropout_p", "<= 1", "1.5"]),
    (dict(dropout_p=-0.1), ValueError, ["dropout_p", "-0.1"]),
    (dict(dropout_p="0.1"), TypeError, ["dropout_p", "float", "str"]),
    (dict(scale=torch.tensor([0.5])), TypeError, ["scale", "float", "shape=(1,)"]),
    (dict(dropout_p=torch.tensor(True)), TypeError, ["dropout_p", "float", "torch.bool"]),
    (dict(dropout_p=torch.tensor(0.1, device="meta")), TypeError, ["dropout_p", "float", "meta"]),
    (dict(scale=torch.tensor(0.3, requires_grad=True)), TypeError, ["scale", "float", "Tensor"]),
    (dict(scale=math.nan), ValueError, ["scale", "finite", "nan"]),
    (dict(scale="1"), TypeError, ["scale", "float", "str"]),
    (dict(scale=1e39), ValueError, ["scale", "float32 can hold", "1e+39"]),
    (dict(scale=-2.4e38), ValueError, ["scale", "log2(e)", "2.359e+38", "-2.4e+38"]),
    # ints past a float's range (float() raises OverflowError without the argument's name)
    (dict(scale=2**1024), ValueError, ["scale", "1025 bits", "too large for a float"]),
    (dict(dropout_p=2**1024), ValueError, ["dropout_p", "too large for a float"]),
    (dict(softcap=-(2**1030)), ValueError, ["softcap", "1031 bits", "too large for a float"]),
    (dict(window=(1, 2, 3)), ValueError, ["window", "pair"]),
    (dict(window=(-1, 2)), ValueError, ["window", "left >= 0", "-1"]),
    (dict(window=(1, 2.5)), TypeError, ["window", "right", "float"]),
    (dict(window=5), ValueError, ["window", "pair", "5"]),
    (dict(backend="gpu"), ValueError, ["backend", "'gpu'", "reference"]),
    (dict(backend=3), TypeError, ["backend", "int"]),
    (dict(backend="cuda"), ValueError, ["backend", "'cuda'", "CUDA"]),
    (dict(return_lse=None), TypeError, ["return_lse", "bool", "NoneType"]),
    (dict(query=Q.to_sparse()), TypeError, ["query", "dense", "sparse_coo"]),
    (dict(attn_mask=torch.ones(8, 10).to_sparse()), TypeError, ["attn_mask", "dense", "sparse_coo"]),
    (dict(attn_mask=torch.ones(2, 1, 1, 8, 10)), ValueError, ["attn_mask", "(2, 4, 8, 10)"]),
    # float32 queries: one dtype named, not "float32 or torch.float32"
    (dict(sinks=torch.zeros(4, dtype=torch.float64)), TypeError,
     ["sinks: expected dtype torch.float32, got torch.float64"]),
    (dict(query=Q.half(), key=K.half(), value=V.half(), sinks=torch.zeros(4, dtype=torch.float64)),
     TypeError, ["sinks: expected dtype torch.float32 or torch.float16 (that of the query)"]),
]


@pytest.mark.parametrize("over,exc,words", SDPA_CASES, ids=[str(i) for i in range(len(SDPA_CASES))])
def test_sdpa_bad_input(over, exc, words):
    assert_raises_naming(sdpa, over, exc, words)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_zero_d_tensor_scale_and_dropout_p_as_in_torch(backend):
    """torch's function takes a 0-d tensor where it takes a float (scale, dropout_p): a drop-in
    caller's did not reach attnx (TypeError)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g) for _ in range(3))
    got = attnx.scaled_dot_product_attention(q, k, v, scale=torch.tensor(0.3, dtype=torch.float64),
                                             dropout_p=torch.tensor(0.0), backend=backend)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(
        q, k, v, scale=torch.tensor(0.3), dropout_p=torch.tensor(0.0)))
    with pytest.raises(ValueError, match="dropout_p: expected 0 <= dropout_p <= 1, got 2"):
        attnx.scaled_dot_product_attention(q, k, v, dropout_p=torch.tensor(2), backend=backend)


def test_meta_device_mismatch():
    with pytest.raises(TypeError, match="key: expected device cpu"):
        sdpa(key=K.to("meta"))
    with pytest.raises(TypeError, match="attn_mask: expected device cpu"):
        sdpa(attn_mask=torch.ones(8, 10, dtype=torch.bool, device="meta"))


def test_meta_tensors_give_meta_results_on_the_default_backend():
    """Meta tensors (shapes only) run through backend=None as through torch's functions: the
    reference's float64 rerun test, which reads values, is left out for them (it raised
    RuntimeError from Tensor.item()); varlen's shapes depend on cu_seqlens' values."""
    out = sdpa(query=Q.to("meta"), key=K.to("meta"), value=V.to("meta"), is_causal=True)
    assert out.device.type == "meta" and out.shape == (2, 4, 8, 12)
    out = attnx.additive_attention(*(t.to("meta") for t in (A_Q, A_K, A_VAL, A_V)))
    assert out.device.type == "meta" and out.shape == (2, 3, 5, 4)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device="meta")
    x = torch.randn(7, 2, 8, device="meta")
    with pytest.raises(TypeError, match="cu_seqlens_q: expected a tensor with values"):
        attnx.varlen_attention(x, x, x, cu, cu)


A_Q, A_K, A_VAL, A_V = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4), torch.randn(8)


def additive(**over):
    args = dict(query=A_Q, key=A_K, value=A_VAL, v=A_V)
    args.update(over)
    return attnx.additive_attention(**args)


ADDITIVE_CASES = [
    (dict(v=torch.randn(7)), ValueError, ["v", "(8,)", "(3, 8)", "(7,)"]),
    (dict(v=torch.randn(2, 8)), ValueError, ["v", "(3, 8)", "(2, 8)"]),
    (dict(v=torch.randn(1, 3, 8)), ValueError, ["v", "dimensions"]),
    (dict(v=A_V.double()), TypeError, ["v", "float32", "float64"]),
    (dict(query=torch.randn(2, 3, 5, 9)), ValueError, ["key", "(2, 3, 'Lk', 9)"]),
    (dict(key=torch.randn(2, 2, 7, 8)), ValueError, ["key", "match query"]),
    (dict(value=torch.randn(2, 3, 6, 4)), ValueError, ["value", "match key"]),
    (dict(query=torch.randn(5, 8)), ValueError, ["query", "3 to 4"]),
    (dict(query=torch.randn(1, 2, 3, 5, 8)), ValueError, ["query", "3 to 4"]),
    (dict(attn_mask=torch.ones(5, 6, dtype=torch.bool)), ValueError, ["attn_mask", "(2, 3, 5, 7)"]),
    (dict(attn_mask=torch.ones(5, 7), is_causal=True), ValueError, ["attn_mask", "is_causal"]),
    (dict(dropout_p=2), ValueError, ["dropout_p"]),
    (dict(return_weights=1), TypeError, ["return_weights"]),
    (dict(window=(1,)), ValueError, ["window"]),
    (dict(backend="cuda"), ValueError, ["backend", "'cuda'"]),
]


@pytest.mark.parametrize("over,exc,words", ADDITIVE_CASES, ids=[str(i) for i in range(len(ADDITIVE_CASES))])
def test_additive_bad_input(over, exc, words):
    assert_raises_naming(additive, over, exc, words)


def test_nested_query_is_named():
    nested = torch.nested.nested_tensor([torch.randn(4, 8, 16)], layout=torch.jagged)
    assert_raises_naming(sdpa, dict(query=nested), TypeError, ["query", "dense", "nested"])


@pytest.mark.parametrize("mask_shape", [(1, 1, 5, 7), (1, 2, 5, 7), (1, 1, 1, 5, 7)])
def test_masks_with_leading_ones_beyond_the_inputs_rank_as_in_torch(mask_shape):
    """torch 2.14's function accepts a (1, 1, Lq, Lk) mask with 3-D inputs (2.11's rejects
    it); attnx does, on every supported torch: the leading ones broadcast away."""
    q, k, v = torch.randn(2, 5, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 4)
    mask = torch.randn(mask_shape)
    got = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.view(-1, 5, 7)))
    out = attnx.additive_attention(q, k, v, A_V, attn_mask=mask)
    torch.testing.assert_close(out, attnx.additive_attention(q, k, v, A_V, attn_mask=mask.view(-1, 5, 7)))


def test_additive_three_d_mask_shape():
    q, k, val = torch.randn(2, 5, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 4)
    with pytest.raises(ValueError, match=r"broadcasts to \(2, 5, 7\)"):
        attnx.additive_attention(q, k, val, A_V, attn_mask=torch.ones(3, 5, 7, dtype=torch.bool))


dims = st.integers(min_value=0, max_value=5)


@settings(max_examples=150, deadline=None)
@given(bq=dims, hq=dims, lq=dims, e=dims, bk=dims, hk=dims, lk=dims, ek=dims, lv=dims, ev=dims,
       mask_shape=st.none() | st.lists(dims, min_size=0, max_size=4),
       gqa=st.booleans(), causal=st.booleans(),
       window=st.none() | st.tuples(st.integers(-2, 4) | st.none(), st.integers(-2, 4) | st.none()))
def test_sdpa_any_shapes_either_work_or_raise_cleanly(bq, hq, lq, e, bk, hk, lk, ek, lv, ev, mask_shape,
                                                        gqa, causal, window):
    q = torch.randn(bq, hq, lq, e)
    k = torch.randn(bk, hk, lk, ek)
    v = torch.randn(bk, hk, lv, ev)
    mask = None if mask_shape is None else torch.rand(mask_shape) > 0.5
    try:
        out = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                                 enable_gqa=gqa, window=window, backend="reference")
    except (ValueError, TypeError) as err:
        assert any(n in str(err) for n in ("query", "key", "value", "attn_mask", "window")), str(err)
        return
    # batch and a single query head broadcast, as in torch's function
    assert out.shape == (torch.broadcast_shapes((bq,), (bk,))[0], hk if hq == 1 else hq, lq, ev)
    assert not torch.isnan(out).any()


def test_broadcast_agrees_with_torch():
    """_validate._broadcast (plain Python, for speed) against torch.broadcast_shapes, sizes 0-3
    included, on every pair and triple of a few hundred random shapes."""
    import random

    from attnx._validate import _broadcast

    rng = random.Random(0)
    shapes = [tuple(rng.choice([0, 1, 1, 2, 3]) for _ in range(rng.randint(0, 4))) for _ in range(60)]
    for a in shapes:
        for b in shapes[:30]:
            for more in ((), (shapes[(len(a) * 7 + len(b)) % 60],)):
                try:
                    want = tuple(torch.broadcast_shapes(a, b, *more))
                except RuntimeError:
                    want = None
                assert _broadcast(a, b, *more) == want, (a, b, more)
