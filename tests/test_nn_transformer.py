"""attnx.nn Transformer classes against torch.nn with the same weights."""

import copy
import inspect

import pytest
import torch

import attnx.nn as ann

D, H, FF = 16, 4, 24
T = torch.nn


def _clone(ours_cls, ref_cls, *args, **kwargs):
    torch.manual_seed(0)
    ref = ref_cls(*args, **kwargs)
    torch.manual_seed(0)
    ours = ours_cls(*args, **kwargs)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


def _backward(module, inputs, call):
    inputs = [t.clone().requires_grad_() for t in inputs]
    module.zero_grad()
    out = call(module, *inputs)
    out.pow(2).sum().backward()
    return out, [t.grad for t in inputs] + [p.grad for p in module.parameters()]


def _assert_same(ours, ref, inputs, call, tol=1e-10):
    o1, g1 = _backward(ours, inputs, call)
    o2, g2 = _backward(ref, inputs, call)
    torch.testing.assert_close(o1, o2, rtol=tol, atol=tol)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def _attention_modules(module):
    return [m for m in module.modules() if isinstance(m, T.MultiheadAttention)]


@pytest.mark.parametrize("name", ["MultiheadAttention", "TransformerEncoderLayer",
                                  "TransformerDecoderLayer", "TransformerEncoder",
                                  "TransformerDecoder", "Transformer"])
def test_signatures_match_torch(name):
    def params(f):  # names, kinds and defaults (annotations may be spelled differently)
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    ours, ref = getattr(ann, name), getattr(T, name)
    assert params(ours) == params(ref)
    assert params(ours.forward) == params(ref.forward)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_encoder_layer(norm_first, batch_first):
    kw = dict(dim_feedforward=FF, dropout=0.1, batch_first=batch_first, norm_first=norm_first,
              activation="gelu", dtype=torch.float64)
    ours, ref = _clone(ann.TransformerEncoderLayer, T.TransformerEncoderLayer, D, H, **kw)
    assert all(type(m) is ann.MultiheadAttention for m in _attention_modules(ours))
    ours.eval(), ref.eval()
    n, l = 3, 7
    x = torch.randn((n, l, D) if batch_first else (l, n, D), dtype=torch.float64)
    kpm = torch.zeros(n, l, dtype=torch.bool)
    kpm[1, 5:] = True
    causal = T.Transformer.generate_square_subsequent_mask(l, dtype=torch.float64)
    _assert_same(ours, ref, [x], lambda m, x: m(x, src_key_padding_mask=kpm))
    _assert_same(ours, ref, [x], lambda m, x: m(x, src_mask=causal, is_causal=True))
    with torch.no_grad():  # torch takes its fused fast path here; attnx must not
        torch.testing.assert_close(ours(x, src_key_padding_mask=kpm), ref(x, src_key_padding_mask=kpm),
                                   rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer(norm_first):
    ours, ref = _clone(ann.TransformerDecoderLayer, T.TransformerDecoderLayer, D, H, FF, 0.0,
                       batch_first=True, norm_first=norm_first, dtype=torch.float64)
    assert len(_attention_modules(ours)) == 2
    assert all(type(m) is ann.MultiheadAttention for m in _attention_modules(ours))
    tgt, mem = torch.randn(2, 5, D, dtype=torch.float64), torch.randn(2, 9, D, dtype=torch.float64)
    causal = T.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    mkpm = torch.zeros(2, 9, dtype=torch.bool)
    mkpm[0, 4:] = True
    _assert_same(ours, ref, [tgt, mem], lambda m, t, s: m(t, s, tgt_mask=causal, tgt_is_causal=True,
                                                           memory_key_padding_mask=mkpm))


def test_encoder_stack_with_padding_eval():
    layer = T.TransformerEncoderLayer(D, H, FF, 0.0, batch_first=True, dtype=torch.float64)
    torch.manual_seed(0)
    ref = T.TransformerEncoder(layer, 2, norm=T.LayerNorm(D, dtype=torch.float64))
    ours = ann.TransformerEncoder(layer, 2, norm=T.LayerNorm(D, dtype=torch.float64))
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert all(type(m) is ann.MultiheadAttention for m in _attention_modules(ours))
    assert all(type(m) is T.MultiheadAttention for m in _attention_modules(ref))  # not mutated
    ours.eval(), ref.eval()
    x = torch.randn(3, 8, D, dtype=torch.float64)
    kpm = torch.zeros(3, 8, dtype=torch.bool)
    kpm[0, 5:] = True
    kpm[2, 2:] = True
    with torch.no_grad():  # torch runs nested tensors here: its padded positions are zeros
        a, b = ours(x, src_key_padding_mask=kpm), ref(x, src_key_padding_mask=kpm)
    # padded positions included: zeros before the final norm, as torch's nested path leaves
    # them (the norm's bias there), not the rows the layers compute
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(a[kpm], ours.norm(ours.layers[1](ours.layers[0](
        x, src_key_padding_mask=kpm), src_key_padding_mask=kpm))[kpm])
    _assert_same(ours.train(), ref.train(), [x], lambda m, x: m(x, src_key_padding_mask=kpm))


def test_transformer_inference_with_source_padding_only():
    """nn.Transformer in inference with a source padding mask and no memory_key_padding_mask:
    the decoder attends to the memory's padded positions, which torch's encoder returns as its
    final norm of zeros (nested tensors). attnx's were computed rows: the target's outputs
    differed by 0.46."""
    kw = dict(d_model=D, nhead=H, num_encoder_layers=2, num_decoder_layers=2,
              dim_feedforward=FF, dropout=0.0, batch_first=True, dtype=torch.float64)
    torch.manual_seed(0)
    ref = T.Transformer(**kw).eval()
    ours = ann.Transformer(**kw).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    src, tgt = torch.randn(2, 7, D, dtype=torch.float64), torch.randn(2, 5, D, dtype=torch.float64)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[0, 4:] = True
    with torch.no_grad():
        torch.testing.assert_close(ours(src, tgt, src_key_padding_mask=kpm),
                                   ref(src, tgt, src_key_padding_mask=kpm), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case", ["left_padded", "no_nested", "no_nested_later", "norm_first",
                                  "grad", "float_mask", "finite_float_mask"])
