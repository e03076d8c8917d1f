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
    else:
        m = torch.randn(shape[-2:], dtype=torch.float64)
    return m.expand(shape)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
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
           mask_kind == "float")
    torch.library.opcheck(torch.ops.attnx.sdpa_bwd.default, bwd)
    torch.library.opcheck(torch.ops.attnx.sdpa_bwd.default, bwd + (torch.randn_like(lse),))


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
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
           None, mask_kind == "float")
    torch.library.opcheck(torch.ops.attnx.additive_bwd.default, bwd)
    torch.library.opcheck(torch.ops.attnx.additive_bwd.default, bwd + (torch.randn_like(lse),))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_second_order_gradients_raise_or_are_right(backend):
    """The fused backward ops have no derivative of their own: a second-order gradient through
    them raises instead of coming out silently wrong; the reference backend computes it."""
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 3, dtype=torch.float64), torch.randn(1, 2, 5, 2, dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64)
    calls = (lambda q: attnx.scaled_dot_product_attention(q, k, v, backend=backend),
             lambda q: attnx.additive_attention(q, k, v, w, backend=backend))
    for fn in calls:
        if backend == "reference":
            torch.autograd.gradgradcheck(fn, (q,))
            continue
        g, = torch.autograd.grad(fn(q).pow(2).sum(), q, create_graph=True)
        with pytest.raises(NotImplementedError, match="second-order"):
            torch.autograd.grad(g.sum(), q)
