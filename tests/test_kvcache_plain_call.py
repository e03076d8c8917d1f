"""The plain decoding call's fast route. Its short validation (attnx/_validate.py,
_plain_kvcache_call, with csrc/kvcache_plain_args.cpp) against the full one: where the short one
answers, it gives the call the full one gives; for everything it does not vouch for, it declines,
so that the full checks run (and raise, naming the argument). Its unboxed entry to the op
(attnx/_ops.py, kvcache_fwd): the same results, and torch.ops kept where modes need it."""

import dataclasses
import itertools

import pytest
import torch

import attnx
from attnx import _validate


def _full(monkeypatch, *args):
    with monkeypatch.context() as m:
        m.setattr(_validate, "_plain_kvcache_call", lambda *a: None)
        return _validate.kvcache_call(*args)


def _args(q, kc, vc, lens, *, is_causal=True, scale=None, backend=None, return_lse=False,
          k=None, v=None, block_table=None, window=None, softcap=None, alibi=None, sinks=None):
    return (q, kc, vc, lens, k, v, block_table, is_causal, scale, window, softcap, alibi, sinks,
            backend, return_lse)


def _same_call(a, b):
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y), field.name
            assert x.stride() == y.stride(), field.name
        else:
            assert type(x) is type(y) and x == y, (field.name, x, y)


def _tensors(b=2, hq=8, hkv=2, lq=1, cap=24, e=16, ev=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, lq, e, generator=g).to(dtype)
    kc = torch.randn(b, hkv, cap, e, generator=g).to(dtype)
    vc = torch.randn(b, hkv, cap, ev, generator=g).to(dtype)
    lens = torch.randint(0, cap + 1, (b,), generator=g, dtype=torch.int32)
    return q, kc, vc, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_causal,return_lse", [(True, False), (False, True)])
@pytest.mark.parametrize("scale", [None, 0.3, -2.0, 0.0])
@pytest.mark.parametrize("backend", [None, "auto", "cpu", "reference"])
def test_plain_calls_match_the_full_checks(monkeypatch, dtype, is_causal, return_lse, scale,
                                           backend):
    q, kc, vc, lens = _tensors(dtype=dtype)
    args = _args(q, kc, vc, lens, is_causal=is_causal, scale=scale, backend=backend,
                 return_lse=return_lse)
    short = _validate._plain_kvcache_call(*args)
    assert short is not None
    _same_call(short, _full(monkeypatch, *args))
    assert _validate.kvcache_call(*args) is not None


@pytest.mark.parametrize("shape", [(1, 32, 1, 2048, 128, 128), (3, 4, 4, 17, 8, 5),
                                   (2, 6, 3, 1, 1, 1), (1, 1, 97, 1025, 64, 64),
                                   (0, 4, 1, 9, 8, 8), (2, 4, 0, 9, 8, 8), (2, 4, 1, 0, 8, 8),
                                   (2, 4, 1, 9, 0, 8)])
