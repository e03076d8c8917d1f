"""The reference backend against float64 formulas and against torch's own SDPA."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attnx
from attnx import _rng

import golden
from _compare import assert_within

REF = dict(backend="reference")


def rand(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def qkv(b=2, hq=3, hk=None, lq=17, lk=23, e=16, ev=None, dtype=torch.float32, grad=False):
    hk = hq if hk is None else hk
    ev = e if ev is None else ev
    return (rand(b, hq, lq, e, dtype=dtype, grad=grad), rand(b, hk, lk, e, dtype=dtype, grad=grad),
            rand(b, hk, lk, ev, dtype=dtype, grad=grad))


def check(out, gold, dtype=torch.float32):
    baseline = out  # fp32: bound by an absolute floor; lower precisions by the dtype's eps
    floor = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    assert_within(out, gold, baseline, factor=1.0, floor=floor)


@pytest.mark.parametrize("lq,lk", [(1, 1), (17, 23), (97, 33), (23, 17)])
@pytest.mark.parametrize("e,ev", [(16, 16), (24, 7)])
def test_plain_matches_formula_and_torch(lq, lk, e, ev):
    q, k, v = qkv(lq=lq, lk=lk, e=e, ev=ev)
    out = attnx.scaled_dot_product_attention(q, k, v, **REF)
    check(out, golden.sdpa(q, k, v))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("shape", [(1, 1, 5, 5), (2, 1, 17, 1), (1, 3, 1, 23), (17, 23), (3, 17, 23)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_broadcast(shape, kind):
    q, k, v = qkv()
    if kind == "bool":
        mask = torch.rand(shape) > 0.3
    else:
        mask = torch.randn(shape)
    if mask.shape[-2:] == (5, 5):
        q, k, v = qkv(lq=5, lk=5)
    out = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, **REF)
    check(out, golden.sdpa(q, k, v, mask=mask))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("lq,lk", [(17, 17), (9, 23), (23, 9)])
def test_causal_and_causal_bias(lq, lk):
    q, k, v = qkv(lq=lq, lk=lk)
    out = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, **REF)
    check(out, golden.sdpa(q, k, v, is_causal=True))
    ul = attnx.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(lq, lk), **REF)
    torch.testing.assert_close(ul, out)
    lr = attnx.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, lk), **REF)
    check(lr, golden.sdpa(q, k, v, lower_right=True))
    if lq <= lk:  # torch's lower-right bias returns NaN rows otherwise; attnx returns zeros
        torch.testing.assert_close(lr, F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, lk)))


@pytest.mark.parametrize("window,causal", [((3, 2), False), ((0, 0), False), ((4, None), False),
                                           ((None, 1), False), ((5, 5), True), ((100, 100), False)])
def test_window(window, causal):
    q, k, v = qkv(lq=29, lk=31)
    out = attnx.scaled_dot_product_attention(q, k, v, is_causal=causal, window=window, **REF)
    check(out, golden.sdpa(q, k, v, is_causal=causal, window=window))


def test_gqa_and_scale():
    q, k, v = qkv(hq=6, hk=2)
    out = attnx.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.3, **REF)
    check(out, golden.sdpa(q, k, v, scale=0.3))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.3))


@pytest.mark.parametrize("lead", [(), (2,), (2, 3), (2, 1, 3)])
def test_leading_batch_dims(lead):
    q = rand(*lead, 4, 11, 8)
    k = rand(*lead, 4, 13, 8)
    v = rand(*lead, 4, 13, 5)
    mask = torch.rand(11, 13) > 0.2
    out, lse = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True, **REF)
    assert out.shape == (*lead, 4, 11, 5) and lse.shape == (*lead, 4, 11)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_four_dim_output_is_no_view_as_torchs(backend):
    """The output of (B, H, L, E) inputs is the op's own tensor, as torch's is (it was a
    reshape of itself, a view): detach_() works on it, and an in-place op after a no_grad call
    records its gradient."""
    q, k, v = (rand(1, 2, 3, 4, grad=True) for _ in range(3))
    out = attnx.scaled_dot_product_attention(q, k, v, backend=backend)
    assert not out._is_view() and not F.scaled_dot_product_attention(q, k, v)._is_view()
    out.detach_()
    with torch.no_grad():
        out = attnx.scaled_dot_product_attention(q, k, v, backend=backend)
    w = torch.ones(4, requires_grad=True)
    out.mul_(w).sum().backward()
    torch.testing.assert_close(w.grad, out.detach().div(w.detach()).sum((0, 1, 2)))


def test_two_dim_inputs():
    q, k, v = rand(7, 4), rand(9, 4), rand(9, 3)
    out = attnx.scaled_dot_product_attention(q, k, v, **REF)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_non_contiguous_inputs():
    q, k, v = (rand(2, 7, 5, 16).transpose(1, 2) for _ in range(3))  # (B, L, H, E) storage
    mask = (torch.rand(7, 7) > 0.5).t()
    out = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, **REF)
    check(out, golden.sdpa(q, k, v, mask=mask))


def test_lse_is_log_of_softmax_denominator():
    q, k, v = qkv(lq=5, lk=7)
    mask = torch.randn(5, 7)
    _, lse = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5, return_lse=True, **REF)
    want = torch.logsumexp((q.double() @ k.double().transpose(-1, -2)) * 0.5 + mask.double(), dim=-1)
    assert lse.dtype == torch.float32 and lse.shape == (2, 3, 5)
    torch.testing.assert_close(lse.double(), want, rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_give_zeros_and_zero_grads():
    q, k, v = qkv(lq=6, lk=5, grad=True)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[2] = False
    fmask = torch.zeros(6, 5).masked_fill(~mask, -math.inf).requires_grad_()
    for m in (mask, fmask):
        out, lse = attnx.scaled_dot_product_attention(q, k, v, attn_mask=m, return_lse=True, **REF)
        assert torch.isfinite(out).all() and (out[:, :, 2] == 0).all()
        assert (lse[:, :, 2] == -math.inf).all() and torch.isfinite(lse[:, :, [0, 1, 3, 4, 5]]).all()
        q.grad = k.grad = v.grad = None
        out.sum().backward()
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()
        assert (q.grad[:, :, 2] == 0).all()
    assert torch.isfinite(fmask.grad).all() and (fmask.grad[2] == 0).all()
    # Lk > Lq with a lower-right bias: every row has keys; upper-left causal with Lq > Lk: all do.
    out = attnx.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(6, 5), **REF)
    assert (out[:, :, 0] == 0).all() and torch.isfinite(out).all()


def test_zero_length_keys_and_queries():
    q, k, v = qkv(lq=4, lk=0, grad=True)
    out = attnx.scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 3, 4, 16) and (out == 0).all()
    out.sum().backward()
    assert (q.grad == 0).all()
    q, k, v = qkv(lq=0, lk=4)
    assert attnx.scaled_dot_product_attention(q, k, v).shape == (2, 3, 0, 16)


@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"scale": 3.0},
                                {"attn_mask": torch.tensor([[True, False, True, True]] * 3)}])
def test_head_dim_zero_is_uniform_attention_as_in_torch(kw):
    """Every score is 0, so each row averages the values it admits (torch does the same)."""
    q, k, v = (torch.randn(2, 1, n, e, dtype=torch.float64, requires_grad=True)
               for n, e in ((3, 0), (4, 0), (4, 5)))
    out, lse = attnx.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    gold = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
    torch.testing.assert_close(out, gold)
    admitted = (gold.new_ones(3, 4).tril() if kw.get("is_causal") else
                kw.get("attn_mask", torch.ones(3, 4, dtype=torch.bool)).double()).sum(-1)
    torch.testing.assert_close(lse, admitted.log().float().expand(2, 1, 3))
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, v, g), torch.autograd.grad(gold, v, g))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_gradients_match_formula(dtype):
    q, k, v = qkv(hq=4, hk=2, lq=9, lk=11, e=8, dtype=dtype, grad=True)
    mask = torch.randn(1, 4, 9, 11, dtype=dtype, requires_grad=True)
    out = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, window=(3, 4), **REF)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, mask), g)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, mask)]
    gold = golden.sdpa(*leaves[:3], mask=leaves[3], window=(3, 4))
    gold_grads = torch.autograd.grad(gold, leaves, g.double())
    for name, a, b in zip("q k v mask".split(), grads, gold_grads):
        assert a.shape == b.shape, name
        tol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 0.1, torch.float16: 1e-2}[dtype]
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol, msg=name)


def test_gradcheck_float64():
    q, k, v = qkv(b=1, hq=2, lq=4, lk=5, e=3, dtype=torch.float64, grad=True)
    mask = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    fn = lambda q, k, v, m: attnx.scaled_dot_product_attention(q, k, v, attn_mask=m, window=(1, 2), **REF)
    assert torch.autograd.gradcheck(fn, (q, k, v, mask))


def test_dropout_hash_matches_pure_python():
    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    seed = torch.tensor([0xDEADBEEF, 12345])
    keep = _rng.keep_mask(seed, 2, 3, 4, 5, 0.3, torch.device("cpu"))
    thr = int(0.3 * 2**32)
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 3, 4), (0, 1, 2, 3), (1, 0, 3, 0)]:
        key_bh = mix(0xDEADBEEF ^ mix((b * 3 + h) ^ 12345))
        key_row = mix(key_bh ^ ((i * 0x9E3779B1) & 0xFFFFFFFF))
        assert bool(keep[b, h, i, j]) == (mix(key_row ^ ((j * 0x85EBCA77) & 0xFFFFFFFF)) >= thr)


@pytest.mark.parametrize("d", [1, 3, 17, 100])
def test_dropout_masks_are_no_permutations_of_one_another(d):
    """With i and j XORed into the hash as they were, two heads whose keys differ by d < Lq in
    XOR had the same mask with rows i and i ^ d swapped, and two rows whose keys differ by
    d < Lk the same with columns j and j ^ d swapped (a helper found such heads at 1024 heads,
    L = 4096). Keys built to differ by d: their rows (columns) share no more than chance."""
    n = 128
    i = torch.arange(n, dtype=torch.int64)
    for key in (0x12345678, 0xCAFEF00D, 7):
        a = _rng.element_hash(_rng.row_key(torch.tensor(key), i)[:, None], i[None, :])
        b = _rng.element_hash(_rng.row_key(torch.tensor(key ^ d), i ^ d)[:, None], i[None, :])
        assert (a == b).sum() <= 1  # was: every element
        # a row and one whose key differs by d (XOR): was the same row with columns j ^ d
        rows = _rng.row_key(torch.tensor(key), i)[:, None]
        same = _rng.element_hash(rows ^ d, i[None, :] ^ d) == _rng.element_hash(rows, i[None, :])
        assert same.sum() <= 1


def test_dropout_reproducible_and_correct():
    q, k, v = qkv(lq=64, lk=64)
    torch.manual_seed(0)
    a = attnx.scaled_dot_product_attention(q, k, v, dropout_p=0.25, **REF)
    torch.manual_seed(0)
    seed = _rng.draw_seed()
    torch.manual_seed(0)
    b = attnx.scaled_dot_product_attention(q, k, v, dropout_p=0.25, **REF)
    c = attnx.scaled_dot_product_attention(q, k, v, dropout_p=0.25, **REF)
    assert torch.equal(a, b) and not torch.equal(a, c)
    keep = _rng.keep_mask(seed, 2, 3, 64, 64, 0.25, torch.device("cpu"))
    assert abs(keep.float().mean().item() - 0.75) < 0.01
    check(a, golden.sdpa(q, k, v, keep=keep, dropout_p=0.25))


def test_additive_matches_formula():
    b, h, lq, lk, a, ev = 2, 3, 7, 9, 12, 5
    q, k, val = rand(b, h, lq, a, grad=True), rand(b, h, lk, a, grad=True), rand(b, h, lk, ev, grad=True)
    for vshape in [(a,), (h, a)]:
        v = rand(*vshape, grad=True)
        mask = torch.randn(1, h, lq, lk, requires_grad=True)
        out, w = attnx.additive_attention(q, k, val, v, attn_mask=mask, window=(2, 3), return_weights=True, **REF)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, val, v, mask)]
        gold, gold_w = golden.additive(*leaves[:4], mask=leaves[4], window=(2, 3))
        check(out, gold)
        check(w, gold_w)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, val, v, mask), g)
        gold_grads = torch.autograd.grad(gold, leaves, g.double())
        for x, y in zip(grads, gold_grads):
            torch.testing.assert_close(x.double(), y, rtol=1e-4, atol=1e-4)


def test_additive_three_dim_and_causal():
    q, k, val, v = rand(2, 6, 8), rand(2, 6, 8), rand(2, 6, 3), rand(8)
    mask = torch.rand(2, 6, 6) > 0.3
    mask[:, 1] = False
    out, w = attnx.additive_attention(q, k, val, v, attn_mask=mask, return_weights=True, **REF)
    assert out.shape == (2, 6, 3) and w.shape == (2, 6, 6)
    gold, gold_w = golden.additive(q, k, val, v, mask=mask)
    check(out, gold)
    assert (out[:, 1] == 0).all() and (w[:, 1] == 0).all()
    out = attnx.additive_attention(q, k, val, v, is_causal=True, **REF)
    check(out, golden.additive(q, k, val, v, is_causal=True)[0])


def test_auto_backend_matches_reference_on_cpu():
    q, k, v = qkv()
    torch.testing.assert_close(attnx.scaled_dot_product_attention(q, k, v),
                               attnx.scaled_dot_product_attention(q, k, v, **REF))


def test_additive_dropout_reproducible_and_correct():
    q, k, val, v = rand(2, 3, 16, 8), rand(2, 3, 16, 8), rand(2, 3, 16, 5), rand(3, 8)
    torch.manual_seed(1)
    seed = _rng.draw_seed()
    torch.manual_seed(1)
    a, w = attnx.additive_attention(q, k, val, v, dropout_p=0.3, return_weights=True, **REF)
    torch.manual_seed(1)
    b = attnx.additive_attention(q, k, val, v, dropout_p=0.3, **REF)
    assert torch.equal(a, b)
    keep = _rng.keep_mask(seed, 2, 3, 16, 16, 0.3, torch.device("cpu"))
    _, p = golden.additive(q, k, val, v)
    check(w, p * keep / 0.7)  # the weights returned are the ones applied, after dropout
    check(a, (p * keep / 0.7) @ val.double())


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_dropout_of_one_drops_everything_as_torch(backend):
    """dropout_p=1 is allowed by torch's function and gives zeros with zero gradients; the lse
    (return_lse) does not depend on dropout. Same for additive attention and its weights."""
    q, k, v = qkv(lq=5, lk=7, e=8, grad=True)
    mask = torch.randn(5, 7, requires_grad=True)
    out, lse = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=1.0,
                                                  backend=backend, return_lse=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=1.0)
    assert torch.equal(out, want) and out.requires_grad
    _, lse0 = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend,
                                                 return_lse=True)
    torch.testing.assert_close(lse, lse0)
    out.sum().backward()
    for t in (q, k, v, mask):
        assert torch.equal(t.grad, torch.zeros_like(t))

    qa, ka, va = (t.detach().requires_grad_() for t in qkv(lq=5, lk=7, e=8))
    w = torch.randn(8, requires_grad=True)
    out, weights = attnx.additive_attention(qa, ka, va, w, dropout_p=1.0, backend=backend,
                                            return_weights=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(weights, torch.zeros_like(weights))
    (out.sum() + weights.sum()).backward()
    for t in (qa, ka, va, w):
        assert torch.equal(t.grad, torch.zeros_like(t))


def _huge_calls(dtype):
    """Finite inputs whose float32 scores or sums overflow: (name, call on `dtype` tensors)."""
    g = torch.Generator().manual_seed(5)
    big = torch.rand(1, 2, 3, 4, generator=g, dtype=torch.float64) + 0.5
    small = torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64)
    q, k, v = (t.to(dtype) for t in (big * 1e19, big * 1e19, small))
    a = torch.ones(1, 3, 4, dtype=dtype)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    return [
        ("sdpa", lambda **kw: attnx.scaled_dot_product_attention(q, k, v, **kw)),
        ("sdpa-values", lambda **kw: attnx.scaled_dot_product_attention(
            v, v, torch.full_like(v, 3e38), **kw)),
        ("additive", lambda **kw: attnx.additive_attention(
            a, a, a.neg(), torch.full((4,), 3e38, dtype=dtype), **kw)),
        ("kvcache", lambda **kw: attnx.attention_with_kvcache(q, k, v, 3, **kw)),
        ("varlen", lambda **kw: attnx.varlen_attention(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, **kw)),
    ]


@pytest.mark.parametrize("case", range(5), ids=[n for n, _ in _huge_calls(torch.float32)])
def test_float32_overflow_reruns_in_float64(case):
    """Finite inputs never give NaN: where float32 overflows, the reference runs in float64 and
    gives its answer (rounded to float32)."""
    _, call = _huge_calls(torch.float32)[case]
    _, call64 = _huge_calls(torch.float64)[case]
    out, want = call(backend="reference"), call64(backend="reference")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_scores_overflowing_to_minus_inf_rerun_in_float64(backend):
    """An ALiBi slope of 3e38 sends every float32 score of a row to -inf, as if the row admitted
    no key (the reference gave it zeros, an lse of -inf); in float64 the row's nearest admitted
    key takes all the weight (its lse, -3e38 times the distance, rounds to -inf in float32, as
    every backend rounds it). A row that admits no key stays zeros."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 1, n, 8, generator=g) for n in (3, 6, 6))
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[:, :3] = False
    slopes = torch.full((1,), 3e38)
    out = attnx.scaled_dot_product_attention(q, k, v, mask, alibi_slopes=slopes, backend=backend)
    want = v[0, 0, 3].expand(3, 8)  # key 3: the nearest admitted one of every row
    torch.testing.assert_close(out[0, 0], want)
    empty = attnx.scaled_dot_product_attention(q, k, v, torch.zeros(3, 6, dtype=torch.bool),
                                               backend=backend, return_lse=True)
    assert torch.equal(empty[0], torch.zeros_like(empty[0])) and (empty[1] == float("-inf")).all()


