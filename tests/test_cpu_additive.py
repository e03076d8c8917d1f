"""The fused C++ CPU kernels of additive attention against the float64 reference backend.

Each case runs the same inputs three ways: the reference in float64 (golden), the reference in
the tested dtype (PyTorch's own error, the baseline) and the cpu backend; the cpu backend's
error must stay within a small multiple of the baseline's (tests/_compare.py).
"""

from __future__ import annotations


import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

import attnx
from _compare import assert_within, check_fp16_out_past_its_range
from _rerun import rerun_under, skip_unless_avx512

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# float64's baseline is the golden itself (error 0), so its bound is this floor.
FLOOR = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 1e-5, torch.float16: 1e-5}
NAMES = ("out", "weights", "weights_for_plots", "dq", "dk", "dvalue", "dv", "dmask")


def make_inputs(b, h, lq, lk, a, ev, v_heads=False, three_d=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (lambda l, d: (b, l, d)) if three_d else (lambda l, d: (b, h, l, d))
    q = torch.randn(shape(lq, a), generator=g, dtype=torch.float64)
    k = torch.randn(shape(lk, a), generator=g, dtype=torch.float64)
    value = torch.randn(shape(lk, ev), generator=g, dtype=torch.float64)
    v = torch.randn((h, a) if v_heads else (a,), generator=g, dtype=torch.float64) / a ** 0.5
    return [q, k, value, v]


def run(backend, inputs, dtype, attn_mask=None, dropout_seed=None, **kw):
    """Outputs and all gradients (of the tensors among inputs and a float mask) of a loss on
    both out and the weights, as a list; also the weights under no_grad (the same kernels'
    output with nothing saved for a backward)."""
    xs = [t.detach().to(dtype).requires_grad_() for t in inputs]
    mask = attn_mask
    if type(mask) is torch.Tensor:  # not a CausalBias (a Tensor subclass), passed as it is
        mask = mask.detach().to(dtype if mask.is_floating_point() else torch.bool)
        mask.requires_grad_(mask.is_floating_point())
    if dropout_seed is not None:
        torch.manual_seed(dropout_seed)
    out, weights = attnx.additive_attention(*xs, attn_mask=mask, backend=backend,
                                            return_weights=True, **kw)
    d_out = torch.sin(torch.arange(out.numel(), dtype=torch.float64)).view_as(out).to(dtype)
    d_weights = torch.cos(torch.arange(weights.numel(), dtype=torch.float64)).view_as(weights)
    wrt = xs + ([mask] if type(mask) is torch.Tensor and mask.requires_grad else [])
    grads = torch.autograd.grad((out, weights), wrt, (d_out, d_weights.to(dtype)))
    if dropout_seed is not None:
        torch.manual_seed(dropout_seed)
    with torch.no_grad():
        _, plain = attnx.additive_attention(*xs, attn_mask=mask, backend=backend,
                                            return_weights=True, **kw)
    return [out, weights, plain, *grads]


def check_case(dtype, inputs, grad_factor=3.0, **kw):
    golden = run("reference", inputs, torch.float64, **kw)
    baseline = run("reference", inputs, dtype, **kw)
    actual = run("cpu", inputs, dtype, **kw)
    for name, a, g, base in zip(NAMES, actual, golden, baseline):
        factor = 2.0 if name in ("out", "weights", "weights_for_plots") else grad_factor
        assert_within(a, g, base, factor=factor, floor=FLOOR[dtype], what=name)
    return actual


def padding_mask(b, lk, dtype=torch.bool):
    """(B, 1, 1, Lk): batch element n may attend its first lk - 3n keys (at least one)."""
    keep = torch.arange(lk).view(1, lk) < (lk - 3 * torch.arange(b)).clamp(min=1).view(b, 1)
    if dtype == torch.bool:
        return keep.view(b, 1, 1, lk)
    return torch.zeros(b, 1, 1, lk, dtype=dtype).masked_fill(~keep.view(b, 1, 1, lk), float("-inf"))


def huge_bias_mask(b, lq, lk, big=torch.finfo(torch.float32).min):
    """(B, 1, Lq, Lk) float mask padding whole rows with a huge finite bias, as Hugging Face
    models do with finfo.min: the row's lse rounds to its max, where the backward must still
    find probabilities 1 / l (csrc/cpu/huge_lse.h). One row has a single key less biased."""
    m = torch.zeros(b, 1, lq, lk, dtype=torch.float64)
    m[:, :, 1] = big
    m[0, :, 4, 3:] = big
    m[-1, :, lq - 1] = big
    m[-1, :, lq - 1, 2] = big / 2
    return m


CASES = {
    "4d": (dict(b=2, h=3, lq=17, lk=17, a=33, ev=9), {}),
    "3d": (dict(b=2, h=1, lq=17, lk=13, a=16, ev=5, three_d=True), {}),
    "v_per_head": (dict(b=2, h=3, lq=9, lk=11, a=24, ev=7, v_heads=True), {}),
    "size_1": (dict(b=1, h=1, lq=1, lk=1, a=1, ev=1), {}),
    "lq_ne_lk_97": (dict(b=1, h=2, lq=5, lk=97, a=17, ev=8), {}),
    "lq_97": (dict(b=1, h=1, lq=97, lk=17, a=40, ev=3), {}),
    # A of whole 16-lane vectors, keys in blocks of 4 and a tail of 2 (csrc/cpu/additive_terms.h)
    "a256": (dict(b=1, h=2, lq=13, lk=30, a=256, ev=8), {}),
    # value sums of kSumRows query rows at once: whole vectors of Ev and a tail, the group's rows
    # with different bands (the last group holds 2 rows)
    "ev_vectors_window": (dict(b=1, h=2, lq=10, lk=40, a=32, ev=37), dict(window=(5, 30))),
    "causal": (dict(b=2, h=2, lq=17, lk=17, a=20, ev=6), dict(is_causal=True)),
    "window": (dict(b=2, h=2, lq=17, lk=23, a=20, ev=6), dict(window=(3, 2))),
    "causal_window": (dict(b=1, h=2, lq=17, lk=17, a=20, ev=6), dict(is_causal=True, window=(4, None))),
    "causal_lower_right": (dict(b=1, h=2, lq=5, lk=17, a=20, ev=6),
                           dict(attn_mask=causal_lower_right(5, 17))),
    "bool_padding": (dict(b=3, h=2, lq=7, lk=17, a=12, ev=5), dict(attn_mask=padding_mask(3, 17))),
    "bool_2d_mask": (dict(b=2, h=2, lq=7, lk=9, a=12, ev=5),
                     dict(attn_mask=torch.rand(7, 9, generator=torch.Generator().manual_seed(3)) < 0.7)),
    "float_mask": (dict(b=2, h=3, lq=7, lk=9, a=12, ev=5),
                   dict(attn_mask=torch.randn(1, 3, 7, 9, generator=torch.Generator().manual_seed(4)))),
    "float_padding_3d": (dict(b=3, h=1, lq=6, lk=17, a=12, ev=5, three_d=True),
                         dict(attn_mask=padding_mask(3, 17, torch.float64).view(3, 1, 17))),
    "huge_bias_rows": (dict(b=2, h=2, lq=9, lk=13, a=12, ev=5), dict(attn_mask=huge_bias_mask(2, 9, 13))),
    "dropout": (dict(b=2, h=2, lq=17, lk=19, a=16, ev=6), dict(dropout_p=0.3, dropout_seed=7)),
    "dropout_mask_window": (dict(b=2, h=2, lq=9, lk=9, a=16, ev=6),
                            dict(dropout_p=0.5, dropout_seed=8, window=(2, 2),
                                 attn_mask=torch.randn(2, 1, 9, 9, generator=torch.Generator().manual_seed(5)))),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(case, dtype):
    sizes, kw = CASES[case]
    check_case(dtype, make_inputs(**sizes), **kw)


def large_operands(seed=0):
    """Inputs where some rows of q and k hold values past the exponential form's limit
    (|x| > 20, csrc/cpu/additive_terms.h: e^{2q} e^{2k} would overflow or underflow float32)
    and others just inside it (|x| = 19.5, products up to e^{+-78}), mixed in one call: pairs
    of two ordinary rows, of one ordinary and one large, and of two large."""
    q, k, value, v = make_inputs(b=2, h=2, lq=11, lk=14, a=40, ev=5, v_heads=True, seed=seed)
    q[0, 0, 2, 5] = 60.0   # one huge entry in an otherwise ordinary row
    q[1, 1, 4] *= 25.0     # a whole row of large values, both signs
    q[0, 1, 7] = 19.5      # at the limit, same sign as the keys below: e^{78}
    q[1, 0, 3] = -19.5
    k[0, 0, 3] *= 40.0
    k[1, 1, 9, 0] = -1e4
    k[0, 1, 5] = 19.5
    k[1, 0, 6] = -19.5
    k[0, 1, 6] = -19.5     # against q[0, 1, 7] = +19.5: tanh(0), from e^{39} e^{-39}
    return [q, k, value, v]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"window": (3, 4)}], ids=["full", "causal", "window"])
