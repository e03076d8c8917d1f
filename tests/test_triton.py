"""The `triton` backend against the float64 reference, forward and backward.

Without a GPU the kernels run in Triton's interpreter on CPU tensors: set TRITON_INTERPRET=1
before Triton is imported (`TRITON_INTERPRET=1 python -m pytest tests/test_triton.py`). Shapes
are small because the interpreter runs every program in Python; block sizes there are 16, so
lengths like 17, 33 and 40 cross block edges and exercise the band's block skipping.

Errors are bounded as in flash-attention's tests: a small multiple of the error that the same
math done naively in the test dtype makes against the float64 golden value.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("the triton backend needs a CUDA device, or TRITON_INTERPRET=1 to run its "
                "kernels on CPU tensors in Triton's interpreter", allow_module_level=True)

import attnx  # noqa: E402
from attnx import _dispatch, _rng, _validate  # noqa: E402
from attnx._backends import reference  # noqa: E402
from attnx.triton import additive as _additive_ops, sdpa as _sdpa_ops  # noqa: E402,F401
from attnx.triton.sdpa_bwd_rerun import _narrow  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from _compare import (assert_within, causal_varlen_run,  # noqa: E402
                      check_fp16_ds_past_its_range, check_fp16_out_past_its_range,
                      lost_key_qkv, max_err, ulp_floor, wrong_sign_qk)

DEVICE = "cpu" if INTERPRET else "cuda"
SEED = 1234
f32, f16, bf16, f64 = torch.float32, torch.float16, torch.bfloat16, torch.float64


def _randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)


def _is_float_mask(t) -> bool:
    return (isinstance(t, torch.Tensor) and not isinstance(t, CausalBias)
            and t.dtype != torch.bool)


def _up(t):
    """Inputs for the float64 golden run."""
    return t.double() if _is_float_mask(t) else t


def _grads(out, leaves, grad):
    wanted = [t for t in leaves if t.requires_grad]
    return list(torch.autograd.grad(out, wanted, grad))


# ---------------------------------------------------------------- SDPA


def _naive_sdpa(q, k, v, mask, call):
    """The reference math without its float32 upcast: PyTorch's own error in q's dtype."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = torch.matmul(q, k.transpose(-2, -1)) * call.scale
    mask = None if mask is None or isinstance(mask, CausalBias) else mask.expand(s.shape)
    p, lse = reference.masked_softmax(s, mask, call.window_lo, call.window_hi)
    return torch.matmul(reference.apply_dropout(p, call.dropout_p, call.seed), v), lse


def _run(inputs, mask, grad, forward, extra_grad=None):
    """forward(*leaves, mask) under SEED on fresh leaves of the inputs (and of a float mask),
    and the gradients of every leaf: (out, forward's second result, grads). The loss is
    out . grad, plus extra . extra_grad when that is given."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    m = mask
    if _is_float_mask(mask):
        m = mask.detach().requires_grad_()
        leaves.append(m)
    torch.manual_seed(SEED)
    out, extra = forward(*leaves[:len(inputs)], m)
    if extra_grad is None:
        return out, extra, _grads(out, leaves, grad.to(out.dtype))
    return out, extra, _grads((out, extra), leaves, (grad.to(out.dtype), extra_grad.to(extra.dtype)))


def _run_sdpa(backend, q, k, v, mask, kwargs, grad):
    def forward(q, k, v, m):
        if backend == "naive":
            call = _validate.sdpa_call(q, k, v, m, kwargs.get("dropout_p", 0.0),
                                       kwargs.get("is_causal", False), kwargs.get("scale"),
                                       kwargs.get("enable_gqa", False), kwargs.get("window"),
                                       "reference", True)
            return _naive_sdpa(q, k, v, m, call)
        return attnx.scaled_dot_product_attention(q, k, v, attn_mask=m, backend=backend,
                                                  return_lse=True, **kwargs)
    return _run((q, k, v), mask, grad, forward)


def check_sdpa(dtype, b, hq, hkv, lq, lk, e, ev=None, mask_shape=None, mask_kind=None,
               empty_rows=(), attn_mask=None, **kwargs):
    """Triton vs float64 reference on random inputs; returns (triton out, lse, grads).

    The mask is random (`mask_kind` "bool"/"float" of `mask_shape`) or `attn_mask` as given."""
    gen = torch.Generator().manual_seed(0)
    ev = ev or e
    q, k, v = (_randn(s, dtype, gen) for s in ((b, hq, lq, e), (b, hkv, lk, e), (b, hkv, lk, ev)))
    grad = _randn((b, hq, lq, ev), torch.float64, gen)
    mask = attn_mask
    if mask_kind == "bool":
        mask = torch.rand(mask_shape, generator=gen).to(DEVICE) > 0.3
        for r in empty_rows:
            mask[..., r, :] = False
    elif mask_kind == "float":
        mask = _randn(mask_shape, dtype, gen)
        for r in empty_rows:
            mask[..., r, :] = float("-inf")
    if hq != hkv:
        kwargs["enable_gqa"] = True
    out, lse, grads = _run_sdpa("triton", q, k, v, mask, kwargs, grad)
    gold_out, gold_lse, gold_grads = _run_sdpa("reference", _up(q), _up(k), _up(v), _up(mask),
                                               kwargs, grad)
    base_out, base_lse, base_grads = _run_sdpa("naive", q, k, v, mask, kwargs, grad)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_within(out, gold_out, base_out)
    assert torch.equal(torch.isinf(lse), torch.isinf(gold_lse)), "lse: -inf rows differ"
    fin = torch.isfinite(gold_lse)
    assert_within(lse[fin], gold_lse[fin].float(), base_lse[fin].float(), what="lse")
    names = ["dq", "dk", "dv", "dmask"]
    for name, g, gg, bg in zip(names, grads, gold_grads, base_grads):
        assert_within(g, gg, bg, factor=3.0, what=name)
    return out, lse, grads


@pytest.mark.parametrize("dtype", [f32, f16, bf16])
def test_sdpa_plain(dtype):
    check_sdpa(dtype, 2, 2, 2, 17, 33, 24)


@pytest.mark.parametrize("lq,lk,e,ev", [(1, 17, 16, 16), (33, 1, 64, 16), (17, 17, 40, 72)])
def test_sdpa_odd_sizes_and_head_dims(lq, lk, e, ev):
    check_sdpa(f32, 1, 2, 2, lq, lk, e, ev)


@pytest.mark.parametrize("e,ev", [(160, 192), (200, 40)])
def test_sdpa_head_dims_in_two_chunks(e, ev):
    """Head dims over 128 in two power-of-two chunks (sdpa._head_blocks: 128+32, 128+64),
    unpadded and padded (200 = 128+128 less 56; 40 is one 64 block)."""
    from attnx.triton import sdpa as ts

    assert ts._head_blocks(160) == (128, 32) and ts._head_blocks(192) == (128, 64)
    assert ts._head_blocks(96) == (128, 0)
    check_sdpa(f16, 1, 2, 2, 17, 33, e, ev, is_causal=True)


@pytest.mark.parametrize("dtype", [f32, f16, bf16])
def test_sdpa_negative_scale(dtype):
    """scale < 0 negates q (forward, dq) and k (dk, dv) once per tile (sdpa.py): exact in every
    dtype, through float32 (common.negated; the interpreter's bf16 -q gave errors of ~3)."""
    check_sdpa(dtype, 1, 2, 2, 17, 20, 16, scale=-0.7, is_causal=True)


@pytest.mark.parametrize("dtype", [f32, f16])
def test_sdpa_causal_lq_ne_lk(dtype):
    check_sdpa(dtype, 1, 2, 2, 33, 17, 24, is_causal=True)
    check_sdpa(dtype, 1, 2, 2, 17, 40, 24, is_causal=True, scale=0.3)


def test_sdpa_causal_lower_right():
    # Lq > Lk: the first Lq - Lk rows admit no key (lse -inf, zero output and grads).
    out, lse, grads = check_sdpa(f32, 1, 2, 2, 40, 17, 16, attn_mask=causal_lower_right(40, 17))
    assert torch.isinf(lse[..., :23]).all() and (out[..., :23, :] == 0).all()
    assert (grads[0][..., :23, :] == 0).all()


@pytest.mark.parametrize("window,causal", [((4, 2), False), ((5, None), True), ((0, 0), False)])
def test_sdpa_window(window, causal):
    check_sdpa(f32, 1, 2, 2, 40, 40, 16, window=window, is_causal=causal)


def test_sdpa_window_lq_ne_lk_half():
    check_sdpa(f16, 1, 1, 1, 17, 50, 32, window=(3, 20))


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_sdpa_gqa(dtype):
    check_sdpa(dtype, 1, 4, 2, 17, 33, 16, is_causal=True)
    if dtype == f32:
        check_sdpa(f32, 1, 6, 1, 17, 17, 24)


def test_sdpa_bool_mask_broadcast_with_empty_rows():
    out, lse, grads = check_sdpa(f32, 2, 2, 2, 33, 17, 24, mask_shape=(2, 1, 33, 17),
                                 mask_kind="bool", empty_rows=(0, 20))
    for r in (0, 20):
        assert torch.isinf(lse[:, :, r]).all() and (lse[:, :, r] < 0).all()
        assert (out[:, :, r] == 0).all() and (grads[0][:, :, r] == 0).all()


@pytest.mark.parametrize("dtype", [f32, f16])
def test_sdpa_float_mask_grad_broadcast(dtype):
    # (1, H, Lq, 1) and (Lq, Lk) masks: dmask is summed over the broadcast dims by autograd.
    check_sdpa(dtype, 2, 2, 2, 17, 33, 16, mask_shape=(1, 2, 17, 1), mask_kind="float")
    check_sdpa(dtype, 1, 2, 2, 17, 33, 16, mask_shape=(17, 33), mask_kind="float",
               empty_rows=(3,), window=(8, 8))


def _huge_bias_mask(b, lq, lk, dtype=f32):
    """Whole rows padded with finfo.min, as Hugging Face models pad: their lse rounds to the
    row max, where the backward must still find probabilities 1 / l (common.HUGE_LSE)."""
    big = torch.finfo(dtype).min
    m = torch.zeros(b, 1, lq, lk, dtype=dtype)
    m[:, :, 2] = big
    m[0, :, 5, 9:] = big
    m[-1, :, lq - 1] = big
    m[-1, :, lq - 1, 3] = big / 2
    return m.to(DEVICE)


def test_sdpa_rows_under_a_huge_finite_bias():
    check_sdpa(f32, 2, 2, 1, 40, 37, 16, attn_mask=_huge_bias_mask(2, 40, 37))


@pytest.mark.parametrize("dtype", [f16, bf16])
@pytest.mark.parametrize("scale", [3e8, 1e9])
def test_sdpa_huge_scaled_scores_forward(dtype, scale):
    """Scaled scores of 1e8-1e10: the forward's in-band loop folds the scale into the exponent,
    exp2(qk * qk_scale - m), which a GPU compile makes one FMA (sm_90 PTX: fma.rn.f32 into
    ex2): a row's largest probability then comes out 2^(rounding of m), half an ulp of the
    scaled max (hundreds and more here), far past fp16's range (the cuda kernel's kFoldLimit
    case). The interpreter does not fuse, so
    only a GPU run tests it; the cuda backend passes the same test (test_cuda.py)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (_randn(s, dtype, gen) for s in ((1, 2, 70, 64), (1, 2, 150, 64), (1, 2, 150, 64)))
    out = attnx.scaled_dot_product_attention(q, k, v, scale=scale, backend="triton")
    gold = attnx.scaled_dot_product_attention(_up(q), _up(k), _up(v), scale=scale,
                                              backend="reference")
    base = attnx.scaled_dot_product_attention(q, k, v, scale=scale, backend="reference")
    assert_within(out, gold, base)


@pytest.mark.parametrize("dtype", [f16, bf16])
@pytest.mark.parametrize("scale", [3e8, 1e9])
def test_sdpa_huge_scaled_scores_backward_stays_finite(dtype, scale):
    """At scaled scores of 3e8-1e9 a recomputed score's rounding (an ulp of the raw q . k times
    the scale: hundreds in the exponent) leaves the GPU backward's P unrelated to the forward's
    and to its own row sums: gradients there are not accurate on the triton (or cuda) backend
    (README), but they must stay finite. Before the probabilities were clamped to <= 1, exp2
    overflowed and dq, dk, dv came out NaN (here, in the interpreter, as on a GPU)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (_randn(s, dtype, gen) for s in ((1, 2, 70, 64), (1, 2, 150, 64),
                                                   (1, 2, 150, 64), (1, 2, 70, 64)))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = attnx.scaled_dot_product_attention(*leaves, scale=scale, backend="triton")
    for name, g in zip("qkv", torch.autograd.grad(out, leaves, do)):
        assert torch.isfinite(g).all(), f"d{name}: non-finite values"


