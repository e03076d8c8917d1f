"""torch.compile traces through the public ops without graph breaks."""

import pytest
import torch

import attnx
import attnx.nn


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


@pytest.mark.parametrize("module", ["multihead", "attention"])
def test_nn_weights_under_dropout_compile_fullgraph(module):
    """Training with dropout and need_weights (MultiheadAttention's default): the module draws
    the seed itself and hands it to the op, with no graph break."""
    import attnx.nn as ann

    torch.manual_seed(0)
    m = (ann.MultiheadAttention(16, 2, dropout=0.3, batch_first=True) if module == "multihead"
         else ann.Attention(16, 16, score="dot", dropout=0.3)).train()
    x = torch.randn(2, 5, 16)

    def f(x):
        return m(x, x, x, need_weights=True) if module == "multihead" else m(x, x, need_weights=True)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    got = compiled(x)
    torch.manual_seed(3)
    want = f(x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert (got[1] == 0).any()  # weights after dropout


def test_nn_module_trains_under_inductor():
    """torch.compile's default backend (inductor) checks the real gradients' strides against the
    fake kernels'; modules hand the op heads as transposed views."""
    import attnx.nn as ann

    torch.manual_seed(0)
    m = ann.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    torch._dynamo.reset()
    got = torch.compile(m)(x, x, x, need_weights=False)[0]
    want = m(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(got, want)
    g1 = torch.autograd.grad(got.sum(), (x, *m.parameters()))
    g2 = torch.autograd.grad(want.sum(), (x, *m.parameters()))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_export_with_a_dynamic_batch():
    """torch.export over a batch size left symbolic: the validation compares the sizes it
    broadcasts, never hashes them."""
    class Causal(torch.nn.Module):
        def forward(self, q):
            return attnx.scaled_dot_product_attention(q, q, q, is_causal=True)

    q = torch.randn(2, 2, 5, 4)
    program = torch.export.export(Causal(), (q,),
                                  dynamic_shapes=({0: torch.export.Dim("batch", min=2, max=64)},))
    q3 = torch.randn(3, 2, 5, 4)
    torch.testing.assert_close(program.module()(q3), Causal()(q3))


def test_export_with_a_dynamic_sequence_length_runs_under_aot_inductor(tmp_path):
    """torch.export with a Dim on the sequence length, then AOTInductor: the ops' SymInt band
    bounds go through its C++ wrapper, for lengths other than the traced one."""
    import torch._inductor

    class Windowed(torch.nn.Module):
        def forward(self, q, k):
            return attnx.scaled_dot_product_attention(q, k, k, is_causal=True, window=(4, None))

    length = torch.export.Dim("length", min=4, max=4096)
    program = torch.export.export(Windowed(), (torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)),
                                  dynamic_shapes=({2: length}, {2: length}))
    compiled = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(
        program, package_path=str(tmp_path / "windowed.pt2")))
    for n in (5, 40):
        q, k = torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16)
        torch.testing.assert_close(program.module()(q, k), Windowed()(q, k))
        torch.testing.assert_close(compiled(q, k), Windowed()(q, k))


@pytest.mark.parametrize("strict", [False, True])
def test_export_with_a_window_from_the_shapes(strict):
    """A window edge computed from the sizes (transformers' causal and sliding-window layers
    pass lk - lq) is a SymInt under non-strict torch.export, where dynamo makes it an int: taken
    as an int (a TypeError before)."""
    class Offset(torch.nn.Module):
        def forward(self, q, k):
            offset = k.shape[2] - q.shape[2]
            return attnx.scaled_dot_product_attention(q, k, k, window=(3 - offset, offset))

    length = torch.export.Dim("length", min=4, max=64)
    program = torch.export.export(Offset(), (torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)),
                                  dynamic_shapes=({2: length}, {2: length}), strict=strict)
    for n in (5, 12):
        q, k = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)
        torch.testing.assert_close(program.module()(q, k), Offset()(q, k))


