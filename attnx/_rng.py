"""The dropout mask every backend draws, as one counter-based hash.

All backends (reference, C++, Triton, CUDA) decide whether element (bh, i, j) is kept with the
same integer hash of (seed, bh, i, j), so for one seed they drop exactly the same elements. That
makes dropout reproducible under ``torch.manual_seed`` and lets tests compare backends exactly
with dropout on. The hash is 32-bit and stateless, so tiles can be processed in any order.

    mix32(x):   x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16
    key_bh    = mix32(seed0 ^ mix32(bh ^ seed1))       bh = b * Hq + h (query head)
    key_row   = mix32(key_bh ^ i)
    r         = mix32(key_row ^ j)
    keep      = r >= threshold,  threshold = min(floor(p * 2**32), 2**32 - 1)

Kept elements are scaled by 1 / (1 - p).

Packed variable-length batches (varlen_attention) draw sequence n's dropout as a batch-1 call
with the seed (seed0, mix32((seed1 + n + 1) mod 2**32)) and its local positions i, j:
sequence_seed() below, and csrc/cpu/varlen_cpu.cpp.
"""

from __future__ import annotations

import torch

MIX_MUL1 = 0x7FEB352D
MIX_MUL2 = 0x846CA68B
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for uint32 values held in int64, split so no product overflows int64.
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MUL2)
    return x ^ (x >> 16)


def draw_seed() -> torch.Tensor:
    """Two uint32 words from torch's CPU generator (seeded by ``torch.manual_seed``)."""
    return torch.randint(0, 2**32, (2,), dtype=torch.int64)


def keep_threshold(p: float) -> int:
    return min(int(p * 2**32), _M32)


def keep_mask(seed: torch.Tensor, batch: int, heads: int, lq: int, lk: int,
              p: float, device: torch.device) -> torch.Tensor:
    """Bool tensor (batch, heads, lq, lk): True where the element survives dropout."""
    s = seed.to(device)  # tensor ops only (no .tolist()), so torch.compile traces it whole
    bh = torch.arange(batch * heads, dtype=torch.int64, device=device)
    key_bh = mix32(s[0] ^ mix32(bh ^ s[1])).view(batch, heads, 1, 1)
    i = torch.arange(lq, dtype=torch.int64, device=device).view(1, 1, lq, 1)
    j = torch.arange(lk, dtype=torch.int64, device=device).view(1, 1, 1, lk)
    r = mix32(mix32(key_bh ^ i) ^ j)
    return r >= keep_threshold(p)


def sequence_seed(seed: torch.Tensor, n: int) -> torch.Tensor:
    """The seed of sequence n of a packed batch (see the module's docstring)."""
    word = mix32((seed[1:2] + n + 1) & _M32)
    return torch.cat([seed[:1], word])