def test_large_operands_take_the_exact_path(dtype, kw):
    check_case(dtype, large_operands(), **kw)


def small_operands(b, rows, seed=0):
    """q and k rows whose entries are ~1e-4 (tanh in its linear part) against a large v, with
    or without ordinary rows beside them (`rows` "mixed" or "all_small"): the exponential
    form's error is absolute, ~eps sum_a |v_a| a score, where torch's tanh errs by ~eps |q + k|
    |v_a| a term (~1000x less here), so pairs of two small rows take the exact path
    (csrc/cpu/additive_terms.h kSmallMeanAbs); a small row against an ordinary one stays on the
    form (tanh of an ordinary value). "outlier": every row small but for one coordinate (+5 in
    q, -5 in k: a model's massive activation), which an RMS took for an ordinary row (the
    form's error, dv 60x torch's)."""
    q, k, value, v = make_inputs(b=b, h=2, lq=9, lk=13, a=40, ev=5, v_heads=True, seed=seed)
    ordinary_rows = rows == "mixed"
    q[:, :, 1 if ordinary_rows else 0:] *= 1e-4  # row 0 of each head ordinary, or none
    k[:, :, :-2 if ordinary_rows else None] *= 1e-4  # the last two keys ordinary, or none
    q[:, 1, 4] *= 500.0  # RMS ~0.05: small still
    if rows == "outlier":
        q[..., 0] += 5.0
        k[..., 0] -= 5.0
    return [q, k, value, v * 30.0]