def test_sdpa_lse_is_differentiable():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (_randn(s, f32, gen) for s in ((2, 2, 20, 16), (2, 1, 33, 16), (2, 1, 33, 8)))
    mask = _huge_bias_mask(2, 20, 33)
    dout, dlse = _randn((2, 2, 20, 8), f32, gen), _randn((2, 2, 20), f32, gen)
    res = {}
    # Bounded by the reference's own float32 error against float64, not a flat tolerance: on a
    # GPU tl.exp / tl.log lower to approximate instructions, which the interpreter's numpy
    # does not reproduce.
    for name, backend, dtype in (("triton", "triton", f32), ("base", "reference", f32),
                                 ("gold", "reference", torch.float64)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, mask)]
        out, lse = attnx.scaled_dot_product_attention(*leaves[:3], attn_mask=leaves[3],
                                                      enable_gqa=True, return_lse=True,
                                                      backend=backend)
        res[name] = torch.autograd.grad((out * dout.to(dtype)).sum() + (lse * dlse.to(dtype)).sum(),
                                        leaves)
    for name, a, gold, base in zip(("dq", "dk", "dv", "dmask"), res["triton"], res["gold"],
                                   res["base"]):
        assert_within(a, gold, base, factor=3.0, what=name)


def test_sdpa_dropout_matches_reference():
    # The same seed drops the same elements: otherwise errors would be O(1), not rounding.
    check_sdpa(f32, 1, 2, 2, 33, 40, 16, dropout_p=0.3)
    check_sdpa(f16, 1, 4, 2, 17, 33, 24, dropout_p=0.5, is_causal=True)
    check_sdpa(f32, 1, 2, 2, 17, 17, 16, dropout_p=0.2, mask_shape=(17, 17), mask_kind="float")


def test_sdpa_dropout_reproducible_and_deterministic():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (_randn((1, 2, 17, 16), f32, gen).requires_grad_() for _ in range(3))
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        out = attnx.scaled_dot_product_attention(q, k, v, dropout_p=0.4, backend="triton")
        runs.append((out, *torch.autograd.grad(out.sum(), (q, k, v))))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not torch.equal(runs[0][0], runs[2][0])


# ---------------------------------------------------------------- additive


def _naive_additive(q, k, value, w, mask, call):
    """The reference formula without its float32 upcast."""
    t = torch.tanh(q.unsqueeze(3) + k.unsqueeze(2))
    s = (t * w.expand(q.shape[1], q.shape[-1]).view(1, q.shape[1], 1, 1, -1)).sum(-1)
    mask = None if mask is None else mask.expand(s.shape)
    p, _ = reference.masked_softmax(s, mask, call.window_lo, call.window_hi)
    p = reference.apply_dropout(p, call.dropout_p, call.seed)
    return torch.matmul(p, value), p


def _run_additive(backend, q, k, value, w, mask, kwargs, grad, weights_grad=None):
    def forward(q, k, value, w, m):
        if backend == "naive":
            call = _validate.additive_call(q, k, value, w, m, kwargs.get("dropout_p", 0.0),
                                           kwargs.get("is_causal", False), kwargs.get("window"),
                                           "reference", True)
            return _naive_additive(q, k, value, w, m, call)
        return attnx.additive_attention(q, k, value, w, attn_mask=m, backend=backend,
                                        return_weights=True, **kwargs)
    return _run((q, k, value, w), mask, grad, forward, weights_grad)


def check_additive(dtype, b, h, lq, lk, a, ev, w_shape=None, mask_shape=None, mask_kind=None,
                   empty_rows=(), attn_mask=None, qk_scale=1.0, w_scale=1.0, floor=1e-5,
                   **kwargs):
    """floor: each bound's least value; "ulps" for 4 float32 ulp of the golden's largest."""
    gen = torch.Generator().manual_seed(0)
    q, k, value = (_randn(s, dtype, gen) for s in ((b, h, lq, a), (b, h, lk, a), (b, h, lk, ev)))
    q, k = q * qk_scale, k * qk_scale
    w = _randn(w_shape or (h, a), dtype, gen) * (w_scale / a ** 0.5)
    grad = _randn((b, h, lq, ev), torch.float64, gen)
    mask = attn_mask
    if mask_kind == "bool":
        mask = torch.rand(mask_shape, generator=gen).to(DEVICE) > 0.3
    elif mask_kind == "float":
        mask = _randn(mask_shape, dtype, gen)
    for r in empty_rows:
        mask[..., r, :] = False if mask_kind == "bool" else float("-inf")
    # the loss also takes the weights: they are differentiable (grad_weights of the backward)
    wgrad = _randn((b, h, lq, lk), torch.float64, gen)
    out, weights, grads = _run_additive("triton", q, k, value, w, mask, kwargs, grad, wgrad)
    gold = _run_additive("reference", _up(q), _up(k), _up(value), _up(w), _up(mask), kwargs, grad,
                         wgrad)
    base = _run_additive("naive", q, k, value, w, mask, kwargs, grad, wgrad)
    def least(golden):
        return ulp_floor(golden, f32) if floor == "ulps" else floor

    assert_within(out, gold[0], base[0], floor=least(gold[0]))
    assert_within(weights, gold[1], base[1], floor=least(gold[1]), what="weights")
    with torch.no_grad():  # the weights kernel's own output, as plots get it
        torch.manual_seed(SEED)
        _, plain = attnx.additive_attention(q, k, value, w, attn_mask=mask, backend="triton",
                                            return_weights=True, **kwargs)
    assert_within(plain, gold[1], base[1], floor=least(gold[1]), what="weights without grad")
    for name, g, gg, bg in zip(["dq", "dk", "dvalue", "dv", "dmask"], grads, gold[2], base[2]):
        assert_within(g, gg, bg, factor=3.0, floor=least(gg), what=name)
    return out, weights, grads


@pytest.mark.parametrize("dtype", [f32, f16])
def test_additive_plain(dtype):
    check_additive(dtype, 1, 2, 17, 33, 24, 20)


@pytest.mark.parametrize("kw", [{}, {"window": (9, 3), "mask_kind": "float",
                                      "mask_shape": (33, 40)}], ids=["full", "window-float-mask"])
def test_additive_small_operands_keep_float32s_precision(kw):
    """q, k ~ 1e-3 (tanh in its linear part) against a large v: the exp form of tanh errs by
    ~eps absolute a term, ~eps / |x| relative, where torch's tanh errs by ~eps |x|; out erred
    13-25x torch's float32 error here (90x at other shapes), until common.tanh took its exact
    branch below 1/2. The floor is a few ulp of the largest value (check_additive's 1e-5 would
    pass 100x torch's error)."""
    check_additive(f32, 1, 2, 33, 40, 128, 16, qk_scale=1e-3, w_scale=300.0, floor="ulps", **kw)


def test_additive_causal_window_shared_v():
    check_additive(f32, 1, 2, 33, 17, 40, 16, w_shape=(40,), is_causal=True)
    check_additive(f32, 1, 1, 40, 40, 8, 16, window=(3, 5))


def test_additive_masks_and_empty_rows():
    out, weights, grads = check_additive(f32, 2, 1, 17, 33, 16, 16, mask_shape=(2, 1, 17, 33),
                                         mask_kind="bool", empty_rows=(4,))
    assert (out[:, :, 4] == 0).all() and (weights[:, :, 4] == 0).all()
    assert (grads[0][:, :, 4] == 0).all()
    check_additive(f32, 1, 2, 17, 20, 16, 16, mask_shape=(1, 2, 1, 20), mask_kind="float")


def test_additive_rows_under_a_huge_finite_bias():
    """The backward and the weights (made from the saved lse) both renormalize such rows."""
    check_additive(f32, 2, 1, 20, 37, 16, 8, attn_mask=_huge_bias_mask(2, 20, 37))


def test_additive_dropout_matches_reference():
    _, weights, _ = check_additive(f32, 2, 2, 17, 33, 16, 16, dropout_p=0.3)
    # Exactly the elements of attnx._rng's mask are dropped (every probability is > 0 here).
    torch.manual_seed(SEED)
    keep = _rng.keep_mask(_rng.draw_seed(), 2, 2, 17, 33, 0.3, weights.device)
    assert torch.equal(weights != 0, keep)


def test_additive_bf16_and_three_d():
    check_additive(bf16, 1, 1, 17, 17, 64, 16)
    gen = torch.Generator().manual_seed(1)
    q, k, value = (_randn((2, 5, 8), f32, gen) for _ in range(3))
    w = _randn((8,), f32, gen)
    out, weights = attnx.additive_attention(q, k, value, w, backend="triton", return_weights=True)
    gold, gold_w = attnx.additive_attention(q.double(), k.double(), value.double(), w.double(),
                                            backend="reference", return_weights=True)
    base, base_w = attnx.additive_attention(q, k, value, w, backend="reference",
                                            return_weights=True)
    assert out.shape == (2, 5, 8) and weights.shape == (2, 5, 5)
    assert_within(out, gold, base)  # relative to float32's own error: GPU exp is approximate
    assert_within(weights, gold_w, base_w, what="weights")


# ---------------------------------------------------------------- fp32 dots


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """x (float32) rounded to TF32 (10 explicit mantissa bits), to nearest, ties away from zero
    as the GPU's cvt.rna.tf32.f32 rounds."""
    bits = x.view(torch.int32).to(torch.int64)
    bits = ((bits + 0x1000) & ~0x1FFF).to(torch.int32)  # + half an ulp of tf32, then truncate
    return bits.view(torch.float32)


