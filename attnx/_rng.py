"""The dropout mask every backend draws, as one counter-based hash.

All backends (reference, C++, Triton, CUDA) decide whether element (bh, i, j) is kept with the
same integer hash of (seed, bh, i, j), so for one seed they drop exactly the same elements. That
makes dropout reproducible under ``torch.manual_seed`` and lets tests compare backends exactly
with dropout on. The hash is 32-bit and stateless, so tiles can be processed in any order.

    mix32(x):   x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16
    key_bh    = mix32(seed0 ^ mix32(bh ^ seed1))       bh = b * Hq + h (query head)
    key_row   = mix32(key_bh ^ (i * 0x9E3779B1))        (products mod 2**32)
    r         = mix32(key_row ^ (j * 0x85EBCA77))
    keep      = r >= threshold,  threshold = min(floor(p * 2**32), 2**32 - 1)

The indices are spread by the odd multipliers before the XOR: with i and j XORed in as they are,
two heads whose key_bh differ by d < Lq in XOR had the same mask with rows i and i ^ d swapped
(and two rows whose key_row differ by d < Lk the same one with columns permuted): at 1024
heads and L = 4096 about one such pair of heads a call.

Kept elements are scaled by 1 / (1 - p).

Packed variable-length batches (varlen_attention) draw sequence n's dropout as a batch-1 call
with the seed (seed0, mix32((seed1 + n + 1) mod 2**32)) and its local positions i, j:
sequence_seed() below, and csrc/cpu/varlen_cpu.cpp.
"""

from __future__ import annotations

import torch

MIX_MUL1 = 0x7FEB352D
MIX_MUL2 = 0x846CA68B
ROW_MUL = 0x9E3779B1
COL_MUL = 0x85EBCA77
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
    return element_hash(row_key(key_bh, i), j) >= keep_threshold(p)


def row_key(key_bh: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """The hash state of query row i of the head whose key is key_bh (uint32 in int64)."""
    return mix32(key_bh ^ _mul32(i, ROW_MUL))


def element_hash(key_row: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """r of element (row, j): kept where r >= keep_threshold(p)."""
    return mix32(key_row ^ _mul32(j, COL_MUL))


def sequence_seed(seed: torch.Tensor, n: int) -> torch.Tensor:
    """The seed of sequence n of a packed batch (see the module's docstring)."""
    word = mix32((seed[1:2] + n + 1) & _M32)
    return torch.cat([seed[:1], word])
