"""attnx.nn.Attention against the score formulas of the seq2seq papers, written out here."""

import math

import numpy as np
import pytest
import torch

from attnx.nn import Attention

B, LQ, LK, DQ, DK = 2, 3, 5, 6, 6
D64 = torch.float64


def _data(dq=DQ, dk=DK, dv=None, lk=LK):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, LQ, dq, generator=g, dtype=D64)
    k = torch.randn(B, lk, dk, generator=g, dtype=D64)
    v = torch.randn(B, lk, dv, generator=g, dtype=D64) if dv else None
    return q, k, v


def _kpm(lk=LK):
    m = torch.zeros(B, lk, dtype=torch.bool)
    m[1, lk - 2:] = True
    return m


def _softmax_context(scores, value, kpm=None, allowed=None):
    """The papers' a_ij = softmax_j(e_ij) and c_i = sum_j a_ij value_j."""
    if kpm is not None:
        scores = scores.masked_fill(kpm[:, None, :], float("-inf"))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    a = torch.softmax(scores, dim=-1)
    return a @ value, a


def _formula(att, score, q, k):
    """e_ij for one head, straight from the papers."""
    if score == "additive":  # Bahdanau: v_a^T tanh(W_a s_i + U_a h_j)
        e = torch.tanh((q @ att.W_a.weight.T)[:, :, None, :] + (k @ att.U_a.weight.T)[:, None, :, :])
        return e @ att.v[0]
    if score == "dot":  # Luong: s_i^T h_j
        return torch.einsum("bid,bjd->bij", q, k)
    if score == "general":  # Luong: s_i^T W_a h_j, W_a stored as a Linear(query -> key) weight
        return torch.einsum("bid,de,bje->bij", q, att.W_a.weight.T, k)
    if score == "scaled_dot":  # Vaswani: s_i^T h_j / sqrt(d)
        return torch.einsum("bid,bjd->bij", q, k) / math.sqrt(q.shape[-1])
    if score == "cosine":  # Graves: beta * cos(s_i, h_j)
        cos = torch.einsum("bid,bjd->bij", q, k) / (q.norm(dim=-1)[:, :, None] * k.norm(dim=-1)[:, None, :])
        return att.sharpness * cos
    if score == "location":  # Luong: a_t = softmax(W_a s_t), positions only
        return (q @ att.W_a.weight.T + att.W_a.bias)[..., :k.shape[1]]
    raise AssertionError(score)


SCORES = ["additive", "dot", "general", "scaled_dot", "cosine", "location"]


@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("with_value", [False, True])
def test_scores_match_formulas(score, with_value):
    torch.manual_seed(0)
    att = Attention(DQ, DK, score=score, attn_dim=7, max_len=9, sharpness=2.5).double()
    q, k, v = _data(dv=4 if with_value else None)
    kpm = _kpm()
    q.requires_grad_(), k.requires_grad_()
    ctx, w = att(q, k, v, key_padding_mask=kpm, need_weights=True)
    want_ctx, want_w = _softmax_context(_formula(att, score, q, k), k if v is None else v, kpm)
    torch.testing.assert_close(ctx, want_ctx, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w, want_w, rtol=1e-10, atol=1e-10)
    params = [q, k] + list(att.parameters())
    wg = torch.randn(w.shape, generator=torch.Generator().manual_seed(1), dtype=D64)
    # the weights are differentiable too (a coverage or alignment loss uses them)
    g1 = torch.autograd.grad(ctx.pow(2).sum() + (w * wg).sum(), params, allow_unused=True)
    g2 = torch.autograd.grad(want_ctx.pow(2).sum() + (want_w * wg).sum(), params, allow_unused=True)
    for a, b in zip(g1, g2):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_concat_is_additive_and_different_dims():
    torch.manual_seed(0)
    att = Attention(5, 9, score="concat", attn_dim=4).double()
    q, k, _ = _data(5, 9)
    ctx, w = att(q, k, need_weights=True)
    want, want_w = _softmax_context(_formula(att, "additive", q, k), k)
    torch.testing.assert_close(ctx, want)
    torch.testing.assert_close(w, want_w)


