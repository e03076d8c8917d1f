"""The `cuda` backend (csrc/cuda/) against the float64 reference.

Two modes: on a GPU, on CUDA tensors; without one, on CPU tensors through the host harness
(ATTNX_CUDA_ON_CPU=1, csrc/cuda/host/), which runs the same kernel source with every block's
threads as fibers in a shuffled order, bounds-checked buffers and NaN-filled outputs, at sizes
that keep the module to a few minutes on two cores (`gpu_or_cpu`).

Each result is compared with the reference backend run in float64 (the golden value); the error
is bounded by a small multiple of the error of the same PyTorch math done in the low dtype (the
baseline: scores, probabilities and products rounded to the dtype as a plain PyTorch model
would), flash-attention style (factor 2 for outputs, 3 for gradients). Dropout is compared
exactly in its pattern: every backend draws the same hash, so the reference with the same seed
is the golden value.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention.bias import CausalBias

import attnx
from attnx import _dispatch, _ops, _validate
from attnx._backends import reference
from tests._compare import (assert_near_largest, assert_within, causal_varlen_run,
                            check_fp16_ds_past_its_range, check_fp16_out_past_its_range,
                            lost_key_qkv, wrong_sign_qk)

from attnx._backends import cuda as cuda_backend

ON_CPU = not torch.cuda.is_available()  # the kernels then run through the host harness


def _skip_reason():
    if ON_CPU:
        return _ops.cuda_host()  # None once attnx._cuda_host is built and loaded
    return cuda_backend._device_reason(torch.device("cuda"))  # e.g. too little shared memory


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))

DTYPES = (torch.float16, torch.bfloat16)
DEV = "cpu" if ON_CPU else "cuda"
BF16 = torch.bfloat16
OPS = torch.ops.attnx_cuda_host if ON_CPU else torch.ops.attnx


def gpu_or_cpu(gpu, cpu):
    """A test's sizes: `gpu` on a GPU, the smaller `cpu` through the host harness."""
    return cpu if ON_CPU else gpu


@pytest.fixture(autouse=True)
def _harness_switch(monkeypatch):
    if ON_CPU:
        monkeypatch.setenv("ATTNX_CUDA_ON_CPU", "1")


def rand(*shape, dtype, grad=True):
    return torch.randn(*shape, device=DEV, dtype=dtype).requires_grad_(grad)


def leaf64(t):
    return t.detach().double().requires_grad_(t.requires_grad)


def lowp_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, window=None, **_):
    """The baseline: SDPA math in q's dtype (softmax in float32, as torch's math path does)."""
    call = attnx._validate.sdpa_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                     window, "reference", False)
    groups = call.q.shape[1] // call.k.shape[1]
    kk = call.k.repeat_interleave(groups, dim=1)
    vv = call.v.repeat_interleave(groups, dim=1)
    s = (call.q @ kk.transpose(-2, -1)) * call.scale
    p, _ = reference.masked_softmax(s.float(), call.mask, call.window_lo, call.window_hi)
    p = reference.apply_dropout(p, call.dropout_p, call.seed)
    out = p.to(q.dtype) @ vv
    return out.reshape(call.prefix + tuple(out.shape[-2:]))


def lowp_additive(q, k, value, v, attn_mask=None, dropout_p=0.0, is_causal=False, window=None, **_):
    call = attnx._validate.additive_call(q, k, value, v, attn_mask, dropout_p, is_causal, window,
                                         "reference", False)
    t = torch.tanh(call.q.unsqueeze(3) + call.k.unsqueeze(2))
    s = (t * call.v.view(1, call.v.shape[0], 1, 1, call.v.shape[1])).sum(-1)
    p, _ = reference.masked_softmax(s.float(), call.mask, call.window_lo, call.window_hi)
    p = reference.apply_dropout(p, call.dropout_p, call.seed)
    out, p = p.to(q.dtype) @ call.value, p.to(q.dtype)
    return (out.squeeze(1), p.squeeze(1)) if call.three_d else (out, p)


def is_mask_tensor(mask) -> bool:
    return isinstance(mask, torch.Tensor) and not isinstance(mask, CausalBias)


def grad_mask(mask) -> bool:
    return is_mask_tensor(mask) and mask.requires_grad


def mask64(mask):
    """The float64 golden run's mask: a float mask as a float64 leaf, anything else as is."""
    if is_mask_tensor(mask) and mask.dtype != torch.bool:
        return leaf64(mask)
    return mask


def seeded(fn, seed, *args, **kw):
    torch.manual_seed(seed)  # the dropout seed comes from torch's CPU generator
    return fn(*args, **kw)


def check_sdpa(q, k, v, mask=None, grads=True, seed=0, **kw):
    """cuda vs float64 reference vs low-precision baseline, outputs and gradients."""
    inputs = [q, k, v] + ([mask] if grad_mask(mask) else [])
    out, lse = seeded(attnx.scaled_dot_product_attention, seed, q, k, v, mask, backend="cuda",
                      return_lse=True, **kw)
    m64 = mask64(mask)
    ins64 = [leaf64(t) for t in (q, k, v)] + ([m64] if grad_mask(m64) else [])
    gold, gold_lse = seeded(attnx.scaled_dot_product_attention, seed, *ins64[:3], m64,
                            backend="reference", return_lse=True, **kw)
    base = seeded(lowp_sdpa, seed, q, k, v, mask, **kw)
    assert_within(out, gold, base, what="out")
    finite = torch.isfinite(gold_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse: -inf rows differ"
    torch.testing.assert_close(lse[finite], gold_lse[finite].float(), atol=2e-2, rtol=1e-3)
    if not grads:
        return out, lse
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, dout)
    want = torch.autograd.grad(gold, ins64, dout.double())
    bl = torch.autograd.grad(base, inputs, dout)
    for name, g, w, b in zip(("dq", "dk", "dv", "dmask"), got, want, bl):
        assert_within(g, w, b, factor=3.0, what=name)
    return out, lse


def check_additive(q, k, value, v, mask=None, seed=0, **kw):
    inputs = [q, k, value, v] + ([mask] if grad_mask(mask) else [])
    out, w = seeded(attnx.additive_attention, seed, q, k, value, v, mask, backend="cuda",
                    return_weights=True, **kw)
    m64 = mask64(mask)
    ins64 = [leaf64(t) for t in (q, k, value, v)] + ([m64] if grad_mask(m64) else [])
    gold, gold_w = seeded(attnx.additive_attention, seed, *ins64[:4], m64, backend="reference",
                          return_weights=True, **kw)
    base, base_w = seeded(lowp_additive, seed, q, k, value, v, mask, **kw)
    assert_within(out, gold, base, what="out")
    torch.testing.assert_close(w.double(), gold_w.detach(), atol=1e-2, rtol=1e-2)
    # the loss takes the weights too: their gradient is grad_weights of the backward
    dout, dw = torch.randn_like(out), torch.randn_like(w)
    got = torch.autograd.grad((out, w), inputs, (dout, dw))
    want = torch.autograd.grad((gold, gold_w), ins64, (dout.double(), dw.double()))
    bl = torch.autograd.grad((base, base_w), inputs, (dout, dw))
    for name, g, wt, b in zip(("dq", "dk", "dvalue", "dv", "dmask"), got, want, bl):
        assert_within(g, wt, b, factor=3.0, what=name)
    return out


def test_cuda_backend_is_usable():
    status = attnx.backends()["cuda"]
    assert status.usable, status.reason


# ------------------------------------------------------------------------------------------ SDPA

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq,lk", [(1, 1), (1, 97), (17, 17), (97, 17), (17, 97), (128, 128),
                                   gpu_or_cpu((1025, 1025), (130, 130))])
def test_sdpa_sizes(dtype, lq, lk):
    torch.manual_seed(1)
    b, h = gpu_or_cpu((2, 3), (1, 2))
    check_sdpa(rand(b, h, lq, 64, dtype=dtype), rand(b, h, lk, 64, dtype=dtype),
               rand(b, h, lk, 64, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e,ev", [(16, 16), (32, 32), (59, 59), (64, 128), (80, 72), (96, 96),
                                  (111, 111), (128, 128), (150, 160), (192, 64), (256, 256)])
def test_sdpa_head_dims(dtype, e, ev):
    torch.manual_seed(2)
    check_sdpa(rand(1, 2, 97, e, dtype=dtype), rand(1, 2, 113, e, dtype=dtype),
               rand(1, 2, 113, ev, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq,lk", [(97, 97), (17, 203), (203, 17),
                                   gpu_or_cpu((1025, 1025), (130, 130))])
def test_sdpa_causal(dtype, lq, lk):
    torch.manual_seed(3)
    check_sdpa(rand(1, 2, lq, 128, dtype=dtype), rand(1, 2, lk, 128, dtype=dtype),
               rand(1, 2, lk, 128, dtype=dtype), is_causal=True)


@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
def test_sdpa_causal_bias(variant):
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left
    torch.manual_seed(4)
    lq, lk = 33, 150
    bias = (causal_upper_left if variant == "upper_left" else causal_lower_right)(lq, lk)
    check_sdpa(rand(2, 2, lq, 64, dtype=torch.float16), rand(2, 2, lk, 64, dtype=torch.float16),
               rand(2, 2, lk, 64, dtype=torch.float16), bias)


@pytest.mark.parametrize("window,causal", [((16, 16), False), ((0, 0), False), ((40, None), True),
                                           ((None, 3), False), ((100, 0), False), ((1, 0), False)])
def test_sdpa_window(window, causal):
    torch.manual_seed(5)
    lq, lk = gpu_or_cpu((300, 260), (150, 130))
    check_sdpa(rand(1, 2, lq, 64, dtype=torch.bfloat16), rand(1, 2, lk, 64, dtype=torch.bfloat16),
               rand(1, 2, lk, 64, dtype=torch.bfloat16), window=window, is_causal=causal)


@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 1), (8, 8)])
def test_sdpa_gqa(hq, hkv):
    torch.manual_seed(6)
    check_sdpa(rand(2, hq, 97, 64, dtype=torch.float16), rand(2, hkv, 130, 64, dtype=torch.float16),
               rand(2, hkv, 130, 64, dtype=torch.float16), enable_gqa=True, is_causal=True)


def test_sdpa_bool_mask_broadcast_with_empty_rows():
    torch.manual_seed(7)
    lq, lk = 70, 90
    mask = torch.rand(lq, lk, device=DEV) > 0.3  # broadcast over batch and heads
    mask[5] = False
    mask[63] = False
    q = rand(2, 3, lq, 64, dtype=torch.float16)
    out, lse = check_sdpa(q, rand(2, 3, lk, 64, dtype=torch.float16),
                          rand(2, 3, lk, 64, dtype=torch.float16), mask)
    assert (out[:, :, [5, 63]] == 0).all()
    assert (lse[:, :, [5, 63]] == float("-inf")).all()


