"""The attention function attnx registers with transformers, and the compact mask it takes.

Nothing here imports transformers: the function only receives what a model's attention layer
passes (`attention_interface(self, query, key, value, attention_mask, dropout=..., scaling=...,
**kwargs)`) and maps it onto attnx's ops.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from .. import _dispatch
from .._backends import cpu


class NotAMaskTensor(TypeError):
    """A CompactMask used as a tensor."""


_NOT_A_TENSOR = ("attention_mask: this model computes attention itself from a mask tensor, "
                 "and attn_implementation='attnx' serves only models whose attention goes "
                 "through transformers' attention interface (ALL_ATTENTION_FUNCTIONS); use "
                 "'sdpa' or 'eager' for it")


@dataclass(frozen=True, eq=False)  # eq: identity (its padding tensor has no truth value)
class CompactMask:
    """A layer's mask as attnx takes it (built by `attnx.hf.masks.attnx_mask`).

    Query i (of `q_length`) may attend key j (of `kv_length`) iff `padding[b, j]` (every key
    when `padding` is None) and, when `causal`, `j <= i + kv_length - q_length` (the queries
    are the last positions of the keys, as with transformers' dynamic caches: bottom-right), and
    with a `sliding_window` W also `j > i + kv_length - q_length - W` (W keys, the query's own
    included: transformers' convention). The kernels take the causal and window parts as a band
    of keys (whole tiles outside it are skipped) and the padding as a (B, 1, 1, Lk) mask
    broadcast without a copy, where "sdpa" gets a materialised (B, 1, Lq, Lk) tensor.
    """

    padding: Optional[torch.Tensor]  # (B, kv_length) bool, True: a token that may be attended
    causal: bool
    sliding_window: Optional[int]
    batch_size: int
    q_length: int
    kv_length: int
    # packed sequences (q_length == kv_length, no padding): (B, L) integers, equal within a
    # sequence (consecutive tokens), which attends only to itself; run as varlen_attention
    sequence_ids: Optional[torch.Tensor] = None

    # generate() builds a step's masks ahead for compileable caches and passes them back in as
    # the model's attention_mask; transformers tells such a finished mask from a 2-D padding
    # mask by its rank (and attnx_mask returns it as it is)
    ndim = 4

    @property
    def shape(self) -> tuple:
        return (self.batch_size, 1, self.q_length, self.kv_length)

    # transformers builds masks for every model that asks its builders (Bloom and MPT too),
    # whatever the model does with them: one that adds it to its scores, or moves it (.to),
    # gets a clear error here, not one from its arithmetic.
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise NotAMaskTensor(_NOT_A_TENSOR)

    def __getattr__(self, name: str):  # attributes a CompactMask lacks: .to, .dtype, .bool()
        # (a plain AttributeError: hasattr and getattr with a default answer "no", also while
        # torch.compile traces with fullgraph=True, which an exception of attnx's own breaks)
        raise AttributeError(f"{_NOT_A_TENSOR} (it asked for the mask's .{name})")

    def _arithmetic(self, *_):  # scores + mask: a Tensor's operator gives way to this one
        raise NotAMaskTensor(_NOT_A_TENSOR)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _arithmetic
    __and__ = __rand__ = __or__ = __ror__ = __invert__ = _arithmetic


# What some layers pass only to attention functions other than eager and sdpa, which they
# otherwise fold into the mask: attnx would attend densely without them (a silent wrong answer).
_UNSERVED = {
    "position_bias": "T5-style relative position biases",
    "indices": "sparse attention's top-k key indices (DeepSeek-V3.2 and its kin)",
    "block_indices": "block-sparse key indices",
    "sinks": "a layer's own sink logits under that name (gpt-oss's s_aux is served)",
}


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask, dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                      softcap: Optional[float] = None, s_aux: Optional[torch.Tensor] = None,
                      **kwargs):
    """transformers' attention-function contract: query (B, Hq, Lq, E), key and value
    (B, Hkv, Lk, E/Ev), a mask (a CompactMask, a tensor, or None); returns the
    (B, Lq, Hq, Ev) output and no weights.

    `scaling` is attnx's `scale`, `softcap` its `softcap`, `s_aux` (gpt-oss) its `sinks`;
    `dropout` is what the layer passes (its rate in training, 0 in eval). GQA runs without
    copying the key/value heads. `sliding_window`, which some layers also pass, is already in
    the mask, as for "sdpa".
    """
    for name, what in _UNSERVED.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: not supported by attn_implementation='attnx' ({what}); "
                             "use 'sdpa' or 'eager'")
    if kwargs.get("output_attentions"):  # (as sdpa's function, which logs it)
        warnings.warn("output_attentions=True: attn_implementation='attnx' returns no attention "
                      "weights; use 'eager' for them", stacklevel=2)
    modifiers = {name: x for name, x in (("softcap", softcap), ("sinks", s_aux)) if x is not None}
    gqa = key.shape[1] != query.shape[1]
    if isinstance(attention_mask, CompactMask):
        out = _with_compact_mask(attention_mask, query, key, value, dropout, scaling, gqa,
                                 modifiers)
    else:
        # A tensor mask (one transformers materialised, or the user's own 4-D mask) is the whole
        # truth; without one a causal layer is causal, top-left, as in transformers' sdpa path.
        causal = attention_mask is None and query.shape[2] > 1 and (
            is_causal if is_causal is not None else getattr(module, "is_causal", True))
        out = _dispatch.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal,
            scale=scaling, enable_gqa=gqa, **modifiers)
    return out.transpose(1, 2).contiguous(), None


def _with_compact_mask(mask: CompactMask, q, k, v, dropout, scale, gqa, modifiers):
    lq, lk = q.shape[2], k.shape[2]
    if (lq, lk) != (mask.q_length, mask.kv_length):
        raise ValueError(f"attention_mask: a CompactMask for (Lq, Lk) = ({mask.q_length}, "
                         f"{mask.kv_length}), got query and key lengths ({lq}, {lk})")
    if mask.sequence_ids is not None:
        return _packed(mask, q, k, v, dropout, scale, modifiers)
    padding, window = mask.padding, None
    if mask.causal:
        offset, w = lk - lq, mask.sliding_window  # query i sits at key position i + offset
        if w is not None and offset > w - 1:
            # keys before the first query's window are never attended: drop them, so that the
            # window's left edge (i + offset - (w - 1)) is expressible relative to i
            k, v = k[:, :, offset - (w - 1):], v[:, :, offset - (w - 1):]
            padding = None if padding is None else padding[:, offset - (w - 1):]
            offset = w - 1
        window = (None if w is None else w - 1 - offset, offset)
        if lq == 1 and padding is None and _decode_kernel_serves(q, k, v, dropout, modifiers):
            return _dispatch.attention_with_kvcache(
                q, k, v, k.shape[2], scale=scale,
                window=None if w is None else (w - 1, None))
    attn_mask = None if padding is None else padding[:, None, None, :]
    return _dispatch.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout, scale=scale, enable_gqa=gqa,
        window=window, **modifiers)


def _packed(mask: CompactMask, q, k, v, dropout, scale, modifiers):
    """A packed batch as one varlen_attention call: the B rows' tokens in a row, each run of
    equal sequence ids one sequence (no padding anywhere); (B, H, L, .) in and out."""
    b, lq = q.shape[0], q.shape[2]
    ids = mask.sequence_ids.to(q.device).expand(b, lq)
    starts = torch.ones_like(ids, dtype=torch.bool)  # a sequence starts each row, and where
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]         # the id changes
    bounds = torch.cat([starts.flatten().nonzero().flatten(),
                        torch.tensor([b * lq], device=q.device)])
    cu = bounds.to(torch.int32)
    packed = [t.transpose(1, 2).reshape(b * lq, t.shape[1], t.shape[3]) for t in (q, k, v)]
    window = None if mask.sliding_window is None else (mask.sliding_window - 1, None)
    out = _dispatch.varlen_attention(*packed, cu, cu, dropout_p=dropout, is_causal=mask.causal,
                                     scale=scale, window=window, **modifiers)
    return out.view(b, lq, q.shape[1], v.shape[3]).transpose(1, 2)


def _decode_kernel_serves(q, k, v, dropout, modifiers) -> bool:
    """Whether a one-query step can run on the CPU decoding kernel (split over the keys; it
    reads the cache where it lies), which is faster there than the SDPA kernel for one query
    row. It is an inference op: no dropout, no gradient, no score modifiers yet. Not under
    autocast: the decoding op does not cast (Llama's q and k come out float32 from RoPE beside a
    bf16 v there), the SDPA op does, as torch's, and runs one query row on the same kernel.
    A decoding step asks this per layer with the caches cold: `is_cpu` costs a third of
    `device.type`'s building of a torch.device then."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return (q.is_cpu and not needs_grad and dropout == 0 and not modifiers
            and q.dtype in cpu.DTYPES and cpu.availability() is None
            and not torch.is_autocast_enabled("cpu"))