def test_odd_shapes_match_the_full_checks(monkeypatch, shape):
    b, hq, lq, cap, e, ev = shape
    q, kc, vc, lens = _tensors(b, hq, 2 if hq % 2 == 0 else 1, lq, cap, e, ev)
    for lengths in (lens, torch.full((b,), cap, dtype=torch.int32),
                    torch.zeros(b, dtype=torch.int32), 0, cap, cap // 2):
        args = _args(q, kc, vc, lengths)
        short = _validate._plain_kvcache_call(*args)
        assert short is not None
        _same_call(short, _full(monkeypatch, *args))


@pytest.mark.parametrize("kind", ["inference", "requires_grad"])
def test_inference_and_grad_tensors_match_the_full_checks(monkeypatch, kind):
    q, kc, vc, lens = _tensors()
    if kind == "inference":
        with torch.inference_mode():
            q, kc, vc, lens = (t.clone() for t in (q, kc, vc, lens))
    else:
        q.requires_grad_(True)
    args = _args(q, kc, vc, lens)
    short = _validate._plain_kvcache_call(*args)
    assert short is not None
    _same_call(short, _full(monkeypatch, *args))


def test_strided_inputs_match_the_full_checks(monkeypatch):
    q, kc, vc, _ = _tensors(b=2, cap=40)
    lens = torch.tensor([5, 0, 7, 3], dtype=torch.int32)[::2]  # a strided view: copied
    args = _args(q.transpose(1, 2).contiguous().transpose(1, 2), kc[:, :, ::2], vc[:, :, ::2, :8], lens)
    short = _validate._plain_kvcache_call(*args)
    assert short is not None and short.seqlens.is_contiguous()
    _same_call(short, _full(monkeypatch, *args))


def _declined(**changes):
    """Calls the short path must leave to the full checks: each one input away from plain."""
    q, kc, vc, lens = _tensors()
    base = dict(q=q, kc=kc, vc=vc, lens=lens)
    base.update(changes)
    return _args(base.pop("q"), base.pop("kc"), base.pop("vc"), base.pop("lens"), **base)


class _Sub(torch.Tensor):
    pass


DECLINED = {
    "lengths past the cache": dict(lens=torch.tensor([3, 25], dtype=torch.int32)),
    "negative lengths": dict(lens=torch.tensor([-1, 2], dtype=torch.int32)),
    "int lengths past the cache": dict(lens=25),
    "negative int lengths": dict(lens=-1),
    "an int length past int32": dict(lens=2**40),
    "a bool length": dict(lens=True),
    "a negative view": dict(q=torch._neg_view(torch.randn(2, 8, 1, 16))),
    "a float length": dict(lens=5.0),
    "int64 lengths": dict(lens=torch.tensor([3, 4])),
    "lengths of the wrong batch": dict(lens=torch.tensor([3], dtype=torch.int32)),
    "2-D lengths": dict(lens=torch.tensor([[3, 4]], dtype=torch.int32)),
    "a tensor subclass": dict(q=_tensors()[0].as_subclass(_Sub)),
    "mixed dtypes": dict(kc=_tensors()[1].double()),
    "an integer query": dict(q=torch.ones(2, 8, 1, 16, dtype=torch.int64)),
    "3-D query": dict(q=torch.randn(8, 1, 16)),
    "head dims apart": dict(kc=torch.randn(2, 2, 24, 8)),
    "value cache of another length": dict(vc=torch.randn(2, 2, 23, 16)),
    "head count not dividing": dict(kc=torch.randn(2, 3, 24, 16), vc=torch.randn(2, 3, 24, 16)),
    "no kv heads": dict(kc=torch.randn(2, 0, 24, 16), vc=torch.randn(2, 0, 24, 16)),
    "cache of another batch": dict(kc=torch.randn(3, 2, 24, 16), vc=torch.randn(3, 2, 24, 16)),
    "meta tensors": dict(q=torch.empty(2, 8, 1, 16, device="meta")),
    "a sparse query": dict(q=torch.randn(2, 8, 1, 16).to_sparse()),
    "an int scale": dict(scale=1),
    "an infinite scale": dict(scale=float("inf")),
    "a NaN scale": dict(scale=float("nan")),
    "a scale past float32": dict(scale=1e300),
    "a 0-d tensor scale": dict(scale=torch.tensor(0.5)),
    "an int is_causal": dict(is_causal=1),
    "a tensor is_causal": dict(is_causal=torch.tensor(True)),
    "an int return_lse": dict(return_lse=0),
    "an unknown backend": dict(backend="gpu"),
    "a non-str backend": dict(backend=3),
    "a window": dict(window=(4, None)),
    "softcap": dict(softcap=30.0),
    "alibi slopes": dict(alibi=torch.ones(8)),
    "sinks": dict(sinks=torch.zeros(8)),
    "new keys": dict(k=torch.randn(2, 2, 1, 16), v=torch.randn(2, 2, 1, 16)),
    "a block id past the blocks": dict(kc=torch.randn(6, 2, 8, 16), vc=torch.randn(6, 2, 8, 16),
                                       block_table=torch.tensor([[0, 1, 6], [2, 3, 4]],
                                                                dtype=torch.int32),
                                       lens=torch.tensor([24, 3], dtype=torch.int32)),
    "a padding id where keys are": dict(kc=torch.randn(6, 2, 8, 16), vc=torch.randn(6, 2, 8, 16),
                                        block_table=torch.tensor([[0, -1, 5], [2, 3, 4]],
                                                                 dtype=torch.int32),
                                        lens=torch.tensor([9, 3], dtype=torch.int32)),
    "lengths past a block table": dict(kc=torch.randn(6, 2, 8, 16), vc=torch.randn(6, 2, 8, 16),
                                       block_table=torch.zeros(2, 3, dtype=torch.int32),
                                       lens=torch.tensor([25, 3], dtype=torch.int32)),
    "an int64 block table": dict(block_table=torch.zeros(2, 3, dtype=torch.int64)),
    "a block table of another batch": dict(block_table=torch.zeros(3, 3, dtype=torch.int32)),
    "a 1-D block table": dict(block_table=torch.zeros(3, dtype=torch.int32)),
    "a block size of 0": dict(kc=torch.randn(6, 2, 0, 16), vc=torch.randn(6, 2, 0, 16),
                              block_table=torch.zeros(2, 3, dtype=torch.int32),
                              lens=torch.zeros(2, dtype=torch.int32)),
    "a block table of many ids": dict(
        kc=torch.randn(6, 2, 8, 16), vc=torch.randn(6, 2, 8, 16),
        block_table=torch.zeros(2, _validate._PLAIN_TABLE_IDS // 2 + 1, dtype=torch.int32)),
}


@pytest.mark.parametrize("name", list(DECLINED))
def test_anything_not_plain_goes_to_the_full_checks(name):
    assert _validate._plain_kvcache_call(*_declined(**DECLINED[name])) is None


@pytest.mark.parametrize("name", ["lengths past the cache", "negative lengths",
                                  "int lengths past the cache", "a block id past the blocks",
                                  "a padding id where keys are", "mixed dtypes",
                                  "head dims apart", "an unknown backend", "a NaN scale",
                                  "an int is_causal", "3-D query"])
def test_bad_plain_looking_calls_still_raise_naming_the_argument(name):
    with pytest.raises((ValueError, TypeError)) as info:
        _validate.kvcache_call(*_declined(**DECLINED[name]))
    assert info.value.args[0].split(":")[0] in (
        "cache_seqlens", "k_cache", "v_cache", "q", "backend", "scale", "is_causal", "block_table")


@pytest.mark.parametrize("lengths", [[24, 3], [0, 0], [17, 17], [1, 24], 9, 0, 24])
@pytest.mark.parametrize("table", ["exact", "padded", "strided"])
def test_paged_calls_match_the_full_checks(monkeypatch, lengths, table):
    """Paged caches: ids past each sequence's keys (padding -1, or anything) are not looked at,
    as in the full checks."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 1, 16, generator=g)
    kc, vc = torch.randn(7, 2, 8, 16, generator=g), torch.randn(7, 2, 8, 12, generator=g)
    ids = {"exact": torch.tensor([[3, 0, 6], [5, 1, 2]], dtype=torch.int32),
           "padded": torch.tensor([[3, 0, 6, -1, 99], [5, 1, 2, -1, -7]], dtype=torch.int32),
           "strided": torch.tensor([[3, 9, 0, 9, 6], [5, 9, 1, 9, 2]], dtype=torch.int32)[:, ::2]}
    lens = lengths if isinstance(lengths, int) else torch.tensor(lengths, dtype=torch.int32)
    args = _args(q, kc, vc, lens, block_table=ids[table])
    short = _validate._plain_kvcache_call(*args)
    assert short is not None and short.block_table is ids[table]
    _same_call(short, _full(monkeypatch, *args))
    got = attnx.attention_with_kvcache(q, kc, vc, lens, block_table=ids[table], backend="cpu")
    want = attnx.attention_with_kvcache(q, kc, vc, lens, block_table=ids[table],
                                        backend="reference")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_under_vmap_the_full_checks_run(monkeypatch):
    """vmap's batched tensors are plain torch.Tensors whose shapes hide the vmapped dim: the
    short path declines while a functorch transform is active."""
    seen = []
    plain = _validate._plain_kvcache_call
    monkeypatch.setattr(_validate, "_plain_kvcache_call", lambda *a: seen.append(plain(*a)))
    q, kc, vc, _ = _tensors()
    lens = torch.tensor([4, 9], dtype=torch.int32)
    out = torch.func.vmap(
        lambda qq: attnx.attention_with_kvcache(qq, kc, vc, lens, backend="reference"))(q[None])
    assert seen == [None]
    ref = attnx.attention_with_kvcache(q, kc, vc, lens, backend="reference")
    torch.testing.assert_close(out[0], ref)


def test_plain_calls_give_the_reference_answer():
    """The public function on a plain call (the short path) against the reference backend, over
    lengths from 0 to the capacity and both causalities."""
    for lq, causal in itertools.product((1, 4), (True, False)):
        q, kc, vc, _ = _tensors(b=3, lq=lq, cap=33)
        lens = torch.tensor([0, 17, 33], dtype=torch.int32)
        got = attnx.attention_with_kvcache(q, kc, vc, lens, is_causal=causal, backend="cpu")
        want = attnx.attention_with_kvcache(q, kc, vc, lens, is_causal=causal,
                                            backend="reference")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _routes(monkeypatch):
    """Which entry each kvcache op call takes: "unboxed" (_C.kvcache_fwd) or "torch.ops"."""
    from attnx import _ops
    seen = []
    unboxed, boxed = _ops._C.kvcache_fwd, _ops._ATTNX.kvcache_fwd

    class _Spy:
        def __getattr__(self, name):
            return getattr(_ops._C, name)

        @staticmethod
        def kvcache_fwd(*args):
            seen.append("unboxed")
            return unboxed(*args)

    class _Ops:
        @staticmethod
        def kvcache_fwd(*args):
            seen.append("torch.ops")
            return boxed(*args)

    monkeypatch.setattr(_ops, "_C", _Spy())
    monkeypatch.setattr(_ops, "_ATTNX", _Ops)
    monkeypatch.setattr("attnx._backends.native.kvcache.__defaults__", (_Ops,))
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("paged", [False, True])
def test_the_unboxed_entry_gives_the_op_bit_for_bit(dtype, paged):
    from attnx import _ops
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 8, 3, 16, generator=g).to(dtype)
    kc, vc = (torch.randn(6, 2, 8, 16, generator=g).to(dtype) for _ in range(2))
    lens = torch.tensor([11, 4] if paged else [8, 3], dtype=torch.int32)
    table = torch.tensor([[5, 2, 0], [1, 4, 3]], dtype=torch.int32) if paged else None
    if not paged:
        kc, vc = kc[:2], vc[:2]
    args = (q, kc, vc, lens, table, 0.3, -(1 << 40), 0)
    for a, b in zip(_ops._C.kvcache_fwd(*args), torch.ops.attnx.kvcache_fwd(*args)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_eager_plain_calls_take_the_unboxed_entry(monkeypatch):
    seen = _routes(monkeypatch)
    q, kc, vc, lens = _tensors()
    want = attnx.attention_with_kvcache(q, kc, vc, lens, backend="reference")
    torch.testing.assert_close(attnx.attention_with_kvcache(q, kc, vc, lens), want)
    assert seen == ["unboxed"]


class _Logged(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_sees_the_op(monkeypatch):
    """The unboxed entry skips torch.ops's torch-function handling: under a mode the call goes
    through torch.ops, and the mode sees attnx::kvcache_fwd."""
    seen = _routes(monkeypatch)
    q, kc, vc, lens = _tensors()
    with _Logged() as mode:
        attnx.attention_with_kvcache(q, kc, vc, lens)
    assert seen == ["torch.ops"]
    assert any("kvcache_fwd" in n for n in mode.names)


def test_the_profiler_records_the_op_on_the_unboxed_entry():
    q, kc, vc, lens = _tensors()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        attnx.attention_with_kvcache(q, kc, vc, lens)
    assert "attnx::kvcache_fwd" in {e.name for e in prof.events()}


def test_a_dispatch_mode_sees_the_op_on_the_unboxed_entry(monkeypatch):
    """The unboxed entry is the dispatcher's op: a TorchDispatchMode sees attnx.kvcache_fwd
    (the entry releases the GIL; the mode's Python runs under it again)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    seen = _routes(monkeypatch)
    q, kc, vc, lens = _tensors()
    want = attnx.attention_with_kvcache(q, kc, vc, lens, backend="reference")
    with _Seen() as mode:
        got = attnx.attention_with_kvcache(q, kc, vc, lens)
    assert seen == ["unboxed"] and "attnx.kvcache_fwd.default" in mode.names
    torch.testing.assert_close(got, want)