def _dot_tf32x3(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Triton's input_precision="tf32x3" in float32: big*big + big*small + small*big with each
    operand split as big = tf32(x), small = tf32(x - big); TF32 products are exact in fp32."""
    a_big, b_big = _tf32(a), _tf32(b)
    a_small, b_small = _tf32(a - a_big), _tf32(b - b_big)
    return a_big @ b_small + a_small @ b_big + a_big @ b_big


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_fp32_dots_on_tensor_cores_are_as_accurate_as_fp32(d):
    """fp32 kernels multiply with tf32x3 (common.dot_precision): on a GPU three TF32 tensor-core
    products. Triton's interpreter ignores input_precision (numpy float32 matmul), so the GPU's
    rounding is emulated here: its error against float64 must stay within 2x plain float32's
    (the suite's output bound), which a single TF32 product misses by orders of magnitude."""
    from attnx.triton import common

    assert common.dot_precision(f32) == "tf32x3"
    gen = torch.Generator().manual_seed(d)
    a, b = (torch.randn(shape, generator=gen, dtype=torch.float64) for shape in ((128, d), (d, 64)))
    gold = a @ b
    a32, b32 = a.float(), b.float()
    fp32_err = max_err(a32 @ b32, gold)
    assert max_err(_dot_tf32x3(a32, b32), gold) <= 2 * fp32_err
    assert max_err(_tf32(a32) @ _tf32(b32), gold) > 20 * fp32_err  # the check can fail


# ---------------------------------------------------------------- registration


def test_second_order_gradients_match_the_reference():
    """A backward with create_graph=True recomputes on the reference backend (attnx/
    _second_order.py), through each Triton formula: the Hessian-vector products are the
    reference's."""
    gen = torch.Generator().manual_seed(0)
    q = _randn((1, 2, 5, 16), f32, gen).requires_grad_()
    k, v, w = _randn((1, 2, 6, 16), f32, gen), _randn((1, 2, 6, 16), f32, gen), _randn((16,), f32, gen)
    sinks = _randn((2,), f32, gen)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=q.device)
    calls = (lambda q, b: attnx.scaled_dot_product_attention(q, k, v, is_causal=True, backend=b),
             lambda q, b: attnx.scaled_dot_product_attention(q, k, v, sinks=sinks, softcap=5.0,
                                                             backend=b),
             lambda q, b: attnx.additive_attention(q, k, v, w, backend=b),
             lambda q, b: attnx.varlen_attention(q[0].transpose(0, 1), k[0, :, :5].transpose(0, 1),
                                                 v[0, :, :5].transpose(0, 1), cu, cu, backend=b))
    for fn in calls:
        c = torch.randn(fn(q, "reference").shape, generator=gen).to(q.device)
        hessian_vector = []
        for backend in ("triton", "reference"):
            # (a loss linear in the output: the same grad_out whatever each forward rounded)
            g, = torch.autograd.grad((fn(q, backend) * c).sum(), q, create_graph=True)
            hessian_vector.append(torch.autograd.grad(g.pow(2).sum(), q)[0])
        torch.testing.assert_close(*hessian_vector)


def test_ops_pass_opcheck_and_compile():
    """Schemas, fake kernels and autograd registration as torch.library checks them, and a
    fullgraph torch.compile through the ops (backward included)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (_randn(s, f32, gen).requires_grad_() for s in ((1, 2, 17, 16), (1, 2, 20, 16),
                                                              (1, 2, 20, 8)))
    mask = _randn((1, 1, 17, 20), f32, gen).requires_grad_()
    args = (q, k, v, mask.expand(1, 2, 17, 20), 0.25, -17, 3, 0.2, torch.tensor([5, 6]))
    torch.library.opcheck(torch.ops.attnx.triton_sdpa_fwd.default, args)
    aq, ak, avalue, aw = (_randn(s, f32, gen).requires_grad_() for s in ((1, 1, 5, 8), (1, 1, 7, 8),
                                                                         (1, 1, 7, 4), (1, 8)))
    for return_weights in (False, True):
        torch.library.opcheck(torch.ops.attnx.triton_additive_fwd.default,
                              (aq, ak, avalue, aw, None, -5, 0, 0.0, None, return_weights))

    def f(q, k, v, mask):
        return torch.ops.attnx.triton_sdpa_fwd(q, k, v, mask.expand(1, 2, 17, 20), 0.25, -17, 3,
                                               0.0, None)[0]

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    eager_out, compiled_out = f(q, k, v, mask), compiled(q, k, v, mask)
    assert torch.equal(eager_out, compiled_out)
    # A weighted loss, not .sum(): eager autograd hands the backward .sum()'s gradient as a
    # stride-0 expand and AOT autograd a contiguous tensor: Triton specializes a kernel on its
    # strides, and on an H200 (2026-11-26) the two specializations' gradients differed in their
    # last bits (a reduction's layout, hence its order, follows the loads'), not a compile bug.
    leaves, w = (q, k, v, mask), _randn(eager_out.shape, f32, gen)
    eager = torch.autograd.grad((eager_out * w).sum(), leaves)
    compiled_grads = torch.autograd.grad((compiled_out * w).sum(), leaves)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled_grads))


def test_backward_ops_return_what_their_fake_kernels_promise():
    """Contiguous gradients whatever the inputs' strides (modules pass heads transposed), as the
    fake kernels say: torch.compile's inductor checks it on backward."""
    gen = torch.Generator().manual_seed(0)

    def strided(b, h, l, d):
        return _randn((b, l, h, d), f32, gen).transpose(1, 2)

    q, k, v = strided(1, 2, 17, 16), strided(1, 2, 20, 16), strided(1, 2, 20, 8)
    args = (q, k, v, None, 0.25, -17, 3, 0.0, None)
    out, lse = torch.ops.attnx.triton_sdpa_fwd(*args)
    torch.library.opcheck(torch.ops.attnx.triton_sdpa_bwd.default,
                          (torch.randn_like(out), *args[:4], out, lse, *args[4:], False))
    q, k, value = strided(1, 2, 5, 8), strided(1, 2, 7, 8), strided(1, 2, 7, 4)
    w = _randn((8,), f32, gen).expand(2, 8)
    args = (q, k, value, w, None, -5, 0, 0.0, None)
    out, lse, _ = torch.ops.attnx.triton_additive_fwd(*args, False)
    torch.library.opcheck(torch.ops.attnx.triton_additive_bwd.default,
                          (torch.randn_like(out), *args[:5], out, lse, *args[5:], False, None, None))


# ---------------------------------------------------------------- availability


def test_backend_reported_usable():
    status = _dispatch.backends()["triton"]
    assert status.usable, status.reason


def test_forced_backend_rejects_what_it_cannot_serve():
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(_dispatch.BackendUnavailableError, match="float16, bfloat16 and float32"):
        attnx.scaled_dot_product_attention(q, q, q, backend="triton")
    big = torch.randn(1, 1, 4, 300, device=DEVICE)
    with pytest.raises(_dispatch.BackendUnavailableError, match="head dims up to 256"):
        attnx.scaled_dot_product_attention(big, big, big, backend="triton")


@pytest.mark.skipif(not INTERPRET, reason="auto-selection for CPU tensors only matters in the interpreter")
def test_auto_never_picks_the_interpreter():
    q = torch.randn(1, 1, 4, 8)
    call = _validate.sdpa_call(q, q, q, None, 0.0, False, None, False, None, None, False)
    assert _dispatch.select("sdpa", call) != "triton"


def test_raw_ops_take_bands_of_any_size():
    """A window wider than the sequences (up to the int64 limits) admits every pair."""
    from attnx.triton import additive as ta, sdpa as ts

    gen = torch.Generator().manual_seed(1)
    q, k, val, w = (_randn(s, f32, gen) for s in ((1, 1, 5, 16), (1, 1, 7, 16), (1, 1, 7, 16), (1, 16)))
    huge = (-2**63, 2**63 - 1)
    for a, b in zip(ta.additive_fwd(q, k, val, w, None, -5, 7, 0.0, None, True),
                    ta.additive_fwd(q, k, val, w, None, *huge, 0.0, None, True)):
        torch.testing.assert_close(a, b)
    for a, b in zip(ts.sdpa_fwd(q, k, val, None, 0.25, -5, 7, 0.0, None),
                    ts.sdpa_fwd(q, k, val, None, 0.25, *huge, 0.0, None)):
        torch.testing.assert_close(a, b)


def test_dropout_seed_never_goes_through_the_host():
    """The seed words stay on the device the kernels read them from: on the meta device, which
    has no data, any copy through the host raises."""
    from attnx.triton.rng import rng_words

    words = rng_words(torch.tensor([7, 9], device="meta"), 0.25, torch.device("meta"))
    assert words.device.type == "meta" and words.shape == (3,) and words.dtype == torch.int64
    on_cpu = rng_words(torch.tensor([7, 9]), 0.25, torch.device("cpu"))
    assert on_cpu.tolist() == [7, 9, _rng.keep_threshold(0.25)]

def test_grids_stay_within_cudas_axis_caps():
    """CUDA caps grid axes y and z at 65535 (x at 2^31 - 1): 65536 heads must still launch.
    Launches are recorded, not run (tests/triton_compile/capture.py)."""
    from attnx.triton import additive as ta, sdpa as ts
    from triton_compile.capture import recording

    b, d = 65536, 16
    q, k, v = (torch.zeros(b, 1, 2, d) for _ in range(3))
    w = torch.zeros(1, d)
    launches = []
    with recording(launches), torch.no_grad():
        out, lse = ts.sdpa_fwd(q, k, v, None, 0.25, -2, 2, 0.0, None)
        ts.sdpa_bwd(q, q, k, v, None, out, lse, 0.25, -2, 2, 0.0, None, False, None)
        out, lse, _ = ta.additive_fwd(q, k, v, w, None, -2, 2, 0.0, None, True)
        ta.additive_bwd(q, q, k, v, w, None, out, lse, -2, 2, 0.0, None, False, None,
                        torch.zeros(b, 1, 2, 2))
    assert len(launches) == 16  # (the SDPA forward's rerun; float32: the backwards' reruns)
    for launch in launches:
        grid = launch.grid
        if callable(grid):  # an autotuned kernel: its grid for each config
            grid = [grid({**launch.kwargs, **c.kwargs}) for c in launch.kernel.configs]
        else:
            grid = [grid]
        for g in grid:
            assert g[0] < 2**31 and all(n <= 65535 for n in g[1:]), (launch.kernel, g)


def test_gqa_backward_fills_the_gpu(monkeypatch):
    """The dK/dV grid counts slices of each GQA group's query heads (partial sums added up on
    the host), so MQA launches at least two programs per SM, where one program per kv head
    and key block left most SMs idle (issue 18 item 9)."""
    from attnx.triton import common, sdpa as ts

    monkeypatch.setattr(common, "multiprocessors", lambda: 132)
    n = max(c.kwargs["BLOCK_N"] for c in ts._DKDV)
    assert ts._gqa_split(1, 32 * n, 8) == 1     # no groups: nothing to split
    assert ts._gqa_split(32, 128 * n, 1) == 4   # 128 key blocks x 4 slices >= 264
    assert ts._gqa_split(8, 32 * n, 1) == 8     # 32 key blocks: one slice per query head
    assert ts._gqa_split(4, 64 * n, 32) == 1    # 64 x 32 programs already
    assert ts._gqa_split(4, 64 * n, 32, one_head=True) == 4  # sm_90's wide tiles: a head each


def _autotune_keys(lq, lk):
    """The autotuners' keys (as Triton's Autotuner builds them) of an SDPA forward and backward."""
    import triton

    from attnx.triton import sdpa as ts
    from triton_compile.capture import recording

    q, k = torch.zeros(1, 2, lq, 64), torch.zeros(1, 2, lk, 64)
    launches = []
    with recording(launches), torch.no_grad():
        out, lse = ts.sdpa_fwd(q, k, k, None, 0.125, -lq, lk, 0.0, None)
        ts.sdpa_bwd(out, q, k, k, None, out, lse, 0.125, -lq, lk, 0.0, None, False, None)
    keys = []
    for launch in launches:
        if not isinstance(launch.kernel, triton.runtime.Autotuner):  # (sdpa_bwd_rerun's)
            continue
        args = {**dict(zip(launch.kernel.arg_names, launch.args)), **launch.kwargs}
        keys.append(tuple(args[name] for name in launch.kernel.keys))
    return keys


def test_autotuning_keys_on_length_buckets():
    """New lengths within a power of two reuse the tuned configs: an exact-length key re-tuned
    (about a second forward, two backward) at every new length of a decoding loop."""
    assert _autotune_keys(1000, 1000) == _autotune_keys(1020, 513) == _autotune_keys(1024, 1024)
    assert _autotune_keys(1000, 1000) != _autotune_keys(1025, 1000)


# ---------------------------------------------------------------- KV-cache decoding


def _nan_cache(slots, hkv, depth, e, dtype, lengths, table, gen):
    """A cache holding random keys at each sequence's positions and NaN in every other slot
    (a read past a sequence's length shows in the output)."""
    cache = torch.full((slots, hkv, depth, e), float("nan"), dtype=torch.float64)
    for b, n in enumerate(lengths):
        p = torch.arange(n)
        rows, slot = (table[b].long()[p // depth], p % depth) if table is not None else (
            torch.full((n,), b), p)
        cache[rows, :, slot] = torch.randn(n, hkv, e, generator=gen, dtype=torch.float64)
    return cache.to(DEVICE, dtype)


def test_kvcache_more_queries_than_the_cache_holds():
    """Lq past the capacity, not causal: query 0 sits Lq - 1 keys left of the last key's
    diagonal and still attends every key."""
    gen = torch.Generator().manual_seed(SEED)
    lengths, depth = [3, 0, 5], 6
    k = _nan_cache(3, 1, depth, 16, f32, lengths, None, gen)
    v = _nan_cache(3, 1, depth, 8, f32, lengths, None, gen)
    q = _randn((3, 2, 12, 16), f32, gen)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = attnx.attention_with_kvcache(q, k, v, lens, is_causal=False, backend="triton")
    want = attnx.attention_with_kvcache(q.double(), k.double(), v.double(), lens, is_causal=False,
                                        backend="reference")
    base = attnx.attention_with_kvcache(q, k, v, lens, is_causal=False, backend="reference")
    assert_within(out, want, base, floor=1e-5)


@pytest.mark.parametrize("dtype", [f32, f16, bf16])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("lq,is_causal,window", [(1, True, None), (4, True, (5, None)),
                                                 (3, False, (20, 1))])
def test_kvcache(dtype, paged, lq, is_causal, window):
    """attention_with_kvcache through the split-K decode kernel: lengths 0-150 in one batch
    (several key tiles and two splits), GQA, odd head dims, shuffled blocks of 16."""
    gen = torch.Generator().manual_seed(SEED)
    lengths, hq, hkv, e, ev, depth = [150, 0, 17, 64], 4, 2, 24, 40, 16
    table = None
    if paged:
        per_seq = 10  # 160 positions each
        table = torch.randperm(len(lengths) * per_seq + 3, generator=gen)[:len(lengths) * per_seq]
        table = table.view(len(lengths), per_seq).to(torch.int32)
        slots = len(lengths) * per_seq + 3
    else:
        slots, depth = len(lengths), 160
    k = _nan_cache(slots, hkv, depth, e, dtype, lengths, table, gen)
    v = _nan_cache(slots, hkv, depth, ev, dtype, lengths, table, gen)
    q = _randn((len(lengths), hq, lq, e), dtype, gen)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    table = None if table is None else table.to(DEVICE)
    kw = dict(block_table=table, is_causal=is_causal, window=window, return_lse=True)
    out, lse = attnx.attention_with_kvcache(q, k, v, lens, backend="triton", **kw)
    want, want_lse = attnx.attention_with_kvcache(q.double(), k.double(), v.double(), lens,
                                                  backend="reference", **kw)
    base, _ = attnx.attention_with_kvcache(q, k, v, lens, backend="reference", **kw)
    assert out.dtype == dtype and lse.dtype == f32
    # the reference computes 16-bit inputs in fp32 and rounds once: its error floors the bound
    floor = {f32: 1e-5, f16: 2e-3, bf16: 1.6e-2}[dtype]
    assert_within(out, want, base, floor=floor)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    ok = torch.isfinite(want_lse)
    assert_within(lse[ok], want_lse[ok].float(), want_lse[ok].float(), floor=1e-4, what="lse")


# ---------------------------------------------------------------- values near the dtype's max

# bf16 and fp32 values near their max over hundreds of keys (P <= 1 each) overflowed the fp32
# accumulator P V: out came inf or NaN (common.OVERFLOW_SHIFT). The output is a weighted average
# of the values: its error is bounded relative to max|v|, as the kernels do on ordinary values
# (bf16: 0.55-0.65% here, with P rounded to bf16 for P V; fp32: 1e-6, the shifted exponent's
# rounding, 2^-18 at 64, included), and its lse as if nothing had been shifted.
NEAR_MAX_TOL = {f32: 1e-5, bf16: 2e-2}
# The interpreter's numpy warns of the first pass's overflow (and its NaN rows), which the
# kernels then redo.
near_max = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                      "ignore:invalid value encountered:RuntimeWarning",
                                      "ignore:All-NaN slice encountered:RuntimeWarning",
                                      "ignore:divide by zero encountered:RuntimeWarning")


def _near_max(shape, dtype, gen, signed=False):
    """3e38 * U(0, 1) (or U(-1, 1)): finite in bf16 and fp32, whose sums of a few overflow."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    return (3e38 * (2 * u - 1 if signed else u)).to(DEVICE, dtype)


def _assert_near(out, gold, scale, dtype, what="output"):
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = max_err(out, gold) / scale
    bound = NEAR_MAX_TOL[dtype]
    assert err <= bound, f"{what}: max error {err:.3g} of max|v| > {bound}"


def _assert_lse(lse, gold):
    torch.testing.assert_close(lse, gold.float(), rtol=1e-5, atol=1e-4)


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("signed", [False, True], ids=["positive", "mixed-signs"])
@pytest.mark.parametrize("mods", ["plain", "causal-softcap", "alibi-dropout", "sinks"])
def test_sdpa_values_near_the_dtype_max(dtype, signed, mods):
    """300 keys (19 blocks here): plain (exp2 of scores in log2 units), with the natural-units
    exponent (softcap, ALiBi), dropout's 1 / (1 - p) and a sink's term."""
    gen = torch.Generator().manual_seed(0)
    q, k = _randn((1, 2, 17, 64), dtype, gen), _randn((1, 2, 300, 64), dtype, gen)
    v = _near_max((1, 2, 300, 64), dtype, gen, signed)
    kw = {"plain": {}, "causal-softcap": dict(is_causal=True, softcap=5.0),
          "alibi-dropout": dict(alibi_slopes=torch.tensor([0.01, 0.1], device=DEVICE),
                                dropout_p=0.2),
          "sinks": dict(sinks=torch.tensor([6.0, 2.0], device=DEVICE))}[mods]
    runs = {}
    for name, backend, t in (("triton", "triton", dtype), ("gold", "reference", torch.float64)):
        torch.manual_seed(SEED)  # the same dropout mask
        runs[name] = attnx.scaled_dot_product_attention(q.to(t), k.to(t), v.to(t), backend=backend,
                                                        return_lse=True, **kw)
    (out, lse), (gold, gold_lse) = runs["triton"], runs["gold"]
    _assert_near(out, gold, v.double().abs().max(), dtype)
    _assert_lse(lse, gold_lse)


# Scores past float32's range from finite inputs (|q| |k| ~ 1e19 in bf16 and fp32, or a scale
# near its bound): the forward flags the rows and sdpa_fwd_rerun redoes them in float64; the
# backward's pre-pass flags their lse and sdpa_bwd_rerun redoes the call with float64 row maxima.
PAST_RANGE_MODS = {"plain": {}, "causal": dict(is_causal=True), "window": dict(window=(3, 2)),
                   "softcap": dict(softcap=5.0), "sinks": dict(sinks=[0.5, -1.0, 2.0, 0.0]),
                   "alibi": dict(alibi_slopes=[0.5, 0.25, 1.0, 2.0]), "dropout": dict(dropout_p=0.3),
                   "bool-mask": {}, "float-mask": {}}


def _past_range_call(mods, dtype, gen, lq, lk):
    """Keyword arguments and mask of a PAST_RANGE_MODS entry (4 query heads, 2 kv heads)."""
    kw = {k: torch.tensor(x, device=DEVICE) if isinstance(x, list) else x
          for k, x in PAST_RANGE_MODS[mods].items()}
    mask = None
    if mods == "bool-mask":
        mask = torch.rand((1, 4, lq, lk), generator=gen).to(DEVICE) > 0.3
        mask[..., 0] = True  # no row left empty
    elif mods == "float-mask":
        mask = _randn((1, 4, lq, lk), dtype, gen)
        mask[..., 1, :] = -3.0e38  # a row of large biases that the scores push past the range
    return kw, mask


def _past_range_grads(q, k, v, do, mask, kw, dtype):
    """(out, lse, dq, dk, dv) of out . do (_sdpa_run)."""
    out, lse, grads = _sdpa_run(q, k, v, do, mask, kw, dtype)
    return (out, lse, *grads[:3])


def _assert_past_range(got, gold, q, k, v, do, scale):
    """Output within NEAR_MAX_TOL of max|v|; the lse as float32 rounds the golden one (+inf past
    its largest, its lowest past that); dv within it of max|dO| times the keys (dv_j = sum_i P_ij
    dO_i); dq and dk within it of the largest their terms can be, dS = P (dP - D) <= 2 max|dO|
    max|v| times max|k| (or |q|) |scale| the query rows or keys: their true values are 0 where a
    row's softmax is one key's, as at these sizes it mostly is (the first passes gave 1e20)."""
    out, lse, dq, dk, dv = got
    dtype = out.dtype
    _assert_near(out, gold[0], v.double().abs().max(), dtype)
    # The reference's float32 lse rounds past float32's lowest to -inf; the kernels saturate
    # there (-inf marks a row that admits no key, and these tests have none).
    want = gold[1].where(gold[1] > -float("inf"), torch.finfo(f32).min)
    torch.testing.assert_close(lse, want, rtol=1e-5, atol=1e-4)
    big = lambda t: t.double().abs().max()  # noqa: E731
    ds = 2 * big(do) * big(v) * abs(scale)
    _assert_near(dv, gold[4], big(do) * q.shape[2] * q.shape[1], dtype, "dv")
    _assert_near(dq, gold[2], ds * big(k) * k.shape[2], dtype, "dq")
    _assert_near(dk, gold[3], ds * big(q) * q.shape[2] * q.shape[1], dtype, "dk")


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("mods", list(PAST_RANGE_MODS))
def test_sdpa_scores_past_float32s_range(dtype, mods):
    """q . k near 1e40 from finite inputs of ~1.5e19: most rows' softmax is one key's, some
    rows' lse passes float32's range. 40 keys: in-band blocks (16 here) and an edge block."""
    gen = torch.Generator().manual_seed(0)
    q, k = (_randn((1, h, n, 64), f64, gen) * 1.5e19 for h, n in ((4, 9), (2, 40)))
    q, k, v = q.to(dtype), k.to(dtype), _randn((1, 2, 40, 64), dtype, gen)
    do = _randn((1, 4, 9, 64), dtype, gen)
    kw, mask = _past_range_call(mods, dtype, gen, 9, 40)
    got = _past_range_grads(q, k, v, do, mask, kw, None)
    _assert_past_range(got, _past_range_grads(q, k, v, do, mask, kw, f64), q, k, v, do, 1 / 8)


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_sdpa_softcap_of_an_overflow_whose_sign_is_wrong(dtype):
    """A softcap over scores whose float32 dot may overflow to +inf while the true score is
    -6.4e38 (_compare.wrong_sign_qk; whether it does depends on the dot's summation order, the
    interpreter's numpy BLAS's here): the backward took such an inf as +cap, finite (dV wrong,
    unflagged, the lse ordinary); now an inf score on the modifier path is NaN there as in the
    forward (common.admitted), which flags the float64 rerun."""
    q, k = (t.to(dtype) for t in wrong_sign_qk(2, 9, 2, 40))
    gen = torch.Generator().manual_seed(4)
    v, do = _randn((1, 2, 40, 128), dtype, gen), _randn((1, 2, 9, 128), dtype, gen)
    kw = dict(softcap=5.0, scale=1.0)
    got = _past_range_grads(q, k, v, do, None, kw, None)
    _assert_past_range(got, _past_range_grads(q, k, v, do, None, kw, f64), q, k, v, do, 1.0)


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("case", ["interior", "causal", "sinks", "varlen"])
def test_sdpa_score_lost_to_an_overflowed_partial_sum(dtype, case):
    """A score whose dot's partial sums pass float32's lowest though the true score (0) is the
    row's largest (_compare.lost_key_qkv, as test_cuda.py's): -inf beside finite scores. The
    forward's in-band loop (no mask or modifier) took it as probability 0 with no sign: out off
    by ~0.58 and the lse by 0.21 (interior, sinks; the causal edge block maps it to NaN,
    common.admitted). Now its row's least score flags the row for the float64 rerun."""
    q, k, v = (t.to(dtype) for t in lost_key_qkv(9, 150))
    do = _randn((1, 1, 9, 64), dtype, torch.Generator().manual_seed(1))
    if case == "varlen":  # two sequences: the 9 x 150 one, then its first 8 x 100, causal
        cu_q = torch.tensor([0, 9, 17], dtype=torch.int32, device=DEVICE)
        cu_k = torch.tensor([0, 150, 250], dtype=torch.int32, device=DEVICE)
        pack = lambda t, n: torch.cat([t[0, 0], t[0, 0, :n]]).unsqueeze(1).to(DEVICE)  # noqa: E731
        packed = (pack(q, 8), pack(k, 100), pack(v, 100), pack(do, 8))
        got = causal_varlen_run(*packed, cu_q, cu_k, "triton", dtype, scale=1.0)
        gold = causal_varlen_run(*packed, cu_q, cu_k, "reference", f64, scale=1.0)
        for x, want, bound, what in ((got[0], gold[0], v.abs().max(), "out"),
                                     (got[4], gold[4], do.abs().max() * 17, "dv")):
            err = (x.double() - want).abs().max() / bound.double()
            assert err <= 2e-2, f"varlen {what}: max error {err:.3g} of its bound"
        return
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    kw = {"causal": dict(is_causal=True),
          "sinks": dict(sinks=torch.tensor([-1.0], device=DEVICE))}.get(case, {})
    kw["scale"] = 1.0
    got = _past_range_grads(q, k, v, do, None, kw, None)
    _assert_past_range(got, _past_range_grads(q, k, v, do, None, kw, f64), q, k, v, do, 1.0)


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_sdpa_every_score_past_float32s_lowest(dtype):
    """Every score of every row under float32's lowest (-4.5e38 to -1.8e39 scaled), each row's
    largest on key 0: float32 takes every score as -inf, rows as empty (zeros, lse -inf) unless
    caught. 40 keys, in-band blocks and an edge block; causal too (its edge blocks mask). With
    a (zero) float mask or ALiBi the backward works in natural units, where the saturated lse
    looks like a Hugging Face row's: its pre-pass flags the rows whose terms all came out 0 (it
    gave dv = 0 unflagged)."""
    gen = torch.Generator().manual_seed(1)
    a = (1.0 + torch.arange(9, dtype=f64) / 8)[:, None] * 6e19
    b = (1.0 + torch.arange(40, dtype=f64) / 40)[:, None] * 6e19
    u = torch.full((64,), 0.125, dtype=f64)  # |u| = 1: scores -a b / 8
    q = (a * u).expand(1, 2, 9, 64).to(DEVICE, dtype)
    k = (-b * u).expand(1, 2, 40, 64).to(DEVICE, dtype)
    v, do = _randn((1, 2, 40, 64), dtype, gen), _randn((1, 2, 9, 64), dtype, gen)
    zeros = torch.zeros((1, 2, 9, 40), dtype=dtype, device=DEVICE)
    alibi = dict(alibi_slopes=torch.tensor([1e-3, 2e-3], device=DEVICE))
    for mask, kw in ((None, {}), (None, dict(is_causal=True)), (zeros, {}), (None, alibi)):
        got = _past_range_grads(q, k, v, do, mask, kw, None)
        gold = _past_range_grads(q, k, v, do, mask, kw, f64)
        _assert_past_range(got, gold, q, k, v, do, 1 / 8)
        torch.testing.assert_close(got[0][..., -1, :].double(), v[:, :, 0].double(),
                                   atol=0, rtol=0)  # key 0's value, exactly
        assert (got[1] == torch.finfo(f32).min).all(), "lse: not saturated at float32's lowest"


