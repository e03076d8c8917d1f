"""attnx.nn.MultiheadAttention against torch.nn.MultiheadAttention with the same weights."""

import pytest
import torch

import attnx.nn as ann
from attnx.nn._masks import combine
from _compare import assert_within

E, H = 12, 3


def _pair(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, dtype=dtype, **kw)
    torch.manual_seed(1)
    ours = ann.MultiheadAttention(E, H, dtype=dtype, **kw)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


def _inputs(n, lq, lk, batch_first, kdim=E, vdim=E, dtype=torch.float64):
    g = torch.Generator().manual_seed(2)
    shape = (lambda l, d: (n, l, d)) if batch_first else (lambda l, d: (l, n, d))
    q = torch.randn(shape(lq, E), generator=g, dtype=dtype)
    k = torch.randn(shape(lk, kdim), generator=g, dtype=dtype)
    v = torch.randn(shape(lk, vdim), generator=g, dtype=dtype)
    return q, k, v


def _masks(n, lq, lk, kind, extra_keys=0):
    """Random torch.nn-convention masks (True = masked) that leave every row one key."""
    g = torch.Generator().manual_seed(3)
    attn = torch.rand(lq, lk, generator=g) < 0.4
    attn[torch.arange(lq), torch.arange(lq) % lk] = False
    kpm = torch.rand(n, lk, generator=g) < 0.3
    kpm[:, 0] = False
    attn[:, 0] = False
    out = {}
    if "attn2d" in kind:
        out["attn_mask"] = attn
    if "attn3d" in kind:
        a3 = torch.rand(n * H, lq, lk, generator=g) < 0.4
        a3[:, :, 0] = False
        out["attn_mask"] = a3
    if "kpm" in kind:
        out["key_padding_mask"] = kpm
    if "float" in kind:
        out = {k: torch.zeros(m.shape, dtype=torch.float64).masked_fill(m, float("-inf"))
               + 0.1 * torch.randn(m.shape, generator=g, dtype=torch.float64) for k, m in out.items()}
    return out


def _grads(module, inputs):
    return [t.grad for t in inputs] + [p.grad for p in module.parameters()]


def _run(module, inputs, kwargs):
    inputs = [t.clone().requires_grad_() for t in inputs]
    out, w = module(*inputs, **kwargs)
    loss = out.pow(2).sum() + (w.pow(2).sum() if w is not None else 0)
    module.zero_grad()
    loss.backward()
    return out, w, _grads(module, inputs)


def _check(ours, ref, inputs, kwargs, tol=1e-10):
    o1, w1, g1 = _run(ours, inputs, kwargs)
    o2, w2, g2 = _run(ref, inputs, kwargs)
    torch.testing.assert_close(o1, o2, rtol=tol, atol=tol)
    assert (w1 is None) == (w2 is None)
    if w1 is not None:
        torch.testing.assert_close(w1, w2, rtol=tol, atol=tol)
    for a, b in zip(g1, g2):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["none", "kpm", "kpm_float", "attn2d", "attn2d_float", "attn3d",
                                  "attn3d_float", "attn2d_kpm", "attn3d_kpm_float"])
@pytest.mark.parametrize("batch_first,need_weights,average",
                         [(False, False, True), (True, True, True), (False, True, False)])
def test_masks_and_weights(batch_first, kind, need_weights, average):
    ours, ref = _pair(batch_first=batch_first)
    n, lq, lk = 2, 5, 7
    kwargs = dict(_masks(n, lq, lk, kind), need_weights=need_weights, average_attn_weights=average)
    _check(ours, ref, _inputs(n, lq, lk, batch_first), kwargs)


@pytest.mark.parametrize("opts", [dict(kdim=5, vdim=7), dict(bias=False), dict(add_bias_kv=True),
                                  dict(add_zero_attn=True),
                                  dict(add_bias_kv=True, add_zero_attn=True, kdim=5, vdim=4)])
