"""attnx.varlen_attention (API.md): packed variable-length batches on the reference, cpu,
triton and cuda backends (triton in Triton's interpreter on CPU tensors without a GPU,
tests/conftest.py, on few and small cases: it runs each program in Python; cuda in float16 and
bfloat16, without a GPU through the host harness, ATTNX_CUDA_ON_CPU=1, csrc/cuda/host/).

The golden value is plain torch SDPA in float64 run on each sequence alone, the bottom-right
band as a bool mask and GQA heads repeated; the bound is a small multiple of what the same
PyTorch computation makes in the tested dtype. Sequences of length 0 and 1, Lq != Lk and rows
with no admissible key (causal with Lq > Lk) are among the cases.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import attnx
from attnx import _dispatch, _ops, _rng
from tests._backends import ON_GPU, cuda_reason, device
from tests._compare import assert_within

HAS_CPU_KERNEL = _ops.has_kernel("varlen_fwd", "CPU")
HAS_TRITON = _dispatch.backends()["triton"].usable
MARKS = {"reference": [],
         "cpu": [pytest.mark.skipif(not HAS_CPU_KERNEL, reason="attnx._C is not built")],
         "triton": [pytest.mark.skipif(not HAS_TRITON,
                                       reason=_dispatch.backends()["triton"].reason)],
         "cuda": [pytest.mark.skipif(cuda_reason() is not None, reason=str(cuda_reason()))]}
BACKENDS = [pytest.param(b, marks=MARKS[b]) for b in ("reference", "cpu")]
TRITON = pytest.param("triton", marks=MARKS["triton"])
CUDA = pytest.param("cuda", marks=MARKS["cuda"])


def cases(backends, *axes):
    """pytest.params of each backend x the cross product of `axes` (lists of tuples)."""
    return [pytest.param(b, *sum(combo, ()), marks=MARKS[b])
            for b in backends for combo in itertools.product(*axes)]


def on(backend, *tensors):
    return tuple(t.to(device(backend)) for t in tensors)


# (Lq, Lk) per sequence
MIXED = [(17, 17), (1, 1), (0, 5), (97, 97), (5, 0), (3, 40), (40, 3)]
LONG = [(1025, 1025), (17, 97)]


def pack(lens, hq, hkv, e, ev, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(a for a, _ in lens), sum(b for _, b in lens)
    q = torch.randn(tq, hq, e, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(tk, hkv, e, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(tk, hkv, ev, generator=g, dtype=torch.float64).to(dtype)
    cu_q = torch.tensor([0] + [a for a, _ in lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [b for _, b in lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    return q, k, v, cu_q, cu_k


def allowed(lq, lk, is_causal, window):
    """Bool (Lq, Lk): the band aligned bottom-right."""
    d = torch.arange(lk).view(1, lk) - torch.arange(lq).view(lq, 1) - (lk - lq)
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if is_causal:
        ok &= d <= 0
    if window is not None:
        left, right = window
        if left is not None:
            ok &= d >= -left
        if right is not None:
            ok &= d <= right
    return ok


def golden(q, k, v, lens, is_causal=False, window=None, scale=None, dtype=torch.float64,
           softcap=None, alibi=None, sinks=None):
    """Per-sequence attention in `dtype` (output, lse); empty rows give zeros and -inf (the
    sink, with sinks). The modifiers as API.md words them: softcap, then -slope |i + Lk - Lq - j|
    (alibi (N, Hq), a row per sequence), then the band; the sink in every row's denominator."""
    hq, hkv = q.shape[1], k.shape[1]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    outs, lses, q0, k0 = [], [], 0, 0
    for n, (lq, lk) in enumerate(lens):
        qs = q[q0:q0 + lq].transpose(0, 1)
        ks, vs = (t[k0:k0 + lk].transpose(0, 1).repeat_interleave(hq // hkv, 0) for t in (k, v))
        ok = allowed(lq, lk, is_causal, window)
        sc = scale if scale is not None else q.shape[-1] ** -0.5
        s = qs @ ks.transpose(-1, -2) * sc
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if alibi is not None:
            dist = (torch.arange(lq).view(lq, 1) + lk - lq - torch.arange(lk).view(1, lk)).abs()
            s = s - alibi[n].to(dtype).view(hq, 1, 1) * dist.to(dtype)
        s = s.masked_fill(~ok, float("-inf"))
        if sinks is not None:
            sink = sinks.to(dtype).view(hq, 1, 1).expand(hq, lq, 1)
            lse = torch.logsumexp(torch.cat([s, sink], -1), -1)
        else:
            lse = torch.logsumexp(s, -1) if lk else torch.full((hq, lq), float("-inf"), dtype=dtype)
        p = torch.where(ok, torch.exp(s - lse.unsqueeze(-1)), torch.zeros_like(s))
        outs.append((p @ vs).transpose(0, 1))
        lses.append(lse)
        q0, k0 = q0 + lq, k0 + lk
    return torch.cat(outs), torch.cat(lses, 1)


TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 2e-3}


# Queries outnumbering every sequence's keys: an unbounded band must reach Lq - 1 past the
# bottom-right diagonal, beyond the longest key run.
FEW_KEYS = [(40, 3), (6, 1), (0, 2), (9, 9)]
GOLDEN_CASES = [(MIXED, False, None, (3, 3)), (MIXED, True, None, (4, 2)),
                (MIXED, False, (4, 2), (4, 1)), (MIXED, True, (8, None), (4, 2)),
                (FEW_KEYS, False, None, (2, 1)), (FEW_KEYS, False, (2, None), (2, 2))]


# The long case once per backend (float32, float64); triton (no float64) in float32 and the
# short causal GQA case in bfloat16.
@pytest.mark.parametrize(
    "backend,dtype,lens,is_causal,window,heads",
    cases(["reference", "cpu"], [(torch.float32,), (torch.bfloat16,), (torch.float64,),
                                 (torch.float16,)], GOLDEN_CASES)
    + cases(["reference", "cpu"], [(torch.float32,), (torch.float64,)],
            [(LONG, True, None, (4, 2))])
    + cases(["triton"], [(torch.float32,)], GOLDEN_CASES)
    + cases(["triton"], [(torch.bfloat16,)], GOLDEN_CASES[1:2])
    + cases(["cuda"], [(torch.float16,), (torch.bfloat16,)], GOLDEN_CASES)
    + cases(["cuda"], [(torch.float16,)], [(LONG[1:], True, None, (4, 2))]))
def test_matches_golden(backend, dtype, lens, is_causal, window, heads):
    hq, hkv = heads
    q, k, v, cu_q, cu_k = pack(lens, hq, hkv, 16, 8, dtype)
    out, lse = attnx.varlen_attention(*on(backend, q, k, v, cu_q, cu_k), is_causal=is_causal,
                                      window=window, backend=backend, return_lse=True)
    out, lse = out.cpu(), lse.cpu()
    want, want_lse = golden(q, k, v, lens, is_causal, window)
    base, _ = golden(q, k, v, lens, is_causal, window, dtype=dtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_within(out, want, base, floor=TOL[dtype])
    assert lse.shape == (hq, q.shape[0])
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert_within(lse[~empty], want_lse[~empty].float(), want_lse[~empty].float(), floor=1e-5,
                  what="lse")
    if empty.any():  # rows with no admissible key: zeros
        assert (out.transpose(0, 1)[empty] == 0).all()


GRAD_CASES = [(False, None), (True, None), (True, (6, None))]


@pytest.mark.parametrize("backend,dtype,is_causal,window",
                         cases(["reference", "cpu"], [(torch.float32,), (torch.bfloat16,),
                                                      (torch.float16,)], GRAD_CASES)
                         # the interpreter takes ~10 s a case: causal in bfloat16 only
                         + cases(["triton"], [(torch.float32,)], GRAD_CASES[::2])
                         + cases(["triton"], [(torch.bfloat16,)], GRAD_CASES[1:2])
                         + cases(["cuda"], [(torch.float16,), (torch.bfloat16,)], GRAD_CASES))
def test_gradients(backend, dtype, is_causal, window):
    lens = MIXED
    q, k, v, cu_q, cu_k = pack(lens, 4, 2, 16, 8, dtype, seed=1)
    g = torch.randn(q.shape[0], 4, 8, generator=torch.Generator().manual_seed(2))
    gl = torch.randn(4, q.shape[0], generator=torch.Generator().manual_seed(3))

    def grads(fn, x, y, z):
        x, y, z = (t.detach().requires_grad_() for t in (x, y, z))
        out, lse = fn(x, y, z)
        ok = torch.isfinite(lse)
        gd, gld = g.to(out), gl.to(lse)  # dtype and device
        (out * gd).sum().add((lse.where(ok, 0) * gld).sum()).backward()
        return x.grad.cpu(), y.grad.cpu(), z.grad.cpu()

    dcu_q, dcu_k = on(backend, cu_q, cu_k)
    got = grads(lambda *t: attnx.varlen_attention(*t, dcu_q, dcu_k, is_causal=is_causal,
                                                  window=window, backend=backend,
                                                  return_lse=True), *on(backend, q, k, v))
    want = grads(lambda *t: golden(*t, lens, is_causal, window), q, k, v)
    base = grads(lambda *t: golden(*t, lens, is_causal, window, dtype=dtype), q, k, v)
    for name, a, w, b in zip(("dq", "dk", "dv"), got, want, base):
        assert a.dtype == dtype
        assert_within(a, w, b, factor=3.0, floor=TOL[dtype], what=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_gradcheck(backend):
    lens = [(3, 5), (1, 1), (4, 2)]
    q, k, v, cu_q, cu_k = pack(lens, 2, 1, 4, 3, torch.float64)
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    fn = lambda *t: attnx.varlen_attention(*t, cu_q, cu_k, is_causal=True, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs)


def dropout_dtype(backend):
    return torch.float16 if backend == "cuda" else torch.float32  # cuda: 16-bit only


def dropout_reference(fn, low):
    """(golden, baseline) of fn(name, dtype): the reference in float64 (the same dropout mask)
    and in `low`, the dtype tested."""
    return fn("reference", torch.float64), fn("reference", low)


@pytest.mark.parametrize("backend", BACKENDS + [TRITON, CUDA])
def test_dropout(backend):
    """Reproducible under torch.manual_seed; the kernels drop what the reference drops; two
    identical sequences of one batch get different patterns (each its own seed)."""
    lens = [(20, 20), (20, 20), (7, 9)]
    dtype = dropout_dtype(backend)
    q, k, v, cu_q, cu_k = pack([(20, 20), (0, 0), (7, 9)], 2, 2, 8, 8, dtype)
    q = torch.cat([q[:20], q[:20], q[20:]])
    k = torch.cat([k[:20], k[:20], k[20:]])
    v = torch.cat([v[:20], v[:20], v[20:]])
    cu_q = torch.tensor([0, 20, 40, 47], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 40, 49], dtype=torch.int32)

    def run(name, dt=dtype):
        torch.manual_seed(7)
        x, y, z = (t.to(dt) for t in (q, k, v))
        return attnx.varlen_attention(*on(name, x, y, z, cu_q, cu_k), dropout_p=0.3,
                                      backend=name).cpu()

    a, b = run(backend), run(backend)
    assert torch.equal(a, b)
    assert_within(a, *dropout_reference(run, dtype), floor=TOL[dtype])
    assert not torch.allclose(a[:20], a[20:40])
    no_drop = attnx.varlen_attention(*on(backend, q, k, v, cu_q, cu_k), backend=backend).cpu()
    assert not torch.allclose(a, no_drop)
    assert lens  # the packing above


@pytest.mark.parametrize("backend", BACKENDS + [TRITON, CUDA])
def test_dropout_pattern_is_the_references(backend):
    """Bit for bit: with one-hot values (key j of a sequence -> column j) output column j of
    query i is nonzero iff element (i, j) was kept, and the kept set must be the reference's
    mask of each sequence (_rng.keep_mask with _rng.sequence_seed), GQA heads included."""
    lens = [(9, 12), (12, 5), (1, 1), (6, 12)]
    dtype = dropout_dtype(backend)
    q, k, _, cu_q, cu_k = pack(lens, 2, 1, 8, 8, dtype, seed=8)
    v = torch.cat([torch.eye(12)[:lk] for _, lk in lens]).view(-1, 1, 12).to(dtype)
    torch.manual_seed(11)
    seed = _rng.draw_seed()  # the one the call below draws
    torch.manual_seed(11)
    out = attnx.varlen_attention(*on(backend, q, k, v, cu_q, cu_k), dropout_p=0.4,
                                 backend=backend).cpu()
    q0 = 0
    for n, (lq, lk) in enumerate(lens):
        keep = _rng.keep_mask(_rng.sequence_seed(seed, n), 1, 2, lq, lk, 0.4, "cpu")[0]
        assert torch.equal(out[q0:q0 + lq, :, :lk].transpose(0, 1) != 0, keep)
        q0 += lq


@pytest.mark.parametrize("backend", BACKENDS[1:] + [TRITON, CUDA])
def test_dropout_gradients_match_reference(backend):
    """The backward draws the forward's mask (causal GQA, Lq != Lk)."""
    lens = [(9, 12), (12, 5), (1, 1)]
    dtype = dropout_dtype(backend)
    q, k, v, cu_q, cu_k = pack(lens, 4, 2, 16, 8, dtype, seed=9)
    g = torch.randn(q.shape[0], 4, 8, generator=torch.Generator().manual_seed(10))

    def grads(name, dt=dtype):
        x, y, z, cq, ck, gd = on(name, *(t.detach().to(dt) for t in (q, k, v)), cu_q, cu_k,
                                 g.to(dt))
        x, y, z = (t.requires_grad_() for t in (x, y, z))
        torch.manual_seed(12)
        out = attnx.varlen_attention(x, y, z, cq, ck, dropout_p=0.25, is_causal=True,
                                     backend=name)
        (out * gd).sum().backward()
        return [t.grad.cpu() for t in (x, y, z)]

    # cuda: 4x, as its SDPA dropout gradients (tests/test_modifiers.py): dS reads delta =
    # rowsum(dO O) of the kernel's float16 O, with the kept values scaled by 1 / (1 - p)
    # (measured: dk 3.2x)
    factor = 4.0 if backend == "cuda" else 3.0
    for name, got, want, base in zip(("dq", "dk", "dv"), grads(backend),
                                     *dropout_reference(grads, dtype)):
        assert_within(got, want, base, factor=factor, floor=TOL[dtype], what=name)


@pytest.mark.skipif(not HAS_TRITON, reason=_dispatch.backends()["triton"].reason)
def test_triton_auto_and_opcheck():
    """backend=None picks triton for CUDA tensors; the triton ops' schemas, fake kernels and
    the forward's autograd registration as torch.library checks them (its aot_dispatch check
    reruns the op many times in the interpreter; the gradient tests cover the backward)."""
    from attnx import _validate
    from attnx.triton import varlen  # noqa: F401  (registers the ops)
    dev = device("triton")
    q, k, v, cu_q, cu_k = on("triton", *pack([(3, 5), (4, 2)], 2, 1, 16, 8, torch.float32))
    if dev == "cuda":
        call = _validate.varlen_call(q, k, v, cu_q, cu_k, None, None, 0.0, True, None, None,
                                     None, None, None, None, False)
        assert _dispatch.select("varlen", call) == "triton"
    q.requires_grad_()
    fwd = (q, k, v, cu_q, cu_k, 4, 5, 0.25, -9, 0, 0.0, None)
    torch.library.opcheck(torch.ops.attnx.triton_varlen_fwd.default, fwd,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))
    mods = (2.0, torch.tensor([[0.5, 0.25], [1.0, 0.1]], device=dev),
            torch.tensor([0.5, -1.0], device=dev))
    torch.library.opcheck(torch.ops.attnx.triton_varlen_fwd.default, fwd + mods,
                          test_utils=("test_schema", "test_faketensor"))
    out, lse = torch.ops.attnx.triton_varlen_fwd(*fwd)
    torch.library.opcheck(torch.ops.attnx.triton_varlen_bwd.default,
                          (torch.randn_like(out), q.detach(), k, v, cu_q, cu_k, 4, 5,
                           out.detach(), lse.detach(), 0.25, -9, 0, 0.0, None,
                           torch.randn_like(lse)), test_utils=("test_schema", "test_faketensor"))


def test_auto_picks_cpu_and_opcheck():
    if not HAS_CPU_KERNEL:
        pytest.skip("attnx._C is not built")
    from attnx import _dispatch, _validate
    q, k, v, cu_q, cu_k = pack(MIXED, 4, 2, 16, 8, torch.float32)
    call = _validate.varlen_call(q, k, v, cu_q, cu_k, None, None, 0.0, True, None, None, None,
                                 None, None, None, False)
    assert _dispatch.select("varlen", call) == "cpu"
    q.requires_grad_()
    torch.library.opcheck(torch.ops.attnx.varlen_fwd,
                          (q, k, v, cu_q, cu_k, 0.25, -200, 0, 0.0, None))


BAD = [
    (dict(cu_seqlens_q=torch.tensor([0, 3, 5])), TypeError, "cu_seqlens_q: expected dtype torch.int32"),
    (dict(cu_seqlens_q=torch.tensor([1, 3, 5], dtype=torch.int32)), ValueError, "start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 4, 3, 5], dtype=torch.int32)), ValueError, "non-decreasing"),
    (dict(cu_seqlens_k=torch.tensor([0, 3, 6], dtype=torch.int32)), ValueError, "end at the total"),
    (dict(cu_seqlens_k=torch.tensor([0, 2, 3, 5], dtype=torch.int32)), ValueError, "expected 3 entries"),
    (dict(cu_seqlens_q=[0, 3, 5]), TypeError, "cu_seqlens_q: expected an int32 torch.Tensor"),
    (dict(max_seqlen_q=2), ValueError, "max_seqlen_q: expected at least"),
    (dict(softcap=0.0), ValueError, "softcap: expected a finite float > 0"),
    (dict(alibi_slopes=torch.ones(3, 2)), ValueError, "alibi_slopes: expected shape \\(2,\\) or \\(2, 2\\)"),
    (dict(alibi_slopes=torch.ones(2, dtype=torch.float64)), TypeError, "alibi_slopes: expected dtype torch.float32"),
    (dict(sinks=torch.zeros(3)), ValueError, "sinks: expected shape \\(2,\\)"),
    (dict(sinks=torch.zeros(2, dtype=torch.float64)), TypeError, "sinks: expected dtype"),
    (dict(q=torch.randn(1, 5, 2, 8)), ValueError, "q: expected 3 dimensions"),
    (dict(k=torch.randn(5, 3, 8), v=torch.randn(5, 3, 4)), ValueError,
     "k: expected a head count dividing 2"),
    (dict(v=torch.randn(5, 2, 4, dtype=torch.float64)), TypeError, "v: expected dtype torch.float32"),
    (dict(backend="triton", **{n: torch.randn(5, h, 8, dtype=torch.float64)
                               for n, h in (("q", 2), ("k", 1), ("v", 1))}), ValueError,
     "backend: 'triton' cannot run this call: .*(TRITON_INTERPRET|takes float16, bfloat16 and "
     "float32, got torch.float64)"),
    (dict(backend="cuda"), ValueError,
     "backend: 'cuda' cannot run this call: the cuda backend takes CUDA tensors, got device cpu"),
    (dict(is_causal=1), TypeError, "is_causal: expected a bool"),
]


@pytest.mark.parametrize("change,error,message", BAD)
def test_bad_input(change, error, message):
    args = dict(q=torch.randn(5, 2, 8), k=torch.randn(5, 1, 8), v=torch.randn(5, 1, 4),
                cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 2, 5], dtype=torch.int32))
    args.update(change)
    with pytest.raises(error, match=message):
        attnx.varlen_attention(**args)