@near_max
@pytest.mark.parametrize("keys", [2, 3])
def test_sdpa_fp16_ds_past_its_range(keys):
    check_fp16_ds_past_its_range("triton", DEVICE, keys)


def test_varlen_fp16_ds_past_its_range():
    check_fp16_ds_past_its_range("triton", DEVICE)


@pytest.mark.parametrize("kind", ["sdpa", "additive"])
def test_fp16_out_past_its_range(kind):
    check_fp16_out_past_its_range(kind, "triton", DEVICE)


@near_max
def test_varlen_scores_past_float32s_range():
    """Packed sequences of 9 and 5 queries, 40 and 17 keys, bf16 inputs of ~1.5e19: as
    SDPA's, each sequence against the reference backend's."""
    gen = torch.Generator().manual_seed(3)
    q = (_randn((14, 4, 64), f64, gen) * 1.5e19).to(bf16)
    k = (_randn((57, 2, 64), f64, gen) * 1.5e19).to(bf16)
    v, do = _randn((57, 2, 64), bf16, gen), _randn((14, 4, 64), bf16, gen)
    cu_q = torch.tensor([0, 9, 14], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 40, 57], dtype=torch.int32, device=DEVICE)
    got = causal_varlen_run(q, k, v, do, cu_q, cu_k, "triton", bf16)
    gold = causal_varlen_run(q, k, v, do, cu_q, cu_k, "reference", f64)
    # as SDPA's, per sequence: (B, H, L, D) views of the packed rows
    for (q0, q1), (k0, k1) in (((0, 9), (0, 40)), ((9, 14), (40, 57))):
        part = lambda t, a, c: t[a:c].transpose(0, 1)[None]  # noqa: E731
        mine = [part(got[0], q0, q1), got[1][:, q0:q1][None], part(got[2], q0, q1),
                part(got[3], k0, k1), part(got[4], k0, k1)]
        want = [part(gold[0], q0, q1), gold[1][:, q0:q1][None], part(gold[2], q0, q1),
                part(gold[3], k0, k1), part(gold[4], k0, k1)]
        _assert_past_range(mine, want, part(q, q0, q1), part(k, k0, k1), part(v, k0, k1),
                           part(do, q0, q1), 1 / 8)


