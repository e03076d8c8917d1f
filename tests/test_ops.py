"""torch.library.opcheck on every native op (schema, fake kernel, autograd registration)."""

import pytest
import torch

import attnx  # noqa: F401  (loads the ops)
from attnx import _ops, _rng

pytestmark = pytest.mark.skipif(_ops.LOAD_ERROR is not None, reason="attnx._C not built")


def _mask(kind, shape):
    if kind is None:
        return None
    if kind == "bool":
        m = torch.rand(shape[-2:]) > 0.2
    else:  # "float": q's dtype (float64); "float32": torch's other float mask dtype
        m = torch.randn(shape[-2:], dtype=torch.float32 if kind == "float32" else torch.float64)
    return m.expand(shape)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "float32"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_opcheck_sdpa(mask_kind, dropout_p):
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 11, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 11, 6, dtype=torch.float64, requires_grad=True)
    mask = _mask(mask_kind, (2, 4, 9, 11))
    seed = _rng.draw_seed() if dropout_p else None
    fwd = (q, k, v, mask, 0.3, -5, 3, dropout_p, seed)
    torch.library.opcheck(torch.ops.attnx.sdpa_fwd.default, fwd)
    out, lse = torch.ops.attnx.sdpa_fwd(*fwd)
    g = torch.randn_like(out)
    bwd = (g, q.detach(), k.detach(), v.detach(), mask, out.detach(), lse.detach(), 0.3, -5, 3, dropout_p, seed,
           mask_kind in ("float", "float32"))
    torch.library.opcheck(torch.ops.attnx.sdpa_bwd.default, bwd)
    torch.library.opcheck(torch.ops.attnx.sdpa_bwd.default, bwd + (torch.randn_like(lse),))


