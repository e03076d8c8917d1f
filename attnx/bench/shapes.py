"""The problems a sweep measures (`Case`) and the default sweeps for each device."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
PASSES = ("forward", "backward", "forward_backward")
PASS_ALIASES = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward_backward",
                "fwdbwd": "forward_backward", "forward+backward": "forward_backward"}


@dataclass(frozen=True)
class Case:
    """One problem. For "sdpa" `head_dim` is E (= Ev); for "additive" it is the attention dim A
    and `value_dim` is Ev."""
    op: str
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    value_dim: int
    causal: bool
    dtype: str
    device: str

    def as_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        dims = f"D={self.head_dim}" if self.op == "sdpa" else f"A={self.head_dim} Ev={self.value_dim}"
        lens = f"L={self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"Lq={self.seqlen_q} Lk={self.seqlen_k}"
        return (f"{self.op} B={self.batch} H={self.heads} {lens} {dims} {self.dtype}"
                f"{' causal' if self.causal else ''}")


@dataclass
class Sweep:
    seqlens: tuple
    head_dims: tuple
    dtypes: tuple
    passes: tuple
    repeats: int
    # tokens per batch (batch * L) for SDPA, as flash-attention's benchmarks hold it constant
    sdpa_tokens: int
    sdpa_heads_dim: int  # hidden size H * D, so heads = hidden // D
    additive_batch: int
    additive_value_dim: int
    additive_seqlens: tuple
    additive_dims: tuple
    time_scale: float = 1.0  # multiplies the warm-up and block durations of `timing`


def default_sweep(device: str, quick: bool) -> Sweep:
    """A sweep that runs in a few minutes on the device (seconds with `quick`).

    CPU: batch 1, 8 heads of 64 (the figures of ANCHORS.md); GPU: batch x L = 16k tokens, hidden
    2048 (flash-attention's benchmark). Additive: NMT-sized (Britz et al. 2017) attention dims.
    """
    if device == "cuda":
        if quick:
            return Sweep((512, 1024), (64,), ("bfloat16",), ("forward", "forward_backward"), 5,
                         8192, 2048, 16, 256, (64, 128), (256,), time_scale=0.2)
        return Sweep((512, 1024, 2048, 4096, 8192, 16384), (64, 128), ("bfloat16",), PASSES, 10,
                     16384, 2048, 32, 256, (32, 64, 128, 256, 512), (256, 512))
    if quick:
        return Sweep((64, 128), (64,), ("float32",), ("forward", "forward_backward"), 3,
                     256, 512, 2, 64, (16, 32), (64,), time_scale=0.2)
    return Sweep((256, 512, 1024, 2048), (64,), ("float32",), ("forward", "forward_backward"), 5,
                 2048, 512, 8, 128, (32, 64, 128), (128,))


def cases(op: str, sweep: Sweep, device: str) -> list:
    """Every Case of `op` in the sweep, causal and not, smallest first."""
    out = []
    for dtype in sweep.dtypes:
        if op == "sdpa":
            for d in sweep.head_dims:
                heads = max(1, sweep.sdpa_heads_dim // d)
                for L in sweep.seqlens:
                    batch = max(1, sweep.sdpa_tokens // L)
                    for causal in (False, True):
                        out.append(Case("sdpa", batch, heads, L, L, d, d, causal, dtype, device))
        else:
            for a in sweep.additive_dims:
                for L in sweep.additive_seqlens:
                    for causal in (False, True):
                        out.append(Case("additive", sweep.additive_batch, 1, L, L, a,
                                        sweep.additive_value_dim, causal, dtype, device))
    return out
