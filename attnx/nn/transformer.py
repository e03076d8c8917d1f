"""Transformer layers and stacks of torch.nn with their attention on attnx.

Each class subclasses its torch.nn namesake and keeps its constructor (signature, parameter
names, initialisation order), then turns the torch `MultiheadAttention` modules it built into
`attnx.nn.MultiheadAttention` in place (a class change: the parameters stay the same objects,
so no random numbers are drawn and a torch `state_dict` loads with `strict=True`).
The encoder layer and encoder override `forward` only to leave torch's fused fast paths, which
would run torch's own attention kernels (and nested tensors) instead of attnx's. The layers, the
stacks and `Transformer` check their inputs' ranks, feature sizes, dtypes and batch sizes and
their masks' types first: torch raises RuntimeErrors, AssertionErrors or IndexErrors there (a
LayerNorm's under norm_first, its mask canonicalisation's), attnx a ValueError or TypeError
naming the argument.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.nn.modules.transformer import _detect_is_causal_mask, _get_seq_len

from .._validate import _check_tensor
from ._inputs import check_dtype, check_features, check_init
from ._masks import check_mask_type, named_as
from .multihead import MultiheadAttention

_SWAPS = {}  # torch class -> attnx class, filled below


def to_attnx(module: torch.nn.Module) -> torch.nn.Module:
    """Turn every torch.nn attention / transformer module inside `module` into its attnx class."""
    for m in module.modules():
        cls = _SWAPS.get(type(m))
        if cls is not None:
            m.__class__ = cls
    return module


def _check_input(name: str, x, layer) -> None:
    """x is (L, E) or batched (L, N, E) / (N, L, E), floating, with E = d_model and the dtype
    of `layer`'s weights (but under autocast), where `layer` is an attnx encoder or decoder
    layer; a tensor for another module (a stack's custom layer, which torch hands anything)."""
    if not isinstance(layer, (TransformerEncoderLayer, TransformerDecoderLayer)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        return
    _check_tensor(name, x, 2, 3)
    check_features(name, x, layer.self_attn.embed_dim, "d_model")
    check_dtype(name, x, layer.linear1.weight)


def _first_layer(stack):
    """The stack's first layer, whose weights its inputs meet, or None for an empty stack."""
    return stack.layers[0] if len(stack.layers) else None


def _check_batch(name: str, x, ref_name: str, ref, batch_first: bool) -> None:
    """x is batched (or not) as ref is, with ref's batch size."""
    if x.dim() != ref.dim():
        raise ValueError(f"{name}: expected {ref.dim()} dims (as {ref_name}, batched or not), "
                         f"got shape {tuple(x.shape)}")
    b = 0 if batch_first else 1
    if x.dim() == 3 and x.shape[b] != ref.shape[b]:
        raise ValueError(f"{name}: expected batch size {ref.shape[b]} (that of {ref_name}, dim "
                         f"{b}), got shape {tuple(x.shape)}")


def _check_masks(dtype: torch.dtype, **masks) -> None:
    for name, mask in masks.items():
        check_mask_type(name, mask, dtype)


def _same_signature(cls, base):
    cls.__init__.__signature__ = inspect.signature(base.__init__)
    cls.__init__.__doc__ = base.__init__.__doc__
    return cls


class TransformerEncoderLayer(torch.nn.TransformerEncoderLayer):
    """torch.nn.TransformerEncoderLayer with `self_attn` on attnx."""

    def __init__(self, *args, **kwargs):
        check_init(torch.nn.TransformerEncoderLayer, args, kwargs)
        super().__init__(*args, **kwargs)
        to_attnx(self)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        _check_input("src", src, self)
        # torch's _canonical_mask asserts on other dtypes: a TypeError naming the mask instead
        _check_masks(src.dtype, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask)
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask, mask_name="src_key_padding_mask",
            other_type=F._none_or_dtype(src_mask), other_name="src_mask", target_type=src.dtype)
        src_mask = F._canonical_mask(mask=src_mask, mask_name="src_mask", other_type=None,
                                     other_name="", target_type=src.dtype, check_other=False)
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal=False):
        with named_as(attn_mask="src_mask", key_padding_mask="src_key_padding_mask"):
            return super()._sa_block(x, attn_mask, key_padding_mask, is_causal=is_causal)


