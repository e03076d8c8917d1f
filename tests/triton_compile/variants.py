"""Which variants and units a run compiles: the CI set, or the full cross-product (--full)."""

from __future__ import annotations

import itertools

from .capture import Variant

HEAD_DIMS = (16, 64, 96, 128, 192, 256)
DTYPES = ("fp32", "fp16", "bf16")

# The CI set: each dtype, each head-dim family and each constexpr flag at least once per op
# (masks none/bool/float/float32, dropout, GQA, additive weights and shared v, paged caches,
# softcap (a huge cap too: its own SOFTCAP), ALiBi, sinks),
# wide heads in each dtype family.
CI = (
    Variant("sdpa", "fp16", 64),
    Variant("sdpa", "bf16", 128, mask="bool", dropout=True),
    Variant("sdpa", "fp32", 96, mask="float", gqa=True),
    Variant("sdpa", "fp16", 256, mask="float", dropout=True),
    Variant("sdpa", "bf16", 16, gqa=True, dropout=True),
    Variant("sdpa", "fp32", 256),
    # head dims in two chunks (attnx/triton/common.py head_blocks): 64 + 32, 128 + 64
    Variant("sdpa", "fp16", 96, mask="bool"),
    Variant("sdpa", "bf16", 192, gqa=True),
    Variant("additive", "fp32", 64, weights=True),
    Variant("additive", "fp16", 128, mask="bool", dropout=True),
    Variant("additive", "bf16", 256, mask="float", weights=True),
    Variant("additive", "fp16", 64, mask="float32"),
    Variant("additive", "bf16", 128, shared_v=True),
    Variant("kvcache", "fp16", 128, gqa=True, paged=True),
    Variant("kvcache", "bf16", 64),
    Variant("kvcache", "fp32", 256, paged=True),
    # the score modifiers: each flag alone and all together, forward, backward and decoding
    Variant("sdpa", "fp16", 128, softcap=True),
    Variant("sdpa", "bf16", 64, alibi=True, gqa=True),
    Variant("sdpa", "fp16", 64, sinks=True, mask="float32"),
    Variant("sdpa", "bf16", 128, mask="bool", softcap=True, alibi=True, sinks=True),
    Variant("sdpa", "fp32", 256, softcap=True, alibi=True, sinks=True),
    Variant("kvcache", "fp16", 64, softcap=True, huge_cap=True),
    Variant("kvcache", "bf16", 128, gqa=True, paged=True, softcap=True, alibi=True, sinks=True),
    # packed sequences (the sdpa kernels' VARLEN mode; no mask there), with the modifiers
    Variant("varlen", "fp16", 64),
    Variant("varlen", "bf16", 128, gqa=True, dropout=True),
    Variant("varlen", "fp16", 128, softcap=True, huge_cap=True, alibi=True, sinks=True),
)


def full() -> list[Variant]:
    """Every dtype x head dim x each flag alone and all flags together, for each op."""
    flags = {
        "sdpa": [{}, dict(mask="bool"), dict(mask="float"), dict(mask="float32"),
                 dict(dropout=True), dict(gqa=True),
                 dict(mask="float", dropout=True, gqa=True), dict(softcap=True),
                 dict(alibi=True), dict(sinks=True),
                 dict(mask="float", dropout=True, gqa=True, softcap=True, alibi=True,
                      sinks=True)],
        "additive": [{}, dict(mask="bool"), dict(mask="float"), dict(mask="float32"),
                     dict(dropout=True), dict(weights=True), dict(shared_v=True),
                     dict(mask="float", dropout=True, weights=True)],
        "kvcache": [{}, dict(gqa=True), dict(paged=True), dict(gqa=True, paged=True),
                    dict(gqa=True, paged=True, softcap=True, alibi=True, sinks=True)],
        "varlen": [{}, dict(dropout=True), dict(gqa=True), dict(dropout=True, gqa=True),
                   dict(dropout=True, gqa=True, softcap=True, alibi=True, sinks=True)],
    }
    return [Variant(op, dt, d, **f) for op in ("sdpa", "additive", "kvcache", "varlen")
            for dt, d in itertools.product(DTYPES, HEAD_DIMS) for f in flags[op]]


def config_key(unit) -> tuple:
    return tuple(sorted(unit.config.items()))


def cover(units: list) -> list:
    """A subset of `units` (in variant order) that compiles every kernel x every config at
    least once, and every launch of every variant at least once (a kernel launched twice with
    other constexprs, as sdpa_bwd_rerun._keys_kernel for dK and dV, is two): for each launch,
    the config compiled least so far; then each config not yet compiled."""
    chosen, seen = [], {}
    by_kernel: dict = {}
    for u in units:
        by_kernel.setdefault((u.kernel, u.variant, u.launch), []).append(u)
    for group in by_kernel.values():
        pick = min(group, key=lambda u: seen.get((u.kernel, config_key(u)), 0))
        seen[(pick.kernel, config_key(pick))] = seen.get((pick.kernel, config_key(pick)), 0) + 1
        chosen.append(pick)
    for u in units:
        if (u.kernel, config_key(u)) not in seen:
            seen[(u.kernel, config_key(u))] = 1
            chosen.append(u)
    return chosen