@near_max
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("mods", ["plain", "window", "softcap", "alibi", "sinks"])
def test_kvcache_scores_past_float32s_range(paged, mods):
    """Decoding 3 query rows against caches of 50 and 31 keys (two splits here), bf16 inputs of
    ~1.5e19: rows flagged by the split kernel, redone by decode_rerun, against the reference."""
    gen = torch.Generator().manual_seed(5)
    q = (_randn((2, 4, 3, 64), f64, gen) * 1.5e19).to(bf16)
    k = (_randn((2, 2, 64, 64), f64, gen) * 1.5e19).to(bf16)
    v = _randn((2, 2, 64, 64), bf16, gen)
    lens = torch.tensor([50, 31], dtype=torch.int32, device=DEVICE)
    kw = {"plain": {}, "window": dict(window=(10, 0)), "softcap": dict(softcap=5.0),
          "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 1.0, 2.0], device=DEVICE)),
          "sinks": dict(sinks=torch.tensor([0.5, 1.0, -1.0, 2.0], device=DEVICE))}[mods]
    want, want_lse = attnx.attention_with_kvcache(q.double(), k.double(), v.double(), lens,
                                                  backend="reference", return_lse=True, **kw)
    if paged:  # blocks of 16 positions, shuffled over a pool
        table = torch.randperm(10, generator=gen)[:8].view(2, 4).to(DEVICE, torch.int32)
        pool_k = torch.zeros((10, 2, 16, 64), dtype=bf16, device=DEVICE)
        pool_v = torch.zeros_like(pool_k)
        for n in range(2):
            for blk in range(4):
                pool_k[table[n, blk]] = k[n, :, 16 * blk:16 * blk + 16]
                pool_v[table[n, blk]] = v[n, :, 16 * blk:16 * blk + 16]
        k, v, kw = pool_k, pool_v, dict(kw, block_table=table)
    out, lse = attnx.attention_with_kvcache(q, k, v, lens, backend="triton", return_lse=True,
                                            **kw)
    _assert_near(out, want, v.double().abs().max(), bf16)
    torch.testing.assert_close(lse, want_lse.where(want_lse > -float("inf"), torch.finfo(f32).min),
                               rtol=1e-5, atol=1e-4)


@near_max
def test_sdpa_fp16_scale_past_float32s_range():
    """fp16 inputs with a scale near its bound (1e38, scores up to ~3e39): the forward as in
    bf16; the backward's pre-pass flags the lse past the range and dv comes from the rerun,
    not 0."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (_randn((1, 2, n, 64), f16, gen) for n in (9, 40, 40))
    do = _randn((1, 2, 9, 64), f16, gen)
    got = _past_range_grads(q, k, v, do, None, dict(scale=1e38), None)
    gold = _past_range_grads(q, k, v, do, None, dict(scale=1e38), f64)
    assert torch.isinf(got[1]).any(), "no row past the range: the case is not tested"
    _assert_near(got[0], gold[0], v.double().abs().max(), bf16)
    _assert_near(got[4], gold[4], do.double().abs().max() * 9, bf16, "dv")


def test_an_ordinary_forward_is_not_rerun(monkeypatch):
    """Ordinary values leave the forward's flag at 0, Hugging Face's float32 masks too (float32's
    lowest on padded keys and on whole rows): no row takes sdpa_fwd_rerun's float64 path."""
    from attnx.triton import sdpa_fwd_rerun

    real, flags = sdpa_fwd_rerun.launch, []

    def spied(out, lse, flag, *args, **kw):
        real(out, lse, flag, *args, **kw)
        flags.append(int(flag.item()))

    monkeypatch.setattr(sdpa_fwd_rerun, "launch", spied)
    gen = torch.Generator().manual_seed(11)
    low = torch.finfo(f32).min
    for dtype in (f32, bf16, f16):
        q, k, v = (_randn((1, 2, n, 32), dtype, gen) for n in (20, 40, 40))
        mask = torch.zeros((1, 1, 20, 40), device=DEVICE)
        mask[..., 30:] = low
        mask[..., 3, :] = low
        attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(dtype), backend="triton")
        attnx.scaled_dot_product_attention(q, k, v, is_causal=True, backend="triton")
    assert flags == [0] * 6