@pytest.mark.parametrize("kind", ["attn2d_kpm", "kpm_float"])
def test_constructor_options(opts, kind):
    ours, ref = _pair(batch_first=True, **opts)
    n, lq, lk = 3, 1, 17
    inputs = _inputs(n, lq, lk, True, opts.get("kdim", E), opts.get("vdim", E))
    _check(ours, ref, inputs, dict(_masks(n, lq, lk, kind), need_weights=True))


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("with_kpm", [False, True])
def test_is_causal_hint(need_weights, with_kpm):
    ours, ref = _pair(batch_first=True)
    n, l = 2, 6
    kwargs = dict(attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(l, dtype=torch.float64),
                  is_causal=True, need_weights=need_weights)
    if with_kpm:
        kwargs["key_padding_mask"] = _masks(n, l, l, "kpm")["key_padding_mask"]
    _check(ours, ref, _inputs(n, l, l, True), kwargs)
    with pytest.raises(ValueError, match="is_causal"):  # torch: RuntimeError; API.md: ValueError
        ours(*_inputs(n, l, l, True), is_causal=True)


def test_unbatched():
    ours, ref = _pair()
    q, k, v = (t[:, 0] for t in _inputs(1, 4, 6, False))
    kpm = torch.tensor([False, True, False, False, True, False])
    _check(ours, ref, (q, k, v), dict(key_padding_mask=kpm, average_attn_weights=False))


def test_self_attention_eval_matches_torch_fast_path():
    ours, ref = _pair(dtype=torch.float32, batch_first=True)
    ours.eval(), ref.eval()
    x = torch.randn(2, 9, E)
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 6:] = True
    with torch.no_grad():
        o1, w1 = ours(x, x, x, key_padding_mask=kpm)
        o2, w2 = ref(x, x, x, key_padding_mask=kpm)  # torch's fused fast path
        x64 = x.double()
        gold, _ = _pair(batch_first=True)[1].eval()(x64, x64, x64, key_padding_mask=kpm)
    assert_within(o1, gold, o2, factor=4.0, floor=1e-6)
    torch.testing.assert_close(w1, w2, rtol=1e-5, atol=1e-6)


def test_float32_error_bounded_by_torch():
    ours, ref = _pair(dtype=torch.float32, batch_first=True)
    _, gold_mod = _pair(batch_first=True)
    q, k, v = _inputs(3, 17, 97, True)
    masks = _masks(3, 17, 97, "attn2d_kpm")
    gold, _ = gold_mod(q, k, v, **masks)
    o1, _ = ours(q.float(), k.float(), v.float(), **masks)
    o2, _ = ref(q.float(), k.float(), v.float(), **masks)
    assert_within(o1, gold, o2, factor=4.0, floor=1e-6)


def test_bfloat16_module_with_a_float32_mask_adds_it_in_float32():
    """torch's MultiheadAttention passes a float32 attn_mask to its SDPA as it is (added to the
    scores in float32); a mask cast to bfloat16 would move them by up to ~0.1 at |mask| ~ 40."""
    ours, ref = _pair(dtype=torch.bfloat16, batch_first=True)
    _, gold_mod = _pair(batch_first=True)
    q, k, v = _inputs(3, 17, 33, True)
    g = torch.Generator().manual_seed(4)
    mask = torch.randn(17, 33, generator=g).mul(40)
    kpm = _masks(3, 17, 33, "kpm")["key_padding_mask"]
    low = [t.to(torch.bfloat16).double() for t in (q, k, v)]  # the same inputs in float64
    gold, _ = gold_mod(*low, attn_mask=mask.double(), key_padding_mask=kpm, need_weights=False)
    kw = dict(attn_mask=mask, key_padding_mask=kpm, need_weights=False)
    o1, _ = ours(*(t.to(torch.bfloat16) for t in (q, k, v)), **kw)
    o2, _ = ref(*(t.to(torch.bfloat16) for t in (q, k, v)), **kw)
    assert o1.dtype == torch.bfloat16
    assert_within(o1, gold, o2, factor=2.0, floor=1e-5)
    # the bf16 projections' error hides the mask's rounding above: the mask the kernel gets
    merged = combine([mask, kpm.view(3, 1, 1, 33)], torch.bfloat16)
    assert merged.dtype == torch.float32
    assert torch.equal(merged, mask.masked_fill(kpm.view(3, 1, 1, 33), float("-inf")))