@pytest.mark.parametrize("heads", ["rows_beforehand", "a_head_a_task"])
@pytest.mark.parametrize("rows", ["mixed", "all_small", "outlier"])
@pytest.mark.parametrize("kw", [{}, {"is_causal": True}], ids=["full", "causal"])
def test_small_operands_keep_float32s_precision(heads, rows, kw):
    """Against torch's float32 error on the same formula: out was 50-560x it, and dv, summed
    as sum ds - 2 sum ds r, lost t's precision where every pair is small. Both ways the rows'
    flags are made: beforehand for the call (few heads) and by the task that takes a head
    (B H >= 8 heads a thread)."""
    b = 2 if heads == "rows_beforehand" else 8 * torch.get_num_threads()
    inputs = small_operands(b, rows)
    golden = run("reference", inputs, torch.float64, **kw)
    baseline = run("reference", inputs, torch.float32, **kw)
    actual = run("cpu", inputs, torch.float32, **kw)
    for name, a, g, base in zip(NAMES, actual, golden, baseline):
        # (check_case's absolute floor of 1e-5 would pass 100x torch's error on out here; this
        # one is a few ulp of the largest value.) dvalue: the backward's P = exp(s - lse) errs
        # by ~eps |lse|, as flash-attention's does, where torch's softmax errs by ~eps; the
        # ordinary rows' scores reach ~20 against this v: 8-10x torch's error there.
        floor = 2 * torch.finfo(torch.float32).eps * g.abs().max().item()
        assert_within(a, g, base, factor=12.0 if name == "dvalue" else 4.0, floor=floor,
                      what=name)