@pytest.mark.parametrize("backend", [None, "reference"])
def test_kvcache_with_int_lengths_compiles_fullgraph(backend):
    """A cache length given as an int (transformers' decoding steps pass the cache's own
    length) is validated without reading a tensor, so the call traces with no graph break. The
    reference (what backend=None falls back to where the cpu kernels are missing) computes from
    the lengths validation knew: it had answered uninitialised memory while torch.compile traced
    (it reads no tensor then)."""
    q, kc, vc = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 21, 16), torch.randn(2, 2, 21, 16)

    def f(q, kc, vc):
        return attnx.attention_with_kvcache(q, kc, vc, 17, window=(4, None), backend=backend)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, kc, vc)
    torch.testing.assert_close(got, f(q, kc, vc))


def test_kvcache_reference_with_a_tensor_of_lengths_compiles():
    """Lengths in a tensor are read by validation (a graph break), and the reference computes
    from what it read."""
    q, kc, vc = torch.randn(2, 8, 2, 16), torch.randn(2, 2, 21, 16), torch.randn(2, 2, 21, 16)
    lens = torch.tensor([17, 9], dtype=torch.int32)

    def f(q, kc, vc):
        return attnx.attention_with_kvcache(q, kc, vc, lens, backend="reference")

    torch._dynamo.reset()
    got = torch.compile(f, backend="aot_eager")(q, kc, vc)
    torch.testing.assert_close(got, f(q, kc, vc))


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_writing_new_keys_compiles_fullgraph(paged):
    """With new k, v written into the cache at an int length, the call still traces whole: the
    expanded-cache check reads strides only, and the overlap check (which asks where storage
    lies) gives way to a copy of the new rows. Output and cache writes are eager's. (A paged
    cache's block ids are checked by value: a graph break there, by design.)"""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 2, 8, generator=g)
    slots = (6, 2, 4, 8) if paged else (2, 2, 12, 8)  # paged: 6 blocks of 4 slots
    kc, vc = torch.randn(*slots, generator=g), torch.randn(*slots, generator=g)
    kn, vn = torch.randn(2, 2, 2, 8, generator=g), torch.randn(2, 2, 2, 8, generator=g)
    table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32) if paged else None

    def f(q, kc, vc, kn, vn):
        return attnx.attention_with_kvcache(q, kc, vc, 5, kn, vn, block_table=table)

    eager_caches = kc.clone(), vc.clone()
    want = f(q, *eager_caches, kn, vn)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=not paged, backend="aot_eager")(q, kc, vc, kn, vn)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(kc, eager_caches[0], rtol=0, atol=0)
    torch.testing.assert_close(vc, eager_caches[1], rtol=0, atol=0)


@pytest.mark.parametrize("backend", [None, "reference"])
def test_kvcache_bad_block_ids_raise_under_compile_before_any_write(backend):
    """A block id of -1 where the new keys go: validation refuses it under torch.compile too
    (its check had passed while traced, and the reference then wrote into the cache's last
    block), and nothing is written."""
    g = torch.Generator().manual_seed(0)
    q, kn, vn = (torch.randn(2, 1, 1, 8, generator=g) for _ in range(3))
    kc, vc = torch.randn(6, 1, 4, 8, generator=g), torch.randn(6, 1, 4, 8, generator=g)
    table = torch.tensor([[0, -1], [1, 2]], dtype=torch.int32)  # sequence 0's key 4: block -1
    before = kc.clone(), vc.clone()

    def f(q, kc, vc, kn, vn, table):
        return attnx.attention_with_kvcache(q, kc, vc, 4, kn, vn, block_table=table,
                                           backend=backend)

    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"block_table: expected block ids in \[0, 6\)"):
        torch.compile(f, backend="aot_eager")(q, kc, vc, kn, vn, table)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