HAS_CPU_MODS = _ops.has_kernel("varlen_mod_fwd", "CPU")
MOD_CPU_MARK = pytest.mark.skipif(not HAS_CPU_MODS, reason="attnx._C is not built with varlen_mod_fwd")
MOD_BACKENDS = ["reference", pytest.param("cpu", marks=MOD_CPU_MARK)]
MOD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# (Lq, Lk) per sequence: Lq != Lk both ways (ALiBi's bottom-right alignment shows), lengths 0
# and 1, a sequence without keys (its rows: lse = the sink), causal rows with no key (Lq > Lk)
MOD_LENS = [(17, 17), (1, 1), (5, 0), (3, 40), (40, 3), (0, 4), (9, 23)]
MODS = {
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes=torch.tensor([[0.5, 0.25, 0.125, 1.0]] * 7) * torch.arange(
        1, 8, dtype=torch.float32).view(7, 1) / 4),
    "alibi_per_head": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 1.0])),
    "sinks": dict(sinks=torch.tensor([0.3, -1.0, 2.0, 0.0])),
    "all": dict(softcap=2.0, alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 1.0]),
                sinks=torch.tensor([0.3, -1.0, 2.0, 0.0])),
}


def run_with_modifiers(fn, q, k, v, sinks, sinks_dtype, g, gl):
    """((out, lse), gradients of q, k, v (and sinks)) of fn(q, k, v, sinks) under the loss
    sum(out g) + sum(lse gl) over the finite lse; sinks (or None) taken in sinks_dtype."""
    x, y, z = (t.detach().requires_grad_() for t in (q, k, v))
    sinks = None if sinks is None else sinks.detach().to(sinks_dtype).clone().requires_grad_()
    out, lse = fn(x, y, z, sinks)
    ok = torch.isfinite(lse)
    (out * g.to(out.dtype)).sum().add((lse.where(ok, 0) * gl.to(lse.dtype)).sum()).backward()
    grads = (x.grad, y.grad, z.grad) + ((sinks.grad,) if sinks is not None else ())
    return (out.detach(), lse.detach()), grads