@pytest.mark.parametrize("score", SCORES)
def test_local_window_and_attn_mask(score):
    """window=(D, D) is Luong's local-m attention: keys i-D..i+D around query i."""
    torch.manual_seed(0)
    att = Attention(DQ, DK, score=score, window=(1, 1), max_len=LK).double()
    q, k, _ = _data()
    attn_mask = torch.zeros(LQ, LK, dtype=D64)
    attn_mask[:, 1] = -0.7  # a float mask is added to the scores
    i, j = torch.arange(LQ)[:, None], torch.arange(LK)[None, :]
    allowed = (j >= i - 1) & (j <= i + 1)
    ctx, w = att(q, k, attn_mask=attn_mask, need_weights=True)
    want, want_w = _softmax_context(_formula(att, score, q, k) + attn_mask, k, allowed=allowed)
    torch.testing.assert_close(ctx, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w, want_w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("score", SCORES)
def test_query_offset_shifts_the_window(score):
    """A decoder's step t alone (query_offset=t) attends as row t of all steps at once."""
    torch.manual_seed(0)
    att = Attention(DQ, DK, score=score, window=(0, 1), max_len=LK).double()
    q, k, _ = _data()
    ctx, w = att(q, k, key_padding_mask=_kpm(), need_weights=True)
    for t in range(LQ):
        step, step_w = att(q[:, t:t + 1], k, key_padding_mask=_kpm(), need_weights=True,
                           query_offset=t)
        torch.testing.assert_close(step, ctx[:, t:t + 1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(step_w, w[:, t:t + 1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("score", ["additive", "scaled_dot", "cosine", "location"])
def test_multi_head_splits(score):
    torch.manual_seed(0)
    att = Attention(8, 8, score=score, attn_dim=6, num_heads=2, max_len=LK).double()
    q, k, _ = _data(8, 8)
    ctx, w = att(q, k, need_weights=True)
    assert w.shape == (B, 2, LQ, LK)
    for h in range(2):
        if score == "additive":
            wq, wk = att.W_a.weight[3 * h:3 * h + 3], att.U_a.weight[3 * h:3 * h + 3]
            e = torch.tanh((q @ wq.T)[:, :, None] + (k @ wk.T)[:, None]) @ att.v[h]
        elif score == "scaled_dot":
            qh, kh = q[..., 4 * h:4 * h + 4], k[..., 4 * h:4 * h + 4]
            e = qh @ kh.transpose(1, 2) / 2.0
        elif score == "cosine":  # per head: beta * cos(s_i, h_j) of the head's slices
            e = _formula(att, score, q[..., 4 * h:4 * h + 4], k[..., 4 * h:4 * h + 4])
        else:
            e = (q @ att.W_a.weight.T + att.W_a.bias).view(B, LQ, 2, LK)[:, :, h]
        want, want_w = _softmax_context(e, k[..., 4 * h:4 * h + 4])
        torch.testing.assert_close(ctx[..., 4 * h:4 * h + 4], want)
        torch.testing.assert_close(w[:, h], want_w)


def test_location_variable_key_length_and_limit():
    torch.manual_seed(0)
    att = Attention(DQ, DK, score="location", max_len=8).double()
    for lk in (1, 3, 8):
        q, k, _ = _data(lk=lk)
        ctx, _ = att(q, k)
        want, _ = _softmax_context(_formula(att, "location", q, k), k)
        torch.testing.assert_close(ctx, want)
    with pytest.raises(ValueError, match="max_len"):
        att(*_data(lk=9)[:2])


@pytest.mark.parametrize("score", SCORES)
def test_fully_masked_row_and_dropout(score):
    torch.manual_seed(0)
    att = Attention(DQ, DK, score=score, dropout=0.5, max_len=LK)
    q, k = _data()[0].float(), _data()[1].float()
    mask = torch.zeros(LQ, LK, dtype=torch.bool)
    mask[1] = True
    att.eval()
    ctx, w = att(q, k, attn_mask=mask, need_weights=True)
    assert torch.all(ctx[:, 1] == 0) and torch.all(w[:, 1] == 0) and torch.isfinite(ctx).all()
    att.train()
    torch.manual_seed(3)
    a, _ = att(q, k)
    torch.manual_seed(3)
    b, _ = att(q, k)
    assert torch.equal(a, b)


@pytest.mark.parametrize("score", SCORES)
def test_weights_under_dropout_are_the_ones_the_context_used(score):
    att = Attention(DQ, DK, score=score, dropout=0.5, max_len=LK).double().train()
    q, k, _ = _data()
    torch.manual_seed(5)
    ctx, w = att(q, k, key_padding_mask=_kpm(), need_weights=True)
    torch.testing.assert_close(ctx, w @ k)  # value defaults to key
    assert (w == 0).any() and (w.sum(-1) - 1).abs().max() > 1e-3


def test_bad_arguments():
    with pytest.raises(ValueError, match="score"):
        Attention(4, 4, score="bilinear")
    with pytest.raises(ValueError, match="query_dim == key_dim"):
        Attention(4, 6, score="dot")
    with pytest.raises(ValueError, match="num_heads"):
        Attention(4, 6, score="general", num_heads=4)
    att = Attention(4, 4, score="dot")
    q, k = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    with pytest.raises(TypeError, match="key_padding_mask: expected a mask of dtype torch.bool, torch.float32"):
        att(q, k, key_padding_mask=torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"key_padding_mask: expected shape \(2, 5\)"):
        att(q, k, key_padding_mask=torch.zeros(2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask: expected shape \(3, 5\) or \(2, 3, 5\)"):
        att(q, k, attn_mask=torch.zeros(1, 5))
    with pytest.raises(ValueError, match="query: expected a"):
        att(q[0], k)
    with pytest.raises(ValueError, match="attn_dim: expected >= 1"):
        Attention(4, 4, attn_dim=0)
    with pytest.raises(TypeError, match="key_dim: expected an int"):
        Attention(4, 4.0)
    with pytest.raises(ValueError, match="max_len: expected >= 1"):
        Attention(4, 4, score="location", max_len=0)
    Attention(np.int64(4), 4, max_len=0)  # numpy sizes, as nn.Linear takes; max_len unused
    with pytest.raises(TypeError, match="query: expected a torch.Tensor"):
        att([[0.0] * 4], k)
    with pytest.raises(TypeError, match="key: expected a torch.Tensor"):
        att(q, None)
    with pytest.raises(ValueError, match="query: expected a last dim of query_dim=4"):
        att(torch.randn(2, 3, 5), k)
    with pytest.raises(ValueError, match="key: expected a last dim of key_dim=4"):
        Attention(4, 4)(q, torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match="key: expected batch size 2"):
        att(q, k[:1])
    with pytest.raises(ValueError, match="value: expected"):
        att(q, k, torch.randn(2, 4, 4))
    with pytest.raises(TypeError, match="num_heads: expected an int"):
        Attention(4, 4, num_heads=2.0)
    with pytest.raises(ValueError, match="num_heads: expected >= 1"):
        Attention(4, 4, num_heads=0)
    two = Attention(4, 6, num_heads=2, attn_dim=8)
    with pytest.raises(ValueError, match=r"projected_key: expected shape \(2, 5, 8\)"):
        two(q, torch.randn(2, 5, 6), projected_key=torch.randn(2, 5, 6))
    with pytest.raises(ValueError, match="projected_key: expected shape"):
        two(q, torch.randn(2, 5, 6), projected_key=torch.randn(10, 8))
    with pytest.raises(ValueError, match="query_offset: expected >= 0"):
        att(q, k, query_offset=-1)
    with pytest.raises(TypeError, match="query_offset: expected an int"):
        att(q, k, query_offset=1.0)
    with pytest.raises(ValueError, match="dropout: expected 0 <= dropout <= 1"):
        Attention(4, 4, dropout=1.5)
    with pytest.raises(TypeError, match="dropout: expected a float"):
        Attention(4, 4, dropout="0.1")
    with pytest.raises(TypeError, match="window: expected left to be an int"):
        Attention(4, 4, window=(1.5, 2))


@pytest.mark.parametrize("score", SCORES)
def test_inputs_of_another_dtype_raise_naming_the_argument(score):
    """A float64 input to a float32 module: TypeError naming it, before any projection (one
    with weights raised nn.Linear's RuntimeError)."""
    att = Attention(4, 4, score=score)
    q, k = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    if score in ("additive", "general", "location"):  # the query meets W_a
        with pytest.raises(TypeError, match=r"query: expected dtype torch.float32 \(the module's\)"):
            att(q.double(), k.double())
    else:  # no weights: the dtype of the inputs
        assert att(q.double(), k.double())[0].dtype == torch.float64
    with pytest.raises(TypeError, match="key: expected dtype torch.float32"):
        att(q, k.double())
    with pytest.raises(TypeError, match="value: expected dtype torch.float32"):
        att(q, k, k.double())
    if score == "additive":
        with pytest.raises(TypeError, match="projected_key: expected dtype torch.float32"):
            att(q, k, projected_key=att.project_key(k).double())


@pytest.mark.parametrize("score", SCORES)
def test_no_keys_gives_zero_context_and_empty_weights(score):
    """Lk = 0: every row admits nothing, so zeros, as for a fully-masked row."""
    att = Attention(DQ, DQ, score=score)
    q, k = torch.randn(2, 3, DQ), torch.randn(2, 0, DQ)
    context, weights = att(q, k, need_weights=True)
    assert context.shape == (2, 3, DQ) and (context == 0).all()
    assert weights.shape == (2, 3, 0)


@pytest.mark.parametrize("score", ["dot", "general", "scaled_dot"])
def test_weights_of_huge_inputs_stay_finite(score):
    """float32 scores past the range (|q| |k| ~ 1e60): the weights come from float64 scores;
    every row still sums to 1."""
    torch.manual_seed(0)
    att = Attention(DQ, DK, score=score)
    q, k, _ = _data()
    ctx, w = att(q.float() * 1e30, k.float() * 1e30, need_weights=True)
    assert w.dtype == torch.float32 and torch.isfinite(w).all() and torch.isfinite(ctx).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(B, LQ))


@pytest.mark.parametrize("inputs_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("score", ["additive", "concat", "dot", "general", "scaled_dot", "cosine",
                                   "location"])
def test_runs_under_autocast(score, inputs_dtype):
    """Under autocast the projections come out bf16 beside float32 (or bf16) inputs and
    float32 parameters, as torch.nn's modules take them: the op got mixed dtypes ("v: expected
    dtype torch.bfloat16", "key: expected ...", a bf16 location mask beside float32 queries).
    The result: the float32 one within bf16's rounding of a few products."""
    torch.manual_seed(0)
    kw = dict(max_len=8) if score == "location" else {}
    module = Attention(8, 8, score=score, num_heads=2, **kw)
    query, key = torch.randn(2, 5, 8), torch.randn(2, 7, 8)
    with torch.no_grad():
        want, _ = module(query, key)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, weights = module(query.to(inputs_dtype), key.to(inputs_dtype), need_weights=True)
    assert torch.isfinite(got).all() and weights.shape == (2, 2, 5, 7)
    assert (got.float() - want).abs().max() <= 0.03 * want.abs().max()