def test_encoder_padded_positions_as_torch_computes_them(case):
    """Where torch's encoder does not go nested (padding not at the end, enable_nested_tensor
    False or use_nested_tensor set False later, a norm_first layer, weights wanting gradients),
    its padded positions are computed, as attnx's are; a float padding mask goes nested as a
    bool one does, any nonzero value (-1 too) a padded key that torch's layers never see."""
    layer = T.TransformerEncoderLayer(D, H, FF, 0.0, batch_first=True, dtype=torch.float64,
                                      norm_first=case == "norm_first")
    kw = dict(enable_nested_tensor=case != "no_nested")
    ref = T.TransformerEncoder(layer, 2, **kw).eval()
    ours = ann.TransformerEncoder(layer, 2, **kw).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    if case == "no_nested_later":  # torch's switch, after construction
        ref.use_nested_tensor = ours.use_nested_tensor = False
    x = torch.randn(3, 8, D, dtype=torch.float64)
    kpm = torch.zeros(3, 8, dtype=torch.bool)
    kpm[0, :3] = case == "left_padded"
    kpm[1, 6:] = case != "left_padded"
    if case in ("float_mask", "finite_float_mask"):
        kpm = torch.zeros(3, 8, dtype=torch.float64).masked_fill(
            kpm, -torch.inf if case == "float_mask" else -1.0)
    with torch.set_grad_enabled(case == "grad"):
        a, b = ours(x, src_key_padding_mask=kpm), ref(x, src_key_padding_mask=kpm)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("batch_first", [False, True])
def test_transformer(batch_first):
    kw = dict(num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=FF, dropout=0.0,
              batch_first=batch_first, dtype=torch.float64)
    torch.manual_seed(0)
    ref = T.Transformer(D, H, **kw)
    torch.manual_seed(0)
    ours = ann.Transformer(D, H, **kw)
    # The constructor is torch's: same seed, same weights, same names.
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert len(_attention_modules(ours)) == 6
    assert all(type(m) is ann.MultiheadAttention for m in _attention_modules(ours))
    n, s, t = 2, 9, 6
    shape = (lambda l: (n, l, D)) if batch_first else (lambda l: (l, n, D))
    src, tgt = torch.randn(shape(s), dtype=torch.float64), torch.randn(shape(t), dtype=torch.float64)
    tgt_mask = T.Transformer.generate_square_subsequent_mask(t, dtype=torch.float64)
    skpm = torch.zeros(n, s, dtype=torch.bool)
    skpm[1, 6:] = True
    call = lambda m, a, b: m(a, b, tgt_mask=tgt_mask, src_key_padding_mask=skpm,
                             memory_key_padding_mask=skpm, tgt_is_causal=True)
    _assert_same(ours, ref, [src, tgt], call)
    fresh = T.Transformer(D, H, **kw)
    fresh.load_state_dict(ours.state_dict(), strict=True)