def _golden_mods(kw):
    alibi = kw.get("alibi_slopes")
    if alibi is not None and alibi.dim() == 1:
        alibi = alibi.expand(len(MOD_LENS), -1)
    return dict(softcap=kw.get("softcap"), alibi=alibi, sinks=kw.get("sinks"))


@pytest.mark.parametrize("backend,dtype",
                         [pytest.param("reference", d) for d in MOD_DTYPES]
                         + [pytest.param("cpu", d, marks=MOD_CPU_MARK) for d in MOD_DTYPES]
                         + cases(["cuda"], [(torch.float16,), (torch.bfloat16,)]))
@pytest.mark.parametrize("mod", list(MODS))
@pytest.mark.parametrize("is_causal", [False, True])
def test_modifiers_match_golden(backend, dtype, mod, is_causal):
    """Output, lse and gradients (q, k, v, sinks) with the modifiers vs the float64 formula."""
    kw = MODS[mod]
    q, k, v, cu_q, cu_k = pack(MOD_LENS, 4, 2, 16, 8, dtype, seed=4)
    g = torch.randn(q.shape[0], 4, 8, generator=torch.Generator().manual_seed(5))
    gl = torch.randn(4, q.shape[0], generator=torch.Generator().manual_seed(6))

    def run(fn, sinks_dtype):
        return run_with_modifiers(fn, q, k, v, kw.get("sinks"), sinks_dtype, g, gl)

    sdtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    dev = device(backend)

    def call(x, y, z, s):  # on the backend's device, the results back on the CPU
        args = on(backend, x, y, z, cu_q, cu_k)
        mods = {n: t.to(dev) if isinstance(t, torch.Tensor) else t
                for n, t in dict(kw, sinks=s).items()}
        out, lse = attnx.varlen_attention(*args, is_causal=is_causal, backend=backend,
                                          return_lse=True, **mods)
        return out.cpu(), lse.cpu()

    (out, lse), got = run(call, sdtype)
    gm = _golden_mods(kw)
    (want, want_lse), want_g = run(lambda x, y, z, s: golden(
        x, y, z, MOD_LENS, is_causal, **dict(gm, sinks=s)), torch.float64)
    (base, _), base_g = run(lambda x, y, z, s: golden(
        x, y, z, MOD_LENS, is_causal, dtype=dtype, **dict(gm, sinks=s)), sdtype)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_within(out, want, base, floor=TOL[dtype])
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    assert_within(lse[fin], want_lse[fin].float(), want_lse[fin].float(), floor=1e-5, what="lse")
    for name, a, w, b in zip(("dq", "dk", "dv", "dsinks"), got, want_g, base_g):
        assert_within(a, w, b, factor=3.0, floor=TOL[dtype], what=name)