def test_state_dict_both_ways():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, kdim=5, vdim=6, add_bias_kv=True)
    torch.manual_seed(0)
    ours = ann.MultiheadAttention(E, H, kdim=5, vdim=6, add_bias_kv=True)
    # Same seed, same initialisation: the class only replaces forward.
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    fresh_ref = torch.nn.MultiheadAttention(E, H, kdim=5, vdim=6, add_bias_kv=True)
    fresh_ref.load_state_dict(ours.state_dict(), strict=True)
    fresh = ann.MultiheadAttention(E, H, kdim=5, vdim=6, add_bias_kv=True)
    fresh.load_state_dict(ref.state_dict(), strict=True)


def test_gradient_penalty_matches_torch():
    """Differentiating a gradient again (WGAN-GP's penalty) works as with torch's module, whose
    need_weights=True path computes the attention in plain PyTorch."""
    grads = []
    for cls in (torch.nn.MultiheadAttention, ann.MultiheadAttention):
        torch.manual_seed(0)
        m = cls(6, 2, batch_first=True, dtype=torch.float64)
        x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
        g, = torch.autograd.grad(m(x, x, x)[0].sum(), x, create_graph=True)
        g.pow(2).sum().backward()
        grads.append(m.in_proj_weight.grad)
    torch.testing.assert_close(*grads)


def test_fully_masked_row_gives_zeros():
    ours, _ = _pair(batch_first=True)
    q, k, v = _inputs(2, 3, 4, True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[1] = True  # query 1 may attend nothing
    q.requires_grad_()
    out, w = ours(q, k, v, attn_mask=mask)
    bias = ours.out_proj.bias
    torch.testing.assert_close(out[:, 1], bias.expand(2, E))  # zero attention -> out_proj(0)
    assert torch.all(w[:, 1] == 0)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    assert torch.all(q.grad[:, 1] == 0)


def test_dropout_runs_and_is_reproducible():
    ours, _ = _pair(batch_first=True, dropout=0.5)
    ours.train()
    q, k, v = _inputs(2, 5, 8, True)
    torch.manual_seed(7)
    a, _ = ours(q, k, v, need_weights=False)
    torch.manual_seed(7)
    b, _ = ours(q, k, v, need_weights=False)
    torch.manual_seed(8)
    c, _ = ours(q, k, v, need_weights=False)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    ours.eval()
    d, _ = ours(q, k, v)
    e, _ = _pair(batch_first=True, dropout=0.5)[1].eval()(q, k, v)
    torch.testing.assert_close(d, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("p", [0.5, 1.0])
def test_weights_under_dropout_are_the_ones_the_output_used(p):
    """As torch's: weights after dropout, so out = out_proj(weights @ V per head)."""
    ours, _ = _pair(batch_first=True, dropout=p)
    ours.train()
    q, k, v = _inputs(2, 5, 7, True)
    torch.manual_seed(4)
    out, w = ours(q, k, v, average_attn_weights=False)
    torch.manual_seed(4)
    out_again, w_mean = ours(q, k, v)
    vh = torch.nn.functional.linear(v, *[t.chunk(3)[2] for t in (ours.in_proj_weight, ours.in_proj_bias)])
    vh = vh.view(2, 7, H, E // H).transpose(1, 2)
    ctx = (w @ vh).transpose(1, 2).reshape(2, 5, E)
    torch.testing.assert_close(out, ours.out_proj(ctx))
    assert torch.equal(out, out_again)
    torch.testing.assert_close(w_mean, w.mean(dim=1))
    if p < 1:
        assert (w == 0).any() and (w.sum(-1) - 1).abs().max() > 1e-3  # some dropped, rescaled


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(attn_mask=torch.ones(5, 7, dtype=torch.int64)), TypeError, "attn_mask: expected a mask of dtype torch.bool, torch.float32"),
    (dict(key_padding_mask=torch.zeros(2, 7, dtype=torch.uint8)), TypeError, "key_padding_mask"),
    (dict(attn_mask=torch.zeros(1, 7, dtype=torch.bool)), ValueError, r"attn_mask: expected shape \(5, 7\)"),
    (dict(attn_mask=torch.zeros(5, 1)), ValueError, "attn_mask"),
    (dict(attn_mask=torch.zeros(3, 5, 7)), ValueError, r"\(6, 5, 7\)"),
    (dict(key_padding_mask=torch.zeros(2, 1, dtype=torch.bool)), ValueError, r"key_padding_mask: expected shape \(2, 7\)"),
    (dict(attn_mask=torch.zeros(5, 7, dtype=torch.float16)), TypeError,
     r"attn_mask: expected a mask of dtype torch.bool, torch.float32 or torch.float64 \(that of the inputs\), got torch.float16"),
    (dict(key_padding_mask=torch.zeros(2, 7, dtype=torch.bfloat16)), TypeError,
     "key_padding_mask: expected a mask of dtype .*, got torch.bfloat16"),
])
def test_bad_masks_are_rejected(kwargs, error, match):
    """torch rejects these too; broadcasting them, or adding an integer 0/1 mask to the scores
    as a bias, would be a silently wrong answer."""
    ours, ref = _pair(batch_first=True)
    with pytest.raises(error, match=match):
        ours(*_inputs(2, 5, 7, True), **kwargs)
    with pytest.raises(Exception):
        ref(*_inputs(2, 5, 7, True), **kwargs)