def test_bool_mask_bytes_other_than_one_mean_true():
    """A bool mask whose True bytes are not 1 (a uint8 tensor viewed as bool, as masks built by
    byte arithmetic are) is read as bytes != 0: the kernels read uint8, never `bool`, whose other
    values are undefined behaviour on the device. SDPA and additive give bitwise what the 0/1
    mask gives."""
    torch.manual_seed(12)
    lq, lk = 33, 40
    ones = torch.rand(lq, lk, device=DEV) > 0.4
    ones[7] = False  # an empty row stays empty
    odd = (ones.to(torch.uint8) * torch.randint(2, 256, (lq, lk), device=DEV,
                                                dtype=torch.uint8)).view(torch.bool)
    assert odd.view(torch.uint8).max() > 1
    q, k, v = (rand(1, 2, n, 64, dtype=torch.float16, grad=False) for n in (lq, lk, lk))
    for mask_op in (lambda m: attnx.scaled_dot_product_attention(q, k, v, m, backend="cuda"),
                    lambda m: attnx.additive_attention(q, k, v, torch.ones(64, device=DEV,
                                                       dtype=torch.float16), m, backend="cuda")):
        assert torch.equal(mask_op(odd), mask_op(ones))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_float_mask_gradient(dtype):
    torch.manual_seed(8)
    lq, lk = 97, 65
    mask = torch.randn(2, 1, lq, lk, device=DEV, dtype=dtype)
    mask[..., 10, :] = float("-inf")  # a fully masked row
    mask.requires_grad_(True)
    check_sdpa(rand(2, 4, lq, 64, dtype=dtype), rand(2, 4, lk, 64, dtype=dtype),
               rand(2, 4, lk, 64, dtype=dtype), mask)


def huge_bias_mask(b, lq, lk, dtype):
    """Whole rows padded with the dtype's most negative finite value, as Hugging Face models
    pad: in bfloat16 (finfo.min ~ -3.4e38) a row's lse rounds to its max, and probabilities
    rebuilt as exp(s - lse) come out 1 instead of 1 / l unless the kernels renormalize those
    rows (csrc/cpu/huge_lse.h). One padded row has a single key less biased."""
    big = torch.finfo(dtype).min
    m = torch.zeros(b, 1, lq, lk, dtype=dtype, device=DEV)
    m[:, :, 2] = big
    m[0, :, 5, 9:] = big
    m[-1, :, lq - 1] = big
    m[-1, :, lq - 1, 3] = big / 2
    return m


