"""The functional ops under torch.autocast take what torch's SDPA takes there.

torch runs its SDPA as an autocast op of lower precision: every floating input but float64 is
cast to autocast's dtype (so q, k, v of mixed dtypes are fine, and a float32 call returns bf16).
attnx's scaled_dot_product_attention, varlen_attention and additive_attention do the same before
their checks; float32 masks and sinks stay float32 (the kernels take them with any query dtype).
attention_with_kvcache does not cast: its caches are the caller's, written in place.
"""

import pytest
import torch
import torch.nn.functional as F

import attnx

BACKENDS = ["cpu", "reference"]


def _qkv(*shapes, dtypes=None, grad=False):
    g = torch.Generator().manual_seed(0)
    dtypes = dtypes or (torch.float32,) * len(shapes)
    return [torch.randn(*s, generator=g).to(dt).requires_grad_(grad) for s, dt in zip(shapes, dtypes)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_sdpa_runs_in_the_autocast_dtype(backend, amp):
    """float32 inputs come out in autocast's dtype, the same call as on inputs cast by hand; the
    gradients reach the float32 leaves in float32; torch's SDPA under the same autocast agrees
    within the dtype's rounding."""
    q, k, v = _qkv((2, 4, 17, 16), (2, 2, 23, 16), (2, 2, 23, 8), grad=True)
    with torch.autocast("cpu", dtype=amp):
        got = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                 backend=backend)
        peer = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert got.dtype == peer.dtype == amp
    by_hand = attnx.scaled_dot_product_attention(*(t.detach().to(amp) for t in (q, k, v)),
                                                 is_causal=True, enable_gqa=True, backend=backend)
    assert torch.equal(got, by_hand)
    assert (got.float() - peer.float()).abs().max() <= 4 * torch.finfo(amp).eps * peer.abs().max().float()
    got.float().sum().backward()
    assert all(t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sdpa_takes_mixed_dtypes_under_autocast_only(backend):
    """q float32, k bfloat16, v float16: a TypeError naming key outside autocast (as before),
    bfloat16 inside it, as torch gives; float64 stays float64 (torch's rule too)."""
    q, k, v = _qkv((1, 2, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8),
                   dtypes=(torch.float32, torch.bfloat16, torch.float16))
    with pytest.raises(TypeError, match="key: expected dtype torch.float32"):
        attnx.scaled_dot_product_attention(q, k, v, backend=backend)
    with torch.autocast("cpu"):
        got = attnx.scaled_dot_product_attention(q, k, v, backend=backend)
        wide = attnx.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), backend=backend)
    assert got.dtype == torch.bfloat16 and wide.dtype == torch.float64
    assert torch.equal(got, attnx.scaled_dot_product_attention(
        *(t.bfloat16() for t in (q, k, v)), backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_masks_and_sinks_under_autocast(backend):
    """A float32 mask and float32 sinks stay float32 (added as the kernels add them for any
    query dtype); a float16 mask under bf16 autocast is cast, not refused; bool masks as given."""
    q, k, v = _qkv((1, 2, 6, 8), (1, 2, 9, 8), (1, 2, 9, 8))
    g = torch.Generator().manual_seed(1)
    mask = torch.randn(6, 9, generator=g)
    sinks = torch.randn(2, generator=g)
    bq, bk, bv = (t.bfloat16() for t in (q, k, v))
    with torch.autocast("cpu"):
        got = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, sinks=sinks, backend=backend)
        half_mask = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask.half(), backend=backend)
        bool_mask = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask > 0, backend=backend)
    assert torch.equal(got, attnx.scaled_dot_product_attention(bq, bk, bv, attn_mask=mask,
                                                               sinks=sinks, backend=backend))
    assert torch.equal(half_mask, attnx.scaled_dot_product_attention(
        bq, bk, bv, attn_mask=mask.half().bfloat16(), backend=backend))
    assert torch.equal(bool_mask, attnx.scaled_dot_product_attention(bq, bk, bv, attn_mask=mask > 0,
                                                                     backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_and_additive_under_autocast(backend):
    """varlen_attention and additive_attention (v too) cast as SDPA does; their results are
    the calls on inputs cast by hand."""
    q, k, v = _qkv((9, 4, 8), (12, 2, 8), (12, 2, 8), dtypes=(torch.float32, torch.bfloat16, torch.float32))
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    with torch.autocast("cpu"):
        got = attnx.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, backend=backend)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, attnx.varlen_attention(*(t.bfloat16() for t in (q, k, v)), cu_q, cu_k,
                                                   is_causal=True, backend=backend))

    qa, ka, val, w = _qkv((2, 5, 8), (2, 7, 8), (2, 7, 4), (8,), grad=True)
    with torch.autocast("cpu"):
        out, weights = attnx.additive_attention(qa, ka.bfloat16(), val, w, backend=backend,
                                                return_weights=True)
    assert out.dtype == weights.dtype == torch.bfloat16
    want, want_w = attnx.additive_attention(*(t.detach().bfloat16() for t in (qa, ka, val, w)),
                                            backend=backend, return_weights=True)
    assert torch.equal(out, want) and torch.equal(weights, want_w)
    out.float().sum().backward()
    assert all(t.grad.dtype == torch.float32 for t in (qa, ka, val, w))


