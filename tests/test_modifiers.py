"""The score modifiers softcap, alibi_slopes and sinks (API.md, "Score modifiers").

The golden value is the contract's formula written out here in float64 with plain torch ops
(not the reference backend): scores scaled, soft-capped, ALiBi subtracted, the mask added (or
applied), the band applied, the sink column joining the softmax. Errors are bounded by a small
multiple of what the same formula makes in the tested dtype (tests/_compare.py). Gradients
include q, k, v, a float mask and the sinks.

The triton backend runs a few representative cases of each test (TRITON_CASES): in Triton's
interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU), which
runs every program in Python, or on CUDA tensors with a GPU. The cuda backend (float16 and
bfloat16 only) runs its own cases below ("cuda backend"): on CUDA tensors with a GPU, else
through the host harness (ATTNX_CUDA_ON_CPU=1, csrc/cuda/host/) on CPU tensors.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import attnx
from attnx import _dispatch, _ops, _rng, _validate
from tests._backends import ON_GPU, cuda_reason, device
from tests._compare import assert_within, ulp_floor
from tests._rerun import rerun_under, skip_unless_avx512

HAS_CPU_KERNELS = _ops.has_kernel("sdpa_mod_fwd", "CPU") and _ops.has_kernel("kvcache_mod_fwd", "CPU")
HAS_TRITON = _dispatch.backends()["triton"].usable
MARKS = {
    "reference": [],
    "cpu": [pytest.mark.skipif(not HAS_CPU_KERNELS, reason="attnx._C is not built")],
    "triton": [pytest.mark.skipif(not HAS_TRITON, reason=_dispatch.backends()["triton"].reason)],
    "cuda": [pytest.mark.skipif(cuda_reason() is not None, reason=str(cuda_reason()))],
}
BACKENDS = [pytest.param(b, marks=MARKS[b]) for b in ("reference", "cpu")]
TRITON = pytest.param("triton", marks=MARKS["triton"])
FLOORS = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
HALF = (torch.float16, torch.bfloat16)


def cases(backends, *axes):
    """pytest params (backend, *combination) of each backend with every combination of axes."""
    return [pytest.param(b, *combo, marks=MARKS[b])
            for b in backends for combo in itertools.product(*axes)]


def to(dev, mods: dict) -> dict:
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in mods.items()}


def golden_attention(q, k, v, mask=None, *, is_causal=False, window=None, scale=None,
                     softcap=None, slopes=None, sinks=None, keep=None, dropout_p=0.0,
                     offset=0):
    """(out, lse) of the formula in q's dtype. q (B, Hq, Lq, E), k/v (B, Hkv, Lk, *); query i's
    diagonal is key i + offset (0: SDPA's top-left alignment); keep: the dropout mask."""
    b, hq, lq, e = q.shape
    lk = k.shape[2]
    groups = hq // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(e) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    diag = torch.arange(lq).view(lq, 1) + offset
    j = torch.arange(lk).view(1, lk)
    if slopes is not None:
        s = s - slopes.to(s.dtype).reshape(-1, hq, 1, 1) * (diag - j).abs().to(s.dtype)
    allowed = torch.ones(lq, lk, dtype=torch.bool)
    if is_causal:
        allowed = allowed & (j <= diag)
    if window is not None:
        left, right = window
        if left is not None:
            allowed = allowed & (j >= diag - left)
        if right is not None:
            allowed = allowed & (j <= diag + right)
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            s = s + mask
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype).view(1, hq, 1, 1).expand(b, hq, lq, 1)], -1)
    # A row without any admissible term is all -inf: zeros for it, lse -inf, and no
    # exp(-inf - -inf) in the forward or the backward
    empty = (s == float("-inf")).all(-1, keepdim=True)
    s = s.masked_fill(empty, 0.0)
    lse = torch.logsumexp(s, -1, keepdim=True)
    # softmax, not exp(s - lse): a row whose terms all sit at a huge bias has an lse rounded to
    # that bias, exp(s - lse) would give each 1
    p = torch.softmax(s, -1).masked_fill(empty, 0.0)[..., :lk]
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    return p @ v, lse.masked_fill(empty, float("-inf")).squeeze(-1)