def test_dropout_train_mode_reproducible():
    model = ann.Transformer(D, H, 1, 1, FF, dropout=0.3, batch_first=True)
    src, tgt = torch.randn(2, 7, D), torch.randn(2, 4, D)
    torch.manual_seed(5)
    a = model(src, tgt)
    torch.manual_seed(5)
    b = model(src, tgt)
    assert torch.equal(a, b) and torch.isfinite(a).all()


def test_attention_runs_on_attnx(monkeypatch):
    from attnx import _dispatch
    calls = []
    real = _dispatch.sdpa_seeded  # what attnx.scaled_dot_product_attention runs on

    def counting(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(_dispatch, "sdpa_seeded", counting)
    model = ann.Transformer(D, H, 2, 1, FF, dropout=0.0, batch_first=True).eval()
    with torch.no_grad():
        model(torch.randn(2, 5, D), torch.randn(2, 3, D))
    assert len(calls) == 2 + 2  # two encoder self-attentions, decoder self- and cross-attention


@pytest.mark.parametrize("kwargs, match", [
    (dict(src_mask=torch.zeros(5, 5, dtype=torch.int64)), "src_mask: expected a mask of dtype torch.bool, torch.float32"),
    (dict(src_key_padding_mask=torch.zeros(2, 5, dtype=torch.int32)),
     "src_key_padding_mask: expected a mask of dtype torch.bool, torch.float32"),
    (dict(src_mask=[[0.0] * 5] * 5), "src_mask: expected a Tensor"),
])
def test_encoder_layer_bad_masks_raise_type_error(kwargs, match):
    layer = ann.TransformerEncoderLayer(8, 2, batch_first=True)
    with pytest.raises(TypeError, match=match):
        layer(torch.randn(2, 5, 8), **kwargs)


@pytest.mark.parametrize("norm_first", [False, True])
def test_layers_check_their_inputs_first(norm_first):
    """Under norm_first a LayerNorm meets the input first: torch's RuntimeError there, a
    ValueError or TypeError naming the argument here (the decoder layer's masks by its names)."""
    enc = ann.TransformerEncoderLayer(8, 2, norm_first=norm_first)
    with pytest.raises(ValueError, match="src: expected a last dim of d_model=8"):
        enc(torch.randn(5, 3, 9))
    with pytest.raises(ValueError, match="src: expected 2 to 3 dimensions"):
        enc(torch.randn(5, 3, 1, 8))
    dec = ann.TransformerDecoderLayer(8, 2, norm_first=norm_first)
    tgt, memory = torch.randn(4, 3, 8), torch.randn(5, 3, 8)
    with pytest.raises(ValueError, match="tgt: expected a last dim of d_model=8"):
        dec(torch.randn(4, 3, 9), memory)
    with pytest.raises(ValueError, match="memory: expected a last dim of d_model=8"):
        dec(tgt, torch.randn(5, 3, 9))
    with pytest.raises(TypeError, match="memory: expected a torch.Tensor"):
        dec(tgt, None)
    with pytest.raises(TypeError, match="tgt_mask: expected a mask of dtype"):
        dec(tgt, memory, tgt_mask=torch.zeros(4, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="memory_key_padding_mask: expected a mask of dtype"):
        dec(tgt, memory, memory_key_padding_mask=torch.zeros(3, 5, dtype=torch.float16))
    assert dec(tgt, memory).shape == tgt.shape


def test_stacks_check_their_inputs_first():
    """The encoder and decoder stacks (and Transformer) check as their layers do: torch's own
    code meets the input first there (an AssertionError for an integer mask, an IndexError for
    a 1-D src, an AttributeError for a list, an int64 overflow RuntimeError in the decoder)."""
    enc = ann.TransformerEncoder(ann.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2)
    dec = ann.TransformerDecoder(ann.TransformerDecoderLayer(8, 2, 16, batch_first=True), 2)
    model = ann.Transformer(8, 2, 1, 1, 16, batch_first=True)
    src, tgt = torch.randn(3, 4, 8), torch.randn(3, 5, 8)
    long = torch.zeros(3, 4, dtype=torch.long)
    cases = [
        (TypeError, "src_key_padding_mask: expected a mask of dtype",
         lambda: enc(src, src_key_padding_mask=long)),
        (TypeError, "mask: expected a mask of dtype", lambda: enc(src, mask=long[0].expand(4, 4))),
        (ValueError, "src: expected 2 to 3 dimensions", lambda: enc(src[0, 0])),
        (TypeError, "src_key_padding_mask: expected a Tensor or None",
         lambda: enc(src, src_key_padding_mask=[[False] * 4] * 3)),
        (TypeError, r"src: expected dtype torch\.float32 \(the module's\), got torch\.float64",
         lambda: enc(src.double())),
        (TypeError, "tgt_mask: expected a mask of dtype",
         lambda: dec(tgt, src, tgt_mask=torch.zeros(5, 5, dtype=torch.long))),
        (ValueError, "tgt: expected a last dim of d_model=8", lambda: dec(tgt[..., :7], src)),
        (TypeError, "memory: expected a torch.Tensor", lambda: dec(tgt, None)),
        (ValueError, "memory: expected batch size 3", lambda: dec(tgt, src[:2])),
        (TypeError, "src_mask: expected a mask of dtype",
         lambda: model(src, tgt, src_mask=long[0].expand(4, 4))),
        (TypeError, "tgt_mask: expected a mask of dtype",
         lambda: model(src, tgt, tgt_mask=torch.zeros(5, 5, dtype=torch.long))),
        (TypeError, "src_key_padding_mask: expected a Tensor or None",
         lambda: model(src, tgt, src_key_padding_mask=[[False] * 4] * 3)),
        (TypeError, r"src: expected dtype torch\.float32", lambda: model(src.double(), tgt)),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()
    assert enc(src).shape == src.shape and dec(tgt, src).shape == tgt.shape
    assert model(src, tgt).shape == tgt.shape


def test_layer_names_its_own_argument():
    """A float64 src reaches the layer's attention as its query: named src, not query; a memory
    of another batch size is memory's error, not key's and value's."""
    with pytest.raises(TypeError, match=r"src: expected dtype torch\.float32"):
        ann.TransformerEncoderLayer(8, 2, 16)(torch.randn(4, 3, 8, dtype=torch.float64))
    dec = ann.TransformerDecoderLayer(8, 2, 16)
    with pytest.raises(ValueError, match="memory: expected batch size 3"):
        dec(torch.randn(4, 3, 8), torch.randn(5, 2, 8))
    with pytest.raises(ValueError, match="memory: expected 3 dims"):
        dec(torch.randn(4, 3, 8), torch.randn(5, 8))


_BAD_CONSTRUCTIONS = {  # id: (construction, error, message)
    "mha-heads": (lambda: ann.MultiheadAttention(8, 3), ValueError,
                  "num_heads: expected a divisor of embed_dim=8"),
    "mha-heads-str": (lambda: ann.MultiheadAttention(8, "2"), TypeError,
                      "num_heads: expected an int, got str"),
    "mha-dim-float": (lambda: ann.MultiheadAttention(8.0, 2), TypeError,
                      "embed_dim: expected an int, got float"),
    "mha-vdim": (lambda: ann.MultiheadAttention(8, 2, vdim=-1), ValueError,
                 "vdim: expected an int >= 1"),
    "mha-dropout": (lambda: ann.MultiheadAttention(8, 2, dropout=1.5), ValueError,
                    "dropout: expected a probability"),
    "mha-dtype": (lambda: ann.MultiheadAttention(8, 2, dtype=torch.int32), TypeError,
                  "dtype: expected None or a floating"),
    "enc-nhead": (lambda: ann.TransformerEncoderLayer(8, 0), ValueError,
                  "nhead: expected an int >= 1"),
    "enc-activation": (lambda: ann.TransformerEncoderLayer(8, 2, activation="gelux"), ValueError,
                       "activation: expected"),
    "dec-nhead": (lambda: ann.TransformerDecoderLayer(8, 3), ValueError,
                  "nhead: expected a divisor of d_model=8"),
    "stack-empty": (lambda: ann.TransformerEncoder(ann.TransformerEncoderLayer(8, 2), 0),
                    ValueError, "num_layers: expected an int >= 1, got 0"),
    "transformer-layers": (lambda: ann.Transformer(8, 2, num_decoder_layers=-1), ValueError,
                           "num_decoder_layers: expected an int >= 1"),
}


@pytest.mark.parametrize("case", _BAD_CONSTRUCTIONS)
def test_constructors_check_their_arguments(case):
    """torch.nn's constructors assert (heads not dividing the dim), fail making a weight of a
    negative size (RuntimeError), take a string head count into a comparison (TypeError naming
    nothing), or build an empty stack whose forward raises IndexError: attnx's raise ValueError
    or TypeError naming the argument, before torch's constructor runs."""
    make, error, match = _BAD_CONSTRUCTIONS[case]
    with pytest.raises(error, match=match):
        make()


def test_mask_errors_name_the_callers_argument():
    """A layer's masks reach its attention as attn_mask / key_padding_mask, a stack's mask as its
    layers' src_mask: each error names the argument the caller passed."""
    src, tgt, mem = torch.randn(5, 3, 8), torch.randn(4, 3, 8), torch.randn(6, 3, 8)
    enc, dec = ann.TransformerEncoderLayer(8, 2, 16), ann.TransformerDecoderLayer(8, 2, 16)
    model = ann.Transformer(8, 2, 1, 1, 16)
    z = torch.zeros
    cases = [
        ("src_key_padding_mask", lambda: enc(src, src_key_padding_mask=z(3, 6) > 0)),
        ("src_mask", lambda: enc(src, src_mask=z(6, 5))),
        ("src_mask", lambda: enc(src, is_causal=True)),
        ("tgt_mask", lambda: dec(tgt, mem, tgt_mask=z(4, 5))),
        ("tgt_mask", lambda: dec(tgt, mem, tgt_is_causal=True)),
        ("tgt_key_padding_mask", lambda: dec(tgt, mem, tgt_key_padding_mask=z(3, 5))),
        ("memory_mask", lambda: dec(tgt, mem, memory_mask=z(4, 7))),
        ("memory_key_padding_mask", lambda: dec(tgt, mem, memory_key_padding_mask=z(3, 7))),
        ("mask", lambda: ann.TransformerEncoder(enc, 2, enable_nested_tensor=False)(
            src, mask=z(6, 5))),
        ("src_mask", lambda: model(src, tgt, src_mask=z(6, 5))),
        ("memory_mask", lambda: model(src, tgt, memory_mask=z(4, 6))),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=f"^{name}: "):
            call()


@pytest.mark.parametrize("inputs_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_first", [False, True])
def test_autocast_takes_what_torch_takes(norm_first, inputs_dtype):
    """Under autocast torch.nn's modules take a bf16 input into float32 weights; attnx's raised
    ("query: expected dtype torch.float32 (the module's)"). Now each gives torch's result
    within a few times torch's own distance from the float32 one. (With gradients on: torch's
    eval fast path under no_grad returns another dtype.)"""
    x = torch.randn(2, 5, 8)
    torch.manual_seed(0)
    for theirs in (torch.nn.MultiheadAttention(8, 2, batch_first=True),
                   torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                                    norm_first=norm_first),
                   torch.nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True,
                                        norm_first=norm_first)):
        ours = ann.to_attnx(copy.deepcopy(theirs))
        call = (lambda m, t: m(t, t, t)[0]) if isinstance(theirs, torch.nn.MultiheadAttention) \
            else (lambda m, t: m(t, t[:, :3]) if isinstance(m, torch.nn.Transformer) else m(t))
        want = call(theirs.eval(), x).detach()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, peer = (call(m.eval(), x.to(inputs_dtype)).detach() for m in (ours, theirs))
        assert got.dtype == peer.dtype, type(theirs).__name__
        bound = 3 * (peer.float() - want).abs().max() + 1e-3
        assert (got.float() - want).abs().max() <= bound, type(theirs).__name__


@pytest.mark.parametrize("batch_first", [False, True])
def test_transformer_checks_batch_and_d_model(batch_first):
    """torch raises RuntimeErrors for these ("the batch number of src and tgt must be equal")."""
    model = ann.Transformer(8, 2, 1, 1, 16, batch_first=batch_first)
    shape = (lambda n, l: (n, l, 8)) if batch_first else (lambda n, l: (l, n, 8))
    src, tgt = torch.randn(shape(3, 5)), torch.randn(shape(3, 4))
    with pytest.raises(ValueError, match="tgt: expected batch size 3"):
        model(src, torch.randn(shape(2, 4)))
    with pytest.raises(ValueError, match="src: expected a last dim of d_model=8"):
        model(torch.randn(5, 3, 9), tgt)
    with pytest.raises(ValueError, match="tgt: expected 3 dims"):
        model(src, torch.randn(4, 8))
    assert model(src, tgt).shape == tgt.shape
    assert model(torch.randn(5, 8), torch.randn(4, 8)).shape == (4, 8)  # unbatched