# Lq != Lk both ways (ALiBi's and the band's bottom-right alignment), lengths 0 and 1, a
# sequence without keys: few and short, the interpreter runs each program in Python
TRITON_LENS = [(17, 17), (1, 1), (3, 20), (20, 3), (0, 4), (9, 0)]


@pytest.mark.parametrize("backend,dtype,mod,is_causal",
                         # the interpreter runs each program in Python: few cases
                         cases(["triton"], [(torch.float32, "all", True),
                                            (torch.bfloat16, "sinks", False),
                                            (torch.float32, "softcap", False),
                                            (torch.float32, "alibi", False)]))
def test_triton_modifiers_match_golden(backend, dtype, mod, is_causal):
    """Output, lse and gradients (q, k, v, sinks) of triton's varlen with the modifiers, GQA,
    against the float64 formula."""
    kw = dict(MODS[mod])
    if isinstance(kw.get("alibi_slopes"), torch.Tensor) and kw["alibi_slopes"].dim() == 2:
        kw["alibi_slopes"] = kw["alibi_slopes"][:len(TRITON_LENS)]
    q, k, v, cu_q, cu_k = pack(TRITON_LENS, 4, 2, 16, 8, dtype, seed=7)
    g = torch.randn(q.shape[0], 4, 8, generator=torch.Generator().manual_seed(5))
    gl = torch.randn(4, q.shape[0], generator=torch.Generator().manual_seed(6))
    sdtype = torch.float32 if dtype == torch.bfloat16 else dtype

    def run(fn, sinks_dtype):
        return run_with_modifiers(fn, q, k, v, kw.get("sinks"), sinks_dtype, g, gl)

    def call(x, y, z, s):
        mods = {n: t.to(device(backend)) if isinstance(t, torch.Tensor) else t
                for n, t in dict(kw, sinks=s).items()}
        out, lse = attnx.varlen_attention(*on(backend, x, y, z, cu_q, cu_k), is_causal=is_causal,
                                          backend=backend, return_lse=True, **mods)
        return out.cpu(), lse.cpu()

    alibi = kw.get("alibi_slopes")
    gm = dict(softcap=kw.get("softcap"), sinks=None,
              alibi=None if alibi is None else alibi.expand(len(TRITON_LENS), -1))
    (out, lse), got = run(call, sdtype)
    (want, want_lse), want_g = run(lambda x, y, z, s: golden(
        x, y, z, TRITON_LENS, is_causal, **dict(gm, sinks=s)), torch.float64)
    (base, _), base_g = run(lambda x, y, z, s: golden(
        x, y, z, TRITON_LENS, is_causal, dtype=dtype, **dict(gm, sinks=s)), sdtype)
    assert_within(out, want, base, floor=TOL[dtype])
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert_within(lse[fin], want_lse[fin].float(), want_lse[fin].float(), floor=1e-5, what="lse")
    for name, a, w, b in zip(("dq", "dk", "dv", "dsinks"), got, want_g, base_g):
        assert_within(a, w, b, factor=3.0, floor=TOL[dtype], what=name)


