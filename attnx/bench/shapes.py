"""The problems a sweep measures (`Case`) and the default sweeps for each device."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
PASSES = ("forward", "backward", "forward_backward")
PASS_ALIASES = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward_backward",
                "fwdbwd": "forward_backward", "forward+backward": "forward_backward"}


OPS = ("sdpa", "additive", "kvcache", "varlen")
# Ops that have a backward pass (attention_with_kvcache is inference only).
TRAINABLE = ("sdpa", "additive", "varlen")


@dataclass(frozen=True)
class Case:
    """One problem. For "sdpa" `head_dim` is E (= Ev); for "additive" it is the attention dim A
    and `value_dim` is Ev. "kvcache": `heads` query heads over `kv_heads` cached ones, Lq =
    `seqlen_q` new queries against a full cache of `seqlen_k` keys per sequence (causal:
    bottom-right). "varlen": `batch` packed sequences of `lengths`, `seqlen_q` = `seqlen_k` =
    their total."""
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
    kv_heads: int = 0  # kvcache: the cache's heads
    lengths: tuple = ()  # varlen: the sequences' lengths

    def as_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        dims = f"A={self.head_dim} Ev={self.value_dim}" if self.op == "additive" else f"D={self.head_dim}"
        lens = f"L={self.seqlen_q}" if self.seqlen_q == self.seqlen_k else f"Lq={self.seqlen_q} Lk={self.seqlen_k}"
        heads = f"H={self.heads}"
        if self.op == "kvcache":
            lens, heads = f"Lq={self.seqlen_q} cache={self.seqlen_k}", f"Hq={self.heads} Hkv={self.kv_heads}"
        if self.op == "varlen":
            lens = f"N={len(self.lengths)} tokens={self.seqlen_q} ({min(self.lengths)}-{max(self.lengths)})"
        batch = "" if self.op == "varlen" else f" B={self.batch}"
        return (f"{self.op}{batch} {heads} {lens} {dims} {self.dtype}"
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
    # kvcache: (B, cache L, Lq) cases of Hq query heads over Hkv cached ones (issue 23's shapes)
    kvcache_cases: tuple = ()
    kvcache_heads: tuple = (32, 8)
    kvcache_dim: int = 128
    # varlen: one packed batch of these lengths, H heads of D
    varlen_lengths: tuple = ()
    varlen_heads: int = 8
    varlen_dim: int = 64


# A training batch of 13 sequences of 64-2048 tokens, 8192 in all (benchmarks/cpu_varlen_targets.py)
VARLEN_LENGTHS = (2048, 1536, 1024, 1024, 768, 512, 384, 256, 256, 128, 128, 64, 64)


def default_sweep(device: str, quick: bool) -> Sweep:
    """A sweep that runs in a few minutes on the device (seconds with `quick`).

    CPU: batch 1, 8 heads of 64 (the figures of ANCHORS.md); GPU: batch x L = 16k tokens, hidden
    2048 (flash-attention's benchmark). Additive: NMT-sized (Britz et al. 2017) attention dims.
    """
    if device == "cuda":
        if quick:
            return Sweep((512, 1024), (64,), ("bfloat16",), ("forward", "forward_backward"), 5,
                         8192, 2048, 16, 256, (64, 128), (256,), time_scale=0.2,
                         kvcache_cases=((1, 4096, 1), (8, 4096, 4)),
                         varlen_lengths=VARLEN_LENGTHS[-6:], varlen_heads=16, varlen_dim=128)
        return Sweep((512, 1024, 2048, 4096, 8192, 16384), (64, 128), ("bfloat16",), PASSES, 10,
                     16384, 2048, 32, 256, (32, 64, 128, 256, 512), (256, 512),
                     kvcache_cases=tuple((b, n, lq) for b in (1, 8, 32) for n in (8192, 32768)
                                         for lq in (1, 4)),
                     varlen_lengths=VARLEN_LENGTHS * 4, varlen_heads=16, varlen_dim=128)
    if quick:
        return Sweep((64, 128), (64,), ("float32",), ("forward", "forward_backward"), 3,
                     256, 512, 2, 64, (16, 32), (64,), time_scale=0.2,
                     kvcache_cases=((1, 256, 1), (2, 256, 4)), kvcache_heads=(8, 2),
                     kvcache_dim=64, varlen_lengths=(64, 17, 40), varlen_heads=2)
    return Sweep((256, 512, 1024, 2048), (64,), ("float32",), ("forward", "forward_backward"), 5,
                 2048, 512, 8, 128, (32, 64, 128), (128,),
                 kvcache_cases=tuple((b, n, lq) for b in (1, 8) for n in (2048, 8192)
                                     for lq in (1, 4)),
                 varlen_lengths=VARLEN_LENGTHS)


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
        elif op == "kvcache":
            hq, hkv = sweep.kvcache_heads
            for b, n, lq in sweep.kvcache_cases:
                out.append(Case("kvcache", b, hq, lq, n, sweep.kvcache_dim, sweep.kvcache_dim,
                                True, dtype, device, kv_heads=hkv))
        elif op == "varlen":
            total = sum(sweep.varlen_lengths)
            for causal in (False, True):
                out.append(Case("varlen", len(sweep.varlen_lengths), sweep.varlen_heads, total,
                                total, sweep.varlen_dim, sweep.varlen_dim, causal, dtype, device,
                                lengths=tuple(sweep.varlen_lengths)))
        else:
            for a in sweep.additive_dims:
                for L in sweep.additive_seqlens:
                    for causal in (False, True):
                        out.append(Case("additive", sweep.additive_batch, 1, L, L, a,
                                        sweep.additive_value_dim, causal, dtype, device))
    return out