class TransformerDecoderLayer(torch.nn.TransformerDecoderLayer):
    """torch.nn.TransformerDecoderLayer with `self_attn` and `multihead_attn` on attnx."""

    def __init__(self, *args, **kwargs):
        check_init(torch.nn.TransformerDecoderLayer, args, kwargs)
        super().__init__(*args, **kwargs)
        to_attnx(self)

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False):
        _check_input("tgt", tgt, self)
        _check_input("memory", memory, self)
        _check_batch("memory", memory, "tgt", tgt, self.self_attn.batch_first)
        _check_masks(tgt.dtype, tgt_mask=tgt_mask, memory_mask=memory_mask,
                     tgt_key_padding_mask=tgt_key_padding_mask,
                     memory_key_padding_mask=memory_key_padding_mask)
        return super().forward(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                               memory_key_padding_mask, tgt_is_causal, memory_is_causal)

    def _sa_block(self, x, attn_mask, key_padding_mask, is_causal=False):
        with named_as(attn_mask="tgt_mask", key_padding_mask="tgt_key_padding_mask"):
            return super()._sa_block(x, attn_mask, key_padding_mask, is_causal=is_causal)

    def _mha_block(self, x, mem, attn_mask, key_padding_mask, is_causal=False):
        with named_as(attn_mask="memory_mask", key_padding_mask="memory_key_padding_mask"):
            return super()._mha_block(x, mem, attn_mask, key_padding_mask, is_causal=is_causal)


class TransformerEncoder(torch.nn.TransformerEncoder):
    """torch.nn.TransformerEncoder whose layers attend on attnx (a torch layer passed in is
    converted). Its forward is torch's without the nested tensors: where torch would make a
    padded batch nested (`use_nested_tensor`, which its constructor sets, and its forward's
    conditions: inference with a key padding mask and no src mask, padding at the ends, ...),
    its layers see the real tokens alone and its padded positions come out as zeros before the
    final norm; attnx's layers take the batch padded, its padded keys masked, and the same
    positions are zeroed. (torch with mask_check=False and padding not at the ends keeps each
    row's first positions instead: bad input, not reproduced.)"""

    def __init__(self, *args, **kwargs):
        check_init(torch.nn.TransformerEncoder, args, kwargs)
        super().__init__(*args, **kwargs)
        to_attnx(self)

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        first = _first_layer(self)
        _check_input("src", src, first)
        _check_masks(src.dtype, mask=mask, src_key_padding_mask=src_key_padding_mask)
        if first is None:  # an empty stack: torch's own answer
            return super().forward(src, mask, src_key_padding_mask, is_causal)
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask, mask_name="src_key_padding_mask",
            other_type=F._none_or_dtype(mask), other_name="mask", target_type=src.dtype)
        mask = F._canonical_mask(mask=mask, mask_name="mask", other_type=None, other_name="",
                                 target_type=src.dtype, check_other=False)
        padding = self._nested_padding(src, mask, src_key_padding_mask)
        if padding is None:
            seq_len = _get_seq_len(src, first.self_attn.batch_first)
            is_causal = _detect_is_causal_mask(mask, is_causal, seq_len)
            keys = src_key_padding_mask
        else:  # torch's layers get the real tokens alone, no mask, and do not read is_causal
            is_causal, keys = False, padding
        out = src
        with named_as(src_mask="mask"):  # (the layers' name for it)
            for layer in self.layers:
                out = layer(out, src_mask=mask, is_causal=is_causal, src_key_padding_mask=keys)
        if padding is not None:
            out = out.masked_fill(padding.unsqueeze(-1), 0.0)
        return out if self.norm is None else self.norm(out)

    def _nested_padding(self, src, mask, src_key_padding_mask):
        """The (N, L) bool padded positions (any nonzero of the canonical mask, as torch reads
        it) where torch's forward would run this call on nested tensors, else None: its
        conditions, in its order."""
        layer = self.layers[0]
        if (not getattr(self, "use_nested_tensor", False)
                or not torch.backends.mha.get_fastpath_enabled() or layer.training
                or src.dim() != 3 or src_key_padding_mask is None):
            return None
        check = getattr(self, "mask_check", True)
        if check and torch.compiler.is_compiling():
            return None
        kept = src_key_padding_mask.logical_not()
        if ((check and not torch._nested_tensor_from_mask_left_aligned(src, kept))
                or src.is_nested or mask is not None or torch.is_autocast_enabled()):
            return None
        attn = layer.self_attn
        weights = (src, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight,
                   attn.out_proj.bias, layer.norm1.weight, layer.norm1.bias, layer.norm2.weight,
                   layer.norm2.bias, layer.linear1.weight, layer.linear1.bias,
                   layer.linear2.weight, layer.linear2.bias)
        devices = ("cpu", "cuda", "xpu", torch.utils.backend_registration._privateuse1_backend_name)
        if (torch.overrides.has_torch_function(weights) or src.device.type not in devices
                or (torch.is_grad_enabled() and any(t.requires_grad for t in weights))):
            return None
        return ~kept