@pytest.mark.parametrize("backend", cases(["triton"]))
def test_triton_alibi_rows_of_huge_lse(backend):
    """Scores of hundreds (|lse| >= common.HUGE_LSE): the backward's pre-pass then re-reads the
    keys for its row sums, ALiBi's bottom-right distance included (Lq != Lk). A wrong distance
    there puts r far from 1. The gradients' bound admits what recomputing the scores costs: the
    dK/dV kernel forms them as K Q^T, the forward as Q K^T; summed in different orders (the
    interpreter's numpy matmul on OpenBLAS's Haswell kernels, its pick on a Zen 5) they differ by an
    ulp of |s| ~ 300, so each probability by ~2e-5 relative, which PyTorch's softmax, formed
    once, does not pay (dk's error was 6x its own there; 0.7x on the SkylakeX kernels)."""
    lens = [(3, 20), (20, 3), (5, 5)]
    slopes = torch.tensor([[0.5, 2.0], [1.0, 0.25], [3.0, 0.5]])
    q, k, v, cu_q, cu_k = pack(lens, 2, 1, 16, 8, torch.float32, seed=8)
    g = torch.randn(q.shape[0], 2, 8, generator=torch.Generator().manual_seed(5))
    gl = torch.randn(2, q.shape[0], generator=torch.Generator().manual_seed(6))

    def call(x, y, z, _):
        out, lse = attnx.varlen_attention(*on(backend, x, y, z, cu_q, cu_k), is_causal=True,
                                          scale=40.0, alibi_slopes=slopes.to(device(backend)),
                                          backend=backend, return_lse=True)
        return out.cpu(), lse.cpu()

    def gold(dtype):
        return lambda x, y, z, _: golden(x, y, z, lens, True, scale=40.0, dtype=dtype,
                                         alibi=slopes)
    (out, lse), got = run_with_modifiers(call, q, k, v, None, None, g, gl)
    (want, want_lse), want_g = run_with_modifiers(gold(torch.float64), q, k, v, None, None, g, gl)
    (base, _), base_g = run_with_modifiers(gold(torch.float32), q, k, v, None, None, g, gl)
    assert want_lse[torch.isfinite(want_lse)].abs().max() > 256  # the huge rows are there
    assert_within(out, want, base, floor=TOL[torch.float32])
    # 8 units in the last place of the largest score (~ the largest lse), relative to each
    # gradient's size
    recompute = 8 * 2.0 ** -24 * want_lse[torch.isfinite(want_lse)].abs().max().item()
    for name, a, w, b in zip(("dq", "dk", "dv"), got, want_g, base_g):
        floor = max(TOL[torch.float32], recompute * w.abs().max().item())
        assert_within(a, w, b, factor=3.0, floor=floor, what=name)


