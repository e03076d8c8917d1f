"""torch.compile traces through the public ops without graph breaks."""

import pytest
import torch

import attnx


@pytest.mark.parametrize("backend", ["reference", None])
def test_sdpa_compiles_fullgraph(backend):
    q, k, v = (torch.randn(2, 4, 33, 16, requires_grad=True) for _ in range(3))
    mask = torch.rand(33, 33) > 0.2

    def f(q, k, v):
        return attnx.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v)
    want = f(q, k, v)
    torch.testing.assert_close(got, want)
    g1 = torch.autograd.grad(got, (q, k, v))
    g2 = torch.autograd.grad(f(q, k, v), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_additive_compiles_fullgraph():
    q, k, val = torch.randn(2, 9, 8), torch.randn(2, 11, 8), torch.randn(2, 11, 4)
    v = torch.randn(8, requires_grad=True)

    def f(q, k, val, v):
        return attnx.additive_attention(q, k, val, v, is_causal=True)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, val, v)
    torch.testing.assert_close(got, f(q, k, val, v))
