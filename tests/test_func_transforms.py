"""torch.func's reverse-mode transforms (grad, vjp, jacrev, vmap of grad) over the backends.

torch.library builds each op's autograd from register_autograd as an autograd.Function without
setup_context, which torch.func refuses (RuntimeError), where torch's own SDPA works; under these
transforms attnx runs the same formulas as Functions of its own (attnx/_ops.py `call`). Each
case is checked against plain autograd through the same backend; second-order gradients under
these transforms stay the reference backend's (the fused backward ops have none:
NotImplementedError; plain autograd's create_graph=True recomputes on the reference,
attnx/_second_order.py). vmap takes no branch on its batched values (attnx/_values.py): the reference then
computes in float64 rather than checking float32 for overflow. Forward mode (jvp, jacfwd) is
test_forward_ad.py's.
"""

import pytest
import torch
from torch.func import grad, jacrev, vjp, vmap

import attnx
from _backends import cuda_reason, device

BACKENDS = ["cpu", "cuda", "triton"]
DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16, "triton": torch.float32,
          "reference": torch.float32}


def _skip_unless_runs(backend):  # (the reference runs anywhere)
    if backend == "cuda" and cuda_reason() is not None:
        pytest.skip(cuda_reason())
    if backend == "triton":
        pytest.importorskip("triton")


def _rand(*shape, seed, backend):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(
        device(backend), DTYPES[backend])


def _cases(be):
    """name -> (f(q, k, v, backend) -> output, (q, k, v))."""
    q, k, v = (_rand(*shape, seed=s, backend=be)
               for s, shape in enumerate(((2, 4, 7, 16), (2, 2, 9, 16), (2, 2, 9, 8))))
    mask = _rand(7, 9, seed=3, backend=be)
    dev = device(be)
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32, device=dev)
    return {
        "sdpa": (lambda q, k, v, be: attnx.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True, backend=be), (q, k, v)),
        "sdpa_causal_softcap": (lambda q, k, v, be: attnx.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True, softcap=5.0, backend=be), (q, k, v)),
        "additive": (lambda q, k, v, be: attnx.additive_attention(
            q[:, 0], k[:, 0], v[:, 0], q[0, 0, 0], backend=be), (q, k, v)),
        "varlen": (lambda q, k, v, be: attnx.varlen_attention(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu_q, cu_k,
            is_causal=True, backend=be), (q, k, v)),
    }


def _autograd(f, args, backend, weight):
    leaves = [a.detach().requires_grad_() for a in args]
    return torch.autograd.grad((f(*leaves, backend) * weight).sum(), leaves)


def _weight(f, args, backend):
    with torch.no_grad():
        out = f(*args, backend)
    return _rand(*out.shape, seed=9, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["sdpa", "sdpa_causal_softcap", "additive", "varlen"])
def test_grad_and_vjp_match_autograd(backend, case):
    _skip_unless_runs(backend)
    f, args = _cases(backend)[case]
    weight = _weight(f, args, backend)
    want = _autograd(f, args, backend, weight)
    got = grad(lambda *a: (f(*a, backend) * weight).sum(), argnums=(0, 1, 2))(*args)
    out, pullback = vjp(lambda *a: f(*a, backend), *args)
    pulled = pullback(weight)
    for g, p, w in zip(got, pulled, want):  # the same kernels: equal up to summation order
        torch.testing.assert_close(g, w)
        torch.testing.assert_close(p, w)
    torch.testing.assert_close(out, f(*args, backend))


# vmap: the ops have no batching rule; torch's per-sample fallback warns of it
NO_BATCHING_RULE = pytest.mark.filterwarnings("ignore:There is a performance drop")


@NO_BATCHING_RULE
@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_per_sample_gradients(backend):
    """vmap(grad): per-sample gradients equal one autograd call per sample."""
    _skip_unless_runs(backend)
    q, k, v = (_rand(3, 1, 2, n, 8, seed=s, backend=backend) for s, n in ((0, 5), (1, 6), (2, 6)))

    def loss(q, k, v):
        out = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
        return out.square().sum()

    per_sample = vmap(grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for i in range(q.shape[0]):
        leaves = [t[i].detach().requires_grad_() for t in (q, k, v)]
        want = torch.autograd.grad(loss(*leaves), leaves)
        for g, w in zip(per_sample, want):
            torch.testing.assert_close(g[i], w)


@NO_BATCHING_RULE
@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_vmap_keeps_the_graph_of_inputs_requiring_grad(backend):
    """vmap's output over leaves requiring grad (plain autograd outside it): differentiable, the
    same gradients as a loop (it had no grad_fn: the batched inputs did not report
    requires_grad, and the op ran below autograd)."""
    _skip_unless_runs(backend)
    q, k, v = (_rand(3, 1, 2, n, 8, seed=s, backend=backend).requires_grad_()
               for s, n in ((0, 5), (1, 6), (2, 6)))

    def f(q, k, v):
        return attnx.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)

    weight = _rand(3, 1, 2, 5, 8, seed=9, backend=backend)
    got = torch.autograd.grad((vmap(f)(q, k, v) * weight).sum(), (q, k, v))
    loop = torch.stack([f(q[i], k[i], v[i]) for i in range(3)])
    want = torch.autograd.grad((loop * weight).sum(), (q, k, v))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@NO_BATCHING_RULE
@pytest.mark.parametrize("backend", [*BACKENDS, "reference"])
def test_jacrev_matches_autograd(backend):
    _skip_unless_runs(backend)
    q, k, v = (_rand(1, 1, n, 4, seed=s, backend=backend) for s, n in ((0, 3), (1, 5), (2, 5)))

    def f(q):
        return attnx.scaled_dot_product_attention(q, k, v, backend=backend)

    jac = jacrev(f)(q)
    assert jac.shape == (1, 1, 3, 4, 1, 1, 3, 4)
    torch.testing.assert_close(jac, torch.autograd.functional.jacobian(f, q))


@pytest.mark.parametrize("backend", BACKENDS)
def test_second_order_names_the_reference(backend):
    """grad of grad: the fused backward ops have no gradient (as in plain autograd); the
    reference backend serves it."""
    _skip_unless_runs(backend)
    q, k, v = (_rand(1, 2, 5, 8, seed=s, backend=backend) for s in range(3))

    def loss(q, be):
        return attnx.scaled_dot_product_attention(q, k, v, backend=be).square().sum()

    with pytest.raises(NotImplementedError, match="backend='reference'"):
        grad(lambda q: grad(loss)(q, backend).sum())(q)
    q64, k64, v64 = (t.cpu().double() for t in (q, k, v))
    hvp = grad(lambda q: grad(lambda x: attnx.scaled_dot_product_attention(
        x, k64, v64, backend="reference").square().sum())(q).sum())(q64)
    assert torch.isfinite(hvp).all()
