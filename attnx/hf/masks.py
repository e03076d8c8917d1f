"""The mask builder attnx registers with transformers' `AttentionMaskInterface`.

transformers describes each layer's mask as a function of (batch, head, q_idx, kv_idx) plus a
2-D padding mask, and for "sdpa" materialises it as a (B, 1, Lq, Lk) bool tensor (or returns
None where `is_causal` suffices). The patterns transformers' own builders make -- causal,
sliding-window causal, bidirectional, each with its padding -- become a `CompactMask` here, which
attnx's kernels take as a band and a broadcast padding vector. Packed sequences (transformers
finds them in position_ids that restart, without a padding mask: its padding-free training
path) with one of those patterns become a CompactMask with the tokens' sequence ids, which the
attention function runs as `attnx.varlen_attention`. Anything else (and/or overlays, a static
cache whose queries are not the last keys, a caller that needs a real tensor) is materialised
exactly as for "sdpa": correct, only not compact.
"""

from __future__ import annotations

import torch
from transformers import masking_utils as mu

from .._values import values_readable
from .attention import CompactMask

# sliding_window_causal_mask_function(w) is and_masks(sliding_window_overlay(w),
# causal_mask_function): recognised by the identity of those closures' code.
_AND_CODE = mu.and_masks(mu.causal_mask_function).__code__
_WINDOW_CODE = mu.sliding_window_overlay(1).__code__
# A packed batch's mask function is and_masks(remap_positions_for_packed_sequence(pattern,
# position_ids), packed_sequence_mask_function(sequence_ids)) in the transformers versions
# that have both (older ones' packed masks are materialised).
_REMAP_CODE, _PACKED_CODE = (
    (mu.remap_positions_for_packed_sequence(mu.causal_mask_function, None).__code__,
     mu.packed_sequence_mask_function(None).__code__)
    if hasattr(mu, "remap_positions_for_packed_sequence")
    and hasattr(mu, "packed_sequence_mask_function") else (None, None))


def _closure_var(fn, name: str):
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    return cells[name].cell_contents if name in cells else None


def _pattern(mask_function):
    """(causal, sliding_window) of a mask function transformers' builders make; None for any
    other (whose mask is then materialised)."""
    if mask_function is mu.causal_mask_function:
        return True, None
    if mask_function is mu.bidirectional_mask_function:
        return False, None
    if getattr(mask_function, "__code__", None) is _AND_CODE:
        parts = _closure_var(mask_function, "mask_functions") or ()
        if (len(parts) == 2 and parts[1] is mu.causal_mask_function
                and getattr(parts[0], "__code__", None) is _WINDOW_CODE):
            window = _closure_var(parts[0], "sliding_window")
            if isinstance(window, int):
                if window <= 0:  # sdpa_mask makes a mask of the wrong width from it (eager and
                    # sdpa fail on that with a size mismatch)
                    raise ValueError(f"sliding_window: expected a positive int (the model "
                                     f"config's), got {window}")
                return True, window
    return None


def _packed(mask_function):
    """(pattern's mask function, sequence ids (B, L)) of a packed batch's mask function, or
    None for any other."""
    if _REMAP_CODE is None or getattr(mask_function, "__code__", None) is not _AND_CODE:
        return None
    parts = _closure_var(mask_function, "mask_functions") or ()
    if (len(parts) != 2 or getattr(parts[0], "__code__", None) is not _REMAP_CODE
            or getattr(parts[1], "__code__", None) is not _PACKED_CODE):
        return None
    return (_closure_var(parts[0], "mask_function"),
            _closure_var(parts[1], "packed_sequence_mask"))


def attnx_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
               mask_function=mu.causal_mask_function, attention_mask=None,
               allow_is_causal_skip: bool = True, allow_is_bidirectional_skip: bool = False,
               **kwargs):
    """A CompactMask where the pattern allows one, else `sdpa_mask`'s (B, 1, Lq, Lk) tensor."""
    if isinstance(attention_mask, CompactMask):  # built ahead by generate() (CompactMask.ndim)
        return attention_mask
    packed = _packed(mask_function)
    if packed is not None and attention_mask is None and q_length == kv_length and (
            q_offset, kv_offset) == (0, 0):
        # transformers clears allow_is_causal_skip for every packed batch: the sequence ids
        # are what it would otherwise need a tensor for
        pattern = _pattern(packed[0])
        if pattern is not None:
            causal, window = pattern
            return CompactMask(None, causal, window, batch_size, q_length, kv_length,
                               sequence_ids=packed[1])
    pattern = _pattern(mask_function)
    if pattern is not None:
        causal, window = pattern
        # transformers clears these flags where the pattern was changed or the caller needs a
        # real tensor (to concatenate it with another mask)
        compact = allow_is_causal_skip if causal else allow_is_bidirectional_skip
        # a causal band is aligned bottom-right: the queries must be the last keys (a static
        # cache's queries are not, and its q_offset is a tensor)
        aligned = not causal or (isinstance(q_offset, int) and kv_length >= q_length
                                 and q_offset + q_length == kv_offset + kv_length)
        if compact and aligned:
            return CompactMask(_padding(attention_mask, kv_length, kv_offset), causal, window,
                               batch_size, q_length, kv_length)
    return mu.sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                        mask_function=mask_function, attention_mask=attention_mask,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **kwargs)


def _padding(attention_mask, kv_length: int, kv_offset: int):
    """The keys' (B, kv_length) padding mask, True for a token; None when none is padding."""
    if attention_mask is None:
        return None
    padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    padding = padding[:, kv_offset:kv_offset + kv_length]
    if not values_readable(padding):  # kept as is
        return padding
    return None if bool(padding.all()) else padding