@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_rows_under_a_huge_finite_bias(dtype):
    torch.manual_seed(13)
    lq, lk = 70, 90  # two query tiles, the second partial
    mask = huge_bias_mask(2, lq, lk, dtype).requires_grad_()
    check_sdpa(rand(2, 2, lq, 64, dtype=dtype), rand(2, 2, lk, 64, dtype=dtype),
               rand(2, 2, lk, 64, dtype=dtype), mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale,size", [(3e8, 1.0), (1e9, 1.0), (None, 3000.0)])
def test_sdpa_huge_scaled_scores(dtype, scale, size):
    """Scaled scores of 1e6 to 1e10, from a huge scale or from huge q and k under the default
    one: the forward's folded exponent exp2(v c - fl(m c)) gave the largest score of a row
    2^err, err up to ulp(m c) / 2 (2^-64 at 3e8: flushed to zero in fp16, a zero row; 2^256 at
    1e9: NaN); past kFoldLimit its tiles subtract first (sdpa_fwd.cuh exp_diff)."""
    torch.manual_seed(14)
    q, k, v = (size * rand(1, 2, n, 64, dtype=torch.float32, grad=False) for n in (33, 97, 97))
    q, k, v = (t.to(dtype) for t in (q, k, v))
    check_sdpa(q, k, v, grads=False, scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [3e8, 1e9])
def test_sdpa_huge_scaled_scores_backward_stays_finite(dtype, scale):
    """The backward at scaled scores of 3e8-1e9: its gradients are not accurate there (a
    recomputed score's rounding times the scale; D from the rounded output: README), but finite
    (the triton backward's came out NaN before its clamp; test_triton.py has the twin)."""
    torch.manual_seed(16)
    q, k, v = (rand(1, 2, n, 64, dtype=dtype) for n in (70, 150, 150))
    out = attnx.scaled_dot_product_attention(q, k, v, scale=scale, backend="cuda")
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for name, g in zip("qkv", grads):
        assert torch.isfinite(g).all(), f"d{name}: non-finite values"


# Scores past float32's range from finite inputs (|q| |k| ~ 1e19 in bf16, or fp16 with a scale
# near its bound): the forward's rows are redone in float64 (sdpa_fwd.cuh past_range, rerun_row;
# decode.cu rerun_row), the bf16 backward's by sdpa_bwd_rerun.cu from float64 scores.
PAST_RANGE_MODS = {"plain": {}, "causal": dict(is_causal=True), "window": dict(window=(3, 2)),
                   "softcap": dict(softcap=5.0), "sinks": dict(sinks=[0.5, -1.0, 2.0, 0.0]),
                   "alibi": dict(alibi_slopes=[0.5, 0.25, 1.0, 2.0]), "dropout": dict(dropout_p=0.3),
                   "bool-mask": {}, "float-mask": {}}
LOWEST = torch.finfo(torch.float32).min


def past_range_run(q, k, v, do, mask, kw, backend):
    """(out, lse, dq, dk, dv, then dsinks with sinks) of out . do on `backend`: the inputs'
    dtype for cuda, float64 for the reference (the same dropout seed)."""
    cast = (lambda t: t) if backend == "cuda" else (lambda t: t.double())  # noqa: E731
    leaves = [cast(t).detach().requires_grad_() for t in (q, k, v)]
    if mask is not None and mask.dtype != torch.bool:
        mask = cast(mask)
    kw = dict(kw)
    if "sinks" in kw:
        kw["sinks"] = cast(kw["sinks"]).detach().requires_grad_()
        leaves.append(kw["sinks"])
    out, lse = seeded(attnx.scaled_dot_product_attention, 5, *leaves[:3], attn_mask=mask,
                      backend=backend, enable_gqa=True, return_lse=True, **kw)
    return (out, lse, *torch.autograd.grad(out, leaves, cast(do)))


def assert_past_range(got, gold, q, k, v, do, scale, grads=True):
    """The output within 2% of max|v|; the lse as float32 rounds the golden one (+inf past its
    largest, its lowest past that: -inf marks a row without keys, and these have none); dv
    within 2% of max|dO| times the rows; dq and dk within 2% of the largest their terms can be,
    dS = P (dP - D) <= 2 max|dO| max|v| times max|k| (or |q|) |scale| the rows or keys: their
    true values are 0 where a row's softmax is one key's, as at these sizes it mostly is."""
    big = lambda t: t.double().abs().max()  # noqa: E731

    def near(x, want, bound, what):
        assert torch.isfinite(x).all(), f"{what}: non-finite values"
        err = (x.double() - want.double()).abs().max() / bound
        assert err <= 2e-2, f"{what}: max error {err:.3g} of its bound"

    near(got[0], gold[0], big(v), "out")
    want = gold[1].float().where(gold[1] > -float("inf"), LOWEST)
    torch.testing.assert_close(got[1], want, rtol=1e-5, atol=1e-4)
    if not grads:
        return
    ds = 2 * big(do) * big(v) * abs(scale)
    near(got[4], gold[4], big(do) * q.shape[2] * q.shape[1], "dv")
    near(got[2], gold[2], ds * big(k) * k.shape[2], "dq")
    near(got[3], gold[3], ds * big(q) * q.shape[2] * q.shape[1], "dk")


def past_range_inputs(seed, hq=4, lq=9, hkv=2, lk=150):
    """bf16 q and k of ~1.5e19 (scores up to ~1e40), ordinary v and dO."""
    gen = torch.Generator().manual_seed(seed)
    q, k = ((torch.randn(1, h, n, 64, generator=gen, dtype=torch.float64) * 1.5e19)
            for h, n in ((hq, lq), (hkv, lk)))
    v = torch.randn(1, hkv, lk, 64, generator=gen)
    do = torch.randn(1, hq, lq, 64, generator=gen)
    return [t.to(DEV, torch.bfloat16) for t in (q, k, v, do)], gen


@pytest.mark.parametrize("mods", list(PAST_RANGE_MODS))
def test_sdpa_scores_past_float32s_range(mods):
    """Most rows' softmax is (all but) one key's, some rows' lse passes float32's range. 150
    keys: interior tiles (no per-score test) and an edge tile; GQA; the modifier kernels."""
    (q, k, v, do), gen = past_range_inputs(0)
    kw = {name: torch.tensor(x, device=DEV) if isinstance(x, list) else x
          for name, x in PAST_RANGE_MODS[mods].items()}
    mask = None
    if mods == "bool-mask":
        mask = (torch.rand((1, 4, 9, 150), generator=gen) > 0.3).to(DEV)
        mask[..., 0] = True  # no row left empty
    elif mods == "float-mask":
        mask = torch.randn((1, 4, 9, 150), generator=gen).to(DEV, torch.bfloat16)
        mask[..., 1, :] = -3.0e38  # a row of large biases that the scores push past the range
    got = past_range_run(q, k, v, do, mask, kw, "cuda")
    gold = past_range_run(q, k, v, do, mask, kw, "reference")
    assert_past_range(got, gold, q, k, v, do, 1 / 8)


LOWEST_CASES = ["interior", "causal", "bool-mask", "sinks", "float-mask"]


@pytest.mark.parametrize("case", LOWEST_CASES)
def test_sdpa_every_score_past_float32s_lowest(case):
    """Every score of every row under float32's lowest, each row's largest on key 0: float32
    takes every score as -inf, a row as empty (zeros, lse -inf) unless caught. Unmasked tiles
    catch it by l = 0 on a non-empty band (interior, causal, sinks: -4.5e38 to -2e39 scaled);
    masked tiles by NaN (an all-true bool mask; float-mask: scores of -1e38 to -3e38 at scale 1
    whose sums with a bias of -3e38 overflow). With sinks the sink takes all: zeros, lse the
    sink. The backward's row sums of such a row are 0: its P come out NaN, which flags the
    rerun."""
    scale = 1.0 if case == "float-mask" else 1 / 8
    x = 1e19 if case == "float-mask" else 6e19
    a = (1.0 + torch.arange(9, dtype=torch.float64) / 16)[:, None] * x
    b = (1.0 + torch.arange(150, dtype=torch.float64) / 150)[:, None] * x
    u = torch.full((64,), 0.125, dtype=torch.float64)  # |u| = 1: scores -a b scale
    q = (a * u).expand(1, 2, 9, 64).to(DEV, torch.bfloat16)
    k = (-b * u).expand(1, 2, 150, 64).to(DEV, torch.bfloat16)
    (_, _, v, do), _ = past_range_inputs(1, hq=2)
    mask, kw = None, dict(scale=scale, is_causal=case == "causal")
    if case == "bool-mask":
        mask = torch.ones(1, 2, 9, 150, dtype=torch.bool, device=DEV)
    elif case == "float-mask":
        mask = torch.full((1, 2, 9, 150), -3e38, dtype=torch.bfloat16, device=DEV)
    elif case == "sinks":
        kw["sinks"] = torch.tensor([0.5, -1.0], device=DEV)
    got = past_range_run(q, k, v, do, mask, kw, "cuda")
    gold = past_range_run(q, k, v, do, mask, kw, "reference")
    assert_past_range(got, gold, q, k, v, do, scale)
    if case == "sinks":
        assert (got[0] == 0).all(), "out: not the sink's zeros"
        assert (got[1] == kw["sinks"].view(1, 2, 1)).all(), "lse: not the sink"
    else:
        torch.testing.assert_close(got[0][..., -1, :], v[:, :, 0], atol=0, rtol=0)  # key 0's
        assert (got[1] == LOWEST).all(), "lse: not saturated at float32's lowest"


@pytest.mark.parametrize("case", ["interior", "causal", "sinks", "varlen"])
def test_sdpa_score_lost_to_an_overflowed_partial_sum(case):
    """A score whose MMA partial sums pass float32's lowest though the true score (0) is the
    row's largest (_compare.lost_key_qkv): -inf, dropped by exp with no sign (the row's sum
    still positive), out off by ~3 and dv of key 0 lost. The forward redoes rows with a score
    of -inf before the band and mask (sdpa_fwd.cuh: l = NaN), the backward flags its float64
    rerun (sdpa_bwd.cuh, `lowest`). 150 keys: an interior tile (interior), an edge tile
    (causal: key 0 on the diagonal tile), the modifier kernels (sinks), packed sequences."""
    q, k, v = (t.to(torch.bfloat16) for t in lost_key_qkv(9, 150))
    do = torch.randn(1, 1, 9, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    kw = {"causal": dict(is_causal=True),
          "sinks": dict(sinks=torch.tensor([-1.0]))}.get(case, {})
    if case == "varlen":  # two sequences: the 9 x 150 one, then its first 8 x 100, causal
        cu_q = torch.tensor([0, 9, 17], dtype=torch.int32, device=DEV)
        cu_k = torch.tensor([0, 150, 250], dtype=torch.int32, device=DEV)
        pack = lambda t, n: torch.cat([t[0, 0], t[0, 0, :n]]).unsqueeze(1).to(DEV)  # noqa: E731
        packed = (pack(q, 8), pack(k, 100), pack(v, 100), pack(do, 8))
        got = causal_varlen_run(*packed, cu_q, cu_k, "cuda", torch.bfloat16, scale=1.0)
        gold = causal_varlen_run(*packed, cu_q, cu_k, "reference", torch.float64, scale=1.0)
        # out within 2% of max|v|, dv of max|dO| times the rows (dq, dk: their true values are
        # ~1e35 times small differences, which out and dv already pin down)
        for x, want, bound, what in ((got[0], gold[0], v.abs().max(), "out"),
                                     (got[4], gold[4], do.abs().max() * 17, "dv")):
            err = (x.double() - want).abs().max() / bound.double()
            assert err <= 2e-2, f"varlen {what}: max error {err:.3g} of its bound"
        return
    q, k, v, do = (t.to(DEV) for t in (q, k, v, do))
    kw = {name: x.to(DEV) if torch.is_tensor(x) else x for name, x in kw.items()}
    kw["scale"] = 1.0
    got = past_range_run(q, k, v, do, None, kw, "cuda")
    gold = past_range_run(q, k, v, do, None, kw, "reference")
    assert_past_range(got, gold, q, k, v, do, 1.0)


def test_sdpa_softcap_of_an_overflow_whose_sign_is_wrong():
    """A softcap over scores whose float32 dot overflowed to +inf while the true score is
    -6.4e38 (_compare.wrong_sign_qk): the cap took +inf as +5 (out and dV wrong, finite, the
    lse ordinary: nothing flagged it); now an inf score under a softcap is NaN (common.cuh
    modified_score), which the forward's rerun and the backward's flag catch. 40 keys:
    interior tiles and an edge tile."""
    gen = torch.Generator().manual_seed(4)
    q, k = (t.to(DEV, torch.bfloat16) for t in wrong_sign_qk(2, 9, 2, 40))
    v, do = (torch.randn(1, 2, n, 128, generator=gen).to(DEV, torch.bfloat16) for n in (40, 9))
    kw = dict(softcap=5.0, scale=1.0)
    got = past_range_run(q, k, v, do, None, kw, "cuda")
    assert_past_range(got, past_range_run(q, k, v, do, None, kw, "reference"), q, k, v, do, 1.0)


@pytest.mark.parametrize("keys", [2, 3])
def test_sdpa_fp16_ds_past_its_range(keys):
    check_fp16_ds_past_its_range("cuda", DEV, keys)


def test_varlen_fp16_ds_past_its_range():
    check_fp16_ds_past_its_range("cuda", DEV)


@pytest.mark.parametrize("kind", ["sdpa", "additive"])
def test_fp16_out_past_its_range(kind):
    check_fp16_out_past_its_range(kind, "cuda", DEV)


def test_sdpa_backward_of_a_row_whose_lse_passed_float32s_range():
    """A saved lse of +inf (the forward's float64 rerun saturates a row whose scores passed
    float32's range): the backward's scan (sdpa_bwd_rerun.cu sdpa_bwd_dq_scan_kernel) flags the
    call, and the float64 passes redo every row from its own max and sum. Unflagged, that row's
    P = exp(s - inf) is 0 wherever its float32 scores are finite: its dQ 0, its share of dK and
    dV lost. The lse is planted on ordinary bf16 inputs, so the redone gradients must match the
    ones of the true lse."""
    gen = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 2, 17, 64, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 2, 23, 64, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
    window = (-4096, 4096)
    out, lse = OPS.sdpa_fwd(q, k, v, None, 0.125, *window, 0.0, None)
    planted = lse.clone()
    planted[0, 1, 5] = float("inf")
    want = OPS.sdpa_bwd(do, q, k, v, None, out, lse, 0.125, *window, 0.0, None, False, None)
    got = OPS.sdpa_bwd(do, q, k, v, None, out, planted, 0.125, *window, 0.0, None, False, None)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        # both within bf16's rounding of the true gradient (float32 sums against float64 ones)
        assert_near_largest(name, g, w)
    assert got[0][0, 1, 5].double().abs().max() > 0.1  # the planted row's dQ is not dropped


@pytest.mark.parametrize("case", ["plain", "causal", "sinks", "alibi"])
def test_sdpa_tied_scores_past_float32s_range(case):
    """q and k of 2^64 e_0 (bf16): every score 2^128 / 8 = 2^125, past float32's range in the
    raw product. The softmax is uniform over each row's keys, so dV (the mean of dO over the
    rows that see a key) and dK (scale 2^64 sum_i dS_ij in column 0) are far from 0 and held
    to 2% of their largest, where the one-key softmax of the other tests leaves them near 0.
    sinks: each of 2^125 (float32, exact), one more tied score: its share and gradient are
    not 0 either. alibi: slopes of 2^119 make each row's diagonal key the only one that counts
    (out = its value), where a rerun without them would average."""
    q = torch.zeros(1, 4, 9, 64, dtype=torch.float64)
    k = torch.zeros(1, 2, 150, 64, dtype=torch.float64)
    q[..., 0] = k[..., 0] = 2.0 ** 64
    (_, _, v, do), _ = past_range_inputs(2)
    q, k = q.to(DEV, torch.bfloat16), k.to(DEV, torch.bfloat16)
    kw = {"plain": {}, "causal": dict(is_causal=True),
          "sinks": dict(sinks=torch.full((4,), 2.0 ** 125, device=DEV)),
          "alibi": dict(alibi_slopes=torch.full((4,), 2.0 ** 119, device=DEV))}[case]
    got = past_range_run(q, k, v, do, None, kw, "cuda")
    gold = past_range_run(q, k, v, do, None, kw, "reference")
    assert_past_range(got, gold, q, k, v, do, 1 / 8)
    checked = [("out", 0), ("dv", 4)] + ([] if case == "alibi" else [("dk", 3)])
    checked += [("dsinks", 5)] if case == "sinks" else []
    for name, x in checked:
        err = (got[x].double() - gold[x]).abs().max() / gold[x].abs().max()
        assert err <= 2e-2, f"{name}: max error {err:.3g} of its largest"
    if case == "alibi":
        torch.testing.assert_close(got[0], v[:, [0, 0, 1, 1], :9], atol=0, rtol=0)


@pytest.mark.parametrize("case", ["folded", "folded-negative", "float-mask"])
def test_sdpa_fp16_scale_past_float32s_range(case):
    """fp16 inputs with a scale near its bound (1e38, scores up to ~3e39). Unmasked, the forward
    folds the scale into the exponent, which takes score differences: no row is redone, and a
    row's lse is +inf past float32's largest, its lowest past that (folded-negative: every
    score negative; -inf there read as a row without keys gave zero gradients). With a float
    mask it scales each score first, which overflows: those rows are redone in float64. The
    backward reruns in float64 at such scales (kernel_ops.cpp), as for bf16: its float32 scores
    and P came out NaN."""
    gen = torch.Generator().manual_seed(4)
    q, do, k, v, mask = (torch.randn(1, 2, n, m, generator=gen).to(DEV, torch.float16)
                         for n, m in ((9, 64), (9, 64), (150, 64), (150, 64), (9, 150)))
    if case == "folded-negative":
        q, k = q.abs(), -k.abs()
    mask = mask if case == "float-mask" else None
    got = past_range_run(q, k, v, do, mask, dict(scale=1e38), "cuda")
    gold = past_range_run(q, k, v, do, mask, dict(scale=1e38), "reference")
    assert (got[1].abs() > 3e38).all(), "a row inside the range: the case is not tested"
    assert_past_range(got, gold, q, k, v, do, 1e38)


def test_varlen_scores_past_float32s_range():
    """Packed sequences of 9 and 5 queries, 150 and 17 keys, causal: as SDPA's, each sequence
    against the reference backend's."""
    gen = torch.Generator().manual_seed(3)
    q, k = ((torch.randn(n, h, 64, generator=gen, dtype=torch.float64) * 1.5e19)
            .to(DEV, torch.bfloat16) for n, h in ((14, 4), (167, 2)))
    v = torch.randn(167, 2, 64, generator=gen).to(DEV, torch.bfloat16)
    do = torch.randn(14, 4, 64, generator=gen).to(DEV, torch.bfloat16)
    cu_q = torch.tensor([0, 9, 14], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 150, 167], dtype=torch.int32, device=DEV)
    got = causal_varlen_run(q, k, v, do, cu_q, cu_k, "cuda", torch.bfloat16)
    gold = causal_varlen_run(q, k, v, do, cu_q, cu_k, "reference", torch.float64)
    for (q0, q1), (k0, k1) in (((0, 9), (0, 150)), ((9, 14), (150, 167))):
        part = lambda t, a, c: t[a:c].transpose(0, 1)[None]  # noqa: E731
        each = lambda r: [part(r[0], q0, q1), r[1][:, q0:q1][None], part(r[2], q0, q1),  # noqa
                          part(r[3], k0, k1), part(r[4], k0, k1)]
        assert_past_range(each(got), each(gold), part(q, q0, q1), part(k, k0, k1),
                          part(v, k0, k1), part(do, q0, q1), 1 / 8)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("capacity", [64, 32], ids=["two-splits", "one-split"])
@pytest.mark.parametrize("mods", ["plain", "window", "softcap", "alibi", "sinks"])
def test_kvcache_scores_past_float32s_range(paged, capacity, mods):
    """Decoding 3 query rows against caches of `capacity` and 9 keys fewer, bf16 inputs of
    ~1.5e19: rows redone by the merge (two splits) or the split kernel (one), against the
    reference."""
    gen = torch.Generator().manual_seed(5)
    q = (torch.randn(2, 4, 3, 64, generator=gen, dtype=torch.float64) * 1.5e19)
    k = (torch.randn(2, 2, capacity, 64, generator=gen, dtype=torch.float64) * 1.5e19)
    q, k = q.to(DEV, torch.bfloat16), k.to(DEV, torch.bfloat16)
    v = torch.randn(2, 2, capacity, 64, generator=gen).to(DEV, torch.bfloat16)
    lens = torch.tensor([capacity, capacity - 9], dtype=torch.int32, device=DEV)
    kw = {"plain": {}, "window": dict(window=(10, 0)), "softcap": dict(softcap=5.0),
          "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 1.0, 2.0], device=DEV)),
          "sinks": dict(sinks=torch.tensor([0.5, 1.0, -1.0, 2.0], device=DEV))}[mods]
    gold = attnx.attention_with_kvcache(q.double(), k.double(), v.double(), lens,
                                        backend="reference", return_lse=True, **kw)
    if paged:  # blocks of 16 positions, shuffled over a pool
        nb = capacity // 16
        table = torch.randperm(2 * nb + 2, generator=gen)[:2 * nb].view(2, nb)
        table = table.to(DEV, torch.int32)
        pool_k = torch.zeros((2 * nb + 2, 2, 16, 64), dtype=torch.bfloat16, device=DEV)
        pool_v = torch.zeros_like(pool_k)
        for n in range(2):
            for blk in range(nb):
                pool_k[table[n, blk]] = k[n, :, 16 * blk:16 * blk + 16]
                pool_v[table[n, blk]] = v[n, :, 16 * blk:16 * blk + 16]
        k, v, kw = pool_k, pool_v, dict(kw, block_table=table)
    got = attnx.attention_with_kvcache(q, k, v, lens, backend="cuda", return_lse=True, **kw)
    assert_past_range(got, gold, q, k, v, None, 1 / 8, grads=False)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_scale_validation_admits(sign):
    """|scale| up to validation's bound (float32's max over log2(e)): the kernels fold scale *
    log2(e) into one float32 factor, which at |scale| of 2.4e38-3.4e38 (then admitted) was inf,
    and every output NaN, zero scores too. Here q = k = 0: each output row is the mean of v,
    through SDPA, the packed sequences and the KV cache."""
    from attnx._validate import MAX_FLOAT32_SCALE
    scale = sign * MAX_FLOAT32_SCALE
    q = torch.zeros(1, 2, 5, 32, device=DEV, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 40, 32, device=DEV, dtype=torch.bfloat16)
    v = rand(1, 2, 40, 32, dtype=torch.bfloat16, grad=False)
    mean = v.float().mean(2, keepdim=True).expand(1, 2, 5, 32)
    out = attnx.scaled_dot_product_attention(q, k, v, scale=scale, backend="cuda")
    cu_q = torch.tensor([0, 5], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 40], dtype=torch.int32, device=DEV)
    packed = attnx.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                    v[0].transpose(0, 1), cu_q, cu_k, scale=scale, backend="cuda")
    cached = attnx.attention_with_kvcache(q[:, :, :1], k, v, 40, scale=scale, backend="cuda")
    for got, want in ((out, mean), (packed.transpose(0, 1)[None], mean), (cached, mean[:, :, :1])):
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_sdpa_tied_scores_just_below_the_fold_limit():
    """1024 keys of one score, |m scale log2(e)| ~ 2^19.5 (kFoldLimit: still folded): the
    output is the mean of v. The folded tiles' rescale exp2(m c - fl(m c)) was 2^(rounding), not
    1, while the max stood still, and weighted the 16 tiles unevenly (rescale_log2)."""
    torch.manual_seed(15)
    q = torch.full((1, 1, 4, 64), 254.0, device=DEV, dtype=torch.bfloat16)
    k = torch.full((1, 1, 1024, 64), 254.0, device=DEV, dtype=torch.bfloat16)
    v = rand(1, 1, 1024, 64, dtype=torch.bfloat16, grad=False)
    check_sdpa(q, k, v, grads=False)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_sdpa_dropout_matches_reference(p):
    torch.manual_seed(9)
    q, k, v = (rand(*gpu_or_cpu((2, 4), (1, 2)), 129, 64, dtype=torch.bfloat16) for _ in range(3))
    check_sdpa(q, k, v, dropout_p=p, is_causal=True, seed=1234)
    a = seeded(attnx.scaled_dot_product_attention, 7, q, k, v, dropout_p=p, backend="cuda")
    b = seeded(attnx.scaled_dot_product_attention, 7, q, k, v, dropout_p=p, backend="cuda")
    assert torch.equal(a, b)