@pytest.mark.parametrize("op", ["sdpa", "kvcache", "varlen", "mha_weights"])
def test_scores_past_float32_stay_finite_under_compile(op):
    """Scores past float32's range from finite inputs (|q| |k| ~ 1e38): eager reruns in float64
    where float32 overflowed (the reference backend, attnx.nn's weights); a traced graph tests
    no values, so it computes in float64 from the start. It had given NaN."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 5, 8, generator=g) * 1e19 for _ in range(2))
    v = torch.randn(1, 2, 5, 8, generator=g)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    mha = attnx.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    calls = {
        "sdpa": lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v, backend="reference"),
        "kvcache": lambda q, k, v: attnx.attention_with_kvcache(q, k, v, 5, backend="reference"),
        "varlen": lambda q, k, v: attnx.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                                         v[0].transpose(0, 1), cu, cu,
                                                         backend="reference"),
        "mha_weights": lambda q, k, v: mha(x := q.transpose(1, 2).reshape(1, 5, 16) * 3, x, x,
                                           need_weights=True)[1],
    }
    f = calls[op]
    torch._dynamo.reset()
    with torch.no_grad():
        want, got = f(q, k, v), torch.compile(f, backend="aot_eager")(q, k, v)
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("case", ["reference", "empty_keys", "empty_additive"])
def test_fake_tensors_take_no_data_dependent_branch(case):
    """Under FakeTensorMode (what torch.compile and make_fx use to work out shapes) the
    reference backend, which every empty call also lands on, skips its float64 rerun guard,
    as it does on the meta device: fake tensors hold no values to test."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    lk = 0 if case.startswith("empty") else 5
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, lk, 8), torch.randn(1, 2, lk, 8)
    if case == "empty_additive":
        def f(q, k, v):
            return attnx.additive_attention(q, k, v, torch.randn(8))
    else:
        def f(q, k, v):
            return attnx.scaled_dot_product_attention(
                q, k, v, backend="reference" if case == "reference" else None)
    want = f(q, k, v)
    with FakeTensorMode() as mode:
        got = f(*(mode.from_tensor(t) for t in (q, k, v)))
    assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())


def test_fake_tensors_through_multihead_weights():
    """need_weights' scores take the same guard (attnx._values): under FakeTensorMode the
    module returns fake output and weights of eager's shapes, not DataDependentOutputException."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import attnx.nn

    m = attnx.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    want = m(x, x, x, need_weights=True)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx = mode.from_tensor(x)
        got = m(fx, fx, fx, need_weights=True)
    assert [t.shape for t in got] == [t.shape for t in want]


def test_values_readable_of_plain_fake_and_wrapped_tensors():
    """attnx._values answers a plain tensor without torch's is_fake, and asks is_fake of every
    other kind: fake tensors and the functionalization wrappers of fake ones have no values;
    functorch's grad wrappers of real ones do; vmap's batched tensors do not (a branch on their
    values raises); meta tensors do not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from attnx._values import values_readable

    t = torch.randn(3, 4)
    assert values_readable(t) and values_readable(t[:, 1:])
    assert not values_readable(torch.empty(3, device="meta"))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(t)
        assert not values_readable(fake)
        assert not values_readable(torch._to_functional_tensor(fake))
    assert values_readable(torch._to_functional_tensor(t))
    seen = []
    torch.vmap(lambda row: seen.append(values_readable(row)) or row)(t)
    torch.func.grad(lambda x: seen.append(values_readable(x)) or x.sum())(t)
    assert seen == [False, True]