def _rows_near_one_huge_value(dtype, grad=True):
    """q, k and values whose rows differ by ~1e-6 around 1e38: with an output gradient of ones,
    each dP = dO V^T (8e38) passes float32's range while dP - D, hence dS and dq, dk, does not."""
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 7, 8, generator=g)
    v = 1e38 + 1e32 * torch.randint(-4, 5, (1, 2, 7, 8), generator=g).float()
    return [t.to(dtype).requires_grad_(grad) for t in (q, k, v)]


@pytest.mark.parametrize("op", ["sdpa", "varlen", "additive"])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_float32_backward_overflow_reruns_in_float64(op, backend):
    """Finite inputs never give NaN gradients either: where the float32 backward overflows
    (dP - D as the difference of two values past the range), it runs again in float64."""
    w = torch.randn(8, generator=torch.Generator().manual_seed(8))

    def call(q, k, v, backend):
        if op == "sdpa":
            return attnx.scaled_dot_product_attention(q, k, v, backend=backend)
        if op == "additive":
            return attnx.additive_attention(q, k, v, w.to(q.dtype), backend=backend)
        cu = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)
        rows = [t[0].transpose(0, 1) for t in (q, k, v)]
        return attnx.varlen_attention(*rows, *cu, backend=backend).transpose(0, 1)[None]

    q, k, v = _rows_near_one_huge_value(torch.float32)
    grads = torch.autograd.grad(call(q, k, v, backend), (q, k, v), torch.ones(1, 2, 5, 8))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(call(q64, k64, v64, "reference"), (q64, k64, v64),
                               torch.ones(1, 2, 5, 8, dtype=torch.float64))
    for name, got, gold in zip("qkv", grads, want):
        assert torch.isfinite(got).all(), f"d{name}: non-finite"
        # float64's own rounding of dP (8e38, ulp 1e23) bounds how well dq, dk (~1e32) are known
        assert (got.double() - gold).abs().max() <= 1e-3 * gold.abs().max() + 1e-5, f"d{name}"