def _inputs(b, hq, hkv, lq, lk, e, ev, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, e, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, lk, e, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, lk, ev, generator=g, dtype=torch.float64)
    dout = torch.randn(b, hq, lq, ev, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _modifiers(hq, b, which, seed=3):
    g = torch.Generator().manual_seed(seed)
    mods = {}
    if "softcap" in which:
        mods["softcap"] = 1.5  # small enough that tanh bends the scores of randn inputs
    if "alibi" in which:
        mods["alibi_slopes"] = torch.rand(hq, generator=g) * 0.5
    if "alibi_batch" in which:
        mods["alibi_slopes"] = torch.rand(b, hq, generator=g) * 0.5
    if "sinks" in which:
        mods["sinks"] = torch.randn(hq, generator=g, dtype=torch.float64) * 2
    return mods


NAMES = ("out", "lse", "dq", "dk", "dv", "dmask", "dsinks")


def _grads(out, lse, dout, leaves, dlse):
    (out * dout).sum().backward(retain_graph=True) if dlse is None else (
        (out * dout).sum() + (lse.nan_to_num(neginf=0.0) * dlse).sum()).backward()
    return [t.grad if t is not None else None for t in leaves]


def _leaves(dtype, q, k, v, mask, mods, dev="cpu"):
    qkv = [t.detach().to(dev, dtype).requires_grad_() for t in (q, k, v)]
    m = None if mask is None else mask.to(dev)
    if mask is not None and mask.dtype != torch.bool:
        m = mask.detach().to(dev, dtype).requires_grad_()
    mods = to(dev, mods)
    if "sinks" in mods:
        mods["sinks"] = mods["sinks"].detach().to(dtype).requires_grad_()
    return qkv, m, mods


def _golden(dtype, q, k, v, dout, mask, mods, kw, dlse, seed):
    (ql, kl, vl), m, md = _leaves(dtype, q, k, v, mask, mods)
    keep = None
    if kw.get("dropout_p", 0.0) > 0:
        torch.manual_seed(seed)
        keep = _rng.keep_mask(_rng.draw_seed(), q.shape[0], q.shape[1], q.shape[2], k.shape[2],
                              kw["dropout_p"], q.device)
    out, lse = golden_attention(ql, kl, vl, m, is_causal=kw.get("is_causal", False),
                                window=kw.get("window"), scale=kw.get("scale"),
                                softcap=md.get("softcap"), slopes=md.get("alibi_slopes"),
                                sinks=md.get("sinks"), keep=keep,
                                dropout_p=kw.get("dropout_p", 0.0))
    grads = _grads(out, lse, dout.to(dtype), [ql, kl, vl, m, md.get("sinks")],
                   None if dlse is None else dlse.to(dtype))
    return [out.detach(), lse.detach(), *grads]


def _actual(backend, dtype, q, k, v, dout, mask, mods, kw, dlse, seed):
    dev = device(backend)
    (ql, kl, vl), m, md = _leaves(dtype, q, k, v, mask, mods, dev)
    torch.manual_seed(seed)
    out, lse = attnx.scaled_dot_product_attention(
        ql, kl, vl, attn_mask=m, enable_gqa=q.shape[1] != k.shape[1], backend=backend,
        return_lse=True, **md, **kw)
    grads = _grads(out, lse, dout.to(dev, dtype), [ql, kl, vl, m, md.get("sinks")],
                   None if dlse is None else dlse.to(dev, dtype))
    return [None if t is None else t.detach().cpu() for t in (out, lse, *grads)]


def _least(floor, dtype, golden) -> float:
    """An error bound's floor: FLOORS' for None, 4 ulp of the golden's largest for "ulps"."""
    if floor == "ulps":
        return ulp_floor(golden, dtype)
    return FLOORS[dtype] if floor is None else floor


def check(backend, dtype, q, k, v, dout, mask=None, mods=None, dlse=None, factor=3.0,
          floor=None, slack=None, **kw):
    """The backend in `dtype` against the float64 formula, bounded by the formula's own error
    in `dtype` (at least `floor`: _least's; for the outputs `slack` names, at least its value);
    returns the backend's (out, lse, dq, dk, dv, dmask, dsinks)."""
    mods = mods or {}
    seed = 11
    golden = _golden(torch.float64, q, k, v, dout, mask, mods, kw, dlse, seed)
    baseline = _golden(dtype, q, k, v, dout, mask, mods, kw, dlse, seed)
    actual = _actual(backend, dtype, q, k, v, dout, mask, mods, kw, dlse, seed)
    for name, a, g, bl in zip(NAMES, actual, golden, baseline):
        if g is None:
            assert a is None, name
            continue
        if name == "lse":  # -inf on empty rows must match exactly
            assert torch.equal(torch.isinf(a), torch.isinf(g)), name
            a, g, bl = (t.float().nan_to_num(neginf=0.0) for t in (a, g, bl))
        least = max(_least(floor, dtype, g), (slack or {}).get(name, 0.0))
        assert_within(a, g, bl, factor=factor, floor=least, what=name)
    return actual


def rounded_out_slack(dtype, q, k, v, dout, mods, seed=11, **kw) -> torch.Tensor:
    """Per head, what dsinks may err by where D = rowsum(dO * O) takes the kernel's own O,
    rounded to `dtype` (flash-attention's design, the GPU backends'): dsinks_h =
    -sum_i P_sink,hi D_hi, so an O off by e_i moves it by sum_i P_sink,hi |dO_i . e_i|; with e_i
    the error of the formula's own O in `dtype`."""
    gold = _golden(torch.float64, q, k, v, dout, None, mods, kw, None, seed)
    base = _golden(dtype, q, k, v, dout, None, mods, kw, None, seed)
    p_sink = torch.exp(mods["sinks"].view(1, -1, 1) - gold[1])  # (B, Hq, Lq)
    moved = (dout.to(dtype).double() * (base[0].double() - gold[0])).sum(-1).abs()
    return (p_sink * moved).sum((0, 2))


SHAPES = [  # b, hq, hkv, lq, lk, e, ev
    (1, 1, 1, 1, 1, 16, 16),
    (2, 3, 3, 17, 97, 16, 16),
    (1, 2, 2, 97, 17, 32, 24),
    (1, 4, 2, 33, 45, 20, 12),  # GQA, Ev != E, dims off the 16-wide panels
]
WHICH = {
    "softcap": ("softcap",),
    "alibi": ("alibi",),
    "alibi_batch": ("alibi_batch",),
    "sinks": ("sinks",),
    "all": ("softcap", "alibi", "sinks"),
    "all_batch": ("softcap", "alibi_batch", "sinks"),
}
MODES = {
    "none": {},
    "causal": dict(is_causal=True),
    "window": dict(window=(7, 3)),
    "causal_window": dict(is_causal=True, window=(5, None), scale=0.3),
}


# The interpreter takes seconds per call: triton runs the shapes but the largest with all three
# modifiers; test_with_causal_and_window takes each alone, test_with_masks_and_lse_gradient
# per-batch slopes.
@pytest.mark.parametrize("backend,shape,which", cases(["reference", "cpu"], SHAPES, WHICH)
                         + cases(["triton"], SHAPES[:1] + SHAPES[2:], ["all"]),
                         ids=str)
def test_each_modifier_and_all(backend, shape, which):
    q, k, v, dout = _inputs(*shape)
    check(backend, torch.float32, q, k, v, dout, mods=_modifiers(shape[1], shape[0], WHICH[which]))


@pytest.mark.parametrize("backend,mode,which",
                         cases(["reference", "cpu"], MODES, ["softcap", "alibi", "sinks", "all"])
                         + [pytest.param("triton", m, w, marks=MARKS["triton"]) for m, w in
                            (("causal", "softcap"), ("window", "alibi"),
                             ("causal_window", "sinks"))])
def test_with_causal_and_window(backend, mode, which):
    b = 1 if backend == "triton" else 2  # the interpreter runs each program in Python
    q, k, v, dout = _inputs(b, 4, 2, 37, 53, 16, 16)
    check(backend, torch.float32, q, k, v, dout, mods=_modifiers(4, b, WHICH[which]),
          **MODES[mode])


def _mask(kind, b, h, lq, lk):
    g = torch.Generator().manual_seed(1)
    shape = (b, h, lq, lk) if kind.endswith("full") else (lq, lk)
    if kind.startswith("bool"):
        return torch.rand(shape, generator=g) > 0.3
    return torch.randn(shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("backend,kind,which",
                         cases(["reference", "cpu"], ["bool_full", "bool_row", "float_full",
                                                      "float_row"], ["all"])
                         + cases(["triton"], ["bool_row"], ["all"])
                         + cases(["triton"], ["float_full"], ["all_batch"]))
def test_with_masks_and_lse_gradient(backend, kind, which):
    b, h, lq, lk = 2, 3, 29, 41
    q, k, v, dout = _inputs(b, h, h, lq, lk, 16, 16)
    dlse = torch.randn(b, h, lq, dtype=torch.float64)
    check(backend, torch.float32, q, k, v, dout, mask=_mask(kind, b, h, lq, lk),
          mods=_modifiers(h, b, WHICH[which]), dlse=dlse)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["alibi", "sinks", "all"])
def test_float64(backend, which):
    q, k, v, dout = _inputs(1, 2, 1, 23, 31, 8, 8)
    mask = _mask("float_row", 1, 2, 23, 31)
    check(backend, torch.float64, q, k, v, dout, mask=mask, mods=_modifiers(2, 1, WHICH[which]),
          is_causal=False, window=(4, 9))


@pytest.mark.parametrize("backend", BACKENDS + [TRITON])
def test_dropout_reproducible(backend):
    """Dropout draws the same hash mask as the formula's (attnx/_rng.py), seeded alike."""
    q, k, v, dout = _inputs(1, 2, 2, 31, 40, 16, 16)
    mods = _modifiers(2, 1, WHICH["all"])
    first = check(backend, torch.float32, q, k, v, dout, mods=mods, dropout_p=0.3)
    again = _actual(backend, torch.float32, q, k, v, dout, None, mods, dict(dropout_p=0.3),
                    None, 11)
    for name, a, b in zip(NAMES, first, again):
        assert a is None and b is None or torch.equal(a, b), name


@pytest.mark.parametrize("backend,with_sinks,dtype",
                         cases(["reference", "cpu", "triton"], [False, True], [torch.float32])
                         + cases(["cuda"], [False, True], HALF), ids=str)
def test_fully_masked_rows(backend, with_sinks, dtype):
    """Rows with no admissible key give zeros and zero gradients; their lse is -inf, or the
    sink with sinks (the sink in q's dtype, as the kernels take it)."""
    b, h, lq, lk = 1, 2, 9, 13
    e = 64 if backend == "cuda" else 16  # cuda: a head-dim family of its own
    q, k, v, dout = _inputs(b, h, h, lq, lk, e, e)
    mask = torch.rand(b, h, lq, lk, generator=torch.Generator().manual_seed(4)) > 0.5
    mask[:, :, 2] = False
    mask[:, 1, 5] = False
    which = ("softcap", "alibi", "sinks") if with_sinks else ("softcap", "alibi")
    mods = _modifiers(h, b, which)
    out, lse, dq, *_, dsinks = check(backend, dtype, q, k, v, dout, mask=mask, mods=mods,
                                     dlse=torch.randn(b, h, lq, dtype=torch.float64))
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert torch.equal(dq[:, :, 2], torch.zeros_like(dq[:, :, 2]))
    if with_sinks:
        torch.testing.assert_close(lse[:, :, 2], mods["sinks"].to(dtype).float().expand(b, h))
        assert dsinks is not None and torch.isfinite(dsinks).all()
    else:
        assert (lse[:, :, 2] == float("-inf")).all()


@pytest.mark.parametrize("backend,dtype", cases(["reference", "cpu", "triton"], [torch.float32])
                         + cases(["cuda"], [torch.bfloat16]), ids=str)
def test_minus_infinity_sinks_are_no_sinks(backend, dtype):
    """A sink of -inf adds exp(-inf) = 0 to its head's sums: the head's results are those of no
    sink, its empty rows zeros with lse -inf and zero gradients, the sink's gradient 0 (the
    kernels took exp(-inf - -inf) = NaN for an empty row: NaN lse, then NaN dK, dV for every
    key of the head; the reference a NaN row)."""
    b, h, lq, lk = 1, 2, 9, 13
    e = 64 if backend == "cuda" else 16
    q, k, v, dout = _inputs(b, h, h, lq, lk, e, e)
    mask = torch.rand(b, h, lq, lk, generator=torch.Generator().manual_seed(4)) > 0.5
    mask[:, :, 2] = False
    sinks = torch.tensor([float("-inf"), 0.5], dtype=torch.float64)
    dlse = torch.randn(b, h, lq, dtype=torch.float64)
    out, lse, dq, dk, dv, _, dsinks = check(backend, dtype, q, k, v, dout, mask=mask,
                                            mods=dict(sinks=sinks), dlse=dlse)
    for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv), ("dsinks", dsinks)):
        assert not t.isnan().any(), name
    assert torch.equal(out[:, 0, 2], torch.zeros_like(out[:, 0, 2]))
    assert (lse[:, 0, 2] == float("-inf")).all() and dsinks[0] == 0
    none = check(backend, dtype, q[:, :1], k[:, :1], v[:, :1], dout[:, :1], mask=mask[:, :1],
                 dlse=dlse[:, :1])
    for name, with_sink, without in zip(NAMES[:5], (out, lse, dq, dk, dv), none):
        torch.testing.assert_close(with_sink[:, :1], without, msg=name)