def test_a_float64_mask_on_a_float32_module_is_rejected():
    """torch refuses it ("Input dtypes must be the same"); rounded to float32 on its way, a
    finite bias of 1e300 became inf and the output NaN."""
    ours, ref = _pair(torch.float32, batch_first=True)
    mask = torch.zeros(5, 7, dtype=torch.float64)
    mask[:, 2] = 1e300
    q, k, v = _inputs(2, 5, 7, True, dtype=torch.float32)
    with pytest.raises(TypeError, match="attn_mask: expected a mask of dtype torch.bool, "
                                        "torch.float32, got torch.float64"):
        ours(q, k, v, attn_mask=mask)
    with pytest.raises(Exception):
        ref(q, k, v, attn_mask=mask)


def test_two_finite_masks_summing_past_the_range_saturate():
    """A float attn_mask and key_padding_mask of 2e38 each on key 1: their float32 sum is inf,
    and torch's output NaN. attnx saturates the sum at float32's largest: key 1 takes every
    row's whole weight, as with a mask that admits it alone."""
    ours, _ = _pair(torch.float32, batch_first=True)
    q, k, v = _inputs(2, 5, 7, True, dtype=torch.float32)
    attn, pad = torch.zeros(5, 7), torch.zeros(2, 7)
    attn[:, 1], pad[:, 1] = 2e38, 2e38
    attn[:, 3] = -2e38  # and a negative one on another key, finite with pad's 0
    out, w = ours(q, k, v, attn_mask=attn, key_padding_mask=pad)
    only = torch.ones(5, 7, dtype=torch.bool)
    only[:, 1] = False
    want_out, want_w = ours(q, k, v, attn_mask=only)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(w, want_w)


def test_combined_masks_saturate_only_what_overflowed_upwards():
    """combine: a finite sum past the largest saturates there; a key a bool mask rules out
    stays -inf (not the most negative, which would admit it), and so do a -inf bias and a sum
    past the most negative (torch's -inf: two finfo.min masks rule a key out)."""
    from attnx.nn._masks import combine

    out_ = torch.tensor([[True, False, False, False, False]])
    a = torch.tensor([[2e38, 2e38, -2e38, 1.0, float("-inf")]])
    b = torch.tensor([[2e38, 2e38, -2e38, 2.0, 5.0]])
    big, inf = torch.finfo(torch.float32).max, float("inf")
    want = torch.tensor([[-inf, big, -inf, 3.0, -inf]])
    assert torch.equal(combine([out_, a, b], torch.float32), want)
    assert torch.equal(combine([a, b], torch.bfloat16), torch.tensor([[big, big, -inf, 3.0, -inf]]))