def test_avx2_bodies_match_reference():
    """ATTNX_CPU_AVX512=0 runs the 8-lane AVX2 term kernels, what CPUs without AVX-512 get, on a
    CPU that has it: the same reference checks pass there."""
    skip_unless_avx512()
    rerun_under("ATTNX_CPU_AVX512", __file__,
                "(matches_reference and float32) or large_operands or small_operands or thread_counts"
                " or fully_masked"
                " or non_finite or (many_heads and float32)",
                probe="cpu_vector", expect=("avx2", "baseline"))


def test_float64_rows_whose_lse_overflows_float32():
    """A float64 row under a -1e300 bias has a finite lse that float32 (the saved lse's dtype)
    cannot hold: its backward must not take it for a row with no admissible key."""
    inputs = make_inputs(b=1, h=2, lq=6, lk=9, a=8, ev=4)
    mask = huge_bias_mask(1, 6, 9, big=-1e300)
    actual = run("cpu", inputs, torch.float64, attn_mask=mask)
    golden = run("reference", inputs, torch.float64, attn_mask=mask)
    for name, a, g in zip(NAMES, actual, golden):
        assert_within(a, g, g, floor=1e-12, what=name)
    assert actual[NAMES.index("dq")][:, :, 1].abs().max() > 1e-3  # the biased row passes a gradient to q