@pytest.mark.parametrize("backend", BACKENDS + [TRITON])
def test_varlen_minus_infinity_sinks(backend):
    """Packed sequences, the first with no key, under sinks of -inf and 0.5: no NaN out or in
    the gradients, and the -inf sink's gradient 0 (the triton backward's exp(sink - lse) was
    NaN on the keyless rows)."""
    dev = device(backend)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, 2, 16, generator=g, device=dev).requires_grad_() for n in (10, 7, 7))
    sinks = torch.tensor([float("-inf"), 0.5], device=dev, requires_grad=True)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=dev) for c in ([0, 4, 10], [0, 0, 7]))
    out, lse = attnx.varlen_attention(q, k, v, cu_q, cu_k, sinks=sinks, window=(1, 1),
                                      backend=backend, return_lse=True)
    (out.sum() + lse.nan_to_num(neginf=0.0).sum()).backward()
    assert (lse[0, :4] == float("-inf")).all() and (out[:4, 0] == 0).all()
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert not t.isnan().any(), name
    assert sinks.grad[0] == 0 and torch.isfinite(sinks.grad).all()


@pytest.mark.parametrize("backend", BACKENDS + [TRITON])
def test_fully_masked_rows_with_sinks_below_exp_range(backend):
    """Sinks past exp's float64 range (-1000, -800): an empty row's lse is its sink and its
    output 0 (the reference once took the row's max from its zeroed scores and gave 0 / 0)."""
    q, k, v, dout = _inputs(1, 2, 2, 9, 13, 16, 16)
    mask = torch.rand(1, 2, 9, 13, generator=torch.Generator().manual_seed(4)) > 0.5
    mask[:, :, 2] = False
    mods = dict(sinks=torch.tensor([-1000.0, -800.0], dtype=torch.float64))
    out, lse, *_ = check(backend, torch.float32, q, k, v, dout, mask=mask, mods=mods,
                         dlse=torch.randn(1, 2, 9, dtype=torch.float64))
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert torch.equal(lse[0, :, 2], torch.tensor([-1000.0, -800.0]))


@pytest.mark.parametrize("backend", BACKENDS + [TRITON])
@pytest.mark.parametrize("varlen", [False, True], ids=["sdpa", "varlen"])
def test_a_sink_holding_nearly_all_weight_keeps_the_gradients(backend, varlen):
    """Sinks 60 and 200 above scores ~1 (a head whose sink takes the row): every key's P is
    ~1e-26 (a normal float32) or ~1e-87 (0 in float32). The cpu backward took P from
    exp(s - lse), which its vector exp floors at 2^-64: dq, dk, dv came out 0 for the first
    head, not ~1e-26. Each gradient is checked against float64 relative to its own largest
    value; the second head's are 0 and finite, d sinks too."""
    q, k, v, dout = _inputs(1, 2, 2, 5, 5, 8, 8, seed=3)
    sinks = torch.tensor([60.0, 200.0], dtype=torch.float64)
    cu = torch.tensor([0, 5], dtype=torch.int32)

    def grads(dtype, be):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, sinks)]
        ql, kl, vl, sl = leaves
        if varlen:
            ql, kl, vl = (t[0].transpose(0, 1) for t in (ql, kl, vl))
            out = attnx.varlen_attention(ql, kl, vl, cu, cu, is_causal=True, sinks=sl, backend=be)
            out = out.transpose(0, 1).unsqueeze(0)
        else:
            out = attnx.scaled_dot_product_attention(ql, kl, vl, is_causal=True, sinks=sl,
                                                     backend=be)
        return torch.autograd.grad(out, leaves, dout.to(dtype))

    got, want = grads(torch.float32, backend), grads(torch.float64, "reference")
    for g, w in zip(got[:3], want[:3]):
        assert torch.isfinite(g).all()
        head0 = (g[:, :1].double() - w[:, :1]).abs().max()
        assert 0 < w[:, :1].abs().max() < 1e-20 and head0 <= 1e-4 * w[:, :1].abs().max()
        assert g[:, 1:].abs().max() < 1e-30
    assert torch.isfinite(got[3]).all()
    assert (got[3].double() - want[3]).abs().max() <= 1e-4 * want[3].abs().max()


@pytest.mark.parametrize("backend", BACKENDS + [TRITON])
def test_no_nan_from_extreme_finite_inputs(backend):
    """A huge sink, huge scores under a small softcap, a -1e30 float mask: finite everywhere."""
    q, k, v, dout = _inputs(1, 2, 2, 9, 11, 8, 8)
    q = q * 1e3
    mask = torch.zeros(9, 11, dtype=torch.float64)
    mask[3] = -1e30
    sinks = torch.tensor([500.0, -500.0], dtype=torch.float64)
    check(backend, torch.float32, q, k, v, dout, mask=mask,
          mods=dict(softcap=2.0, sinks=sinks, alibi_slopes=torch.tensor([0.5, 100.0])))