def test_finfo_min_masks_on_fully_masked_rows_match_torch():
    """A causal mask and a padding mask both of finfo.min (the usual float masks): a key
    masked by both is out, as in torch's sum (-inf), so a row masked everywhere (a left-padded
    query) spreads its weight over the keys masked once, as torch does."""
    ours, ref = _pair(torch.float32, batch_first=True)
    q, k, v = _inputs(2, 4, 4, True, dtype=torch.float32)
    low = torch.finfo(torch.float32).min
    causal = torch.triu(torch.full((4, 4), low), 1)
    pad = torch.tensor([[low, low, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    got, want = (m(q, k, v, attn_mask=causal, key_padding_mask=pad) for m in (ours, ref))
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_no_keys_with_weights_matches_torch():
    """A zero-length key sequence with need_weights (the default): torch gives the output
    projection's bias and (N, L, 0) weights."""
    ours, ref = _pair(batch_first=True)
    q, k, v = _inputs(2, 5, 0, True)
    (out, w), (want, want_w) = ours(q, k, v), ref(q, k, v)
    assert w.shape == want_w.shape == (2, 5, 0)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("call, error, match", [
    (lambda m, q: m(q, q, q, attn_mask=[[0.0] * 5] * 5), TypeError, "attn_mask: expected a Tensor"),
    (lambda m, q: m(q, [1.0], q), TypeError, "key: expected a torch.Tensor"),
    (lambda m, q: m(q[..., :5], q, q), ValueError, f"query: expected a last dim of embed_dim={E}"),
    (lambda m, q: m(q, q, q[..., :5]), ValueError, f"value: expected a last dim of vdim={E}"),
    (lambda m, q: m(*[torch.nested.nested_tensor([t for t in q])] * 3, need_weights=False),
     TypeError, "query: expected a dense"),
    (lambda m, q: m(q[None], q[None], q[None]), ValueError, "query should be unbatched 2D or batched 3D"),
    (lambda m, q: m(q, q[:1], q[:1]), ValueError, "key, value: expected batch size 2"),
    (lambda m, q: m(q, q, q[:, :3]), ValueError, "value: expected sequence length 5"),
    (lambda m, q: m(q.float(), q.float(), q.float()), TypeError, "query: expected dtype torch.float64"),
    (lambda m, q: m(q, q, q, is_causal=True), ValueError, "attn_mask: expected a mask with the is_causal"),
])
def test_bad_inputs_raise_naming_the_argument(call, error, match):
    ours, _ = _pair(batch_first=True)
    with pytest.raises(error, match=match):
        call(ours, _inputs(2, 5, 5, True)[0])


def test_a_bad_last_dim_is_told_with_the_shape_given():
    """The shape in the message is the caller's (sequence-first here), not the batch-first
    transpose the module checked (it said (2, 3, 9) for a (3, 2, 9) query)."""
    m = ann.MultiheadAttention(8, 2)
    x = torch.zeros(3, 2, 9)
    with pytest.raises(ValueError, match=r"query: expected a last dim of embed_dim=8, got shape \(3, 2, 9\)"):
        m(x, x, x)


def test_weights_of_huge_inputs_stay_finite():
    """Scores past float32's range (|x| ~ 1e30 after the projections): the weights come from
    float64 scores, as the output from the op's float64 rerun; every row still sums to 1."""
    ours, _ = _pair(dtype=torch.float32, batch_first=True)
    x = _inputs(2, 5, 5, True, dtype=torch.float32)[0] * 1e30
    out, w = ours(x, x, x, average_attn_weights=False)
    assert w.dtype == torch.float32 and torch.isfinite(w).all() and torch.isfinite(out).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, H, 5))