@near_max
def test_sdpa_second_head_chunk_near_the_max():
    """Head dim 160 (sdpa._head_blocks: 128 + 32): values near the max only in the second
    chunk, whose accumulator acc2 alone overflows."""
    gen = torch.Generator().manual_seed(5)
    q, k = _randn((1, 2, 17, 160), bf16, gen), _randn((1, 2, 300, 160), bf16, gen)
    v = torch.cat([_randn((1, 2, 300, 128), bf16, gen), _near_max((1, 2, 300, 32), bf16, gen)],
                  dim=-1)
    out, lse = attnx.scaled_dot_product_attention(q, k, v, backend="triton", return_lse=True)
    gold, gold_lse = attnx.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                        backend="reference", return_lse=True)
    for cols in (slice(0, 128), slice(128, 160)):
        _assert_near(out[..., cols], gold[..., cols], v[..., cols].double().abs().max(), bf16,
                     f"columns {cols.start}-{cols.stop - 1}")
    _assert_lse(lse, gold_lse)


def _check_with_gpu_config(monkeypatch, config, q, k, v):
    """The forward with one GPU config pinned (the interpreter's own is 16 x 16, the reruns'
    block size), plain, causal, and banded with a softcap, against the reference: output
    within NEAR_MAX_TOL of max|v|, the lse as float32 rounds it."""
    from attnx.triton import common
    import triton

    if not common.warps_fit(q.dtype.itemsize, config[2], config[0]):
        pytest.skip("a config the pruning never runs for this dtype (common.warps_fit)")
    monkeypatch.setattr(_sdpa_ops._fwd_kernel, "configs", common.gpu_configs([config]))
    for kw in ({}, dict(is_causal=True), dict(window=(40, 10), softcap=5.0)):
        try:
            out, lse = attnx.scaled_dot_product_attention(q, k, v, backend="triton",
                                                          return_lse=True, **kw)
        except triton.runtime.errors.OutOfResources as exc:  # only compiled code has limits
            pytest.skip(f"does not fit this device: {exc}")
        gold, gold_lse = attnx.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                            backend="reference", return_lse=True,
                                                            **kw)
        _assert_near(out, gold, v.double().abs().max(), q.dtype)
        _assert_lse(lse, gold_lse)


@near_max
@pytest.mark.parametrize("config", _sdpa_ops._FWD_SHAPES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_sdpa_near_the_max_in_every_gpu_config(monkeypatch, config, dtype):
    """Values near the max: blocks of 32-128 keys in the first pass, 32-128 rows to flag."""
    gen = torch.Generator().manual_seed(6)
    q, k = _randn((1, 2, 70, 64), dtype, gen), _randn((1, 2, 300, 64), dtype, gen)
    v = _near_max((1, 2, 300, 64), dtype, gen, signed=True)
    _check_with_gpu_config(monkeypatch, config, q, k, v)


@near_max
@pytest.mark.parametrize("config", _sdpa_ops._FWD_SHAPES, ids=lambda c: "x".join(map(str, c)))
def test_sdpa_scores_past_float32s_range_in_every_gpu_config(monkeypatch, config):
    """bf16 inputs of ~1.5e19 against 300 keys: in-band blocks of 32-128 keys (no per-score test
    there: NaN from the dot or an all -inf tile), edge blocks, and programs of 32-128 rows to
    flag."""
    gen = torch.Generator().manual_seed(7)
    q, k = ((_randn((1, 2, n, 64), f64, gen) * 1.5e19).to(bf16) for n in (70, 300))
    _check_with_gpu_config(monkeypatch, config, q, k, _randn((1, 2, 300, 64), bf16, gen))


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_sdpa_one_row_near_the_max_others_tiny(dtype):
    """Row 0 admits keys 0-149, values near the max (its sum overflows); rows 1-16, in the same
    program, only keys 150-299, values ~1e-30: their products with 2^-64-scaled probabilities
    would flush, so only the overflowing row may take the shift."""
    gen = torch.Generator().manual_seed(1)
    q, k = _randn((1, 2, 17, 64), dtype, gen), _randn((1, 2, 300, 64), dtype, gen)
    big = _near_max((1, 2, 150, 64), dtype, gen, signed=True)
    tiny = (1e-30 * torch.randn((1, 2, 150, 64), generator=gen, dtype=torch.float64)).to(DEVICE,
                                                                                          dtype)
    v = torch.cat([big, tiny], dim=2)
    mask = torch.zeros(17, 300, dtype=torch.bool, device=DEVICE)
    mask[0] = True
    mask[1:, 150:] = True
    out, lse = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend="triton",
                                                  return_lse=True)
    gold, gold_lse = attnx.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                        attn_mask=mask, backend="reference",
                                                        return_lse=True)
    _assert_near(out[:, :, :1], gold[:, :, :1], big.double().abs().max(), dtype, "row 0")
    _assert_near(out[:, :, 1:], gold[:, :, 1:], tiny.double().abs().max(), dtype, "rows 1-16")
    _assert_lse(lse, gold_lse)


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_varlen_values_near_the_dtype_max(dtype):
    """Packed sequences (the SDPA forward's VARLEN mode): 300 keys, a short one, and one whose
    values are ordinary."""
    gen = torch.Generator().manual_seed(2)
    lens = [(17, 300), (5, 40), (9, 70)]
    tq, tk = sum(a for a, _ in lens), sum(b for _, b in lens)
    q, k = _randn((tq, 2, 64), dtype, gen), _randn((tk, 2, 64), dtype, gen)
    v = _near_max((tk, 2, 64), dtype, gen, signed=True)
    v[-70:] = _randn((70, 2, 64), dtype, gen)
    cu_q = torch.tensor([0, 17, 22, 31], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 300, 340, 410], dtype=torch.int32, device=DEVICE)
    out, lse = attnx.varlen_attention(q, k, v, cu_q, cu_k, backend="triton", return_lse=True)
    gold, gold_lse = attnx.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k,
                                            backend="reference", return_lse=True)
    _assert_near(out[:22], gold[:22], v[:340].double().abs().max(), dtype)
    _assert_near(out[22:], gold[22:], v[340:].double().abs().max(), dtype, "ordinary sequence")
    _assert_lse(lse, gold_lse)


# The backwards of such values: dP = dO V^T and D = rowsum(dO * O) overflowed float32 (inf), and
# dS = P (dP - D) came out inf - inf or 0 * inf: NaN in dq, dk (and dmask, dsinks), where the true
# gradients mostly fit (sdpa_bwd_rerun redoes them in float64). dS is linear in V (O too), so the
# true dq, dk, dmask and dsinks at V are 2^64 times those at V / 2^64 (exact), which the first pass
# computes without overflow: each is held to twice the error of that call (as test_cuda.py's
# assert_as_scaled_down holds the forwards). dv = P^T dO, which no V overflows and the rerun
# leaves, carries the lse of the forward's rerun (sdpa._rerun), which the scaled call does not
# take: it is held as the forward's output is (NEAR_MAX_TOL of its largest).
BIG = 2.0 ** 64
GRAD_SCALE = {"dq": BIG, "dk": BIG, "dmask": BIG, "dsinks": BIG}


def _near_max_values(shape, dtype, gen):
    """Magnitudes 1.5e38-3.3e38, a fifth of them negative."""
    mag = 1.5e38 + 1.8e38 * torch.rand(shape, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.2, -1.0, 1.0)
    return (mag * sign).to(DEVICE, dtype)


def _assert_as_scaled_down(names, grads, scaled, gold, scales, plain):
    """Gradients named `names`, of a call, of the call scaled down and the golden ones: no NaN;
    finite and within twice the error of the scaled call's times scales[name] wherever that is
    well inside the range (under half the largest value), as the true gradient then is;
    elsewhere inf may stand for a true value past the range. The one named `plain` (which
    involves no scaled input): finite, within NEAR_MAX_TOL of its largest."""
    for name, g, small, want in zip(names, grads, scaled, gold):
        assert not torch.isnan(g).any(), f"{name}: NaN"
        if name == plain:
            _assert_near(g, want, want.abs().max(), g.dtype, name)
            continue
        base = small.double() * scales[name]
        inside = base.abs() < torch.finfo(g.dtype).max / 2
        assert inside.float().mean() > 0.9, f"{name}: the check covers too little"
        assert_within(g[inside], want[inside], base[inside], what=name)


def _assert_grads_as_scaled_down(grads_of, v, names):
    """grads_of(values, dtype) -> gradients named `names` (dtype None: the call's, float64: the
    golden call), held to those of grads_of(v / 2^64) times GRAD_SCALE (dv as is)."""
    grads, scaled = grads_of(v, None), grads_of(v / BIG, None)
    gold = grads_of(v.double(), torch.float64)
    _assert_as_scaled_down(names, grads, scaled, gold, GRAD_SCALE, "dv")


def _sdpa_run(q, k, v, do, mask, kw, dtype):
    """(out, lse, grads: dq, dk, dv, then dmask with a float mask and dsinks with sinks) of
    out . do, in `dtype` (None: the inputs' own, the triton backend; float64: the reference)."""
    backend = "triton" if dtype is None else "reference"
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))  # noqa: E731
    leaves = [cast(t).detach().requires_grad_() for t in (q, k, v)]
    mask = cast(mask) if _is_float_mask(mask) else mask
    if _is_float_mask(mask):
        mask = mask.detach().requires_grad_()
        leaves.append(mask)
    kw = dict(kw)
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].detach().requires_grad_()
        leaves.append(kw["sinks"])
    torch.manual_seed(SEED)  # the same dropout mask
    out, lse = attnx.scaled_dot_product_attention(*leaves[:3], attn_mask=mask, backend=backend,
                                                  enable_gqa=True, return_lse=True, **kw)
    return out, lse, torch.autograd.grad(out, leaves, cast(do))


def _sdpa_grads(q, k, v, do, mask, kw, dtype):
    """The gradients of _sdpa_run."""
    return _sdpa_run(q, k, v, do, mask, kw, dtype)[2]