@pytest.mark.parametrize("backend", MOD_BACKENDS)
def test_modifiers_float64_gradcheck(backend):
    lens = [(3, 5), (1, 1), (4, 2), (2, 0)]
    q, k, v, cu_q, cu_k = pack(lens, 2, 1, 4, 3, torch.float64)
    sinks = torch.tensor([0.5, -0.25], dtype=torch.float64)
    inputs = tuple(t.requires_grad_() for t in (q, k, v, sinks))
    slopes = torch.tensor([[0.5, 0.25], [1.0, 0.1], [0.3, 0.2], [0.0, 1.0]])

    def fn(x, y, z, s):
        return attnx.varlen_attention(x, y, z, cu_q, cu_k, is_causal=True, softcap=1.25,
                                      alibi_slopes=slopes, sinks=s, backend=backend)
    assert torch.autograd.gradcheck(fn, inputs)  # (lse is float32: its gradient is checked above)


def test_modifiers_auto_picks_cpu_and_opcheck():
    if not HAS_CPU_MODS:
        pytest.skip("attnx._C is not built with varlen_mod_fwd")
    from attnx import _dispatch, _validate
    q, k, v, cu_q, cu_k = pack(MOD_LENS, 4, 2, 16, 8, torch.float32)
    sinks = MODS["sinks"]["sinks"].clone().requires_grad_()
    call = _validate.varlen_call(q, k, v, cu_q, cu_k, None, None, 0.0, True, None, None, 2.0,
                                 None, sinks, None, False)
    assert _dispatch.select("varlen", call) == "cpu"
    q.requires_grad_()
    slopes = MODS["alibi"]["alibi_slopes"]
    torch.library.opcheck(torch.ops.attnx.varlen_mod_fwd,
                          (q, k, v, cu_q, cu_k, 0.25, -200, 0, 0.0, None, 2.0, slopes, sinks))


