"""A float32 `attn_mask` with a query of another dtype, as torch's SDPA takes it; and additive
attention's v shared by the heads, which goes to the kernels in float32 beside 16-bit queries,
and its weights, which come from them in float32 (the backward takes them so).

torch's rule for the mask's dtype is: bool, float32, or the query's dtype; a float32 mask is
added to the scores in float32 whatever the query's dtype (bf16/fp16/fp64 queries), and its
gradient comes back float32. attnx follows it on every op with a mask (SDPA, additive) and
every backend but the cuda backend's SDPA kernels, which read a float mask as q's dtype: they
refuse the call and `backend=None` takes triton (the additive cuda kernels take it, tested
through the host harness where there is no GPU). Casting the mask to the query's dtype first
would not do: with |mask| ~ 40, bf16 moves the scores by up
to ~0.1 and the output with them (these tests' masks are that large, so their bounds catch it).

The bound: a float32 mask costs no accuracy. Each result's error against the float64 golden
value stays within a small multiple of the larger of two baselines' errors against theirs:
the same backend given the mask rounded to q's dtype (as a mask of q's dtype: its own
rounding, interpreter or GPU, whatever its summation order), and for SDPA torch's own function
on the float32 mask.
"""

from __future__ import annotations

import pytest
import torch

import attnx
from attnx import _dispatch
from _backends import INTERPRET, ON_GPU, cuda_reason, device
from _compare import max_err

f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
FLOOR = {bf16: 1e-5, f16: 1e-5, f64: 1e-10}

# (backend, query dtype): the combinations each backend serves
SERVED = [("cpu", bf16), ("cpu", f16), ("cpu", f64), ("reference", bf16), ("reference", f16),
          ("reference", f64), ("triton", bf16), ("triton", f16)]
ADDITIVE_SERVED = SERVED + [("cuda", bf16), ("cuda", f16)]
# (B, Hq, Hkv, Lq, Lk, E): rows of queries; one query (the cpu decoding kernel's rows); GQA
SDPA_SHAPES = {"17x33": (2, 2, 2, 17, 33, 16), "decode": (2, 4, 2, 1, 40, 16),
               "gqa_lq_gt_lk": (1, 4, 1, 20, 9, 8)}


def _skip_unavailable(backend):
    if backend == "triton" and not (INTERPRET or ON_GPU):
        pytest.skip("the triton backend needs a GPU or TRITON_INTERPRET=1")
    if backend == "cuda" and cuda_reason() is not None:
        pytest.skip(cuda_reason())
    status = _dispatch.backends()[backend]
    if not status.usable:
        pytest.skip(status.reason)


def _inputs(shapes, dtype, dev, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=f64).to(dev, dtype) for s in shapes]


def _big_mask(shape, dev, seed):
    """A float32 mask of values ~ 40 (bf16 holds them to ~0.1); where there are several
    query rows, the first fully masked."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(shape, generator=g, dtype=f64).mul(40).float()
    if shape[-2] > 1:
        m[..., 0, :] = float("-inf")
    return m.to(dev)


def _grads(fn, tensors, mask, seed):
    """Output and the gradients of every tensor and of the mask, of out . sin(arange)."""
    leaves = [t.detach().requires_grad_() for t in tensors]
    m = mask.detach().requires_grad_()
    out = fn(*leaves, m)
    dout = torch.sin(torch.arange(out.numel(), dtype=f64)).view_as(out).to(out)
    return [out, *torch.autograd.grad(out, leaves + [m], dout)]


def _keeps_float32_precision(dmask, dtype):
    """A float32 mask's gradient is computed in float32, not in a 16-bit q's dtype and widened:
    some of its values are not that dtype's (a gradient rounded to it would pass the error
    bounds, whose baselines include the mask rounded to q's dtype)."""
    if dtype in (torch.float16, torch.bfloat16):
        assert not torch.equal(dmask, dmask.to(dtype).float()), "dmask rounded to q's dtype"


def _checked(names, actual, golden, baselines):
    """Each result within 2x (outputs) or 3x (gradients) of the larger baseline error; each
    baseline is (results, their golden)."""
    for i, name in enumerate(names):
        a, g = actual[i], golden[i]
        floor = FLOOR[actual[0].dtype]
        if name == "dmask":  # float32: rounding alone may take it an ulp from the golden value
            floor = max(floor, torch.finfo(f32).eps * g.abs().max().item())
        assert a.shape == g.shape and torch.isfinite(a).all(), name
        base = max(max_err(r[i], rg[i]) for r, rg in baselines)
        bound = max(floor, (2.0 if name == "out" else 3.0) * base)
        err = max_err(a, g)
        assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g} (baseline {base:.3g})"


