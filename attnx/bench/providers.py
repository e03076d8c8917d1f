"""Who can run what: every implementation the suite times, discovered at run time.

A provider maps the inputs of a Case (see `workload.make_inputs`) to the output tensor. Each
states whether it can run on this machine (`reason` is None when it can); a provider that is
listed but fails on a case is reported with its error, never fatal.
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

import attnx
# attnx.backends() is shadowed by the attnx.backends package once a backend module is imported
from attnx._dispatch import backends as backend_status

# attnx backends worth timing per device: the Triton interpreter on CPU is a test tool, not a
# contender, so it is left out there.
ATTNX_BACKENDS = {"cpu": ("cpu", "reference"), "cuda": ("cuda", "triton", "reference")}
TORCH_SDPA_KERNELS = {"cpu": ("math", "flash"), "cuda": ("math", "flash", "efficient", "cudnn")}
COMPILE_PROBE_SECONDS = 60


@dataclass
class Provider:
    name: str
    op: str  # "sdpa", "additive", "kvcache" or "varlen" (shapes.OPS)
    run: Optional[Callable] = None  # run(inputs: dict, causal: bool) -> Tensor
    reason: Optional[str] = None  # why it cannot run here; None when it can
    layout: str = "bhld"  # "blhd" for libraries that take (B, L, H, D); varlen: "packed"/"padded"
    context: Callable = field(default=contextlib.nullcontext)  # entered around each timed block

    @property
    def available(self) -> bool:
        return self.reason is None


def _attnx(backend: str, status) -> list:
    reason = None if status.usable else status.reason

    def sdpa(x, causal):
        return attnx.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=causal,
                                                  backend=backend)

    def additive(x, causal):
        return attnx.additive_attention(x["q"], x["k"], x["value"], x["v"], is_causal=causal,
                                        backend=backend)

    def kvcache(x, causal):
        return attnx.attention_with_kvcache(x["q"], x["k_cache"], x["v_cache"], x["seqlens"],
                                            is_causal=causal, backend=backend)

    def varlen(x, causal):
        cu, longest = x["cu_seqlens"], x["longest"]
        return attnx.varlen_attention(x["q"], x["k"], x["v"], cu, cu, longest, longest,
                                      is_causal=causal, backend=backend)

    return [Provider(f"attnx-{backend}", "sdpa", sdpa, reason),
            Provider(f"attnx-{backend}", "additive", additive, reason),
            Provider(f"attnx-{backend}", "kvcache", kvcache, reason),
            Provider(f"attnx-{backend}", "varlen", varlen, reason, layout="packed")]


def _torch_peers() -> list:
    """What a user runs instead of the kvcache and varlen ops: torch's SDPA (its own choice of
    kernel) over the cache as it is (GQA through enable_gqa, the bottom-right band as a bool
    mask when Lq > 1), and over the packed batch padded to its longest sequence."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def decode(x, causal):
        return sdpa(x["q"], x["k_cache"], x["v_cache"], attn_mask=x["band"] if causal else None,
                    enable_gqa=True)

    def padded(x, causal):
        return sdpa(x["q"], x["k"], x["v"], attn_mask=x["key_padding"], is_causal=causal)

    return [Provider("torch-sdpa", "kvcache", decode),
            Provider("torch-sdpa-padded", "varlen", padded, layout="padded")]


def _torch_varlen(device: str) -> Provider:
    """torch's own packed-sequence kernel (torch.nn.attention.varlen, CUDA only)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        return Provider("torch-varlen", "varlen", reason=f"no torch.nn.attention.varlen here ({exc})")
    if device != "cuda":
        return Provider("torch-varlen", "varlen", reason="torch's varlen_attn runs on CUDA only")

    def run(x, causal):
        cu, longest = x["cu_seqlens"], x["longest"]
        return varlen_attn(x["q"], x["k"], x["v"], cu, cu, longest, longest,
                           window_size=(-1, 0) if causal else (-1, -1))

    return Provider("torch-varlen", "varlen", run, layout="packed")


def _torch_sdpa(kernel: str, device: str) -> Provider:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "cudnn": "CUDNN_ATTENTION"}
    backend = getattr(SDPBackend, names[kernel], None)
    if backend is None:
        return Provider(f"torch-{kernel}", "sdpa", reason=f"this torch has no SDPBackend.{names[kernel]}")
    if device == "cuda" and not torch.cuda.is_available():
        return Provider(f"torch-{kernel}", "sdpa", reason="no CUDA device")

    def run(x, causal):
        return torch.nn.functional.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=causal)

    return Provider(f"torch-{kernel}", "sdpa", run, context=lambda: sdpa_kernel(backend))


def _causal_fill(s):
    """Scores with keys after their query (top-left aligned) set to -inf."""
    lq, lk = s.shape[-2:]
    return s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))


def naive_sdpa(x, causal):
    """softmax(Q K^T / sqrt(D)) V, every intermediate stored, in the inputs' dtype."""
    q, k, v = x["q"], x["k"], x["v"]
    s = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    return torch.matmul(torch.softmax(_causal_fill(s) if causal else s, dim=-1), v)


def naive_additive(x, causal):
    """softmax_j(sum_a v_a tanh(q_ia + k_ja)) V with the full (B, H, Lq, Lk, A) tanh tensor."""
    t = torch.tanh(x["q"].unsqueeze(3) + x["k"].unsqueeze(2))
    s = torch.matmul(t, x["v"].view(-1, 1)).squeeze(-1)
    return torch.matmul(torch.softmax(_causal_fill(s) if causal else s, dim=-1), x["value"])