@pytest.mark.parametrize("backend", BACKENDS + [TRITON, pytest.param("cuda", marks=MARKS["cuda"])])
def test_softcap_below_float32_range(backend):
    """A cap float32 cannot hold (1e-50) still caps: every score ~0, uniform weights (it once
    rounded to 0, which the kernels read as no cap)."""
    q, k, v, _ = _inputs(1, 2, 2, 9, 11, 16, 16)
    dtype = torch.float32 if backend in ("reference", "cpu") else torch.bfloat16
    (ql, kl, vl), _, _ = _leaves(dtype, q, k, v, None, {}, device(backend))
    out = attnx.scaled_dot_product_attention(ql * 8, kl, vl, softcap=1e-50, backend=backend)
    uniform = v.double().mean(dim=2, keepdim=True).expand(-1, -1, 9, -1)
    assert (out.cpu().double() - uniform).abs().max() < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("backend", BACKENDS + [TRITON])
def test_softcap_far_above_the_scores(backend):
    """A cap of 500 over scores ~1: tanh(s / cap) in its linear part, where a tanh of absolute
    error eps (Triton's exp form) errs by ~eps cap a score, torch's by ~eps |s|; out erred 10x
    torch's float32 error until common.tanh took its exact branch. The floor is a few ulp of
    the largest value (FLOORS' 1e-5 would pass it)."""
    q, k, v, dout = _inputs(1, 2, 2, 33, 40, 32, 16)
    check(backend, torch.float32, q, k, v, dout, mods=dict(softcap=500.0), floor="ulps",
          is_causal=True)


@pytest.mark.parametrize("backend,dtype,cap", cases(["reference", "cpu", "triton"], HALF,
                                                   [1e6, 1e30]), ids=str)
def test_half_precision_softcap_far_above_the_scores(backend, dtype, cap):
    """fp16/bf16 under a cap far above the scores: the exp form's tanh, the one Triton keeps
    for 16-bit inputs under usual caps, errs by ~eps cap a score (5x the bound at 1e6, every
    score 0 at 1e30); past common.EXACT_TANH_CAP the kernels take the exact branch."""
    q, k, v, dout = _inputs(1, 2, 2, 33, 40, 32, 16)
    check(backend, dtype, q, k, v, dout, mods=dict(softcap=cap), is_causal=True)


@pytest.mark.parametrize("backend", BACKENDS + [TRITON])
def test_bfloat16_and_sinks_in_float32(backend):
    """bfloat16 inputs with float32 sinks (a model's float32 parameter): its gradient comes back
    in float32."""
    q, k, v, dout = _inputs(1, 2, 2, 17, 19, 16, 16)
    mods = to(device(backend), _modifiers(2, 1, WHICH["all"]))
    (ql, kl, vl), _, _ = _leaves(torch.bfloat16, q, k, v, None, {}, device(backend))
    sinks = mods.pop("sinks").float().requires_grad_()
    out = attnx.scaled_dot_product_attention(ql, kl, vl, sinks=sinks, backend=backend, **mods)
    out.float().mul(dout.to(out.device).float()).sum().backward()
    assert out.dtype == torch.bfloat16 and sinks.grad.dtype == torch.float32
    golden, _ = golden_attention(q, k, v, sinks=sinks.detach().cpu().double(), **{
        "softcap": mods["softcap"], "slopes": mods["alibi_slopes"].cpu()})
    assert (out.cpu().double() - golden).abs().max() < 3e-2


@pytest.mark.parametrize("backend,dtype", cases(["reference", "cpu", "triton"],
                                               [torch.float16, torch.bfloat16]), ids=str)
def test_half_precision(backend, dtype):
    """fp16/bf16 (the backends that take them) against the formula's own error in the dtype:
    GQA, a float mask and its gradient, a causal window, Lq != Lk."""
    b, hq, hkv, lq, lk = 1, 4, 2, 17, 40
    q, k, v, dout = _inputs(b, hq, hkv, lq, lk, 16, 16)
    check(backend, dtype, q, k, v, dout, mask=_mask("float_row", b, hq, lq, lk),
          mods=_modifiers(hq, b, WHICH["all"]), dlse=torch.randn(b, hq, lq, dtype=torch.float64),
          window=(20, 0))


# ----------------------------------------------------------------------------- cuda backend
# float16 and bfloat16 only; head dims in the families 32, 64 and 160 (the wide backward); the
# harness runs each case in about a second at these sizes.

CUDA_SHAPES = [  # b, hq, hkv, lq, lk, e, ev (96-128: test_cuda_backward_with_modifiers_...)
    (1, 1, 1, 1, 1, 16, 16),
    (2, 3, 3, 17, 97, 64, 64),
    (1, 4, 2, 97, 17, 160, 150),  # GQA, Lq > Lk, Ev != E, the wide backward
]


@pytest.mark.parametrize("backend,shape,which,dtype",
                         cases(["cuda"], CUDA_SHAPES, ["softcap", "alibi", "alibi_batch", "sinks"],
                               [torch.float16])
                         + cases(["cuda"], CUDA_SHAPES, ["all"], HALF), ids=str)
def test_cuda_each_modifier_and_all(backend, shape, which, dtype):
    q, k, v, dout = _inputs(*shape)
    check(backend, dtype, q, k, v, dout, mods=_modifiers(shape[1], shape[0], WHICH[which]))


@pytest.mark.parametrize("backend,mode,which,dtype",
                         cases(["cuda"], MODES, ["all"], [torch.bfloat16])
                         + cases(["cuda"], ["causal_window"], ["softcap", "alibi", "sinks"],
                                 [torch.float16]), ids=str)
def test_cuda_with_causal_and_window(backend, mode, which, dtype):
    q, k, v, dout = _inputs(2, 4, 2, 37, 53, 32, 32)
    check(backend, dtype, q, k, v, dout, mods=_modifiers(4, 2, WHICH[which]), **MODES[mode])


@pytest.mark.parametrize("backend,kind,which,dtype",
                         cases(["cuda"], ["bool_full", "bool_row", "float_full", "float_row"],
                               ["all"], [torch.float16])
                         + cases(["cuda"], ["float_full"], ["all_batch"], [torch.bfloat16]),
                         ids=str)
def test_cuda_with_masks_and_lse_gradient(backend, kind, which, dtype):
    b, h, lq, lk = 2, 3, 29, 41
    q, k, v, dout = _inputs(b, h, h, lq, lk, 64, 64)
    dlse = torch.randn(b, h, lq, dtype=torch.float64)
    check(backend, dtype, q, k, v, dout, mask=_mask(kind, b, h, lq, lk),
          mods=_modifiers(h, b, WHICH[which]), dlse=dlse)


@pytest.mark.parametrize("backend,dtype", cases(["cuda"], HALF), ids=str)
def test_cuda_dropout_reproducible(backend, dtype):
    q, k, v, dout = _inputs(1, 2, 2, 31, 40, 64, 64)
    mods = _modifiers(2, 1, WHICH["all"])
    # dsinks = -sum_i P_sink,i delta_i, delta_i = rowsum(dO * O) from the kernel's own rounded O
    # (flash-attention's D), whose error dropout's 1/(1-p) spreads: up to 20x the formula's own
    # 16-bit dsinks error over input seeds, within what an O as far off as the formula's moves
    # it by.
    first = check(backend, dtype, q, k, v, dout, mods=mods, dropout_p=0.3,
                  slack={"dsinks": math.inf})  # checked per head below
    kw = dict(dropout_p=0.3)
    gold, base = (_golden(t, q, k, v, dout, None, mods, kw, None, 11)[6]
                  for t in (torch.float64, dtype))
    err, own = (first[6].double() - gold).abs(), (base.double() - gold).abs()
    bound = torch.maximum(3 * own, rounded_out_slack(dtype, q, k, v, dout, mods, **kw))
    assert (err <= bound.clamp(min=1e-5)).all(), (err, bound, gold)
    again = _actual(backend, dtype, q, k, v, dout, None, mods, dict(dropout_p=0.3), None, 11)
    for name, a, b in zip(NAMES, first, again):
        assert a is None and b is None or torch.equal(a, b), name