@pytest.mark.parametrize("scale", [0.3, -0.25])  # a negative scale cannot be folded into exp2
def test_sdpa_scale_and_noncontiguous_inputs(scale):
    torch.manual_seed(10)
    # (B, L, H, D) storage viewed as (B, H, L, D), as a projection would produce.
    q = torch.randn(2, 77, 4, 64, device=DEV, dtype=torch.float16).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 91, 4, 64, device=DEV, dtype=torch.float16).transpose(1, 2).requires_grad_()
    v = torch.randn(2, 91, 4, 64, device=DEV, dtype=torch.float16).transpose(1, 2).requires_grad_()
    check_sdpa(q, k, v, scale=scale)


def test_sdpa_deterministic_forward():
    torch.manual_seed(11)
    # through the harness, each launch runs its blocks and threads in another order
    q, k, v = (rand(1, 2, gpu_or_cpu(500, 130), 128, dtype=torch.float16, grad=False)
               for _ in range(3))
    a = attnx.scaled_dot_product_attention(q, k, v, backend="cuda")
    assert all(torch.equal(a, attnx.scaled_dot_product_attention(q, k, v, backend="cuda"))
               for _ in range(gpu_or_cpu(5, 2)))


@pytest.mark.skipif(not ON_CPU, reason="a GPU launches the variant of its own arch")
@pytest.mark.parametrize("e,masked,kw", [(32, False, {}), (64, True, {}),
                                         (96, False, {"dropout_p": 0.2}),
                                         (128, False, {"is_causal": True})])
def test_sdpa_forward_below_sm90(e, masked, kw):
    """Below sm_90 the forward runs one 16-row tile a warp (8 warps) up to D = 128, where sm_90
    and the other tests here run two (4 warps; sdpa_fwd.cuh row_tiles): the harness stands for
    an sm_80 device in this test (set_sm90)."""
    from attnx import _cuda_host as host
    torch.manual_seed(27)
    lq, lk = 97, 113
    q, k, v = (rand(1, 2, n, e, dtype=torch.bfloat16) for n in (lq, lk, lk))
    mask = torch.rand(1, 2, lq, lk, device=DEV) > 0.3 if masked else None
    host.set_sm90(False)
    try:
        attnx.scaled_dot_product_attention(q, k, v, mask, backend="cuda", **kw)
        assert host.last_launch_threads() == 256  # 8 warps of one row tile
        check_sdpa(q, k, v, mask, seed=5, **kw)
    finally:
        host.set_sm90(True)
    attnx.scaled_dot_product_attention(q, k, v, mask, backend="cuda", **kw)
    assert host.last_launch_threads() == 128  # sm_90: 4 warps of two


def test_sdpa_opcheck():
    torch.manual_seed(12)
    q = rand(1, 2, 33, 64, dtype=torch.float16)
    k = rand(1, 1, 47, 64, dtype=torch.float16)
    v = rand(1, 1, 47, 64, dtype=torch.float16)
    mask = torch.randn(1, 2, 33, 47, device=DEV, dtype=torch.float16, requires_grad=True)
    seed = torch.tensor([3, 5], dtype=torch.int64)
    torch.library.opcheck(OPS.sdpa_fwd, (q, k, v, mask, 0.125, -33, 47, 0.0, None))
    torch.library.opcheck(OPS.sdpa_fwd, (q, k, v, None, 0.125, -5, 0, 0.2, seed))


# --------------------------------------------------------------------------------- SDPA backward
# The backward's head-dim families (csrc/cuda/launch.h kSdpaBwdFamilies), all on the mma.sync
# kernel (sdpa_bwd.cuh; 64-128 its 128-key variant in the harness's default sm_90, 32 and
# 160-256 the 64-key one); each with every feature at once, odd head dims taking the
# element-wise loads.