class TransformerDecoder(torch.nn.TransformerDecoder):
    """torch.nn.TransformerDecoder whose layers attend on attnx."""

    def __init__(self, *args, **kwargs):
        check_init(torch.nn.TransformerDecoder, args, kwargs)
        super().__init__(*args, **kwargs)
        to_attnx(self)

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=None, memory_is_causal=False):
        _check_input("tgt", tgt, _first_layer(self))
        _check_input("memory", memory, _first_layer(self))
        _check_masks(tgt.dtype, tgt_mask=tgt_mask, memory_mask=memory_mask,
                     tgt_key_padding_mask=tgt_key_padding_mask,
                     memory_key_padding_mask=memory_key_padding_mask)
        return super().forward(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                               memory_key_padding_mask, tgt_is_causal, memory_is_causal)


class Transformer(torch.nn.Transformer):
    """torch.nn.Transformer whose encoder and decoder attend on attnx."""

    def __init__(self, *args, **kwargs):
        check_init(torch.nn.Transformer, args, kwargs)
        super().__init__(*args, **kwargs)
        to_attnx(self)

    def forward(self, src, tgt, src_mask=None, tgt_mask=None, memory_mask=None,
                src_key_padding_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, src_is_causal=None, tgt_is_causal=None,
                memory_is_causal=False):
        for name, x in (("src", src), ("tgt", tgt)):
            _check_tensor(name, x, 2, 3)
            check_features(name, x, self.d_model, "d_model")
        _check_batch("tgt", tgt, "src", src, self.batch_first)
        _check_masks(src.dtype, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask)
        _check_masks(tgt.dtype, tgt_mask=tgt_mask, tgt_key_padding_mask=tgt_key_padding_mask,
                     memory_mask=memory_mask, memory_key_padding_mask=memory_key_padding_mask)
        with named_as(mask="src_mask"):  # (the encoder's name for it)
            return super().forward(src, tgt, src_mask, tgt_mask, memory_mask,
                                   src_key_padding_mask, tgt_key_padding_mask,
                                   memory_key_padding_mask, src_is_causal, tgt_is_causal,
                                   memory_is_causal)


_SWAPS.update({
    torch.nn.MultiheadAttention: MultiheadAttention,
    torch.nn.TransformerEncoderLayer: TransformerEncoderLayer,
    torch.nn.TransformerDecoderLayer: TransformerDecoderLayer,
    torch.nn.TransformerEncoder: TransformerEncoder,
    torch.nn.TransformerDecoder: TransformerDecoder,
})
for _cls in (TransformerEncoderLayer, TransformerDecoderLayer, TransformerEncoder,
             TransformerDecoder, Transformer):
    _same_signature(_cls, _cls.__mro__[1])