@pytest.mark.parametrize("backend,e,sm90,threads,dtype",
                         [pytest.param("cuda", *case, marks=MARKS["cuda"])
                          for case in [(64, True, 128, torch.bfloat16),
                                       (96, True, 256, torch.float16),
                                       (128, True, 256, torch.bfloat16),
                                       (128, False, 128, torch.float16)]],
                         ids=str)
def test_cuda_backward_with_modifiers_in_128_key_blocks_from_96(backend, e, sm90, threads, dtype):
    """sm_90 code runs the backward with softcap and ALiBi in 128-key blocks on 8 warps at head
    dims 96-128 (sdpa_bwd.cuh two_key_tiles<D, true>: the cap's derivative kept as fp16 pairs),
    in 64-key blocks on 4 warps at 64, where 128 queries a step leave it no registers; sm_80
    code (the harness's set_sm90(False)) in 64-key blocks; over two key blocks, GQA, a causal
    band. (A GPU launches the variant its part holds: there only the values are checked.)"""
    q, k, v, dout = _inputs(1, 4, 2, 60, 150, e, e)
    if not ON_GPU:
        from attnx import _cuda_host as host
        host.set_sm90(sm90)
    try:
        check(backend, dtype, q, k, v, dout, mods=_modifiers(4, 1, ("softcap", "alibi")),
              is_causal=True)
        if not ON_GPU:
            assert host.last_launch_threads() == threads  # the backward's block
    finally:
        if not ON_GPU:
            host.set_sm90(True)


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=MARKS["cuda"])])
def test_cuda_huge_bias_rows_and_extreme_sinks(backend):
    """bfloat16 (whose range holds a -1e30 bias): a row under a huge finite bias (its lse past
    the float's fractional precision: the backward's row sums), a huge sink, huge scores under
    a small softcap."""
    q, k, v, dout = _inputs(1, 2, 2, 9, 11, 64, 64)
    q = q * 30
    mask = torch.zeros(9, 11, dtype=torch.float64)
    mask[3] = -1e30
    sinks = torch.tensor([500.0, -500.0], dtype=torch.float64)
    check(backend, torch.bfloat16, q, k, v, dout, mask=mask,
          mods=dict(softcap=2.0, sinks=sinks, alibi_slopes=torch.tensor([0.5, 100.0])))
    mask[3] = -3e4  # a row's bias alone, each modifier alone: the row sums of each path
    for mods in (dict(softcap=2.0), dict(alibi_slopes=torch.tensor([0.5, 0.25])),
                 dict(sinks=torch.tensor([1.0, -2.0], dtype=torch.float64))):
        check(backend, torch.bfloat16, q, k, v, dout, mask=mask, mods=mods)
    # Row 3 padded with bfloat16's most negative finite value, as Hugging Face pads, and head 0's
    # sink the same: its keys and sink tie, lse rounds to the bias, and only the row sums (the
    # sink's term included) give back p = 1 / 12 each, in the gradients and dsinks too.
    big = torch.finfo(torch.bfloat16).min
    mask[3] = big
    check(backend, torch.bfloat16, q, k, v, dout, mask=mask,
          mods=dict(sinks=torch.tensor([big, 0.5], dtype=torch.float64)))


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=MARKS["cuda"])])
def test_cuda_bfloat16_and_sinks_in_float32(backend):
    q, k, v, dout = _inputs(1, 2, 2, 17, 19, 32, 32)
    dev = device(backend)
    mods = to(dev, _modifiers(2, 1, WHICH["all"]))
    (ql, kl, vl), _, _ = _leaves(torch.bfloat16, q, k, v, None, {}, dev)
    sinks = mods.pop("sinks").float().requires_grad_()
    out = attnx.scaled_dot_product_attention(ql, kl, vl, sinks=sinks, backend=backend, **mods)
    out.float().mul(dout.to(dev).float()).sum().backward()
    assert out.dtype == torch.bfloat16 and sinks.grad.dtype == torch.float32
    golden, _ = golden_attention(q, k, v, sinks=sinks.detach().cpu().double(), **{
        "softcap": mods["softcap"], "slopes": mods["alibi_slopes"].cpu()})
    assert (out.cpu().double() - golden).abs().max() < 3e-2


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=MARKS["cuda"])])
def test_cuda_mod_ops_opcheck(backend):
    """The cuda kernels' sdpa_mod ops (attnx_cuda_host's through the harness): schemas, fake
    kernels and the forward's autograd (torch.library.opcheck)."""
    ops = torch.ops.attnx if ON_GPU else torch.ops.attnx_cuda_host
    dev, g = device(backend), torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 5, 16, generator=g).to(dev, torch.float16).requires_grad_()
    k = torch.randn(2, 1, 6, 16, generator=g).to(dev, torch.float16).requires_grad_()
    v = torch.randn(2, 1, 6, 8, generator=g).to(dev, torch.float16).requires_grad_()
    mask = torch.randn(1, 2, 5, 6, generator=g).to(dev, torch.float16).expand(2, 2, 5, 6)
    slopes = torch.rand(2, 2, generator=g).to(dev)
    sinks = torch.randn(2, generator=g).to(dev).requires_grad_()
    fwd = (q, k, v, mask, 0.3, -5, 3, 0.0, None, 2.0, slopes, sinks)
    torch.library.opcheck(ops.sdpa_mod_fwd.default, fwd)
    out, lse = ops.sdpa_mod_fwd(*fwd)
    bwd = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), mask, out.detach(),
           lse.detach(), 0.3, -5, 3, 0.0, None, True, torch.randn_like(lse), 2.0, slopes,
           sinks.detach(), True)
    torch.library.opcheck(ops.sdpa_mod_bwd.default, bwd)
    cache = torch.randn(2, 1, 9, 16, generator=g).to(dev, torch.float16)
    kv = (q.detach(), cache, cache[..., :8], torch.tensor([9, 4], dtype=torch.int32, device=dev),
          None, 0.3, -20, 0, 2.0, slopes, sinks.detach())
    torch.library.opcheck(ops.kvcache_mod_fwd.default, kv)


def test_leading_dims_and_broadcast_heads():
    """3-D inputs (one head, no batch) and 5-D ones: slopes of shape (Hq,) or (prod(batch), Hq)."""
    q, k, v, _ = _inputs(2, 3, 3, 5, 7, 8, 8)
    mods = dict(softcap=2.0, alibi_slopes=torch.rand(2, 3),
                sinks=torch.randn(3, dtype=torch.float64))
    out = attnx.scaled_dot_product_attention(q.view(2, 1, 3, 5, 8), k.view(2, 1, 3, 7, 8),
                                             v.view(2, 1, 3, 7, 8), **mods)
    golden, _ = golden_attention(q, k, v, softcap=2.0, slopes=mods["alibi_slopes"],
                                 sinks=mods["sinks"])
    torch.testing.assert_close(out.view(2, 3, 5, 8), golden)
    out = attnx.scaled_dot_product_attention(q[0, 0], k[0, 0], v[0, 0], sinks=mods["sinks"][:1])
    golden, _ = golden_attention(q[:1, :1], k[:1, :1], v[:1, :1], sinks=mods["sinks"][:1])
    torch.testing.assert_close(out, golden[0, 0])