@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "float32"])
@pytest.mark.parametrize("return_weights", [False, True])
def test_opcheck_additive(mask_kind, return_weights):
    q = torch.randn(2, 3, 7, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    value = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    mask = _mask(mask_kind, (2, 3, 7, 5))
    fwd = (q, k, value, v, mask, -7, 5, 0.0, None, return_weights)
    torch.library.opcheck(torch.ops.attnx.additive_fwd.default, fwd)
    out, lse, _ = torch.ops.attnx.additive_fwd(*fwd)
    g = torch.randn_like(out)
    bwd = (g, q.detach(), k.detach(), value.detach(), v.detach(), mask, out.detach(), lse.detach(), -7, 5, 0.0,
           None, mask_kind in ("float", "float32"))
    torch.library.opcheck(torch.ops.attnx.additive_bwd.default, bwd)
    torch.library.opcheck(torch.ops.attnx.additive_bwd.default, bwd + (torch.randn_like(lse),))
    grad_weights = torch.randn(2, 3, 7, 5, dtype=torch.float64)
    torch.library.opcheck(torch.ops.attnx.additive_bwd.default, bwd + (None, grad_weights))


def _strided(*shape):
    """float64 (B, H, L, D) with H and L swapped in memory, as modules pass their heads."""
    b, h, l, d = shape
    return torch.randn(b, l, h, d, dtype=torch.float64).transpose(1, 2)


def test_opcheck_on_non_contiguous_inputs():
    """The fake kernels promise the layout the real ones return (contiguous gradients, whatever
    the inputs' strides): torch.compile's inductor checks it on backward."""
    q, k, v = _strided(2, 4, 9, 8), _strided(2, 2, 11, 8), _strided(2, 2, 11, 6)
    fwd = (q, k, v, None, 0.3, -5, 3, 0.0, None)
    torch.library.opcheck(torch.ops.attnx.sdpa_fwd.default, fwd)
    out, lse = torch.ops.attnx.sdpa_fwd(*fwd)
    torch.library.opcheck(torch.ops.attnx.sdpa_bwd.default,
                          (torch.randn_like(out), q, k, v, None, out, lse, 0.3, -5, 3, 0.0, None, False))
    q, k, value = _strided(2, 3, 7, 8), _strided(2, 3, 5, 8), _strided(2, 3, 5, 4)
    v = torch.randn(8, dtype=torch.float64).expand(3, 8)
    fwd = (q, k, value, v, None, -7, 5, 0.0, None, True)
    torch.library.opcheck(torch.ops.attnx.additive_fwd.default, fwd)
    out, lse, _ = torch.ops.attnx.additive_fwd(*fwd)
    torch.library.opcheck(torch.ops.attnx.additive_bwd.default,
                          (torch.randn_like(out), q, k, value, v, None, out, lse, -7, 5, 0.0, None, False))


def _second_order_calls(backend):
    """Calls of every fused formula, float64, each with its inputs requiring grad."""
    def t(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    q, k, v, w = t(1, 2, 4, 3), t(1, 2, 5, 3), t(1, 2, 5, 2), t(3)
    mask, sinks = t(1, 1, 4, 5), t(2)
    slopes = torch.tensor([0.5, 0.25])
    qp, kp, vp = t(7, 2, 3), t(9, 1, 3), t(9, 1, 2)
    cu_q = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 5, 9], dtype=torch.int32)

    def dropped(q, k, v):  # the same keys dropped on every call of gradgradcheck
        torch.manual_seed(3)
        return attnx.scaled_dot_product_attention(q, k, v, dropout_p=0.3, backend=backend)

    return {
        "sdpa": (lambda q, k, v, m: attnx.scaled_dot_product_attention(
            q, k, v, attn_mask=m, window=(2, 1), backend=backend), (q, k, v, mask)),
        "sdpa_q_is_k_is_v": (lambda q: attnx.scaled_dot_product_attention(
            q, q, q, is_causal=True, backend=backend), (q,)),
        "sdpa_dropout": (dropped, (q, k, v)),
        "sdpa_modifiers": (lambda q, k, v, s: attnx.scaled_dot_product_attention(
            q, k, v, softcap=2.0, alibi_slopes=slopes, sinks=s, backend=backend), (q, k, v, sinks)),
        "additive": (lambda q, k, v, w: attnx.additive_attention(
            q, k, v, w, return_weights=True, backend=backend), (q, k, v, w)),
        "varlen": (lambda q, k, v: attnx.varlen_attention(
            q, k, v, cu_q, cu_k, is_causal=True, backend=backend), (qp, kp, vp)),
        "varlen_modifiers": (lambda q, k, v, s: attnx.varlen_attention(
            q, k, v, cu_q, cu_k, softcap=3.0, sinks=s, backend=backend), (qp, kp, vp, sinks)),
    }


@pytest.mark.parametrize("name", sorted(_second_order_calls("cpu")))
def test_second_order_gradients(name):
    """A backward with create_graph=True takes its gradients from the reference backend's
    recomputation (attnx/_second_order.py): differentiable again, against finite differences."""
    torch.manual_seed(0)
    fn, inputs = _second_order_calls("cpu")[name]
    torch.autograd.gradgradcheck(fn, inputs)