@pytest.mark.parametrize("backend", MOD_BACKENDS)
def test_sinks_are_read_not_written(backend):
    """One float64 query row: the sinks' float64 copy is the sinks themselves, and the rows'
    lse once went into that buffer (the caller's sinks, and the saved ones, overwritten)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.tensor([0.3, -0.2], dtype=torch.float64)
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32) for n in (1, 3))
    out, lse = attnx.varlen_attention(q, k, v, cu_q, cu_k, sinks=sinks, backend=backend,
                                      return_lse=True)
    assert sinks.tolist() == [0.3, -0.2]
    want, want_lse = golden(q, k, v, [(1, 3)], sinks=sinks)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)
    if backend != "reference":
        torch.library.opcheck(torch.ops.attnx.varlen_mod_fwd,
                              (q, k, v, cu_q, cu_k, 0.5, -10, 10, 0.0, None, 0.0, None, sinks))


@pytest.mark.parametrize("backend", BACKENDS + [TRITON, CUDA])
def test_strided_prefix_sums_and_sinks(backend):
    """cu_seqlens and sinks as strided views give what their contiguous copies give, gradients
    included (Triton read cu[n] and sinks[h] at n and h: past the view, or the wrong sinks)."""
    dtype = dropout_dtype(backend)
    q, k, v, cu_q, cu_k = pack([(5, 7), (0, 3), (4, 4)], 4, 2, 16, 8, dtype, seed=12)
    wide = [torch.stack([c, torch.full_like(c, 99)], 1).view(-1)[::2] for c in (cu_q, cu_k)]
    sinks = torch.tensor([0.3, 9.0, -1.0, 9.0, 2.0, 9.0, 0.5, 9.0])

    def run(cus, sinks, view):
        x = [t.clone().requires_grad_() for t in on(backend, q, k, v)]
        s = sinks.to(device(backend), copy=True).requires_grad_()
        out = attnx.varlen_attention(*x, *on(backend, *cus), sinks=view(s), backend=backend)
        out.float().square().sum().backward()
        return [out.cpu()] + [t.grad.cpu() for t in x] + [view(s.grad).cpu()]

    assert not wide[0].is_contiguous()
    got = run(wide, sinks, lambda t: t[::2])
    want = run((cu_q, cu_k), sinks[::2].clone(), lambda t: t)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_no_sequences_backpropagate(backend, dtype):
    """cu_seqlens [0]: empty results on the inputs' graph (float64's had no grad_fn)."""
    empty = torch.zeros(1, dtype=torch.int32)
    x = [torch.zeros(0, 4, 16, dtype=dtype, requires_grad=True) for _ in range(3)]
    out, lse = attnx.varlen_attention(*x, empty, empty, backend=backend, return_lse=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)
    for result in (out, lse):
        for t in x:
            t.grad = None
        result.sum().backward(retain_graph=True)
        assert all(t.grad is not None and t.grad.shape == t.shape for t in x)


def _cuda_ops():
    return torch.ops.attnx if ON_GPU else torch.ops.attnx_cuda_host


@pytest.mark.parametrize("backend", [CUDA])
def test_cuda_opcheck(backend):
    """The cuda ops' schemas, fake kernels and autograd registration (harness or GPU)."""
    dev = device(backend)
    q, k, v, cu_q, cu_k = on(backend, *pack([(3, 5), (4, 2), (0, 1)], 2, 1, 16, 8,
                                             torch.float16))
    q.requires_grad_()
    sinks = torch.tensor([0.5, -1.0], device=dev)
    slopes = torch.tensor([[0.5, 0.25], [1.0, 0.1], [0.3, 0.2]], device=dev)
    ops = _cuda_ops()
    torch.library.opcheck(ops.varlen_fwd.default, (q, k, v, cu_q, cu_k, 0.25, -9, 0, 0.0, None))
    torch.library.opcheck(ops.varlen_mod_fwd.default,
                          (q, k, v, cu_q, cu_k, 0.25, -9, 0, 0.0, None, 2.0, slopes, sinks))
    if ON_GPU:  # backend=None takes the cuda kernels for CUDA tensors, modifiers included
        from attnx import _validate
        call = _validate.varlen_call(q, k, v, cu_q, cu_k, None, None, 0.0, True, None, None, 2.0,
                                     None, sinks, None, False)
        assert _dispatch.select("varlen", call) == "cuda"