def _bad_modifiers():
    return [
        (ValueError, "softcap.*> 0", dict(softcap=0.0)),
        (ValueError, "softcap.*> 0", dict(softcap=-1.0)),
        (ValueError, "softcap.*> 0", dict(softcap=float("nan"))),
        (ValueError, "softcap.*> 0", dict(softcap=float("inf"))),
        (TypeError, "softcap.*bool", dict(softcap=True)),
        (TypeError, "softcap.*str", dict(softcap="30")),
        (TypeError, "alibi_slopes.*float32", dict(alibi_slopes=torch.ones(4, dtype=torch.float64))),
        (TypeError, "alibi_slopes.*Tensor", dict(alibi_slopes=[0.5] * 4)),
        (ValueError, "alibi_slopes.*shape", dict(alibi_slopes=torch.ones(3))),
        (ValueError, "alibi_slopes.*shape", dict(alibi_slopes=torch.ones(3, 4))),
        (TypeError, "alibi_slopes.*device", dict(alibi_slopes=torch.ones(4, device="meta"))),
        (TypeError, "sinks.*dtype", dict(sinks=torch.zeros(4, dtype=torch.int64))),
        (TypeError, "sinks.*dtype", dict(sinks=torch.zeros(4, dtype=torch.float64))),
        (ValueError, "sinks.*shape", dict(sinks=torch.zeros(2, 4))),
        (ValueError, "sinks.*shape", dict(sinks=torch.zeros(5))),
        (TypeError, "sinks.*device", dict(sinks=torch.zeros(4, device="meta"))),
        (TypeError, "sinks.*Tensor", dict(sinks=1.0)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_modifiers())))
def test_bad_modifiers_name_the_argument(case):
    exc, pattern, kwargs = _bad_modifiers()[case]
    q = torch.randn(2, 4, 5, 8)
    with pytest.raises(exc, match=pattern):
        attnx.scaled_dot_product_attention(q, q, q, **kwargs)


def test_auto_picks_a_backend_that_serves_them():
    q = torch.randn(1, 2, 5, 8)
    call = _validate.sdpa_call(q, q, q, None, 0.0, False, None, False, None, None, False,
                               sinks=torch.zeros(2))
    assert _dispatch.select("sdpa", call) == ("cpu" if HAS_CPU_KERNELS else "reference")
    plain = _validate.sdpa_call(q, q, q, None, 0.0, False, None, False, None, None, False)
    assert not plain.mods.any()


# attention_with_kvcache: ALiBi aligned bottom-right, query i's diagonal at key i + n - Lq.

def _cache(b, hkv, lmax, e, ev, lengths, paged, dtype, block_size=8, seed=5):
    """(k_cache, v_cache, block_table, keys (B, Hkv, Lmax, E), values) with every slot no
    sequence uses NaN, so that a read of one shows."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, hkv, lmax, e, generator=g, dtype=torch.float64)
    values = torch.randn(b, hkv, lmax, ev, generator=g, dtype=torch.float64)
    for i, n in enumerate(lengths):
        keys[i, :, n:] = float("nan")
        values[i, :, n:] = float("nan")
    if not paged:
        return keys.to(dtype), values.to(dtype), None, keys, values
    per_seq = -(-lmax // block_size)
    order = torch.randperm(b * per_seq + 2, generator=g)[: b * per_seq]
    table = order.view(b, per_seq).to(torch.int32)
    pad = per_seq * block_size - lmax
    kc = torch.full((b * per_seq + 2, hkv, block_size, e), float("nan"), dtype=dtype)
    vc = torch.full((b * per_seq + 2, hkv, block_size, ev), float("nan"), dtype=dtype)
    for i in range(b):
        for blk in range(per_seq):
            span = slice(blk * block_size, (blk + 1) * block_size)
            kc[table[i, blk]] = torch.nn.functional.pad(keys[i], (0, 0, 0, pad))[:, span].to(dtype)
            vc[table[i, blk]] = torch.nn.functional.pad(values[i], (0, 0, 0, pad))[:, span].to(dtype)
    return kc, vc, table, keys, values


def _kvcache_golden(q, keys, values, lengths, dtype, *, is_causal, window, mods):
    outs, lses = [], []
    for i, n in enumerate(lengths):
        slopes = mods.get("alibi_slopes")
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[i]
        out, lse = golden_attention(
            q[i:i + 1].to(dtype), keys[i:i + 1, :, :n].to(dtype), values[i:i + 1, :, :n].to(dtype),
            is_causal=is_causal, window=window, softcap=mods.get("softcap"), slopes=slopes,
            sinks=mods.get("sinks"), offset=n - q.shape[2])
        outs.append(out[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


def _check_kvcache(out, lse, q, keys, values, lengths, dtype, mods, kw, floor=None):
    """A decoding call's out and lse against the formula per sequence in float64, bounded by
    the formula's own error in dtype (at least `floor`: _least's); lse -inf exactly where the
    formula's is."""
    gold_out, gold_lse = _kvcache_golden(q, keys, values, lengths, torch.float64, mods=mods, **kw)
    base_out, base_lse = _kvcache_golden(q, keys, values, lengths, dtype, mods=mods, **kw)
    assert_within(out, gold_out, base_out, factor=3.0, floor=_least(floor, dtype, gold_out))
    assert torch.equal(torch.isinf(lse), torch.isinf(gold_lse))
    assert_within(*(t.float().nan_to_num(neginf=0.0) for t in (lse, gold_lse, base_lse)),
                  factor=3.0, floor=FLOORS[dtype], what="lse")


KV_MODES = [(1, {}), (3, dict(window=(6, None))), (5, dict(is_causal=False))]


def _kv_id(x):
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    if isinstance(x, bool):
        return "paged" if x else "contiguous"
    if isinstance(x, tuple):
        return f"{x[0]}-mode{KV_MODES.index(x)}"
    return None


@pytest.mark.parametrize("backend,paged,which,lq_mode",
                         cases(["reference", "cpu"], [False, True],
                               ["softcap", "alibi", "alibi_batch", "sinks", "all"], KV_MODES)
                         + cases(["triton"], [False, True], ["all"], KV_MODES)
                         + cases(["triton"], [False], ["softcap", "alibi_batch", "sinks"],
                                 KV_MODES[1:2]),
                         ids=_kv_id)
