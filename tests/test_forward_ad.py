"""Forward-mode AD (torch.func.jvp, torch.autograd.forward_ad): the kernels' ops have no jvp,
so a call with dual inputs runs on the reference backend, whose tangents are torch's; a forced
kernel backend refuses it (its op dropped the tangent silently: no tangent out). So does a call
under forward-over-reverse transforms (jvp of grad, torch.func.hessian), whose tangents reach it
inside grad's wrappers."""

import pytest
import torch
from torch.func import grad, hessian, jacfwd, jvp

import attnx
from attnx import BackendUnavailableError

F64 = torch.float64


def _rand(*shape, seed=0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _central_difference(f, x, t, eps=1e-6):
    return (f(x + eps * t) - f(x - eps * t)) / (2 * eps)


CASES = {
    "sdpa": lambda q: attnx.scaled_dot_product_attention(
        q, _rand(2, 3, 9, 8, seed=1), _rand(2, 3, 9, 5, seed=2), is_causal=True),
    "sdpa_mask": lambda q: attnx.scaled_dot_product_attention(
        q, q[:, :, :, :8].flip(2), _rand(2, 3, 7, 5, seed=2), attn_mask=_rand(7, 7, seed=3)),
    "additive": lambda q: attnx.additive_attention(
        q[:, 0], _rand(2, 9, 8, seed=1), _rand(2, 9, 5, seed=2), _rand(8, seed=3)),
    "varlen": lambda q: attnx.varlen_attention(
        q[0].transpose(0, 1), _rand(9, 3, 8, seed=1), _rand(9, 3, 5, seed=2),
        torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32),
        is_causal=True),
}


@pytest.mark.parametrize("case", CASES)
def test_jvp_matches_a_central_difference(case):
    f = CASES[case]
    q, t = _rand(2, 3, 7, 8, seed=4), _rand(2, 3, 7, 8, seed=5)
    out, tangent = jvp(f, (q,), (t,))
    torch.testing.assert_close(out, f(q))
    torch.testing.assert_close(tangent, _central_difference(f, q, t), rtol=1e-6, atol=1e-8)


def test_a_forced_kernel_backend_refuses_dual_inputs():
    q = _rand(1, 2, 5, 8)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, torch.ones_like(q))
        with pytest.raises(BackendUnavailableError, match="forward-mode AD"):
            attnx.scaled_dot_product_attention(dual, q, q, backend="cpu")
        out = attnx.scaled_dot_product_attention(q, q, q, backend="cpu")  # no tangent: served
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("case", CASES)
def test_forward_over_reverse_runs_on_the_reference(case):
    """Hessian-vector products (jvp of grad) with backend=None: the reference's, equal to a
    central difference of the gradient; a forced kernel backend raises."""
    f = CASES[case]
    q, t = _rand(2, 3, 7, 8, seed=4), _rand(2, 3, 7, 8, seed=5)

    def loss(x):
        return f(x).square().sum()

    _, hvp = jvp(grad(loss), (q,), (t,))
    torch.testing.assert_close(hvp, _central_difference(grad(loss), q, t), rtol=1e-6, atol=1e-7)


def test_hessian_matches_the_reference_and_forced_kernels_refuse():
    q, k, v = _rand(1, 2, 3, 4, seed=0), _rand(1, 2, 5, 4, seed=1), _rand(1, 2, 5, 4, seed=2)

    def loss(q, backend=None):
        return attnx.scaled_dot_product_attention(q, k, v, backend=backend).square().sum()

    torch.testing.assert_close(hessian(loss)(q), hessian(lambda x: loss(x, "reference"))(q))
    with pytest.raises(BackendUnavailableError, match="forward-mode AD"):
        hessian(lambda x: loss(x, "cpu"))(q)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_jacfwd_of_float32_inputs():
    """jacfwd (vmap over jvp, the tangents batched) of float32 inputs with backend=None: the
    reference serves it, float32 out, as float64 computes it."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 4, generator=g) for n in (3, 5, 5))
    jac = jacfwd(lambda x: attnx.scaled_dot_product_attention(x, k, v))(q)
    k64, v64 = k.double(), v.double()
    want = jacfwd(lambda x: attnx.scaled_dot_product_attention(x, k64, v64))(q.double())
    assert jac.dtype == torch.float32
    torch.testing.assert_close(jac.double(), want, rtol=1e-5, atol=1e-6)