BWD_DIMS = [(32, 32), (59, 64), (96, 80), (128, 111), (160, 137), (181, 192), (256, 200)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("e,ev", BWD_DIMS)
def test_sdpa_backward_families_masked_banded_gqa(dtype, e, ev):
    """A float mask with huge-bias rows and a fully masked row (its gradient too), a causal
    band, GQA (2 query heads per kv head, several query blocks per key block: the staged loads
    alternate), Lq != Lk, odd sizes."""
    torch.manual_seed(30)
    lq, lk = 70, 97
    mask = huge_bias_mask(1, lq, lk, dtype)
    mask += torch.randn_like(mask)
    mask[0, :, 40] = float("-inf")
    mask.requires_grad_(True)
    check_sdpa(rand(1, 4, lq, e, dtype=dtype), rand(1, 2, lk, e, dtype=dtype),
               rand(1, 2, lk, ev, dtype=dtype), mask, window=(None, 0), enable_gqa=True)


@pytest.mark.parametrize("e,ev", BWD_DIMS)
def test_sdpa_backward_families_dropout_window_gqa(e, ev):
    """Dropout draws the forward's pattern in the backward, through a band and GQA."""
    torch.manual_seed(31)
    lq, lk = 100, 70
    check_sdpa(rand(1, 4, lq, e, dtype=torch.float16), rand(1, 1, lk, e, dtype=torch.float16),
               rand(1, 1, lk, ev, dtype=torch.float16), dropout_p=0.25, window=(50, 7),
               enable_gqa=True, seed=77)


# The backward's two variants (sdpa_bwd.cuh): 128-key blocks on 8 warps (KT = 2) where the code
# and the part's shared memory hold them, else 64-key blocks (KT = 1: 4 warps up to D = 128),
# which the tests above reach at D = 64..128 only with softcap or ALiBi at D = 64
# (test_modifiers.py): here the harness stands for each part (set_sm90: its code's arch;
# set_smem_optin: its shared memory per block).
SM86_OPT_IN = 101376
PARTS = {"sm_90": (True, 0), "sm_80": (False, 0), "sm_86": (False, SM86_OPT_IN),
         "sm_120": (True, SM86_OPT_IN)}  # sm_120 runs the sm_90 PTX with 99 KB


@pytest.mark.skipif(not ON_CPU, reason="a GPU launches the variant its code and memory hold")
@pytest.mark.parametrize("part,e,threads", [
    ("sm_90", 32, 128), ("sm_90", 64, 256), ("sm_90", 96, 256), ("sm_90", 128, 256),
    ("sm_80", 64, 128), ("sm_80", 128, 128), ("sm_86", 64, 128), ("sm_120", 96, 128)])
def test_sdpa_backward_variant_of_each_part(part, e, threads):
    """Several key blocks (Lk = 300: three or five, the last partial), a bool mask with a fully
    masked row, a causal band, GQA and dropout, on the variant the part launches."""
    from attnx import _cuda_host as host
    torch.manual_seed(33)
    lq, lk = 150, 300
    q = rand(1, 4, lq, e, dtype=torch.bfloat16)
    k, v = (rand(1, 2, lk, e, dtype=torch.bfloat16) for _ in range(2))
    mask = torch.rand(1, 4, lq, lk, device=DEV) > 0.2
    mask[0, 1, 77] = False
    host.set_sm90(PARTS[part][0])
    host.set_smem_optin(PARTS[part][1])
    try:
        check_sdpa(q, k, v, mask, window=(None, 150), enable_gqa=True, dropout_p=0.1, seed=9)
        assert host.last_launch_threads() == threads  # the backward's block
    finally:
        host.set_sm90(True)
        host.set_smem_optin(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_backward_lse_gradient(dtype):
    """A loss that takes lse too: grad_lse enters delta in the backward's pre-pass kernel."""
    torch.manual_seed(32)
    q, k, v = rand(1, 2, 70, 64, dtype=dtype), rand(1, 2, 90, 64, dtype=dtype), \
        rand(1, 2, 90, 64, dtype=dtype)
    mask = torch.rand(70, 90, device=DEV) > 0.2
    mask[3] = False  # lse = -inf: no gradient through it
    out, lse = attnx.scaled_dot_product_attention(q, k, v, mask, backend="cuda", return_lse=True)
    ins64 = [leaf64(t) for t in (q, k, v)]
    gold, gold_lse = attnx.scaled_dot_product_attention(*ins64, mask, backend="reference",
                                                        return_lse=True)
    base_out, base_lse = attnx.scaled_dot_product_attention(q, k, v, mask, backend="reference",
                                                            return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    finite = torch.isfinite(lse)

    def loss(o, l, cast):
        return (o * cast(dout)).sum() + (l[finite] * cast(dlse)[finite]).sum()

    got = torch.autograd.grad(loss(out, lse, lambda t: t.to(out.dtype)), (q, k, v))
    want = torch.autograd.grad(loss(gold, gold_lse, lambda t: t.double()), ins64)
    bl = torch.autograd.grad(loss(base_out, base_lse, lambda t: t.to(out.dtype)), (q, k, v))
    for name, g, w, b in zip(("dq", "dk", "dv"), got, want, bl):
        assert_within(g, w, b, factor=3.0, what=name)


# -------------------------------------------------------------------------------------- additive

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq,lk,a,ev", [(1, 1, 8, 8), (17, 97, 64, 32), (97, 17, 100, 48),
                                        (33, 65, 256, 256), (20, 130, 33, 100)])
def test_additive_sizes(dtype, lq, lk, a, ev):
    torch.manual_seed(20)
    check_additive(rand(2, 2, lq, a, dtype=dtype), rand(2, 2, lk, a, dtype=dtype),
                   rand(2, 2, lk, ev, dtype=dtype), rand(2, a, dtype=dtype))


def test_additive_three_d_shared_v_and_float_mask():
    torch.manual_seed(21)
    b, lq, lk, a = 3, 19, 40, 32
    mask = torch.randn(b, 1, lk, device=DEV, dtype=torch.float16)
    mask[1, 0, :] = float("-inf")  # every query of batch 1 fully masked
    mask.requires_grad_(True)
    out = check_additive(rand(b, lq, a, dtype=torch.float16), rand(b, lk, a, dtype=torch.float16),
                         rand(b, lk, 16, dtype=torch.float16), rand(a, dtype=torch.float16), mask)
    assert (out[1] == 0).all()


@pytest.mark.parametrize("kw,with_mask", [(dict(is_causal=True), False),
                                         (dict(window=(4, 4)), True),
                                         (dict(dropout_p=0.3), True),
                                         (dict(dropout_p=0.3, is_causal=True), False)])
def test_additive_band_and_dropout(kw, with_mask):
    torch.manual_seed(22)
    mask = torch.rand(1, 1, 50, 50, device=DEV) > 0.2 if with_mask else None
    check_additive(rand(2, 3, 50, 48, dtype=torch.bfloat16), rand(2, 3, 50, 48, dtype=torch.bfloat16),
                   rand(2, 3, 50, 24, dtype=torch.bfloat16), rand(3, 48, dtype=torch.bfloat16),
                   mask, seed=99, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_rows_under_a_huge_finite_bias(dtype):
    torch.manual_seed(25)
    lq, lk, a = 20, 37, 16
    mask = huge_bias_mask(2, lq, lk, dtype).requires_grad_()
    check_additive(rand(2, 1, lq, a, dtype=dtype), rand(2, 1, lk, a, dtype=dtype),
                   rand(2, 1, lk, 8, dtype=dtype), rand(1, a, dtype=dtype), mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("band", ["mask", "window"])
def test_additive_weights_where_a_row_admits_nothing_in_its_first_tiles(dtype, band):
    """Rows whose first key tile (64 keys) admits no key and whose scores all lie below -88:
    the weights' last pass scaled that tile by exp(0 - m) = inf (its stored max was 0, not
    -inf), and its zero weights came out NaN, the gradients through them too (a fuzzing
    helper's finding)."""
    torch.manual_seed(27)
    a, lk = 16, 130
    lq = 1 if band == "mask" else lk
    q = (2 + 0.1 * torch.randn(1, 2, lq, a)).to(dtype)  # tanh(q + k) near 1: scores near -100
    k = (2 + 0.1 * torch.randn(1, 2, lk, a)).to(dtype)
    v = (-100.0 / a * (1 + 0.1 * torch.randn(2, a))).to(dtype)
    q, k, v = (t.to(DEV).requires_grad_() for t in (q, k, v))
    value = rand(1, 2, lk, 8, dtype=dtype)
    if band == "mask":  # key 64 only, the second tile's first
        mask = torch.zeros(1, 1, 1, lk, dtype=torch.bool, device=DEV)
        mask[..., 64] = True
        check_additive(q, k, value, v, mask)
    else:  # rows 65-127 visit key tile 0, all of it outside their band
        check_additive(q, k, value, v, window=(1, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_inputs_past_the_exponential_range(dtype):
    """|q|, |k| past the kernels' limit for exponentials (18), where e^{2q} e^{2k} would leave
    fp32's range or two terms' product of denominators would, in pairs whose sum q + k is small
    (tanh anything but +-1): those chunks compute tanh from q + k instead; clamped exponentials
    would give tanh(0) there, unguarded ones inf * 0 = NaN."""
    torch.manual_seed(26)
    lq, lk, a = 19, 70, 40
    q, k = torch.randn(2, 2, lq, a, dtype=dtype), torch.randn(2, 2, lk, a, dtype=dtype)
    q[0, 1, :, 3], k[0, 1, :, 3] = 60.0, -59.5  # q + k = 0.5 in the first A chunk of one head
    q[1, 0, 5, 35], k[1, 0, 7:, 35] = -80.0, 81.0  # one row, in the second chunk of another
    # keys at q + k = 44 and 0.5 in turn every 16 keys, which is how a thread pairs them:
    # e^{2q} e^{2k} + 1 finite, but not its product with the other key's 3.7 (the fast chunks'
    # shared reciprocal: additive.cu r_pair), so a limit of 22 or more gives a wrong score
    q[1, 1, :, 10] = 22.0
    k[1, 1, :, 10] = torch.where((torch.arange(lk) // 16) % 2 == 0, 22.0, -21.5).to(dtype)
    q, k = (t.to(DEV).requires_grad_() for t in (q, k))
    check_additive(q, k, rand(2, 2, lk, 24, dtype=dtype), rand(2, a, dtype=dtype))


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms for one test: the test calls the fixture with
    warn_only; the caller's setting comes back after."""
    was, warn = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    yield lambda warn_only: torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.use_deterministic_algorithms(was, warn_only=warn)


def _backward_runs(op):
    """op's forward on the cuda backend, then its backward (its gradients)."""
    torch.manual_seed(28)
    if op == "additive":
        ins = [rand(*shape, dtype=BF16) for shape in ((1, 2, 9, 16), (1, 2, 11, 16),
                                                      (1, 2, 11, 8), (16,))]
        out = attnx.additive_attention(*ins, backend="cuda")
    elif op == "varlen":
        cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEV)
        ins = [rand(12, 2, 16, dtype=BF16) for _ in range(3)]
        out = attnx.varlen_attention(*ins, cu, cu, is_causal=True, backend="cuda")
    else:
        ins = [rand(1, 2, lq, 16, dtype=BF16) for lq in (9, 11, 11)]
        out = attnx.scaled_dot_product_attention(*ins, softcap=5.0 if op == "sdpa_mod" else None,
                                                 backend="cuda")
    return lambda: torch.autograd.grad(out.float().sum(), ins)


@pytest.mark.parametrize("op", ["sdpa", "sdpa_mod", "varlen", "additive"])
def test_backward_alerts_under_deterministic_algorithms(op, deterministic):
    """The cuda backwards sum dq (dk, dvalue) by float32 atomics: under
    torch.use_deterministic_algorithms(True) a forced cuda backward raises torch's error naming
    it (the forward runs), with warn_only=True it warns and returns the gradients, as torch's
    own nondeterministic kernels do (a fuzzing helper saw dq differ in its last bits between
    two calls under deterministic mode, silently)."""
    deterministic(False)
    grads = _backward_runs(op)
    with pytest.raises(RuntimeError, match="attnx's cuda .*backward"):
        grads()
    deterministic(True)
    grads = _backward_runs(op)
    with pytest.warns(UserWarning, match="attnx's cuda .*backward"):
        assert all(torch.isfinite(g).all() for g in grads())


def test_auto_passes_over_nondeterministic_backwards(deterministic, monkeypatch):
    """backend=None under deterministic algorithms takes the next backend in order for calls
    that record gradients (cuda's backwards are not deterministic), and still cuda for those
    that do not. Through the harness the cuda backend takes CPU tensors, so the CPU's order is
    made cuda's for the test."""
    if ON_CPU:
        monkeypatch.setitem(_dispatch._AUTO_ORDER, "cpu", ("cuda", "cpu", "reference"))
    after = "cpu" if ON_CPU else "triton"
    ins = [rand(*shape, dtype=BF16) for shape in ((1, 2, 9, 16), (1, 2, 11, 16), (1, 2, 11, 8),
                                                  (16,))]
    call = _validate.additive_call(*ins, None, 0.0, False, None, None, False)
    assert _dispatch.select("additive", call) == "cuda"
    deterministic(False)
    assert _dispatch.select("additive", call) == after
    with torch.no_grad():
        assert _dispatch.select("additive", call) == "cuda"
    frozen = dataclasses.replace(call, q=call.q.detach(), k=call.k.detach(),
                                 value=call.value.detach(), v=call.v.detach())
    assert _dispatch.select("additive", frozen) == "cuda"


def test_additive_opcheck():
    torch.manual_seed(23)
    q, k = rand(1, 2, 9, 16, dtype=torch.float16), rand(1, 2, 21, 16, dtype=torch.float16)
    value, v = rand(1, 2, 21, 8, dtype=torch.float16), rand(2, 16, dtype=torch.float16)
    torch.library.opcheck(OPS.additive_fwd, (q, k, value, v, None, -9, 21, 0.0, None, False))
    torch.library.opcheck(OPS.additive_fwd,
                          (q, k, value, v, None, -2, 0, 0.25, torch.tensor([1, 2]), True))


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_sizes_past_the_grid_raise_before_they_are_narrowed(dim):
    """A batch, head or length count of 2**32 + 3 (a stride-0 view: no memory) raises; narrowed
    to an int first, it would pass the grid check as 3 and run on a slice of the input."""
    shape = [1, 1, 1, 8]
    shape[dim] = 2**32 + 3
    q = torch.randn(1, 1, 1, 8, device=DEV, dtype=torch.float16).expand(*shape)
    with pytest.raises(RuntimeError, match="attnx cuda kernels: sequence lengths below 2\\^31"):
        OPS.sdpa_fwd(q, q, q, None, 0.125, -4, 4, 0.0, None)
    v = torch.randn(1, 8, device=DEV, dtype=torch.float16).expand(shape[1], 8)
    with pytest.raises(RuntimeError, match="attnx cuda kernels: sequence lengths below 2\\^31"):
        OPS.additive_fwd(q, q, q, v, None, -4, 4, 0.0, None, False)


def test_sdpa_many_heads_and_batches():
    """Many CTAs at once (the grid's y and z dims in use), vs the reference."""
    torch.manual_seed(24)
    b, h = gpu_or_cpu((16, 16), (5, 7))
    check_sdpa(rand(b, h, 64, 32, dtype=torch.float16), rand(b, h, 64, 32, dtype=torch.float16),
               rand(b, h, 64, 32, dtype=torch.float16), grads=False)


def test_sdpa_output_offsets_past_2_31_elements():
    """The forward's output offset (row of batch x head, times the head dim) passes 2**31
    elements here: computed in int (review bug 3) it wraps and the last batch's rows land
    elsewhere (or fault). Inputs are stride-0 views of one batch, so only the output is big
    (4 GiB); through the harness only the last CTA runs (`set_last_blocks`)."""
    torch.manual_seed(25)
    b, h, lq, lk, e = 16385, 2, 1024, 17, 64  # (b - 1) * h * lq * e == 2**31
    q1, k1, v1 = (torch.randn(1, h, n, e, device=DEV, dtype=torch.float16) for n in (lq, lk, lk))
    q, k, v = (t.expand(b, -1, -1, -1) for t in (q1, k1, v1))
    host = None
    if ON_CPU:
        from attnx import _cuda_host as host
        host.set_last_blocks(1)  # the CTA of rows 896..1023, head 1, batch b - 1
    try:
        out, lse = OPS.sdpa_fwd(q, k, v, None, e ** -0.5, -4096, 4096, 0.0, None)
    finally:
        if host is not None:
            host.set_last_blocks(0)
    rows = slice(lq - 128, lq)
    golden, golden_lse = OPS.sdpa_fwd(q1[:, 1:, rows], k1[:, 1:], v1[:, 1:], None, e ** -0.5,
                                      -4096, 4096, 0.0, None)
    torch.testing.assert_close(out[-1:, 1:, rows], golden, rtol=0, atol=0)
    torch.testing.assert_close(lse[-1:, 1:, rows], golden_lse, rtol=0, atol=0)


# Values near bf16's largest (3.39e38) over a few keys: the forward kernels' float32 sums P v
# passed float32's largest, and out came inf, or NaN after a rescale (found by fuzzing). Each
# result is held to the error of the same call on the values scaled down by 2^64 (exact in
# bf16), scaled back: the rest of this file holds those to the float64 reference.
BIG = 2.0 ** 64


def near_bf16_max(*shape):
    """bf16 values of magnitude 1.5e38-3.3e38, a fifth of them negative."""
    mag = 1.5e38 + 1.8e38 * torch.rand(*shape, dtype=torch.float64)
    return (mag * torch.where(torch.rand(*shape) < 0.2, -1.0, 1.0)).to(DEV, torch.bfloat16)


def assert_as_scaled_down(call, values, golden_call, what="out"):
    """call(values) vs golden_call (float64), within twice the error of call(values / 2^64) *
    2^64; the outputs only (call returns (out, ...) or out)."""
    first = lambda r: r[0] if isinstance(r, tuple) else r  # noqa: E731
    out = first(call(values))
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    base = first(call(values / BIG)).double() * BIG
    assert_within(out, first(golden_call()), base, what=what)


@pytest.mark.parametrize("e,lq,kw", [
    (64, 17, {}),
    (32, 130, dict(is_causal=True)),
    (128, 40, dict(dropout_p=0.3)),
    (256, 9, dict(softcap=30.0, alibi_slopes=0.05)),
    (96, 33, dict(sinks=True, window=(200, 5))),
])
def test_sdpa_values_near_the_bf16_max(e, lq, kw):
    """Several 64-key tiles of such values, GQA, through the plain and the modifier kernels: the
    rows whose O overflowed are redone in float64 (sdpa_fwd.cuh rerun_row)."""
    torch.manual_seed(40)
    hq, hkv, lk = 4, 2, 300
    q = rand(1, hq, lq, e, dtype=torch.bfloat16, grad=False)
    k = rand(1, hkv, lk, e, dtype=torch.bfloat16, grad=False)
    v = near_bf16_max(1, hkv, lk, e)
    kw = dict(kw, enable_gqa=True)
    if kw.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = torch.full((hq,), kw["alibi_slopes"], device=DEV)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.tensor([0.5, 3.0, -1.0, 8.0], device=DEV)
    sdpa = attnx.scaled_dot_product_attention
    assert_as_scaled_down(
        lambda vals: seeded(sdpa, 3, q, k, vals, backend="cuda", **kw), v,
        lambda: seeded(sdpa, 3, *(t.double() for t in (q, k, v)), backend="reference", **kw))


@pytest.mark.skipif(not ON_CPU, reason="a GPU launches the variant of its own arch")
def test_sdpa_values_near_the_bf16_max_below_sm90():
    """The same through the sm_80 variant (one row tile a warp, 8 warps), a bool mask."""
    from attnx import _cuda_host as host
    torch.manual_seed(41)
    q = rand(1, 2, 70, 64, dtype=torch.bfloat16, grad=False)
    k = rand(1, 2, 200, 64, dtype=torch.bfloat16, grad=False)
    v = near_bf16_max(1, 2, 200, 64)
    mask = torch.rand(1, 2, 70, 200, device=DEV) > 0.3
    sdpa = attnx.scaled_dot_product_attention
    host.set_sm90(False)
    try:
        assert_as_scaled_down(lambda vals: sdpa(q, k, vals, mask, backend="cuda"), v,
                              lambda: sdpa(q.double(), k.double(), v.double(), mask,
                                           backend="reference"))
        assert host.last_launch_threads() == 256
    finally:
        host.set_sm90(True)


def test_sdpa_rows_beside_an_overflowed_row_keep_their_accuracy():
    """Row 0 attends to keys of values near bf16's largest, the other rows of its tile (a float
    mask) to ordinary values: only row 0 is rerun, the others keep the tiles' result."""
    torch.manual_seed(42)
    lq, lk, e = 24, 256, 64
    q = rand(1, 1, lq, e, dtype=torch.bfloat16, grad=False)
    k = rand(1, 1, lk, e, dtype=torch.bfloat16, grad=False)
    v = torch.cat([near_bf16_max(1, 1, lk // 2, e), rand(1, 1, lk // 2, e, dtype=torch.bfloat16,
                                                          grad=False)], dim=2)
    mask = torch.full((lq, lk), -1e4, device=DEV, dtype=torch.bfloat16)
    mask[0, : lk // 2] = 0.0
    mask[1:, lk // 2:] = 0.0
    out = attnx.scaled_dot_product_attention(q, k, v, mask, backend="cuda")
    gold = attnx.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask.double(),
                                              backend="reference")
    base = lowp_sdpa(q, k, v, mask)
    assert torch.isfinite(out).all()
    assert_within(out[..., 1:, :], gold[..., 1:, :], base[..., 1:, :], what="ordinary rows")
    base0 = lowp_sdpa(q, k, v / BIG, mask).double() * BIG
    assert_within(out[..., :1, :], gold[..., :1, :], base0[..., :1, :], what="row 0")


def test_varlen_values_near_the_bf16_max():
    torch.manual_seed(43)
    cu_q = torch.tensor([0, 17, 50], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 150, 390], dtype=torch.int32, device=DEV)
    q = rand(50, 2, 64, dtype=torch.bfloat16, grad=False)
    k = rand(390, 2, 64, dtype=torch.bfloat16, grad=False)
    v = near_bf16_max(390, 2, 64)
    varlen = attnx.varlen_attention
    assert_as_scaled_down(
        lambda vals: varlen(q, k, vals, cu_q, cu_k, is_causal=True, backend="cuda"), v,
        lambda: varlen(q.double(), k.double(), v.double(), cu_q, cu_k, is_causal=True,
                       backend="reference"))


@pytest.mark.parametrize("capacity,sinks", [(300, False), (300, True), (32, True)])
def test_kvcache_values_near_the_bf16_max(capacity, sinks):
    """Decoding: 300 keys split across CTAs (merged by their lse), or 32 in one split (where the
    sink joins in the split kernel); the output rows stay normalised (decode.cu)."""
    torch.manual_seed(44)
    q = 0.1 * rand(2, 8, 2, 128, dtype=torch.bfloat16, grad=False)
    k_cache = rand(2, 2, capacity, 128, dtype=torch.bfloat16, grad=False)
    v_cache = near_bf16_max(2, 2, capacity, 128)
    lens = torch.tensor([capacity, capacity - 7], dtype=torch.int32, device=DEV)
    kw = dict(sinks=torch.linspace(-2, 4, 8, device=DEV)) if sinks else {}
    cache = attnx.attention_with_kvcache
    assert_as_scaled_down(
        lambda vals: cache(q, k_cache, vals, lens, backend="cuda", **kw), v_cache,
        lambda: cache(q.double(), k_cache.double(), v_cache.double(), lens, backend="reference",
                      **kw))


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_additive_values_near_the_bf16_max(dropout_p):
    """The output tile stays normalised (additive.cu). Values at 0.6 of those above: dropout's
    1 / (1 - p) may take an output that far past them."""
    torch.manual_seed(45)
    q = rand(2, 2, 20, 16, dtype=torch.bfloat16, grad=False)
    k = rand(2, 2, 150, 16, dtype=torch.bfloat16, grad=False)
    w = rand(2, 16, dtype=torch.bfloat16, grad=False)
    value = near_bf16_max(2, 2, 150, 32) * 0.6
    add = attnx.additive_attention
    assert_as_scaled_down(
        lambda vals: seeded(add, 6, q, k, vals, w, dropout_p=dropout_p, backend="cuda",
                            return_weights=True), value,
        lambda: seeded(add, 6, q.double(), k.double(), value.double(), w.double(),
                       dropout_p=dropout_p, backend="reference", return_weights=True))


def test_additive_dropout_with_values_near_the_bf16_max():
    """Dropout's 1 / (1 - p) joins the normalised output once, at the end: within the sums, the
    kept keys of the first tile took it to max|value| / (1 - p), past float32's largest, where
    the result is within bf16's (inf out; found by fuzzing). Values 3e38, p = 0.5: the rows whose
    result is in range."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, n, 16, generator=gen).to(DEV, torch.bfloat16) for n in (4, 130))
    w = torch.randn(16, generator=gen).to(DEV, torch.bfloat16)
    value = torch.full((1, 1, 130, 32), 3.0e38, device=DEV, dtype=torch.bfloat16)
    add = attnx.additive_attention
    gold = seeded(add, 0, q.double(), k.double(), value.double(), w.double(), dropout_p=0.5,
                  backend="reference")
    rows = gold.abs().amax(-1) < 3.38e38
    assert rows.sum() >= 2  # (rows 1 and 2 came out inf)
    out = seeded(add, 0, q, k, value, w, dropout_p=0.5, backend="cuda")
    base = seeded(add, 0, q, k, value / BIG, w, dropout_p=0.5, backend="cuda").double() * BIG
    assert_within(out[rows], gold[rows], base[rows])


# The backward of such values: dP = dO V^T and delta = rowsum(dO O) passed float32's largest in
# the key-block kernels' accumulators, and dS = P (dP z - delta) came out NaN (inf - inf, 0 inf),
# though dS, a probability times a difference, and so dQ and dK fit where attention spreads over
# many keys. The kernels flag a non-finite dK and sdpa_bwd_rerun.cu computes dQ, dK (dmask, delta)
# again in float64. Those gradients (and dsinks) are linear in V: each is held to the error of
# the call on V / 2^64, scaled back; dV does not involve V.
def grad_out_for(out, seed):
    """The output gradient the tests below take: 0.25 N(0, 1) (dP = dO V^T still overflows)."""
    gen = torch.Generator().manual_seed(seed)
    return (0.25 * torch.randn(out.shape, generator=gen, dtype=torch.float64)).to(DEV, out.dtype)


def assert_grads_as_scaled_down(call, inputs, v_at, seed=3, floors=None):
    """call(*inputs, backend=...) returns the output; the gradients of the inputs that require
    them (named by their index), cuda vs the float64 reference, within three times the error of
    the cuda call on inputs[v_at] / 2^64 (scaled back), or floors[index]."""

    def grads(tensors, backend):
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
        out = seeded(call, seed, *leaves, backend=backend)
        out.backward(grad_out_for(out, seed))
        return {n: t.grad for n, t in enumerate(leaves) if t.requires_grad}

    got = grads(inputs, "cuda")
    scaled = list(inputs)
    scaled[v_at] = inputs[v_at] / BIG
    base = grads(scaled, "cuda")
    gold = grads([t.double() if t.is_floating_point() else t for t in inputs], "reference")
    for n, g in got.items():
        assert gold[n].abs().max() < 3.3e38, f"grad {n}: past bf16's range in the case itself"
        back = 1.0 if n == v_at else BIG
        assert_within(g, gold[n], base[n].double() * back, factor=3.0,
                      floor=(floors or {}).get(n, 1e-5), what=f"grad {n}")


def sink_grad_floor(out, lse, dout, sinks, head_dim):
    """What the output's rounding to bf16 (2^-9 of each element) may move the sinks' gradient,
    -sum_i P_sink,i rowsum(dO_i O_i), by: the float64 rerun and the float32 kernels read outputs
    that differ in their last bits (a sum that cancels: the baseline's error can be far smaller).
    out, lse: the reference's (lse: out's dims but the last); head_dim: the heads' dim of lse."""
    view = [1] * lse.dim()
    view[head_dim] = -1
    p_sink = torch.exp(sinks.double().view(view) - lse.double())
    terms = p_sink * (dout.double().abs() * out.double().abs()).sum(-1)
    return 2.0 ** -8 * terms.sum(tuple(d for d in range(lse.dim()) if d != head_dim)).max().item()


@pytest.mark.parametrize("e,lq,kw", [
    (64, 17, {}),
    (32, 40, dict(is_causal=True)),
    (128, 24, dict(dropout_p=0.3)),
    (256, 9, dict(softcap=30.0, alibi_slopes=0.05)),
    (96, 20, dict(sinks=True, window=(200, 5))),
    (160, 12, dict(float_mask=True)),
    (64, 21, dict(bool_mask=True)),
    (64, 9, dict(huge_bias=True, sinks=True)),
])
def test_sdpa_backward_values_near_the_bf16_max(e, lq, kw):
    """GQA over 300 keys (several key blocks), through the 128-key (e = 64..128), 64-key and
    split (e > 128) variants, plain and with modifiers; a bool mask with a fully masked row, a
    float mask's gradient, the sinks' gradient; rows of huge lse (a bias of 5000: the rerun
    divides by its own scores' row sums there)."""
    torch.manual_seed(46)
    hq, hkv, lk = 4, 2, 300
    q = rand(1, hq, lq, e, dtype=torch.bfloat16)
    k = rand(1, hkv, lk, e, dtype=torch.bfloat16)
    v = near_bf16_max(1, hkv, lk, e).requires_grad_(True)
    kw = dict(kw, enable_gqa=True)
    inputs = [q, k, v]
    if kw.pop("float_mask", False):
        inputs.append(rand(1, hq, lq, lk, dtype=torch.bfloat16))
    if kw.pop("huge_bias", False):
        bias = torch.zeros(1, 1, lq, lk, device=DEV, dtype=torch.bfloat16)
        bias[..., ::2, :] = 5000.0
        inputs.append(bias)
    if kw.pop("bool_mask", False):
        mask = torch.rand(1, 1, lq, lk, device=DEV) > 0.3
        mask[..., 3, :] = False
        inputs.append(mask)
    if kw.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = torch.full((hq,), kw["alibi_slopes"], device=DEV)
    if kw.pop("sinks", False):
        inputs.append(torch.tensor([0.5, 3.0, -1.0, 8.0], device=DEV, requires_grad=True))

    def call(q, k, v, *rest, backend, return_lse=False):
        mask = rest[0] if rest and rest[0].dim() == 4 else None
        sinks = rest[-1] if rest and rest[-1].dim() == 1 else None
        extra = dict(sinks=sinks) if sinks is not None else {}
        return attnx.scaled_dot_product_attention(q, k, v, mask, backend=backend,
                                                  return_lse=return_lse, **kw, **extra)

    floors = {}
    if inputs[-1].dim() == 1:
        out, lse = seeded(call, 3, *(t.double() for t in inputs), backend="reference",
                          return_lse=True)
        floors[len(inputs) - 1] = sink_grad_floor(out, lse, grad_out_for(out, 3), inputs[-1],
                                                  head_dim=1)
    assert_grads_as_scaled_down(call, inputs, 2, floors=floors)


@pytest.mark.skipif(not ON_CPU, reason="a GPU launches the variant of its own arch")
def test_sdpa_backward_values_near_the_bf16_max_below_sm90():
    """The 64-key variant that sm_80 code takes at e = 64 (sm_90 takes 128 keys)."""
    from attnx import _cuda_host as host
    torch.manual_seed(47)
    q = rand(1, 2, 30, 64, dtype=torch.bfloat16)
    k = rand(1, 2, 200, 64, dtype=torch.bfloat16)
    v = near_bf16_max(1, 2, 200, 64).requires_grad_(True)
    host.set_sm90(False)
    try:
        assert_grads_as_scaled_down(
            lambda q, k, v, backend: attnx.scaled_dot_product_attention(
                q, k, v, is_causal=True, backend=backend), [q, k, v], 2)
    finally:
        host.set_sm90(True)


@pytest.mark.parametrize("kw", [{}, dict(is_causal=True, enable_gqa=True)])
def test_sdpa_backward_keys_near_the_bf16_max(kw):
    """Keys near bf16's largest sharing a common part, q tiny (scores ~1): dS ~ 2 and dK stay
    finite (nothing flags the rerun), but dQ = scale sum_j dS_ij k_j passes float32's largest in
    the kernels' sums (a single product dS k does), where sum_j dS_ij = 0 cancels the common part
    of the true dQ: NaN before the rerun's query pass redid the rows of dq_acc that came out
    non-finite. dQ, dK, dV within three times the error of the call on (q 2^64, k / 2^64): the
    same scores and dS, dQ / 2^64 and dK 2^64, scaled back."""
    gen = torch.Generator().manual_seed(49)
    hq, hkv, lq, lk, e = 2, 2 - bool(kw), 20, 300, 64

    def normal(*shape, std):
        return (std * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(DEV, torch.bfloat16)

    shared = 3.0e38 * torch.sign(torch.randn(1, hkv, 1, e, generator=gen, dtype=torch.float64))
    spread = torch.rand(1, hkv, lk, e, generator=gen, dtype=torch.float64) / 64 - 1 / 128
    k = (shared * (1 + spread)).to(DEV, torch.bfloat16)
    q, v = normal(1, hq, lq, e, std=2e-37), normal(1, hkv, lk, e, std=10.0)
    dout = normal(1, hq, lq, e, std=7.5)

    def grads(q, k, v, backend):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = attnx.scaled_dot_product_attention(*leaves, backend=backend, **kw)
        out.backward(dout.to(out.dtype))
        return [t.grad for t in leaves]

    got = grads(q, k, v, "cuda")
    base = grads(q * BIG, k / BIG, v, "cuda")
    gold = grads(q.double(), k.double(), v.double(), "reference")
    # The case: some product dS_ij k_jd past float32's largest, the true dQ inside bf16's range
    k64, v64 = (t.double().repeat_interleave(hq // hkv, 1) for t in (k, v))
    scores = q.double() @ k64.transpose(-1, -2) / 8
    if kw:
        scores = scores.masked_fill(~torch.ones(lq, lk, dtype=torch.bool, device=DEV).tril(lk - lq),
                                    -torch.inf)
    probs = torch.softmax(scores, -1)
    dp = dout.double() @ v64.transpose(-1, -2)
    ds = probs * (dp - (probs * dp).sum(-1, keepdim=True))
    assert (ds.abs().amax((-1, -2)) * k64.abs().amax((-1, -2))).max() > 3.5e38
    assert gold[0].abs().max() < 3.3e38
    for name, g, b, want, back in zip("qkv", got, base, gold, (BIG, 1 / BIG, 1.0)):
        assert_within(g, want, b.double() * back, factor=3.0, floor=0.0, what=f"d{name}")


@pytest.mark.parametrize("v_std", [1.0, 1e-3])
@pytest.mark.parametrize("hq", [1, 2])
def test_sdpa_backward_grad_out_near_the_bf16_max(hq, v_std):
    """dO near bf16's largest (3e38, 2^-7 spread), its sign flipping every 16 queries, over 3
    keys with P ~ 1/3: dV = sum_i P_ij dO_i passes float32's largest in the kernels' sums (16
    queries of one sign already do) where the true dV fits: NaN or inf before the key pass
    wrote dV again. v ~ 1: dP and delta overflow too; v ~ 1e-3: they do not, dV alone sets the
    flag. Every gradient is linear in dO: held to three times the error of the call on
    dO / 2^64, scaled back. hq = 2: GQA, dV summed over both query heads."""
    gen = torch.Generator().manual_seed(50)
    lq, lk, e = 64, 3, 64

    def normal(*shape, std):
        return (std * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(DEV, torch.bfloat16)

    q, k, v = normal(1, hq, lq, e, std=1e-3), normal(1, 1, lk, e, std=1e-3), normal(1, 1, lk, e, std=v_std)
    sign = 1.0 - 2.0 * (torch.arange(lq, dtype=torch.float64) // 16 % 2).view(lq, 1)
    spread = torch.rand(1, hq, lq, e, generator=gen, dtype=torch.float64) / 128
    dout = (3.0e38 * sign * (1 + spread)).to(DEV, torch.bfloat16)

    def grads(q, k, v, dout, backend):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = attnx.scaled_dot_product_attention(*leaves, backend=backend, enable_gqa=True)
        out.backward(dout.to(out.dtype))
        return [t.grad for t in leaves]

    got = grads(q, k, v, dout, "cuda")
    base = grads(q, k, v, dout / BIG, "cuda")
    gold = grads(q.double(), k.double(), v.double(), dout.double(), "reference")
    assert (dout[..., :16, :].double().sum(-2) / lk).abs().min() > 3.5e38  # the case
    for name, g, b, want in zip("qkv", got, base, gold):
        assert want.abs().max() < 3.3e38, f"d{name}: past bf16's range in the case itself"
        assert_within(g, want, b.double() * BIG, factor=3.0, floor=0.0, what=f"d{name}")


def test_varlen_backward_values_near_the_bf16_max():
    torch.manual_seed(48)
    cu_q = torch.tensor([0, 17, 50], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, 150, 390], dtype=torch.int32, device=DEV)
    q = rand(50, 2, 64, dtype=torch.bfloat16)
    k = rand(390, 2, 64, dtype=torch.bfloat16)
    v = near_bf16_max(390, 2, 64).requires_grad_(True)
    sinks = torch.tensor([1.0, -2.0], device=DEV, requires_grad=True)

    def call(q, k, v, sinks, backend, return_lse=False):
        return attnx.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, sinks=sinks,
                                      backend=backend, return_lse=return_lse)

    out, lse = call(q.double(), k.double(), v.double(), sinks, "reference", return_lse=True)
    floor = sink_grad_floor(out.transpose(0, 1), lse, grad_out_for(out, 3).transpose(0, 1), sinks,
                            head_dim=0)
    assert_grads_as_scaled_down(call, [q, k, v, sinks], 2, floors={3: floor})


@pytest.mark.parametrize("a,kw", [
    (16, {}),
    (16, dict(window=(None, 0), float_mask=True)),
    (300, dict(dropout_p=0.25, float_mask=True)),
    (32, dict(window=(40, 3), weights=True)),
    (16, dict(huge_bias=True, dropout_p=0.25)),
])
def test_additive_backward_values_near_the_bf16_max(a, kw):
    """The additive backward's float64 rerun (additive_bwd_rerun.cu): over two A chunks (a = 300),
    with dropout, a float mask's gradient (a causal band: row 0's one key, whose dS the rerun
    finds 0 where the first pass's was NaN), a band, a loss on the returned weights too, and
    rows padded by bf16's most negative value (their lse keeps no log(l): the rerun divides
    by its own scores' row sums there)."""
    torch.manual_seed(49)
    q = rand(1, 2, 12, a, dtype=torch.bfloat16)
    k = rand(1, 2, 150, a, dtype=torch.bfloat16)
    w = rand(2, a, dtype=torch.bfloat16)
    value = (0.5 * near_bf16_max(1, 2, 150, 32)).requires_grad_(True)
    inputs = [q, k, value, w]
    if kw.pop("float_mask", False):
        inputs.append(rand(1, 2, 12, 150, dtype=torch.bfloat16))
    if kw.pop("huge_bias", False):
        inputs.append(huge_bias_mask(1, 12, 150, torch.bfloat16).requires_grad_())
    weights = kw.pop("weights", False)

    def call(q, k, value, w, *mask, backend):
        res = attnx.additive_attention(q, k, value, w, *mask, backend=backend,
                                       return_weights=weights, **kw)
        return torch.cat([res[0].flatten(), res[1].flatten()]) if weights else res

    assert_grads_as_scaled_down(call, inputs, 2)


@pytest.mark.parametrize("value_std", [1.0, 1e-3])
def test_additive_backward_grad_out_near_the_bf16_max(value_std):
    """dO near bf16's largest (3e38, 2^-7 spread), its sign flipping every 16 queries, over 3
    keys with P ~ 1/3 (q, k, w small): dvalue = sum_i P_ij dO_i passes float32's largest in the
    kernel's sums where the true dvalue fits: NaN or inf before the key pass wrote dvalue again.
    value ~ 1: dPd and delta overflow too (v's gradient NaN); value ~ 1e-3: they do not, a
    non-finite dvalue alone sets the flag. Every gradient is linear in dO: held to three times
    the error of the call on dO / 2^64, scaled back."""
    gen = torch.Generator().manual_seed(51)
    lq, lk, a, ev = 64, 3, 40, 24

    def normal(*shape, std):
        return (std * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(DEV, torch.bfloat16)

    q, k, w = normal(1, 2, lq, a, std=1e-3), normal(1, 2, lk, a, std=1e-3), normal(2, a, std=1e-3)
    value = normal(1, 2, lk, ev, std=value_std)
    sign = 1.0 - 2.0 * (torch.arange(lq, dtype=torch.float64) // 16 % 2).view(lq, 1)
    spread = torch.rand(1, 2, lq, ev, generator=gen, dtype=torch.float64) / 128
    dout = (3.0e38 * sign * (1 + spread)).to(DEV, torch.bfloat16)

    def grads(dout, backend, dtype=torch.bfloat16):
        leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, value, w)]
        attnx.additive_attention(*leaves, backend=backend).backward(dout.to(dtype))
        return [t.grad for t in leaves]

    got, base = grads(dout, "cuda"), grads(dout / BIG, "cuda")
    gold = grads(dout, "reference", torch.float64)
    assert (dout[..., :16, :].double().sum(-2) / lk).abs().min() > 3.5e38  # the case
    for name, g, b, want in zip(("dq", "dk", "dvalue", "dw"), got, base, gold):
        assert want.abs().max() < 3.3e38, f"{name}: past bf16's range in the case itself"
        assert_within(g, want, b.double() * BIG, factor=3.0, floor=0.0, what=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_second_order_gradients_match_the_reference(dtype):
    """A backward with create_graph=True recomputes on the reference backend (attnx/
    _second_order.py), through each cuda formula: the Hessian-vector products are the
    reference's."""
    torch.manual_seed(0)
    q = rand(1, 2, 5, 16, dtype=dtype)
    k, v = rand(1, 2, 6, 16, dtype=dtype, grad=False), rand(1, 2, 6, 16, dtype=dtype, grad=False)
    w, sinks = rand(16, dtype=dtype, grad=False), rand(2, dtype=torch.float32, grad=False)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEV)
    calls = (lambda q, b: attnx.scaled_dot_product_attention(q, k, v, is_causal=True, backend=b),
             lambda q, b: attnx.scaled_dot_product_attention(q, k, v, sinks=sinks, softcap=5.0,
                                                             backend=b),
             lambda q, b: attnx.additive_attention(q, k, v, w, backend=b),
             lambda q, b: attnx.varlen_attention(q[0].transpose(0, 1), k[0, :, :5].transpose(0, 1),
                                                 v[0, :, :5].transpose(0, 1), cu, cu, backend=b),
             lambda q, b: attnx.varlen_attention(q[0].transpose(0, 1), k[0, :, :5].transpose(0, 1),
                                                 v[0, :, :5].transpose(0, 1), cu, cu, sinks=sinks,
                                                 backend=b))
    for fn in calls:
        c = torch.randn(fn(q, "reference").shape, device=DEV, dtype=dtype)
        hessian_vector = []
        for backend in ("cuda", "reference"):
            # (a loss linear in the output: the same grad_out whatever each forward rounded)
            g, = torch.autograd.grad((fn(q, backend) * c).sum(), q, create_graph=True)
            hessian_vector.append(torch.autograd.grad(g.float().pow(2).sum(), q)[0])
        torch.testing.assert_close(*hessian_vector)