CUDA_BAD = [
    (dict(cu_q=[0, 4, 3, 7]), "cu_seqlens_q: expected non-decreasing values, got 4 then 3"),
    (dict(cu_q=[0, 3, 6]), "cu_seqlens_q: expected prefix sums from 0 to 7, got 0 to 6"),
    (dict(cu_k=[1, 3, 7]), "cu_seqlens_k: expected prefix sums from 0 to 7"),
    (dict(cu_k=[0, 3, 5, 7]), "cu_seqlens_k: expected 3 entries"),
]


@pytest.mark.parametrize("backend", [CUDA])
@pytest.mark.parametrize("change,message", CUDA_BAD)
def test_cuda_op_checks_prefix_sums(backend, change, message):
    """A direct caller of the op gets an error, not a kernel reading past q or k."""
    q, k, v, cu_q, cu_k = on(backend, *pack([(3, 3), (4, 4)], 2, 1, 16, 8, torch.float16))
    cus = dict(cu_q=cu_q, cu_k=cu_k)
    cus.update({n: torch.tensor(val, dtype=torch.int32, device=q.device)
                for n, val in change.items()})
    with pytest.raises(RuntimeError, match=message):
        _cuda_ops().varlen_fwd(q, k, v, cus["cu_q"], cus["cu_k"], 0.25, -9, 0, 0.0, None)