def test_gradients_of_one_tensor_as_query_key_and_value():
    """Self-attention on one tensor: its gradient is the sum over the three roles, once."""
    x = rand(2, 3, 6, 4, grad=True)
    got, = torch.autograd.grad(attnx.scaled_dot_product_attention(x, x, x, **REF).sum(), x)
    x64 = x.detach().double().requires_grad_()
    want, = torch.autograd.grad(F.scaled_dot_product_attention(x64, x64, x64).sum(), x64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_torch_func_grad_sees_plain_pytorch():
    """torch.func.grad over the reference backend: its plain PyTorch, as before the guarded
    backward (which autograd runs, not functorch)."""
    x = rand(2, 3, 6, 4)

    def loss(t):
        return attnx.scaled_dot_product_attention(t, t, t, **REF).sum()

    got = torch.func.grad(loss)(x)
    x64 = x.double().requires_grad_()
    want, = torch.autograd.grad(F.scaled_dot_product_attention(x64, x64, x64).sum(), x64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_guarded_backward_keeps_autograd_contracts():
    """The backward that reruns in float64 is an autograd.Function: its inputs are freed after
    the backward (while the output lives), an in-place change to one of them before the
    backward raises as autograd does, and forward-mode AD sees the plain PyTorch."""
    import gc
    import weakref

    import torch.autograd.forward_ad as fwAD
    x, k = rand(1, 2, 4, 8, grad=True), rand(1, 2, 5, 8, grad=True)
    q, m = x * 2, rand(1, 2, 4, 5)
    alive = [weakref.ref(q), weakref.ref(m)]
    out = attnx.scaled_dot_product_attention(q, k, k, attn_mask=m, **REF)
    out.sum().backward()
    del q, m
    gc.collect()
    assert all(ref() is None for ref in alive)
    q, k = rand(1, 2, 4, 8, grad=True), rand(1, 2, 5, 8)
    out = attnx.scaled_dot_product_attention(q, k, k, **REF)
    k.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out.sum(), q)
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.ones_like(q))
        tangent = fwAD.unpack_dual(attnx.scaled_dot_product_attention(dual, k, k, **REF)).tangent
    x64, k64 = q.detach().double(), k.double()

    def formula(t):
        return torch.softmax(t @ k64.transpose(-2, -1) / math.sqrt(8), dim=-1) @ k64
    _, want = torch.func.jvp(formula, (x64,), (torch.ones_like(x64),))
    torch.testing.assert_close(tangent.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_half_inputs_under_a_huge_scale_stay_finite(backend):
    """CPU float16 tensors under a scale of 1e38, which overflows float32 (cpu computes them in
    float32 and reruns the call in float64)."""
    q, k, v = qkv(1, 2, lq=3, lk=5, e=4, dtype=torch.float16)
    out = attnx.scaled_dot_product_attention(q, k, v, scale=1e38, backend=backend)
    want = attnx.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=1e38,
                                              **REF)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, rtol=2e-3, atol=2e-3)