def test_second_order_gradients_through_lse():
    """The lse's gradient joins the recomputation's too (a z-loss differentiated twice), as on
    the reference backend."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 3, dtype=torch.float64), torch.randn(1, 2, 5, 2, dtype=torch.float64)
    hessian_vector = []
    for backend in ("cpu", "reference"):
        out, lse = attnx.scaled_dot_product_attention(q, k, v, backend=backend, return_lse=True)
        g, = torch.autograd.grad(out.sum() + lse.pow(2).sum(), q, create_graph=True)
        hessian_vector.append(torch.autograd.grad(g.pow(2).sum(), q)[0])
    torch.testing.assert_close(*hessian_vector, rtol=1e-5, atol=1e-6)  # lse is float32


def test_second_order_gradients_under_torch_func_raise():
    """torch.func.grad runs every backward with create_graph=True, so the fused backward serves
    it; grad of grad then raises rather than coming out silently wrong."""
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    k, v = torch.randn(1, 2, 5, 3, dtype=torch.float64), torch.randn(1, 2, 5, 2, dtype=torch.float64)

    def loss(q):
        return attnx.scaled_dot_product_attention(q, k, v, backend="cpu").pow(2).sum()

    torch.testing.assert_close(torch.func.grad(loss)(q), torch.func.grad(
        lambda q: attnx.scaled_dot_product_attention(q, k, v, backend="reference").pow(2).sum())(q))
    with pytest.raises(NotImplementedError, match="second-order"):
        torch.func.grad(lambda q: torch.func.grad(loss)(q).sum())(q)


def _additive_raw(window=(-7, 5)):
    q, k = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 5, 8)
    value, v = torch.randn(2, 3, 5, 4), torch.randn(3, 8)
    return (q, k, value, v, None, *window, 0.0, None)


def test_raw_backwards_check_the_saved_shapes():
    """out and lse from a direct caller are read whole: other shapes raise, never read past."""
    fwd = _additive_raw()
    out, lse, _ = torch.ops.attnx.additive_fwd(*fwd, False)
    for bad_out, bad_lse in ((out, lse[:1, :1].clone()), (out[:1].clone(), lse)):
        with pytest.raises(RuntimeError, match="additive_bwd"):
            torch.ops.attnx.additive_bwd(torch.randn_like(bad_out), *fwd[:5], bad_out, bad_lse, *fwd[5:], False)
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 6)
    out, lse = torch.ops.attnx.sdpa_fwd(q, k, v, None, 0.3, -9, 11, 0.0, None)
    with pytest.raises(RuntimeError, match="sdpa_bwd"):
        torch.ops.attnx.sdpa_bwd(out, q, k, v, None, out, lse[:, :1].clone(), 0.3, -9, 11, 0.0, None, False)


def test_raw_additive_band_bounds_of_any_size():
    """A window wider than the sequences (up to the int64 limits) admits every pair."""
    fwd = _additive_raw()
    whole = torch.ops.attnx.additive_fwd(*fwd, False)[0]
    huge = fwd[:5] + (-2**63, 2**63 - 1) + fwd[7:]
    torch.testing.assert_close(torch.ops.attnx.additive_fwd(*huge, False)[0], whole)
    out, lse, _ = torch.ops.attnx.additive_fwd(*huge, False)
    grads = torch.ops.attnx.additive_bwd(out, *huge[:5], out, lse, *huge[5:], False)
    gold = torch.ops.attnx.additive_bwd(out, *fwd[:5], out, lse, *fwd[5:], False)
    for a, b in zip(grads[:4], gold[:4]):
        torch.testing.assert_close(a, b)


def test_meta_tensor_among_real_ones_raises():
    q, k, value, v = _additive_raw()[:4]
    meta = torch.zeros(2, 3, 7, 5, device="meta")
    with pytest.raises(RuntimeError, match="device"):
        torch.ops.attnx.additive_fwd(q, k, value, v, meta, -7, 5, 0.0, None, False)
    with pytest.raises(RuntimeError, match="device"):
        torch.ops.attnx.sdpa_fwd(q, k, value, meta, 1.0, -7, 5, 0.0, None)


def test_auto_order_on_cuda_tensors(monkeypatch):
    """backend=None on CUDA tensors: SDPA tries triton first (measured faster on an H100), the
    other ops cuda first; each falls back to the next that serves the call. Checked on the
    order alone (no GPU needed): every backend is made to serve, then one refuses."""
    from types import SimpleNamespace

    from attnx import _dispatch

    call = SimpleNamespace(q=SimpleNamespace(device=torch.device("cuda"), is_cpu=False),
                           backend="auto")
    refused = set()
    monkeypatch.setattr(_dispatch, "_is_empty", lambda op, c: False)
    monkeypatch.setattr(_dispatch, "_unsupported",
                        lambda name, op, c: "no" if name in refused else None)
    assert _dispatch.select("sdpa", call) == "triton"
    for op in ("additive", "kvcache", "varlen"):
        assert _dispatch.select(op, call) == "cuda"
    refused.add("triton")
    assert _dispatch.select("sdpa", call) == "cuda"
    refused.update({"cuda"})
    assert _dispatch.select("sdpa", call) == "reference"