def summed_additive(x, causal):
    """The naive additive formula with the sum over A written as a reduction: what a user hands
    to torch.compile, whose inductor fuses tanh and the sum into one loop and never stores the
    (B, H, Lq, Lk, A) tensor (eager, it still does)."""
    s = (x["v"] * torch.tanh(x["q"].unsqueeze(3) + x["k"].unsqueeze(2))).sum(-1)
    return torch.matmul(torch.softmax(_causal_fill(s) if causal else s, dim=-1), x["value"])


def _compile_probe(code: str, what: str, timeout: float) -> Optional[str]:
    """Runs `code` (which compiles something with torch.compile and calls it once) in a child
    process; the reason it is unusable, if any.

    A child process bounds the time: on CPU, torch.compile may take minutes or fail for lack of
    a C++ toolchain, and a sweep must not hang on it.
    """
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{what} took over {timeout:.0f} s here"
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no message"])[-1]
        return f"{what} failed: {last[:200]}"
    return None


def _flex_probe(device: str, timeout: float) -> Optional[str]:
    code = ("import torch; from torch.nn.attention.flex_attention import flex_attention\n"
            f"x = torch.randn(1, 2, 128, 64, device='{device}')\n"
            "torch.compile(flex_attention, dynamic=False)(x, x, x).sum().item()\n")
    return _compile_probe(code, "torch.compile(flex_attention)", timeout)


def _flex(device: str, probe: bool) -> Provider:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as exc:
        return Provider("torch-flex", "sdpa", reason=f"no FlexAttention in this torch ({exc})")
    if not probe:
        return Provider("torch-flex", "sdpa", reason=(
            "not probed, compiling FlexAttention is slow (attnx bench --quick: name torch-flex "
            "in --providers; pytest benchmarks/: set ATTNX_BENCH_FLEX=1)"))
    reason = _flex_probe(device, COMPILE_PROBE_SECONDS)
    if reason is not None:
        return Provider("torch-flex", "sdpa", reason=reason)
    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def run(x, causal):
        q = x["q"]
        block_mask = None
        if causal:
            key = (q.shape[-2], x["k"].shape[-2], q.device)
            if key not in masks:
                masks[key] = create_block_mask(lambda b, h, i, j: i >= j, None, None, key[0],
                                               key[1], device=str(q.device))
            block_mask = masks[key]
        return compiled(q, x["k"], x["v"], block_mask=block_mask)

    return Provider("torch-flex", "sdpa", run)


def _compiled_additive(device: str, probe: bool) -> Provider:
    """torch.compile of the naive additive formula: the peer a user runs instead of attnx's
    fused additive kernels (inductor fuses the tanh-sum reduction)."""
    name = "compile-naive"
    if not probe:
        return Provider(name, "additive", reason=(
            "not probed, torch.compile is slow (attnx bench --quick: name compile-naive in "
            "--providers; pytest benchmarks/: set ATTNX_BENCH_COMPILE=1)"))
    code = ("import torch; from attnx.bench.providers import summed_additive\n"
            f"x = {{n: torch.randn(1, 1, 8, 16, device='{device}') for n in ('q', 'k', 'value')}}\n"
            f"x['v'] = torch.randn(16, device='{device}')\n"
            "torch.compile(summed_additive, dynamic=False)(x, True).sum().item()\n")
    reason = _compile_probe(code, "torch.compile(naive additive)", COMPILE_PROBE_SECONDS)
    if reason is not None:
        return Provider(name, "additive", reason=reason)
    return Provider(name, "additive", torch.compile(summed_additive, dynamic=False))


def _flash_attn(device: str) -> Provider:
    if importlib.util.find_spec("flash_attn") is None:
        return Provider("flash-attn", "sdpa", reason="flash_attn is not installed")
    if device != "cuda":
        return Provider("flash-attn", "sdpa", reason="flash-attn runs on CUDA only")
    from flash_attn import flash_attn_func

    return Provider("flash-attn", "sdpa", lambda x, c: flash_attn_func(x["q"], x["k"], x["v"], causal=c),
                    layout="blhd")


def _xformers(device: str) -> Provider:
    if importlib.util.find_spec("xformers") is None:
        return Provider("xformers", "sdpa", reason="xformers is not installed")
    if device != "cuda":
        return Provider("xformers", "sdpa", reason="xformers' fused kernels need CUDA")
    import xformers.ops as xops

    def run(x, causal):
        bias = xops.LowerTriangularMask() if causal else None
        return xops.memory_efficient_attention(x["q"], x["k"], x["v"], attn_bias=bias)

    return Provider("xformers", "sdpa", run, layout="blhd")


def discover(device: str, probe_flex: bool = True, probe_compile: bool = True) -> list:
    """Every provider the suite knows for `device`, available or not (with the reason).
    `probe_flex` / `probe_compile`: whether to try torch.compile for FlexAttention / the naive
    additive formula (slow); when not, those providers are listed as not probed."""
    found = []
    status = backend_status()
    for name in ATTNX_BACKENDS.get(device, ("reference",)):
        found += _attnx(name, status[name])
    found += [_torch_sdpa(k, device) for k in TORCH_SDPA_KERNELS.get(device, ())]
    found.append(_flex(device, probe_flex))
    found += _torch_peers() + [_torch_varlen(device)]
    found += [Provider("naive", "sdpa", naive_sdpa), Provider("naive", "additive", naive_additive)]
    found.append(_compiled_additive(device, probe_compile))
    found += [_flash_attn(device), _xformers(device)]
    return found


def select(found: list, ops, names=None) -> list:
    """Providers of `ops`, restricted to `names` when given (unknown names raise ValueError)."""
    if names:
        known = {p.name for p in found}
        unknown = sorted(set(names) - known)
        if unknown:
            raise ValueError(f"--providers: unknown {unknown}; known here: {sorted(known)}")
    return [p for p in found if p.op in ops and (not names or p.name in names)]