def test_kvcache_keeps_its_dtype_under_autocast():
    """The decoding op reads (and writes in place) the caller's caches: no cast, float32 out."""
    q, kc, vc = _qkv((1, 4, 1, 8), (1, 2, 16, 8), (1, 2, 16, 8))
    lens = torch.tensor([10], dtype=torch.int32)
    with torch.autocast("cpu"):
        got = attnx.attention_with_kvcache(q, kc, vc, lens)
    assert got.dtype == torch.float32
    assert torch.equal(got, attnx.attention_with_kvcache(q, kc, vc, lens))


def test_autocast_compiles_fullgraph():
    """The cast traces under torch.compile without a graph break."""
    q, k, v = _qkv((1, 2, 9, 8), (1, 2, 9, 8), (1, 2, 9, 8))

    def f(q, k, v):
        with torch.autocast("cpu"):
            return attnx.scaled_dot_product_attention(q, k, v, backend="reference")

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, f(q, k, v))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", [None, "cuda", "triton"])
def test_cuda_under_autocast(backend):
    """On a GPU: float32 in, float16 out (CUDA autocast's default), the call by hand's result."""
    q, k, v = (t.cuda() for t in _qkv((2, 4, 33, 64), (2, 4, 33, 64), (2, 4, 33, 64)))
    with torch.autocast("cuda"):
        got = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
    assert got.dtype == torch.float16
    assert torch.equal(got, attnx.scaled_dot_product_attention(*(t.half() for t in (q, k, v)),
                                                               is_causal=True, backend=backend))
    with torch.autocast("cpu"):  # another device type's autocast leaves CUDA tensors alone
        assert attnx.scaled_dot_product_attention(q, k, v, backend=backend).dtype == torch.float32


def test_reference_backward_inside_autocast():
    """A backward called inside the autocast block: the reference backend recomputes its float32
    math with autocast off, as its forward ran (it was downcast there: 2.5e-3 relative error of
    a float mask's gradient, where outside the block it is 6e-8)."""
    q, k, v, mask = _qkv((1, 2, 6, 8), (1, 2, 9, 8), (1, 2, 9, 8), (6, 9), grad=True)
    grads = []
    for inside in (True, False):
        for t in (q, k, v, mask):
            t.grad = None
        with torch.autocast("cpu"):
            out = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend="reference")
            if inside:
                out.float().sum().backward()
        if not inside:
            out.float().sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v, mask)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_nn_modules_take_what_torch_nn_takes_under_autocast():
    """attnx.nn under autocast: a mask in autocast's dtype beside float32 inputs (torch.nn's
    MultiheadAttention takes it), and seq2seq attention whose keys (a GRU's float32 states) meet
    bf16 projections; the weights come out in the output's dtype."""
    import attnx.nn as ann
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32)
    mask = torch.zeros(7, 7).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), -1e4)
    ours, theirs = ann.MultiheadAttention(32, 4, batch_first=True), torch.nn.MultiheadAttention(
        32, 4, batch_first=True)
    ours.load_state_dict(theirs.state_dict())
    with torch.no_grad(), torch.autocast("cpu"):
        got, _ = ours(x, x, x, attn_mask=mask.bfloat16())
        want, _ = theirs(x, x, x, attn_mask=mask.bfloat16())
    assert got.dtype == want.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 0.05 * want.float().abs().max()

    att = ann.Attention(16, 16, score="dot", num_heads=2)
    query, key = torch.randn(2, 5, 16).bfloat16(), torch.randn(2, 7, 16)
    with torch.no_grad(), torch.autocast("cpu"):
        out, weights = att(query, key, need_weights=True)
    assert out.dtype == weights.dtype == torch.bfloat16
    seq = ann.Seq2Seq(20, 20, emb_dim=16, hidden_dim=32, rnn="gru")
    src, tgt = torch.randint(0, 20, (2, 6)), torch.randint(0, 20, (2, 5))
    with torch.no_grad(), torch.autocast("cpu"):
        logits = seq(src, tgt)[0]  # (logits, attention weights)
    assert logits.shape[:2] == (2, 5) and torch.isfinite(logits.float()).all()