NEAR_MAX_BACKWARDS = ["plain", "causal", "window", "bool-mask", "float-mask", "dropout",
                      "softcap", "alibi", "sinks"]


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("mods", NEAR_MAX_BACKWARDS)
def test_sdpa_backward_near_the_dtype_max(dtype, mods):
    """200 keys (13 blocks here), 2 query heads on 1 kv head, q and k small (attention spread):
    the gradients of values near the dtype's largest, each score modifier and mask."""
    gen = torch.Generator().manual_seed(7)
    lq, lk = 20, 200
    q, k = (_randn((1, 2, lq, 16), dtype, gen), _randn((1, 1, lk, 16), dtype, gen))
    v = _near_max_values((1, 1, lk, 16), dtype, gen)
    do = _randn((1, 2, lq, 16), dtype, gen)
    mask = None
    if mods == "bool-mask":
        mask = torch.rand((1, 2, lq, lk), generator=gen).to(DEVICE) > 0.3
    elif mods == "float-mask":
        mask = _randn((1, 2, lq, lk), dtype, gen)
    kw = {"causal": dict(is_causal=True), "window": dict(window=(80, 20)),
          "dropout": dict(dropout_p=0.2), "softcap": dict(softcap=5.0),
          "alibi": dict(alibi_slopes=torch.tensor([0.02, 0.1], device=DEVICE)),
          "sinks": dict(sinks=torch.tensor([1.0, -2.0], device=DEVICE))}.get(mods, {})
    names = ["dq", "dk", "dv"] + ["dmask"] * (mods == "float-mask") + ["dsinks"] * (mods == "sinks")
    _assert_grads_as_scaled_down(lambda vals, dt: _sdpa_grads(q, k, vals, do, mask, kw, dt), v,
                                 names)


@near_max
def test_sdpa_backward_near_the_max_with_gqa_split(monkeypatch):
    """On many SMs the dK/dV kernel splits each GQA group (sdpa._gqa_split) into fp32 partial
    sums that the host adds up: the rerun writes the final dk."""
    from attnx.triton import common

    monkeypatch.setattr(common, "multiprocessors", lambda: 64)
    assert _sdpa_ops._gqa_split(4, 200, 1) == 4
    gen = torch.Generator().manual_seed(8)
    q, k = _randn((1, 4, 17, 16), bf16, gen), _randn((1, 1, 200, 16), bf16, gen)
    v = _near_max_values((1, 1, 200, 16), bf16, gen)
    do = _randn((1, 4, 17, 16), bf16, gen)
    _assert_grads_as_scaled_down(lambda vals, dt: _sdpa_grads(q, k, vals, do, None, {}, dt), v,
                                 ["dq", "dk", "dv"])


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_sdpa_backward_keys_near_the_dtype_max(dtype):
    """Keys near the dtype's largest sharing a common part, q tiny (scores ~1): dS ~ 2 and dk
    stay finite, but dq = scale sum_j dS_ij k_j passes float32's largest in the dQ kernel's sums
    (a single product dS k does), where sum_j dS_ij = 0 cancels the common part of the true dq:
    the dQ kernel flags it and the rerun redoes it. dq, dk, dv within twice the error of the call
    on (q 2^64, k / 2^64): the same scores and dS, dq / 2^64 and dk 2^64, scaled back."""
    gen = torch.Generator().manual_seed(10)
    lq, lk, e = 20, 200, 16
    f64 = torch.float64
    shared = 3.0e38 * torch.sign(torch.randn((1, 1, 1, e), generator=gen, dtype=f64))
    spread = torch.rand((1, 1, lk, e), generator=gen, dtype=f64) / 64 - 1 / 128
    k = (shared * (1 + spread)).to(DEVICE, dtype)
    q = (1e-37 * torch.randn((1, 2, lq, e), generator=gen, dtype=f64)).to(DEVICE, dtype)
    v = (10 * torch.randn((1, 1, lk, e), generator=gen, dtype=f64)).to(DEVICE, dtype)
    do = (8 * torch.randn((1, 2, lq, e), generator=gen, dtype=f64)).to(DEVICE, dtype)
    grads = _sdpa_grads(q, k, v, do, None, {}, None)
    scaled = _sdpa_grads(q * BIG, k / BIG, v, do, None, {}, None)
    gold = _sdpa_grads(q, k, v, do, None, {}, torch.float64)
    # The case: some product dS_ij k_jd past float32's largest, the true dq inside the range
    probs = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 4, -1)
    dp = do.double() @ v.double().transpose(-1, -2)
    ds = probs * (dp - (probs * dp).sum(-1, keepdim=True))
    assert ds.abs().max() * k.double().abs().max() > 3.5e38
    assert gold[0].abs().max() < 3.3e38
    for name, g, small, want, back in zip(("dq", "dk", "dv"), grads, scaled, gold,
                                          (BIG, 1 / BIG, 1.0)):
        assert_within(g, want, small.double() * back, floor=0.0, what=name)


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("hq,v_std", [(1, 1.0), (2, 1.0), (2, 1e-3)])
def test_sdpa_backward_grad_out_near_the_dtype_max(dtype, hq, v_std):
    """dO near the dtype's largest (3e38, 2^-7 spread), its sign flipping every 16 queries, over
    3 keys with P ~ 1/3: dv = sum_i P_ij dO_i passes float32's largest in the dK/dV kernel's sums
    (16 queries of one sign already do) where the true dv fits: NaN or inf unless the rerun
    writes dv again. v ~ 1: dP and D overflow too; v ~ 1e-3: they do not, dv alone sets the
    flag. Every gradient is linear in dO: held to twice the error of the call on dO / 2^64,
    scaled back. hq = 2: GQA (dv over both heads)."""
    gen = torch.Generator().manual_seed(13)
    lq, lk, e = 64, 3, 16
    f64 = torch.float64

    def normal(shape, std):
        return (std * torch.randn(shape, generator=gen, dtype=f64)).to(DEVICE, dtype)

    q, k, v = normal((1, hq, lq, e), 1e-3), normal((1, 1, lk, e), 1e-3), normal((1, 1, lk, e), v_std)
    sign = 1.0 - 2.0 * (torch.arange(lq, dtype=f64) // 16 % 2).view(lq, 1)
    spread = torch.rand((1, hq, lq, e), generator=gen, dtype=f64) / 128
    do = (3.0e38 * sign * (1 + spread)).to(DEVICE, dtype)
    grads = _sdpa_grads(q, k, v, do, None, {}, None)
    scaled = _sdpa_grads(q, k, v, do / BIG, None, {}, None)
    gold = _sdpa_grads(q, k, v, do, None, {}, torch.float64)
    assert (do[..., :16, :].double().sum(-2) / lk).abs().min() > 3.5e38  # the case
    for name, g, small, want in zip(("dq", "dk", "dv"), grads, scaled, gold):
        assert want.abs().max() < 3.3e38, f"{name}: past the dtype's range in the case itself"
        assert_within(g, want, small.double() * BIG, floor=0.0, what=name)


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_varlen_backward_near_the_dtype_max(dtype):
    """Packed sequences (the backward's VARLEN mode), causal (bottom-right), GQA, dropout: 200
    keys, a short sequence, one with more queries than keys."""
    gen = torch.Generator().manual_seed(9)
    cu_q = torch.tensor([0, 17, 22, 52], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 200, 240, 260], dtype=torch.int32, device=DEVICE)
    q, k = _randn((52, 2, 16), dtype, gen), _randn((260, 1, 16), dtype, gen)
    v = _near_max_values((260, 1, 16), dtype, gen)
    do = _randn((52, 2, 16), dtype, gen)

    def grads_of(vals, dt):
        cast = (lambda t: t) if dt is None else (lambda t: t.to(dt))  # noqa: E731
        leaves = [cast(t).detach().requires_grad_() for t in (q, k, vals)]
        torch.manual_seed(SEED)
        out = attnx.varlen_attention(*leaves, cu_q, cu_k, is_causal=True, dropout_p=0.1,
                                     backend="triton" if dt is None else "reference")
        return torch.autograd.grad(out, leaves, cast(do))

    _assert_grads_as_scaled_down(grads_of, v, ["dq", "dk", "dv"])


def test_an_ordinary_backward_is_not_rerun(monkeypatch):
    """Ordinary values leave the backward's flag at 0: the rerun's kernels run no tile, and the
    gradients are those of the same call without them, bit for bit (masks, a row under the
    dtype's lowest bias, dropout, sinks, GQA; bf16, fp32 and fp16, whose dS may pass its range:
    test_sdpa_fp16_ds_past_its_range)."""
    from attnx.triton import sdpa_bwd_rerun

    real, flags = sdpa_bwd_rerun.launch, []

    def spied(flag, *args, **kw):
        rows = real(flag, *args, **kw)
        flags.append(int(flag.item()))
        return rows

    gen = torch.Generator().manual_seed(10)
    for dtype in (f32, bf16, f16):
        q, k, v = (_randn(s, dtype, gen) for s in ((1, 4, 20, 32), (1, 2, 40, 32),
                                                   (1, 2, 40, 32)))
        do = _randn((1, 4, 20, 32), dtype, gen)
        kw = dict(dropout_p=0.2, sinks=torch.tensor([1.0, 0.0, -1.0, 2.0], device=DEVICE))
        mask = _randn((1, 4, 20, 40), dtype, gen)
        mask[..., 3, :] = torch.finfo(dtype).min  # a row under Hugging Face's padding bias
        monkeypatch.setattr(sdpa_bwd_rerun, "launch", spied)
        grads = _sdpa_grads(q, k, v, do, mask, kw, None)
        monkeypatch.setattr(sdpa_bwd_rerun, "launch",
                            lambda flag, inputs, *a, **k: (inputs[6].double(),) * 2)
        plain = _sdpa_grads(q, k, v, do, mask, kw, None)
        assert all(torch.equal(a, b) for a, b in zip(grads, plain))
    assert flags == [0, 0, 0]


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_kvcache_values_near_the_dtype_max(dtype, sinks):
    """Decoding: 300 and 150 cached keys (two splits here, several key tiles each), GQA, and
    the merge of the splits' outputs."""
    gen = torch.Generator().manual_seed(3)
    lengths = [300, 150]
    k = _randn((2, 2, 320, 64), dtype, gen)
    v = _near_max((2, 2, 320, 64), dtype, gen, signed=True)
    q = _randn((2, 4, 3, 64), dtype, gen)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    kw = dict(sinks=torch.tensor([1.0, 3.0, 0.0, 5.0], device=DEVICE)) if sinks else {}
    out, lse = attnx.attention_with_kvcache(q, k, v, lens, backend="triton", return_lse=True,
                                            **kw)
    gold, gold_lse = attnx.attention_with_kvcache(q.double(), k.double(), v.double(), lens,
                                                  backend="reference", return_lse=True, **kw)
    _assert_near(out, gold, v.double().abs().max(), dtype)
    _assert_lse(lse, gold_lse)


def test_kvcache_merge_keeps_a_convex_combination():
    """decode.merge at lse ~ 3e5, whose ulp is 1/32: weights exp(lse_s - lse) summed to 0.99-1.01
    by the lse's rounding, moving the output 1% and, near fp32's max, past it (inf). Normalised
    by their sum they keep the splits' (equal) outputs."""
    from attnx.triton import decode

    lse_part = torch.tensor([3e5, 3e5 + 0.1875], device=DEVICE).view(1, 1, 1, 2)
    o_part = torch.full((1, 1, 1, 2, 8), 3.38e38, device=DEVICE)
    out, lse = decode.merge(o_part, lse_part, f32)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, o_part[..., 0, :], rtol=1e-6, atol=0)
    torch.testing.assert_close(lse, torch.logsumexp(lse_part.double(), -1).float())


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
def test_additive_values_near_the_dtype_max(dtype):
    gen = torch.Generator().manual_seed(4)
    q, k = _randn((1, 2, 17, 16), dtype, gen), _randn((1, 2, 300, 16), dtype, gen)
    value = _near_max((1, 2, 300, 24), dtype, gen, signed=True)
    w = _randn((2, 16), dtype, gen)
    out, weights = attnx.additive_attention(q, k, value, w, backend="triton", return_weights=True)
    gold, gold_w = attnx.additive_attention(q.double(), k.double(), value.double(), w.double(),
                                            backend="reference", return_weights=True)
    _assert_near(out, gold, value.double().abs().max(), dtype)
    # the weights come from the saved lse, which must not keep the shift
    _assert_near(weights, gold_w, 1.0, dtype, "weights")