def _recompiles(fn, calls, **compile_kwargs) -> int:
    """How many frames torch.compile compiles for fn past those of the first call, over the
    calls (argument tuples), each result checked against eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, **compile_kwargs)
    first = None
    for args in calls:
        torch.testing.assert_close(compiled(*args), fn(*args))
        first = counter.frame_count if first is None else first
    return counter.frame_count - first


@pytest.mark.parametrize("op", ["sdpa", "sdpa_causal", "sdpa_window", "additive", "kvcache",
                                "kvcache_new_keys"])
def test_one_graph_serves_every_sequence_length(op):
    """dynamic=True: the lengths stay symbolic (the band's open edges are constants, not
    +-(Lq + Lk), which the ops' int arguments specialized: a graph per length, then eager once
    dynamo's recompile limit was hit). Lengths past 1 (torch specializes sizes 0 and 1) and
    unlike the other dims (duck sizing would tie them)."""
    def fn(q):
        if op == "additive":
            return attnx.additive_attention(q, q, q, torch.ones(16))
        if op == "kvcache":  # the cache's capacity and the int length follow L
            return attnx.attention_with_kvcache(q[:, :, -1:], q, q, q.shape[2] - 1)
        if op == "kvcache_new_keys":  # a new key written in place (the overlap check's strides
            # were sorted: fullgraph's Unsupported under dynamic=True)
            kc, vc = q.clone(), q.clone()
            return attnx.attention_with_kvcache(q[:, :, -1:], kc, vc, q.shape[2] - 2,
                                                k=q[:, :, :1], v=q[:, :, 1:2])
        return attnx.scaled_dot_product_attention(
            q, q, q, is_causal=op == "sdpa_causal", window=(3, 2) if op == "sdpa_window" else None)

    lengths = (3, 5, 17, 33)
    assert _recompiles(fn, [(torch.randn(1, 2, n, 16),) for n in lengths], dynamic=True,
                       fullgraph=True) == 0


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_lower_right_causal_bias_keeps_one_graph(backend):
    """A CausalBias aligned lower right with Lq != Lk (decoding steps, chunked prefill): its
    offset Lk - Lq reaches the ops as the band's bound, which an `int` schema argument
    specialized (a graph per cache length, eager past dynamo's limit; torch's own SDPA keeps one).
    SymInt arguments keep it symbolic, forward and backward."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.nn.attention.bias import causal_lower_right

    def fn(q, k, bias):
        return attnx.scaled_dot_product_attention(q, k, k, attn_mask=bias, backend=backend)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    frames = []
    for n in (5, 9, 17, 33):
        q = torch.randn(1, 2, 3, 16, generator=g, requires_grad=True)
        k = torch.randn(1, 2, n, 16, generator=g, requires_grad=True)
        bias = causal_lower_right(3, n)
        got, want = compiled(q, k, bias), fn(q, k, bias)
        torch.testing.assert_close(got, want)
        for a, b in zip(torch.autograd.grad(got.square().sum(), (q, k)),
                        torch.autograd.grad(want.square().sum(), (q, k))):
            torch.testing.assert_close(a, b)
        frames.append(counter.frame_count)
    assert frames[-1] == frames[0], frames


def test_triton_availability_traces_under_fullgraph():
    """The dispatcher asks whether the triton backend can run on every CUDA SDPA call
    (backend=None puts it first there): with Triton 3.8 that read TRITON_INTERPRET through a C
    function dynamo cannot trace (Unsupported: triton._C.libtriton.getenv_bool), failing
    fullgraph=True. On CPU tensors (TRITON_INTERPRET=1, tests/conftest.py) a forced triton call
    compiles whole too."""
    pytest.importorskip("triton")
    from attnx._backends import triton_backend

    torch._dynamo.reset()
    ok = torch.compile(lambda x: x + (triton_backend.availability() is None), fullgraph=True,
                       backend="eager")(torch.zeros(1))
    assert ok.item() == (triton_backend.availability() is None)
    if triton_backend.availability() is None and not torch.cuda.is_available():
        q = torch.randn(1, 2, 9, 16)
        f = lambda q: attnx.scaled_dot_product_attention(q, q, q, is_causal=True, backend="triton")  # noqa: E731
        torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(q), f(q))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("op", ["sdpa", "sdpa_train", "additive", "kvcache"])
