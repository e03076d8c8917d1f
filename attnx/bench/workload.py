"""Inputs for a Case and the callable that runs one pass of a provider on them."""

from __future__ import annotations

from typing import Callable

import torch

from .providers import Provider
from .shapes import DTYPES, Case


def make_inputs(case: Case, layout: str = "bhld", requires_grad: bool = False, seed: int = 0) -> dict:
    """Random inputs of the case, scaled like trained activations (unit-variance rows)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dtype = DTYPES[case.dtype]

    def rand(*shape):
        t = torch.randn(*shape, generator=gen, dtype=torch.float32).to(case.device, dtype)
        if layout == "blhd" and len(shape) == 4:
            t = t.transpose(1, 2).contiguous()
        return t.requires_grad_(requires_grad)

    b, h, lq, lk = case.batch, case.heads, case.seqlen_q, case.seqlen_k
    if case.op == "kvcache":  # every sequence's cache full; torch's peer takes the band as a mask
        band = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq).to(case.device)
        return {"q": rand(b, h, lq, case.head_dim), "k_cache": rand(b, case.kv_heads, lk, case.head_dim),
                "v_cache": rand(b, case.kv_heads, lk, case.value_dim),
                "seqlens": torch.full((b,), lk, dtype=torch.int32, device=case.device),
                "band": None if lq == 1 else band}
    if case.op == "varlen":
        return _varlen_inputs(case, layout, rand)
    if case.op == "sdpa":
        return {"q": rand(b, h, lq, case.head_dim), "k": rand(b, h, lk, case.head_dim),
                "v": rand(b, h, lk, case.value_dim)}
    return {"q": rand(b, h, lq, case.head_dim), "k": rand(b, h, lk, case.head_dim),
            "value": rand(b, h, lk, case.value_dim), "v": rand(case.head_dim) / case.head_dim ** 0.5}


def _varlen_inputs(case: Case, layout: str, rand) -> dict:
    """The packed batch ("packed": (total, H, D) rows and cu_seqlens), or the same batch padded
    at each sequence's end to the longest ("padded": (N, H, Lmax, D) and, not causal, the
    key-padding mask; causal needs none, a real query never reaching a padded key)."""
    lens, h = tuple(case.lengths), case.heads  # a list when the case comes back from JSON
    if layout == "packed":
        cu = torch.tensor((0,) + lens).cumsum(0).to(device=case.device, dtype=torch.int32)
        return {"q": rand(case.seqlen_q, h, case.head_dim), "k": rand(case.seqlen_k, h, case.head_dim),
                "v": rand(case.seqlen_k, h, case.value_dim), "cu_seqlens": cu, "longest": max(lens)}
    n, longest = len(lens), max(lens)
    real = (torch.arange(longest).view(1, -1) < torch.tensor(lens).view(-1, 1)).to(case.device)
    return {"q": rand(n, h, longest, case.head_dim), "k": rand(n, h, longest, case.head_dim),
            "v": rand(n, h, longest, case.value_dim),
            "key_padding": None if case.causal else real.view(n, 1, 1, longest)}


def make_step(provider: Provider, case: Case, pass_: str) -> Callable[[], object]:
    """A no-argument callable running one `pass_` of `provider` on fresh inputs of `case`.

    "backward" runs the forward once here and then times only `torch.autograd.grad` on the
    retained graph; gradients are returned, not accumulated into `.grad`, so every call does
    the same work.
    """
    def call(x):
        with provider.context():  # e.g. torch's sdpa_kernel(...) forcing one SDPA kernel
            return provider.run(x, case.causal)

    if pass_ == "forward":
        x = make_inputs(case, provider.layout)

        def forward():
            with torch.no_grad():
                return call(x)
        return forward

    x = make_inputs(case, provider.layout, requires_grad=True)
    leaves = [t for t in x.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    if pass_ == "backward":
        out = call(x)
        grad = torch.randn_like(out)

        def backward():
            return torch.autograd.grad(out, leaves, grad, retain_graph=True)
        return backward

    grad = None

    def forward_backward():
        nonlocal grad
        out = call(x)
        if grad is None:
            grad = torch.randn_like(out)
        return torch.autograd.grad(out, leaves, grad)
    return forward_backward