def test_kvcache(backend, paged, which, lq_mode, dtype=torch.float32):
    lq, mode = lq_mode
    b, hq, hkv, e, ev, lmax = 3, 4, 2, 16, 12, 45
    lengths = [1, 17, 40]  # keys attended, the new ones included
    lnew = min(lq, 1)
    kc, vc, table, keys, values = _cache(b, hkv, lmax, e, ev, lengths, paged, dtype)
    kc, vc = kc.to(device(backend)), vc.to(device(backend))
    table = None if table is None else table.to(device(backend))
    q = torch.randn(b, hq, lq, e, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    mods = _modifiers(hq, b, WHICH[which])
    if "sinks" in mods:
        mods["sinks"] = mods["sinks"].to(dtype)
    cached = torch.tensor(lengths, dtype=torch.int32) - lnew
    new = [t[torch.arange(b), :, cached.long()].unsqueeze(2).to(device(backend), dtype)
           for t in (keys, values)]
    kw = dict(is_causal=mode.get("is_causal", True), window=mode.get("window"))
    out, lse = attnx.attention_with_kvcache(
        q.to(device(backend), dtype), kc, vc, cached.to(device(backend)), *new, block_table=table,
        backend=backend, return_lse=True, **kw, **to(device(backend), mods))
    # the first sequence's first queries (1 key, bottom-right) admit none: lse -inf
    _check_kvcache(out.cpu(), lse.cpu(), q, keys, values, lengths, dtype, mods, kw)


@pytest.mark.parametrize("backend", BACKENDS + [TRITON])
def test_kvcache_softcap_far_above_the_scores(backend):
    """test_softcap_far_above_the_scores through the decoding kernels (4 query rows, GQA)."""
    b, hq, hkv, e, ev, lengths = 2, 4, 2, 32, 16, [40, 23]
    kc, vc, _, keys, values = _cache(b, hkv, 40, e, ev, lengths, False, torch.float32)
    q = torch.randn(b, hq, 4, e, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    out, lse = attnx.attention_with_kvcache(
        q.to(device(backend), torch.float32), kc.to(device(backend)), vc.to(device(backend)),
        torch.tensor(lengths, dtype=torch.int32, device=device(backend)), softcap=500.0,
        backend=backend, return_lse=True)
    _check_kvcache(out.cpu(), lse.cpu(), q, keys, values, lengths, torch.float32,
                   dict(softcap=500.0), dict(is_causal=True, window=None), floor="ulps")
    if backend == "reference":
        return
    # the same through the 16-bit decoding kernels under a cap past common.EXACT_TANH_CAP
    out = attnx.attention_with_kvcache(
        q.to(device(backend), torch.float16), kc.to(device(backend), torch.float16),
        vc.to(device(backend), torch.float16),
        torch.tensor(lengths, dtype=torch.int32, device=device(backend)), softcap=1e30,
        backend=backend)
    want = attnx.attention_with_kvcache(q.to(torch.float16), kc.to(torch.float16),
                                        vc.to(torch.float16), torch.tensor(lengths, dtype=torch.int32),
                                        backend="reference")  # (the cap changes no score)
    assert (out.cpu().double() - want.double()).abs().max() < 4e-3


@pytest.mark.skipif(not HAS_CPU_KERNELS, reason="attnx._C is not built")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("lq, hq, e", [(1, 8, 16), (1, 8, 64), (1, 8, 80), (4, 8, 48),
                                       (5, 8, 24)],
                         ids=["four-row-64-key-blocks", "four-row-32-key-blocks",
                              "four-row-16-key-blocks", "lanes", "lanes-and-four-row"])
@pytest.mark.parametrize("which", ["alibi", "all"])
def test_kvcache_alibi_over_many_blocks(paged, lq, hq, e, which):
    """The cpu kernel's modifiers over many key blocks (16-64 keys a block by head dim; those of
    test_kvcache fit one at E = 16), the longest sequence split over threads and merged, a
    window that starts mid-block, GQA rows in fours and as the lanes of a vector."""
    b, hkv, ev = 3, 2, 20
    lengths = [70, 600, 1300]
    kc, vc, table, keys, values = _cache(b, hkv, max(lengths), e, ev, lengths, paged,
                                         torch.float32, block_size=16)
    q = torch.randn(b, hq, lq, e, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    mods = _modifiers(hq, b, WHICH[which])
    if "sinks" in mods:
        mods["sinks"] = mods["sinks"].float()
    for kw in (dict(is_causal=True, window=None), dict(is_causal=True, window=(500, None))):
        out, lse = attnx.attention_with_kvcache(
            q.float(), kc, vc, torch.tensor(lengths, dtype=torch.int32), block_table=table,
            backend="cpu", return_lse=True, **kw, **mods)
        _check_kvcache(out, lse, q, keys, values, lengths, torch.float32, mods, kw)


@pytest.mark.parametrize("backend,paged,which,lq_mode,dtype",
                         cases(["reference", "cpu"], [True], ["all"], KV_MODES,
                               [torch.float16, torch.bfloat16]), ids=_kv_id)
def test_kvcache_half_precision(backend, paged, which, lq_mode, dtype):
    """16-bit caches with every modifier: the cpu kernel widens each block to float32."""
    test_kvcache(backend, paged, which, lq_mode, dtype=dtype)


@pytest.mark.parametrize("backend,paged,which,lq_mode,dtype",
                         cases(["cuda"], [False, True], ["all"], KV_MODES, [torch.float16])
                         + cases(["cuda"], [False], ["softcap", "alibi_batch", "sinks"],
                                 KV_MODES[1:2], [torch.bfloat16]), ids=_kv_id)
def test_cuda_kvcache(backend, paged, which, lq_mode, dtype):
    """The cuda decoding kernels with two key splits (a 45-key cache): the sink joins at the
    merge (test_cuda_kvcache_one_split: in the split kernel)."""
    test_kvcache(backend, paged, which, lq_mode, dtype=dtype)


@pytest.mark.parametrize("backend,dtype,lq",
                         cases(["reference", "cpu", "triton"], [torch.float32], [1, 3])
                         + cases(["cuda"], [torch.float16], [1, 3]), ids=str)
def test_kvcache_minus_infinity_sinks(backend, dtype, lq):
    """Decoding with sinks of -inf (exp(-inf) = 0: no sink) beside finite ones: rows that admit
    no key (sequence 0: no cached key at Lq = 1, its first query outside every window at Lq = 3)
    give zeros and lse -inf under a -inf sink, the sink under a finite one, and no NaN."""
    dev = device(backend)
    g = torch.Generator().manual_seed(6)
    b, hq, hkv, e = 2, 4, 2, 64 if backend == "cuda" else 16
    keys = torch.randn(b, hkv, 20, e, generator=g, dtype=torch.float64)
    values = torch.randn(b, hkv, 20, e, generator=g, dtype=torch.float64)
    q = torch.randn(b, hq, lq, e, generator=g, dtype=torch.float64)
    lengths = [0, 20] if lq == 1 else [2, 20]
    mods = dict(sinks=torch.tensor([float("-inf"), 0.5, float("-inf"), -1.0]))
    kw = dict(is_causal=True, window=(5, None))
    out, lse = attnx.attention_with_kvcache(
        q.to(dev, dtype), keys.to(dev, dtype), values.to(dev, dtype),
        torch.tensor(lengths, dtype=torch.int32, device=dev), backend=backend, return_lse=True,
        **kw, **to(dev, mods))
    out, lse = out.cpu(), lse.cpu()
    assert not out.isnan().any() and not lse.isnan().any()
    _check_kvcache(out, lse, q, keys, values, lengths, dtype, mods, kw)
    assert torch.equal(out[0, :, 0], torch.zeros_like(out[0, :, 0]))
    assert (lse[0, ::2, 0] == float("-inf")).all()


@pytest.mark.parametrize("backend", [pytest.param("cuda", marks=MARKS["cuda"])])
@pytest.mark.parametrize("which", ["sinks", "all"])
def test_cuda_kvcache_one_split(backend, which):
    """A cache of one key tile: one split, the sink added by the split kernel itself; a query
    that admits no key gives lse = the sink."""
    dev, dtype = device(backend), torch.float16
    g = torch.Generator().manual_seed(6)
    b, hq, hkv, lq, e = 2, 4, 2, 3, 64
    keys = torch.randn(b, hkv, 20, e, generator=g, dtype=torch.float64)
    values = torch.randn(b, hkv, 20, e, generator=g, dtype=torch.float64)
    q = torch.randn(b, hq, lq, e, generator=g, dtype=torch.float64)
    lengths = [2, 20]
    mods = _modifiers(hq, b, WHICH[which])
    mods["sinks"] = mods["sinks"].float()  # a model's float32 parameter
    kw = dict(is_causal=True, window=(5, None))  # sequence 0's first query admits no key
    out, lse = attnx.attention_with_kvcache(
        q.to(dev, dtype), keys.to(dev, dtype), values.to(dev, dtype),
        torch.tensor(lengths, dtype=torch.int32, device=dev), backend=backend, return_lse=True,
        **kw, **to(dev, mods))
    gold_out, gold_lse = _kvcache_golden(q, keys, values, lengths, torch.float64, mods=mods, **kw)
    base_out, base_lse = _kvcache_golden(q, keys, values, lengths, dtype, mods=mods, **kw)
    assert_within(out.cpu(), gold_out, base_out, factor=3.0, floor=FLOORS[dtype])
    assert_within(lse.cpu(), gold_lse, base_lse, factor=3.0, floor=FLOORS[dtype], what="lse")
    assert torch.equal(out[0, :, 0].cpu(), torch.zeros_like(out[0, :, 0].cpu()))


@pytest.mark.skipif(not HAS_CPU_KERNELS, reason="attnx._C is not built")
def test_blas_engine():
    """ATTNX_CPU_PANELS=0 runs float32 on the BLAS engine (CPUs without AVX2): its backward
    recomputes the scores in another order than the forward, so the softcap and sink paths of
    its probabilities differ from the panels'."""
    rerun_under("ATTNX_CPU_PANELS", __file__,
                "cpu and ((each_modifier and all) or masks or fully_masked or extreme)",
                probe="cpu_gemm", expect=("blas",))


@pytest.mark.skipif(not HAS_CPU_KERNELS, reason="attnx._C is not built")
def test_avx2_row_operations():
    """ATTNX_CPU_AVX512=0: the 8-lane row operations and the 256-bit panels, what CPUs without
    AVX-512 run."""
    skip_unless_avx512()
    rerun_under("ATTNX_CPU_AVX512", __file__,
                "cpu and ((each_modifier and all) or fully_masked or dropout or (kvcache and 3-mode1))",
                probe="cpu_vector", expect=("avx2", "baseline"))


@pytest.mark.skipif(not HAS_CPU_KERNELS, reason="attnx._C is not built")
@pytest.mark.parametrize("mask_kind", [None, "float"])
def test_opcheck_and_gradcheck(mask_kind):
    """The _mod ops' schemas, fake kernels and autograd (torch.library.opcheck), and gradcheck
    of the cpu backend in float64 through softcap, ALiBi, a float mask and the sinks."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 1, 6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(2, 1, 6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    mask = None if mask_kind is None else torch.randn(1, 2, 5, 6, dtype=torch.float64,
                                                       generator=g, requires_grad=True)
    slopes = torch.rand(2, 2, generator=g)
    sinks = torch.randn(2, dtype=torch.float64, generator=g, requires_grad=True)
    view = None if mask is None else mask.expand(2, 2, 5, 6)  # as the validation passes it
    fwd = (q, k, v, view, 0.3, -5, 3, 0.0, None, 2.0, slopes, sinks)
    torch.library.opcheck(torch.ops.attnx.sdpa_mod_fwd.default, fwd)
    out, lse = torch.ops.attnx.sdpa_mod_fwd(*fwd)
    bwd = (torch.randn_like(out), q.detach(), k.detach(), v.detach(),
           None if view is None else view.detach(), out.detach(),
           lse.detach(), 0.3, -5, 3, 0.0, None, mask is not None, torch.randn_like(lse), 2.0,
           slopes, sinks.detach(), True)
    torch.library.opcheck(torch.ops.attnx.sdpa_mod_bwd.default, bwd)

    def op(q, k, v, sinks, *mask):
        return attnx.scaled_dot_product_attention(
            q, k, v, *mask, enable_gqa=True, window=(5, 3), scale=0.3, softcap=2.0,
            alibi_slopes=slopes, sinks=sinks, backend="cpu")

    leaves = (q, k, v, sinks) + (() if mask is None else (mask,))
    assert torch.autograd.gradcheck(op, leaves)

    cache = torch.randn(2, 1, 9, 4, dtype=torch.float64, generator=g)
    kv = (q.detach(), cache, cache[..., :3], torch.tensor([9, 4], dtype=torch.int32), None, 0.3,
          -20, 0, 2.0, slopes, sinks.detach())
    torch.library.opcheck(torch.ops.attnx.kvcache_mod_fwd.default, kv)


@pytest.mark.skipif(not HAS_CPU_KERNELS, reason="attnx._C is not built")
def test_compiles_fullgraph(backend="cpu"):
    """torch.compile traces the modifiers through (fake kernels of the _mod ops), sinks'
    gradient included."""
    q, k, v = (torch.randn(2, 4, 21, 16, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, requires_grad=True)
    slopes = torch.rand(4)

    def f(q, k, v, sinks):
        return attnx.scaled_dot_product_attention(q, k, v, is_causal=True, softcap=5.0,
                                                  alibi_slopes=slopes, sinks=sinks,
                                                  backend=backend).sum()

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, sinks)
    want = f(q, k, v, sinks)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (q, k, v, sinks)),
                    torch.autograd.grad(want, (q, k, v, sinks))):
        torch.testing.assert_close(a, b)


FAKE_ONLY = ("test_schema", "test_faketensor")


@pytest.mark.skipif(not HAS_TRITON, reason=_dispatch.backends()["triton"].reason)
def test_triton_ops_opcheck():
    """The triton ops' schemas with the modifiers, fake kernels and the forward's autograd
    registration as torch.library checks them (not its aot_dispatch check, which reruns the
    op many times in the interpreter; check() covers the gradients)."""
    from attnx.triton import decode, sdpa  # noqa: F401  (registers the ops)
    dev = device("triton")
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 5, 16, generator=g).to(dev).requires_grad_()
    k = torch.randn(2, 1, 6, 16, generator=g).to(dev).requires_grad_()
    v = torch.randn(2, 1, 6, 16, generator=g).to(dev).requires_grad_()
    slopes = torch.rand(2, generator=g).to(dev).expand(2, 2)  # as the validation passes them
    sinks = torch.randn(2, generator=g).to(dev).requires_grad_()
    fwd = (q, k, v, None, 0.3, -5, 3, 0.0, None, 2.0, slopes, sinks)
    torch.library.opcheck(torch.ops.attnx.triton_sdpa_fwd.default, fwd,
                          test_utils=FAKE_ONLY + ("test_autograd_registration",))
    out, lse = torch.ops.attnx.triton_sdpa_fwd(*fwd)
    plain = tuple(t.detach() for t in (q, k, v))
    torch.library.opcheck(torch.ops.attnx.triton_sdpa_bwd.default,
                          (torch.randn_like(out), *plain, None, out.detach(), lse.detach(), 0.3,
                           -5, 3, 0.0, None, False, torch.randn_like(lse), 2.0, slopes,
                           sinks.detach()), test_utils=FAKE_ONLY)
    cache = torch.randn(2, 1, 9, 16, generator=g).to(dev)
    torch.library.opcheck(torch.ops.attnx.triton_kvcache_fwd.default,
                          (plain[0], cache, cache, torch.tensor([9, 4], dtype=torch.int32,
                                                                device=dev),
                           None, 0.3, -20, 0, 2.0, slopes, sinks.detach()), test_utils=FAKE_ONLY)