def test_cuda_calls_compile_fullgraph(op):
    """backend=None on CUDA tensors (SDPA on triton, the others on cuda) under
    fullgraph=True and dynamic=True: the dispatcher's availability checks trace (run by
    scripts/gpu_check.sh's test_cuda step)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 37, 64, device="cuda", dtype=torch.float16, generator=g)
               for _ in range(3))

    def fn(q, k, v):
        if op == "additive":
            return attnx.additive_attention(q, k, v, torch.ones(64, device="cuda", dtype=q.dtype))
        if op == "kvcache":
            return attnx.attention_with_kvcache(q[:, :, -1:], k, v, k.shape[2] - 3)
        return attnx.scaled_dot_product_attention(q, k, v, is_causal=True)

    if op == "sdpa_train":
        q.requires_grad_()
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(got, fn(q, k, v), atol=2e-3, rtol=2e-3)
    if op == "sdpa_train":
        got.float().square().sum().backward()
        assert q.grad is not None and torch.isfinite(q.grad).all()


def test_mark_dynamic_sequence_length():
    """torch.compile refused a length marked dynamic (ConstraintViolationError: specialized)."""
    q = torch.randn(1, 2, 17, 16)
    torch._dynamo.mark_dynamic(q, 2)
    torch._dynamo.reset()
    f = torch.compile(lambda q: attnx.scaled_dot_product_attention(q, q, q, is_causal=True),
                      fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(q), attnx.scaled_dot_product_attention(q, q, q, is_causal=True))


@pytest.mark.parametrize("which", ["scale", "softcap"])
def test_symbolic_float_arguments(which):
    """dynamic=True makes a float argument symbolic: validation's finiteness check raised
    Unsupported (math.isfinite on a SymFloat) under fullgraph=True on the first call."""
    q = torch.randn(1, 2, 8, 16)
    torch._dynamo.reset()
    f = torch.compile(lambda q, x: attnx.scaled_dot_product_attention(q, q, q, **{which: x}),
                      fullgraph=True, backend="aot_eager", dynamic=True)
    for x in (0.2, 0.7):
        torch.testing.assert_close(f(q, x), attnx.scaled_dot_product_attention(q, q, q, **{which: x}))


def test_multihead_key_padding_mask_with_a_dynamic_batch():
    """The padding mask's shape was checked by hashing it: a graph per batch size under
    dynamic=True, and torch.export with a dynamic batch raised TypeError (unhashable SymInt)."""
    import attnx.nn

    torch.manual_seed(0)
    m = attnx.nn.MultiheadAttention(16, 2, batch_first=True).eval()

    def fn(x, kpm):
        return m(x, x, x, key_padding_mask=kpm, need_weights=False)[0]

    def inputs(b):
        kpm = torch.zeros(b, 7, dtype=torch.bool)
        kpm[0, -1] = True
        return torch.randn(b, 7, 16), kpm

    assert _recompiles(fn, [inputs(b) for b in (2, 3, 5)], dynamic=True) == 0

    class Module(torch.nn.Module):
        def forward(self, x, kpm):
            return fn(x, kpm)

    batch = torch.export.Dim("batch", min=2, max=64)
    exported = torch.export.export(Module(), inputs(3), dynamic_shapes=({0: batch}, {0: batch}))
    x, kpm = inputs(5)
    torch.testing.assert_close(exported.module()(x, kpm), fn(x, kpm))


def test_kvcache_int_length_with_a_dynamic_batch():
    """An int cache length became a list of one entry per sequence ([n] * B): a graph per
    batch size."""
    def fn(q, cache):
        return attnx.attention_with_kvcache(q, cache, cache, 9)

    calls = [(torch.randn(b, 4, 1, 16), torch.randn(b, 2, 12, 16)) for b in (3, 5, 7)]
    assert _recompiles(fn, calls, dynamic=True) == 0


def test_fake_tensors_through_a_paged_cache():
    """A real block table under FakeTensorMode: its slice is fake, and the block-id check read
    it (DataDependentOutputException); fake tensors get the output's shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, kc, vc = torch.randn(2, 4, 1, 16), torch.randn(6, 2, 4, 16), torch.randn(6, 2, 4, 16)
    table = torch.tensor([[1, 0, 2], [5, 4, 3]], dtype=torch.int32)
    want = attnx.attention_with_kvcache(q, kc, vc, 7, block_table=table)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        got = attnx.attention_with_kvcache(*(mode.from_tensor(t) for t in (q, kc, vc)), 7,
                                           block_table=table)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