@pytest.mark.parametrize("kind", ["scores", "value_sums"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_float32_overflow_reruns_in_float64(kind, dtype):
    """Finite inputs never give NaN: scores past float32's range (|score| <= sum_a |v_a|, here
    ~2e39) or gradient sums past it (values of +-3e38: dP = dO . value) make the call rerun in
    float64 (csrc/cpu/float64_rerun.h); each used to give NaN. Saturated rows' gradients carry
    float64's rounding of dP - D times |v| (~1e22), as any backward does."""
    q, k, value, v = make_inputs(b=1, h=2, lq=7, lk=9, a=8, ev=4, v_heads=True, seed=3)
    if kind == "scores":
        v = (v * 1e39).clamp(-3e38, 3e38)
    else:
        value[..., :4, :] = torch.tensor([3e38, 3e38, -3e38, -3e38], dtype=torch.float64)[:, None]
    inputs = [t.to(dtype).double() for t in (q, k, value, v)]
    mask = torch.randn(7, 9, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for kw in ({}, {"attn_mask": mask}, {"is_causal": True}):
        actual = run("cpu", inputs, dtype, **kw)
        golden = run("reference", inputs, torch.float64, **kw)
        for name, a, g in zip(NAMES, actual, golden):
            assert not torch.isnan(a).any(), name
            noise = 1e-13 * (inputs[3].abs().max() * inputs[2].abs().max()).item() * 9
            # sums of +-3e38 terms keep their precision relative to the largest result, not
            # to each (bfloat16: ~1e-3)
            rtol, frac = (1e-4, 1e-6) if dtype == torch.float32 else (2e-2, 1e-3)
            atol = frac * g.abs().max().item() + (noise if name.startswith("d") else 0)
            assert torch.allclose(a.double(), g.to(dtype).double(), rtol=rtol, atol=atol), name


def test_fp16_out_past_its_range():
    """An fp16 output saved as inf (_compare.check_fp16_out_past_its_range)."""
    check_fp16_out_past_its_range("additive", "cpu", "cpu")


def test_strided_inputs():
    """Inputs that are views with arbitrary strides, and v as a stride-0 expansion of (A,)."""
    leaves = [t.float().requires_grad_() for t in make_inputs(2, 3, 9, 11, 20, 6)]

    def views(q, k, value, v):
        return (q.transpose(1, 2).contiguous().transpose(1, 2),  # (B, H, L, A) of (B, L, H, A)
                torch.cat([k, k], dim=-1)[..., ::2],
                value.transpose(-1, -2).contiguous().transpose(-1, -2),
                v.expand(3, 20))

    def grads(backend, dtype):
        xs = [t.detach().to(dtype).requires_grad_() for t in leaves]
        args = views(*xs)
        if backend == "cpu":
            assert not any(a.is_contiguous() for a in args)
        out = attnx.additive_attention(*args, is_causal=True, backend=backend)
        return [out, *torch.autograd.grad(out, xs, torch.ones_like(out))]

    golden = grads("reference", torch.float64)
    baseline = grads("reference", torch.float32)
    for name, a, g, b in zip(("out", "dq", "dk", "dvalue", "dv"), grads("cpu", torch.float32),
                             golden, baseline):
        assert_within(a, g, b, factor=3.0, what=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows(dtype):
    b, h, lq, lk = 2, 2, 6, 9
    mask = torch.ones(b, h, lq, lk, dtype=torch.bool)
    mask[0, 1, 2] = False  # one row with no admissible key
    mask[1, :, 4:] = False
    outs = check_case(dtype, make_inputs(b, h, lq, lk, 10, 4), attn_mask=mask)
    out, weights, dq = outs[0], outs[1], outs[NAMES.index("dq")]
    for t in (out[0, 1, 2], out[1, :, 4:], weights[0, 1, 2], dq[0, 1, 2], dq[1, :, 4:]):
        assert torch.equal(t, torch.zeros_like(t))

    fmask = torch.zeros(b, h, lq, lk, dtype=torch.float64)
    fmask[~mask] = float("-inf")
    outs = check_case(dtype, make_inputs(b, h, lq, lk, 10, 4), attn_mask=fmask)
    dmask = outs[-1]
    assert torch.equal(outs[0][1, :, 4:], torch.zeros_like(outs[0][1, :, 4:]))
    assert torch.equal(dmask[1, :, 4:], torch.zeros_like(dmask[1, :, 4:]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_non_finite_value_stays_in_the_rows_that_attend_it(dtype):
    """Rows share each value load four at a time (csrc/cpu/additive_terms.h weighted_sums): a
    key outside a row's band, masked or with no admissible key at all, must add nothing to it,
    not 0 * inf = NaN."""
    # Ev = 83: the sums' 4-vector, 1-vector and scalar loops (AVX-512)
    q, k, value, v = (t.to(dtype) for t in make_inputs(1, 2, 8, 8, 16, 83))
    value[:, :, 3] = float("inf")  # causal: rows 0-2 never attend key 3
    out = attnx.additive_attention(q, k, value, v, is_causal=True, backend="cpu")
    finite = value.double().nan_to_num(posinf=0.0)  # what rows 0-2 see: key 3 never counts
    ref = attnx.additive_attention(q.double(), k.double(), finite, v.double(), is_causal=True,
                                   backend="reference")
    assert torch.isfinite(out[:, :, :3]).all()
    torch.testing.assert_close(out[:, :, :3].double(), ref[:, :, :3], atol=2e-2, rtol=2e-2)
    assert not torch.isfinite(out[:, :, 3:]).all(dim=-1).any()  # the rows that do attend it

    value = value.clone()
    value[:, :, 3] = 0.0
    value[:, :, 5] = float("nan")
    mask = torch.ones(8, 8, dtype=torch.bool)
    mask[0] = False  # row 0: no admissible key, shares a group with rows 1-3
    mask[1:4, 5] = False  # rows 1-3: key 5 masked
    out = attnx.additive_attention(q, k, value, v, attn_mask=mask, backend="cpu")
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert torch.isfinite(out[:, :, 1:4]).all()
    assert torch.isnan(out[:, :, 4:]).all()


def test_lse_of_empty_rows_is_minus_inf():
    q, k, value, v = (t.float() for t in make_inputs(1, 2, 4, 5, 8, 3, v_heads=True))
    _, lse, _ = torch.ops.attnx.additive_fwd(q, k, value, v, None, 7, 9, 0.0, None, False)
    assert torch.equal(lse, torch.full_like(lse, float("-inf")))  # the band admits no key
    _, lse, _ = torch.ops.attnx.additive_fwd(q, k, value, v, None, -4, 5, 0.0, None, False)
    ref = torch.logsumexp(
        (v.view(1, 2, 1, 1, 8) * torch.tanh(q.unsqueeze(3) + k.unsqueeze(2))).sum(-1), -1)
    torch.testing.assert_close(lse, ref)


def test_dropout_reproducible_and_seeded():
    inputs = [t.float() for t in make_inputs(2, 2, 17, 17, 16, 8)]

    def out(seed):
        torch.manual_seed(seed)
        return attnx.additive_attention(*inputs, dropout_p=0.4, backend="cpu", return_weights=True)

    (o1, w1), (o2, w2), (o3, w3) = out(11), out(11), out(12)
    assert torch.equal(o1, o2) and torch.equal(w1, w2)
    assert not torch.equal(w1, w3)
    torch.manual_seed(11)
    _, w_ref = attnx.additive_attention(*inputs, dropout_p=0.4, backend="reference",
                                        return_weights=True)
    assert torch.equal(w1 == 0, w_ref == 0)  # the same elements dropped, bit for bit
    dropped = (w1 == 0).double().mean().item()
    assert 0.3 < dropped < 0.5


def test_weights_are_probabilities():
    inputs = [t.float() for t in make_inputs(2, 3, 7, 11, 8, 4)]
    _, w = attnx.additive_attention(*inputs, backend="cpu", return_weights=True, window=(1, 3))
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 7))
    i, j = torch.arange(7).view(7, 1), torch.arange(11).view(1, 11)
    assert torch.equal(w[..., (j < i - 1) | (j > i + 3)], torch.zeros_like(w[..., (j < i - 1) | (j > i + 3)]))


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_counts_and_determinism(threads):
    """14 query rows over 3 threads split both (b, h) blocks: the shared-block path."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        inputs = make_inputs(1, 2, 7, 10, 12, 5)
        first = check_case(torch.float32, inputs, is_causal=True)
        again = run("cpu", inputs, torch.float32, is_causal=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_many_heads_take_a_head_a_task(threads, dtype):
    """B H >= 8 heads a thread, a head's rows in 256 KiB: the float32 forward takes a head a
    task and makes that head's e^{2q}, e^{2k} rows itself (csrc/cpu/additive_cpu.cpp
    per_head_tasks), several heads a thread in turn. Some rows past the exponential form's limit
    (|x| > 20: the exact path, by the flags made with the rows) in some heads. Against the
    reference, and bitwise against the same rows one batch element a call (2 heads: the rows
    made in one pass beforehand, a row group a task)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        b = 9 * threads
        inputs = make_inputs(b=b, h=2, lq=6, lk=11, a=40, ev=5, v_heads=True)
        inputs[0][1, 0, 2] *= 25.0   # a query row of large values
        inputs[0][3, 1, 5, 7] = 30.0  # one large entry
        inputs[1][1, 1, 4] *= 25.0   # a key row of large values
        inputs[1][b - 1, 0, 10, 0] = -1e4
        kw = dict(attn_mask=padding_mask(b, 11), window=(4, 1))
        xs = [t.to(dtype) for t in inputs]
        with torch.no_grad():
            whole = attnx.additive_attention(*xs, backend="cpu", **kw)
            for n in range(b):
                one = attnx.additive_attention(xs[0][n:n + 1], xs[1][n:n + 1], xs[2][n:n + 1],
                                               xs[3], backend="cpu", window=(4, 1),
                                               attn_mask=kw["attn_mask"][n:n + 1])
                assert torch.equal(whole[n:n + 1], one), f"batch element {n}"
        check_case(dtype, inputs, **kw)
    finally:
        torch.set_num_threads(before)


def _op_args(seed_p=0.25, return_weights=False, mask_kind="float"):
    g = torch.Generator().manual_seed(1)
    b, h, lq, lk, a, ev = 2, 2, 5, 6, 4, 3
    q = torch.randn(b, h, lq, a, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, h, lk, a, generator=g, dtype=torch.float64, requires_grad=True)
    value = torch.randn(b, h, lk, ev, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(h, a, generator=g, dtype=torch.float64, requires_grad=True)
    if mask_kind == "float":
        mask = torch.randn(1, h, lq, lk, generator=g, dtype=torch.float64)
        mask = mask.requires_grad_().expand(b, h, lq, lk)
    else:
        mask = (torch.rand(b, 1, 1, lk, generator=g) < 0.8).expand(b, h, lq, lk)
    seed = torch.tensor([123456789, 987654321], dtype=torch.int64)
    return (q, k, value, v, mask, -3, 2, seed_p, seed, return_weights)


def test_lse_gradient_of_the_op():
    """attnx::additive_fwd's lse is differentiable (d lse_i / d s_ij = P_ij shifts D_i), as
    the reference's is; additive_attention does not return it, the op does."""
    from attnx import _validate
    from attnx._backends import native, reference

    q, k, value, v = make_inputs(b=2, h=2, lq=7, lk=9, a=8, ev=4)
    mask = huge_bias_mask(2, 7, 9)
    g = torch.Generator().manual_seed(2)
    dout, dlse = torch.randn(2, 2, 7, 4, generator=g, dtype=torch.float64), torch.randn(2, 2, 7, generator=g)
    grads = {}
    for name, backend in (("cpu", native), ("reference", reference)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, value, v)]
        call = _validate.additive_call(*leaves, mask, 0.0, False, (2, 3), name, False)
        out, lse, _ = backend.additive(call)
        loss = (out * dout).sum() + (lse * dlse).sum()
        grads[name] = torch.autograd.grad(loss, leaves)
    for a, b in zip(grads["cpu"], grads["reference"]):
        assert_within(a, b, b, floor=1e-10, what="grad")


def test_gradcheck_float64():
    args = _op_args()
    mask_leaf = args[4]._base if args[4]._base is not None else args[4]

    def f(q, k, value, v, m):
        m = m.expand(args[4].shape)
        return torch.ops.attnx.additive_fwd(q, k, value, v, m, *args[5:])[0]

    assert torch.autograd.gradcheck(f, (*args[:4], mask_leaf))


@pytest.mark.parametrize("return_weights,mask_kind,p", [(False, "float", 0.25), (True, "bool", 0.0)])
def test_opcheck(return_weights, mask_kind, p):
    args = _op_args(p, return_weights, mask_kind)
    torch.library.opcheck(torch.ops.attnx.additive_fwd, args)


def test_gradcheck_float64_through_the_weights():
    """The weights output is differentiable on the kernel itself (grad_weights of
    attnx::additive_bwd), dropout and a float mask included."""
    args = _op_args(0.3, True, "float")
    mask_leaf = args[4]._base if args[4]._base is not None else args[4]

    def f(q, k, value, v, m):
        out, _, weights = torch.ops.attnx.additive_fwd(q, k, value, v, m.expand(args[4].shape),
                                                       *args[5:])
        return out, weights

    assert torch.autograd.gradcheck(f, (*args[:4], mask_leaf))


def test_differentiable_weights_stay_on_the_fused_kernel(monkeypatch):
    """Weights in the loss run on the cpu kernels with the caller's value as it is."""
    from attnx._backends import cpu, reference

    values = []
    real = cpu.additive
    monkeypatch.setattr(cpu, "additive", lambda call: (values.append(call.value.shape), real(call))[1])
    monkeypatch.setattr(reference, "additive", None)  # would raise if chosen
    q, k, value, v = (t.float().requires_grad_() for t in make_inputs(1, 2, 3, 5, 4, 6))
    _, w = attnx.additive_attention(q, k, value, v, return_weights=True)
    (w * torch.randn_like(w)).sum().backward()
    assert values == [value.shape] and q.grad is not None and v.grad is not None