@near_max
def test_additive_dropout_with_values_near_the_dtype_max():
    """Dropout's 1 / (1 - p) joins the normalised output once, at the end (softmax_step): within
    the sums, the kept keys of the first blocks took it to max|v| / (1 - p), past fp32's largest,
    where the result is within bf16's (inf out; found by fuzzing). Values 3e38, p = 0.5: the
    rows whose result is in range."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, n, 16, generator=gen).to(DEVICE, bf16) for n in (4, 130))
    w = torch.randn(16, generator=gen).to(DEVICE, bf16)
    value = torch.full((1, 1, 130, 32), 3.0e38, device=DEVICE, dtype=bf16)
    torch.manual_seed(0)
    gold = attnx.additive_attention(q.double(), k.double(), value.double(), w.double(),
                                    dropout_p=0.5, backend="reference")
    rows = gold.abs().amax(-1) < 3.38e38
    assert rows.sum() >= 2  # (row 1 came out inf)
    torch.manual_seed(0)
    out = attnx.additive_attention(q, k, value, w, dropout_p=0.5, backend="triton")
    _assert_near(out[rows], gold[rows], 3.0e38, bf16)


@triton.jit
def _narrowed(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, _narrow(tl.load(X + offs), Y))


def test_the_reruns_round_float64_to_bfloat16_to_nearest_even():
    """sdpa_bwd_rerun._narrow (both reruns' stores): float64 to bf16 rounded to nearest, ties to
    even, inf past the largest, NaN kept: the GPU's cast, where the interpreter's truncates."""
    # NaN: the interpreter's and the GPU's (0x7fffffff, all ones, and its negative)
    gpu_nans = torch.tensor([0x7FFFFFFF, -1], dtype=torch.int32).view(torch.float32).double()
    x = torch.tensor([1 + 2**-8 + 2**-12, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 3 * 2**-9), 3.4e38,
                      -3.4e38, 3.0e38, float("nan"), 1e-30, 0.0, -2.5, 7.0e37, 1.0, 2.0, 0.0,
                      0.0], dtype=torch.float64)
    x[-2:] = gpu_nans
    y = torch.empty(16, dtype=bf16, device=DEVICE)
    _narrowed[(1,)](x.to(DEVICE), y, 16)
    want = x.to(bf16)  # torch rounds to nearest even
    assert torch.equal(y.cpu().isnan(), want.isnan())
    assert torch.equal(y.cpu()[~want.isnan()], want[~want.isnan()])


def test_the_rerun_launches_only_where_the_device_holds_it(monkeypatch):
    """Its shared memory (sdpa_bwd_rerun.shared_bytes, which tests/triton_compile holds the
    compiles to) against the device's: a 99 KiB part (sm_86, sm_89) takes head dims up to 128
    and skips the rerun above (no launch that would fail on every such backward)."""
    from attnx.triton import common, sdpa_bwd_rerun

    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(common, "shared_memory_limit", lambda: 99 * 1024)
    assert sdpa_bwd_rerun.fits(128, 128) and sdpa_bwd_rerun.fits(64, 96)
    assert not sdpa_bwd_rerun.fits(256, 256) and not sdpa_bwd_rerun.fits(160, 192)
    assert sdpa_bwd_rerun.launch(None, (None,) * 10, (None,) * 4, (), (), (1, 1, 1, 1, 1, 192, 192),
                                 (), (), mask_kind=0, dropout=False, mask_grad=False,
                                 softcap=False, alibi=False, has_sinks=False, has_glse=False,
                                 varlen=False) is None
    monkeypatch.setattr(common, "shared_memory_limit", lambda: 163 * 1024)
    assert sdpa_bwd_rerun.fits(256, 256)


# The additive backward's float32 dP = dO . value_j and delta = rowsum(dO * O) overflow alike at
# values near the dtype's largest (NaN in dq, dk, dw, dmask from dS = P (dP - delta)), where the
# true gradients fit: additive_bwd_rerun redoes them in float64. dS is linear in (value, dW) (the
# weights' gradient), so the true dq, dk, dw, dmask are 2^64 times those of the call on value / 2^64
# (and dW / 2^64), which the first pass computes without overflow: held to twice its error.
ADDITIVE_GRAD_SCALE = {"dq": BIG, "dk": BIG, "dw": BIG, "dmask": BIG}


def _additive_grads(q, k, value, w, do, mask, kw, dweights, dtype):
    """dq, dk, dvalue, dw (dmask with a float mask) of out . do (+ weights . dweights where
    given, with return_weights), in `dtype` (None: the inputs', the triton backend; float64:
    the reference)."""
    backend = "triton" if dtype is None else "reference"
    cast = (lambda t: t) if dtype is None else (lambda t: t.to(dtype))  # noqa: E731
    leaves = [cast(t).detach().requires_grad_() for t in (q, k, value, w)]
    if _is_float_mask(mask):
        mask = cast(mask).detach().requires_grad_()
        leaves.append(mask)
    torch.manual_seed(SEED)  # the same dropout mask
    res = attnx.additive_attention(*leaves[:4], attn_mask=mask, backend=backend,
                                   return_weights=dweights is not None, **kw)
    if dweights is None:
        return torch.autograd.grad(res, leaves, cast(do))
    out, weights = res
    return torch.autograd.grad((out, weights), leaves, (cast(do), cast(dweights)))


ADDITIVE_NEAR_MAX_BACKWARDS = ["plain", "wide", "dropout", "float-mask", "window", "causal",
                               "weights", "huge-bias"]


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("mods", ADDITIVE_NEAR_MAX_BACKWARDS)
def test_additive_backward_near_the_dtype_max(dtype, mods):
    """150 keys, q and k small (attention spread), values 0.5 x 1.5e38-3.3e38: no NaN, and dq,
    dk, dw (and dmask) within twice the error of the scaled-down call; dvalue as the forward's
    output is held. A > 128 ("wide"), dropout, a float mask, a band, returned weights with a
    loss on them, rows padded by finfo.min (their lse keeps no log(l))."""
    gen = torch.Generator().manual_seed(11)
    a = 160 if mods == "wide" else 16
    lq, lk = 12, 150
    q, k = _randn((1, 2, lq, a), dtype, gen), _randn((1, 2, lk, a), dtype, gen)
    value = (0.5 * _near_max_values((1, 2, lk, 16), f32, gen).double()).to(DEVICE, dtype)
    w = _randn((2, a), dtype, gen)
    do = (0.25 * _randn((1, 2, lq, 16), f32, gen)).to(dtype)
    mask = {"float-mask": lambda: _randn((1, 2, lq, lk), dtype, gen),
            "huge-bias": lambda: _huge_bias_mask(1, lq, lk, dtype)}.get(mods, lambda: None)()
    dweights = _randn((1, 2, lq, lk), dtype, gen) if mods == "weights" else None
    kw = {"dropout": dict(dropout_p=0.2), "window": dict(window=(60, 10)),
          "causal": dict(is_causal=True)}.get(mods, {})
    names = ["dq", "dk", "dvalue", "dw"] + ["dmask"] * (mask is not None)
    grads = _additive_grads(q, k, value, w, do, mask, kw, dweights, None)
    scaled = _additive_grads(q, k, value / BIG, w, do, mask, kw,
                             None if dweights is None else dweights / BIG, None)
    gold = _additive_grads(q, k, value, w, do, mask, kw, dweights, torch.float64)
    for name, want in zip(names, gold):
        assert want.abs().max() < 3.3e38, f"{name}: the true gradient exceeds the dtype"
    _assert_as_scaled_down(names, grads, scaled, gold, ADDITIVE_GRAD_SCALE, "dvalue")


@near_max
@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("value_std", [1.0, 1e-3])
def test_additive_backward_grad_out_near_the_dtype_max(dtype, value_std):
    """dO near the dtype's largest (3e38, 2^-7 spread), its sign flipping every 16 queries, over
    3 keys with P ~ 1/3 (q, k, w small): dvalue = sum_i P_ij dO_i passes float32's largest in
    the dK kernel's sums where the true dvalue fits: NaN or inf unless the rerun writes dvalue
    again. value ~ 1: dPd and delta overflow too; value ~ 1e-3: they do not, dvalue alone sets
    the flag. Every gradient is linear in dO: held to twice the error of the call on dO / 2^64,
    scaled back."""
    gen = torch.Generator().manual_seed(14)
    lq, lk, a, ev = 64, 3, 16, 16
    f64 = torch.float64

    def normal(shape, std):
        return (std * torch.randn(shape, generator=gen, dtype=f64)).to(DEVICE, dtype)

    q, k, w = normal((1, 2, lq, a), 1e-3), normal((1, 2, lk, a), 1e-3), normal((2, a), 1e-3)
    value = normal((1, 2, lk, ev), value_std)
    sign = 1.0 - 2.0 * (torch.arange(lq, dtype=f64) // 16 % 2).view(lq, 1)
    spread = torch.rand((1, 2, lq, ev), generator=gen, dtype=f64) / 128
    do = (3.0e38 * sign * (1 + spread)).to(DEVICE, dtype)
    grads = _additive_grads(q, k, value, w, do, None, {}, None, None)
    scaled = _additive_grads(q, k, value, w, do / BIG, None, {}, None, None)
    gold = _additive_grads(q, k, value, w, do, None, {}, None, torch.float64)
    assert (do[..., :16, :].double().sum(-2) / lk).abs().min() > 3.5e38  # the case
    for name, g, small, want in zip(("dq", "dk", "dvalue", "dw"), grads, scaled, gold):
        assert want.abs().max() < 3.3e38, f"{name}: past the dtype's range in the case itself"
        assert_within(g, want, small.double() * BIG, floor=0.0, what=name)


def test_an_ordinary_additive_backward_is_not_rerun(monkeypatch):
    """Ordinary values leave the additive backward's flag at 0: the rerun does nothing and the
    gradients are those of the first pass, bit for bit."""
    from attnx.triton import additive_bwd_rerun

    real, flags = additive_bwd_rerun.launch, []

    def spied(flag, *args, **kw):
        res = real(flag, *args, **kw)
        flags.append(int(flag.item()))
        return res

    def skipped(flag, inputs, *args, **kw):
        return inputs[3].double().new_zeros(inputs[3].shape)  # v's gradient, unused unflagged

    gen = torch.Generator().manual_seed(12)
    for dtype in (f32, bf16, f16):
        q, k = _randn((1, 2, 20, 16), dtype, gen), _randn((1, 2, 40, 16), dtype, gen)
        value, w = _randn((1, 2, 40, 8), dtype, gen), _randn((2, 16), dtype, gen)
        do, mask = _randn((1, 2, 20, 8), dtype, gen), _randn((1, 2, 20, 40), dtype, gen)
        kw = dict(dropout_p=0.2)
        monkeypatch.setattr(additive_bwd_rerun, "launch", spied)
        grads = _additive_grads(q, k, value, w, do, mask, kw, None, None)
        monkeypatch.setattr(additive_bwd_rerun, "launch", skipped)
        plain = _additive_grads(q, k, value, w, do, mask, kw, None, None)
        assert all(torch.equal(a, b) for a, b in zip(grads, plain))
    assert flags == [0, 0, 0]