@pytest.mark.parametrize("case", list(SDPA_SHAPES))
@pytest.mark.parametrize("backend,dtype", SERVED, ids=[f"{b}-{str(d)[6:]}" for b, d in SERVED])
def test_sdpa_float32_mask(backend, dtype, case):
    _skip_unavailable(backend)
    b, hq, hkv, lq, lk, e = SDPA_SHAPES[case]
    dev = device(backend)
    q, k, v = _inputs([(b, hq, lq, e), (b, hkv, lk, e), (b, hkv, lk, e)], f64, dev, 0)
    mask = _big_mask((1, hq, lq, lk), dev, 1)
    gqa = hq != hkv

    def torch_sdpa(q, k, v, m):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                                enable_gqa=gqa)

    def ours(q, k, v, m):
        return attnx.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=gqa,
                                                  backend=backend)

    low = [t.to(dtype) for t in (q, k, v)]
    exact = [t.double() for t in low]  # the golden values: float64 math on the same inputs
    rounded = mask.to(dtype)  # the same mask as one of q's dtype
    actual = _grads(ours, low, mask, 2)
    assert actual[0].dtype == dtype and actual[-1].dtype == f32  # out in q's, dmask in the mask's
    _keeps_float32_precision(actual[-1], dtype)
    assert lq == 1 or actual[0][..., 0, :].eq(0).all()  # the fully masked row: zeros, no NaN
    golden = _grads(torch_sdpa, exact, mask.double(), 2)
    # torch's own error with the float32 mask, from its CPU kernel: its CUDA kernels take a
    # float mask only of q's dtype ('invalid dtype for bias', the H200, torch 2.11).
    torch_low = _grads(torch_sdpa, [t.cpu() for t in low], mask.cpu(), 2)
    _checked(("out", "dq", "dk", "dv", "dmask"), actual, golden,
             [(_grads(ours, low, rounded, 2), _grads(torch_sdpa, exact, rounded.double(), 2)),
              (torch_low, [g.cpu() for g in golden])])


@pytest.mark.parametrize("backend,dtype", ADDITIVE_SERVED,
                         ids=[f"{b}-{str(d)[6:]}" for b, d in ADDITIVE_SERVED])
def test_additive_float32_mask(backend, dtype):
    _skip_unavailable(backend)
    dev = device(backend)
    q, k, value = _inputs([(2, 3, 9, 12), (2, 3, 13, 12), (2, 3, 13, 5)], f64, dev, 3)
    w = _inputs([(12,)], f64, dev, 4)[0] / 12 ** 0.5
    mask = _big_mask((2, 1, 9, 13), dev, 5)

    def run(backend, inputs, mask):
        def fn(q, k, value, w, m):
            return attnx.additive_attention(q, k, value, w, attn_mask=m, backend=backend)
        return _grads(fn, inputs, mask, 6)

    low = [t.to(dtype) for t in (q, k, value, w)]
    exact = [t.double() for t in low]  # the golden values: float64 math on the same inputs
    rounded = mask.to(dtype)
    actual = run(backend, low, mask)
    assert actual[0].dtype == dtype and actual[-1].dtype == f32
    _keeps_float32_precision(actual[-1], dtype)
    assert actual[0][..., 0, :].eq(0).all()
    _checked(("out", "dq", "dk", "dvalue", "dv", "dmask"), actual,
             run("reference", exact, mask.double()),
             [(run(backend, low, rounded), run("reference", exact, rounded.double()))])


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton", "cuda"])
def test_additive_shared_v_gradient_sums_heads_in_float32(backend):
    """A v of shape (A,) serves every head; autograd sums its per-head gradients. Two heads
    alike but for dO (-0.999 times): each head's float16 gradient passed float16's range (inf
    and -inf, NaN summed) where the sum is ~160. In float32 (the kernels take v so) it holds."""
    _skip_unavailable(backend)
    g = torch.Generator().manual_seed(0)
    q, k, value = (torch.randn(s, generator=g).expand(2, 2, -1, -1)
                   for s in ((2, 1, 32, 8), (2, 1, 8, 8), (2, 1, 8, 16)))
    value = value * 100
    v = torch.randn(8, generator=g)
    dout = torch.randn(2, 1, 32, 16, generator=g) * 100
    dout = torch.cat([dout, -0.999 * dout], 1)

    def dv(backend, dtype):
        xs = [t.to(device(backend), dtype).requires_grad_() for t in (q, k, value, v)]
        attnx.additive_attention(*xs, backend=backend).backward(dout.to(xs[0]))
        return xs[3].grad.cpu()

    got, want = dv(backend, f16), dv("reference", f64)
    assert got.dtype == f16 and torch.isfinite(got).all()
    # the error of the rounded out in D = rowsum(dO out), the reference's too in float16
    assert max_err(got, want) <= 2 * max_err(dv("reference", f16), want)


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_additive_shared_v_gradient_past_float32_per_head_on_cpu(dtype):
    """The same with values near 1e36: each head's gradient of v passes float32's range (the
    op reruns in float64), their sum ~1e36 does not. The cpu backend takes a shared v in
    float64 where its gradient is wanted (attnx/_backends/cpu.py additive), so autograd sums
    the heads' float64 gradients: NaN before (inf - inf), now the float64 answer rounded.
    (The other backends keep the gap README names.)"""
    g = torch.Generator().manual_seed(0)
    q, k, value = (torch.randn(s, generator=g).to(dtype).expand(2, 2, -1, -1)
                   for s in ((2, 1, 32, 8), (2, 1, 8, 8), (2, 1, 8, 16)))
    value = value * 1e36
    v = torch.randn(8, generator=g).to(dtype)
    dout = torch.randn(2, 1, 32, 16, generator=g).to(dtype) * 100
    dout = torch.cat([dout, -0.999 * dout], 1)

    def dv(backend, dtype):
        xs = [t.to(dtype).requires_grad_() for t in (q, k, value, v)]
        out = attnx.additive_attention(*xs, backend=backend)
        return torch.autograd.grad(out, xs[3], dout.to(dtype))[0]

    got, want = dv("cpu", dtype), dv("reference", f64)
    assert got.dtype == dtype and torch.isfinite(got).all()
    # float32: the sum of the heads' float64 gradients, rounded; bfloat16: its rounding
    rel = 1e-6 if dtype == f32 else 2 ** -8
    assert max_err(got, want) <= rel * want.abs().max()


