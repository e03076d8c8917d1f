"""The dropout hash of `attnx/_rng.py` in Triton uint32 arithmetic, bit for bit.

The seed words and the keep threshold travel to the device as one int64 tensor of three
words (see `rng_words`), so no kernel argument changes type with the seed's value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _rng


def rng_words(seed: torch.Tensor, p: float, device: torch.device) -> torch.Tensor:
    """int64 (3,) on `device`: seed0, seed1, keep threshold. A seed already on the device stays
    there: no copy through the host, which would synchronise (and break CUDA graphs)."""
    seed = seed.to(device=device, dtype=torch.int64)
    threshold = torch.full((1,), _rng.keep_threshold(p), dtype=torch.int64, device=device)
    return torch.cat((seed, threshold))


@triton.jit
def mix32(x):
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def row_key(key_bh, offs_m):
    """Per query row i of the head whose key is key_bh: mix32(key_bh ^ i * ROW_MUL)."""
    return mix32(key_bh ^ (offs_m.to(tl.uint32) * tl.full([], 0x9E3779B1, tl.uint32)))


@triton.jit
def row_keys(rng_ptr, bh, offs_m):
    """Per query row i of head bh (= b * Hq + h): its row key, and the threshold."""
    s0 = tl.load(rng_ptr).to(tl.uint32)
    s1 = tl.load(rng_ptr + 1).to(tl.uint32)
    threshold = tl.load(rng_ptr + 2).to(tl.uint32)
    key_bh = mix32(s0 ^ mix32(bh.to(tl.uint32) ^ s1))
    return row_key(key_bh, offs_m), threshold


@triton.jit
def _columns(offs_n):
    """j * COL_MUL: the column's spread index (a vector per tile, not per element)."""
    return offs_n.to(tl.uint32) * tl.full([], 0x85EBCA77, tl.uint32)


@triton.jit
def keep(key_row, offs_n, threshold):
    """Bool (BLOCK_M, BLOCK_N): True where element (i, j) survives dropout."""
    return mix32(key_row[:, None] ^ _columns(offs_n)[None, :]) >= threshold


@triton.jit
def keep_t(key_row, offs_n, threshold):
    """`keep` transposed, (BLOCK_N, BLOCK_M), for key-major tiles: computed in that layout, not
    transposed in registers."""
    return mix32(key_row[None, :] ^ _columns(offs_n)[:, None]) >= threshold