@pytest.mark.parametrize("dtype", [f16, bf16])
@pytest.mark.parametrize("backend", ["cpu", "triton", "cuda"])  # the reference: the baseline
def test_additive_weights_gradient_takes_unrounded_weights(backend, dtype):
    """A loss on the weights (after dropout): the softmax backward's D_i takes rowsum(W dW)
    beside the kernels' dP from unrounded P. With W rounded to 16 bits, one-hot rows (|v| ~
    2500) gave dq, dk ~1 where the truth is 0: fp16's 1 / (1 - p) off by 5e-4, times dW and
    v. The ops return float32 weights, the public function rounds what it returns."""
    _skip_unavailable(backend)
    dev = device(backend)
    q, k, value = _inputs([(1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 6)], f64, dev, 8)
    v, dw = _inputs([(2, 4), (1, 2, 8, 8)], f64, dev, 9)
    v = v * 2500

    def grads(backend, dtype):
        xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        torch.manual_seed(5)  # the same dropout seed on every backend
        _, w = attnx.additive_attention(xs[0], xs[1], value.to(dtype), xs[2], dropout_p=0.3,
                                        backend=backend, return_weights=True)
        assert w.dtype == dtype
        return torch.autograd.grad((w * dw.to(w)).sum(), xs)

    low = [t.to(dtype).double() for t in (q, k, v)]
    q, k, v, value = *low, value.to(dtype).double()  # the golden values: float64 on the same inputs
    for name, got, ref, want in zip(("dq", "dk", "dv"), grads(backend, dtype),
                                    grads("reference", dtype), grads("reference", f64)):
        assert torch.isfinite(got).all(), name
        bound = max(FLOOR[dtype], 3 * max_err(ref, want))  # the reference rounds in dtype too
        assert max_err(got, want) <= bound, (name, max_err(got, want), bound)


@pytest.mark.parametrize("backend", ["cuda"])
def test_cuda_sdpa_refuses_a_float32_mask_with_half_queries(backend):
    """Asked for, the cuda backend says why it cannot serve the call; backend=None takes the
    next backend that serves it (triton on CUDA tensors; test_ops.py: the order)."""
    reason = cuda_reason()
    if reason is not None:
        pytest.skip(reason)
    dev = device(backend)
    q, k, v = _inputs([(1, 2, 5, 16)] * 3, bf16, dev, 7)
    mask = _big_mask((5, 5), dev, 8)
    with pytest.raises(ValueError, match=r"cuda.*attn_mask.*torch\.bfloat16.*torch\.float32"):
        attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend="cuda")
    out = attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(bf16), backend="cuda")
    assert out.dtype == bf16  # the same call with the mask in q's dtype is served


def test_a_float64_mask_with_float32_queries_is_refused():
    """torch refuses it too: a float mask is float32 or the query's dtype."""
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(TypeError, match=r"attn_mask.*torch\.float32.*float64"):
        attnx.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(5, 5, dtype=f64))
