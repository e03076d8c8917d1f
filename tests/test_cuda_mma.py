"""csrc/cuda/mma.cuh's primitives (mma_m16n8k16, ldmatrix, cp.async) through the host harness,
checked against the PTX ISA's fragment tables independently of the attention kernels.

The tables are written here a second time, from the PTX ISA (mma.sync.aligned.m16n8k16 with
.f16/.bf16 operands, ldmatrix.sync.aligned.m8n8), with g = lane // 4 and t = lane % 4; a 32-bit
register holds two 16-bit elements, the first in its low half. The test-only kernels are
csrc/cuda/host/mma_selftest.cu, the same source nvcc compiles (tests/test_cuda_resources.py).
"""

from __future__ import annotations

import pytest
import torch

from attnx import _ops

pytestmark = pytest.mark.skipif(_ops.cuda_host() is not None, reason=str(_ops.cuda_host()))

DTYPES = (torch.float16, torch.bfloat16)
LANES = torch.arange(32)
G, T = LANES // 4, LANES % 4


def host():
    from attnx import _cuda_host
    return _cuda_host


def bits(x):
    """The 16-bit patterns of a fp16/bf16 tensor, as int64 in [0, 2^16)."""
    return x.contiguous().view(torch.int16).long() & 0xFFFF


def reg(lo, hi):
    """Registers of (lo, hi) 16-bit patterns, as int32 (the bits of a uint32)."""
    r = (hi << 16) | lo
    return torch.where(r >= 1 << 31, r - (1 << 32), r).to(torch.int32)


def halves(r):
    r = r.long() & 0xFFFFFFFF
    return r & 0xFFFF, r >> 16


def as_dtype(pattern, dtype):
    return pattern.to(torch.int16).view(dtype).float()


def a_registers(A):  # A 16x16: a0 (g, 2t..), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
    b = bits(A)
    return torch.stack([reg(b[G + 8 * (i % 2), 2 * T + 8 * (i // 2)],
                            b[G + 8 * (i % 2), 2 * T + 8 * (i // 2) + 1]) for i in range(4)], 1)


def b_registers(B):  # B 16x8 (k, n): b0 k = 2t.., n = g; b1 k = 2t+8..
    b = bits(B)
    return torch.stack([reg(b[2 * T + 8 * i, G], b[2 * T + 8 * i + 1, G]) for i in range(2)], 1)


def c_lanes(C):  # C 16x8: c0, c1 (g, 2t), (g, 2t+1); c2, c3 (g+8, 2t), (g+8, 2t+1)
    return torch.stack([C[G + 8 * (e // 2), 2 * T + e % 2] for e in range(4)], 1)


def c_matrix(d):
    C = torch.full((16, 8), float("nan"))
    for e in range(4):
        C[G + 8 * (e // 2), 2 * T + e % 2] = d[:, e]
    return C


@pytest.mark.parametrize("dtype", DTYPES)
def test_mma_fragment_layout_exact(dtype):
    # small integers: every product and sum is exact, so any misplaced element shows
    gen = torch.Generator().manual_seed(1)
    A = torch.randint(-8, 9, (16, 16), generator=gen).to(dtype)
    B = torch.randint(-8, 9, (16, 8), generator=gen).to(dtype)
    C = torch.randint(-64, 65, (16, 8), generator=gen).float()
    d = host().test_mma_fragments(a_registers(A), b_registers(B), c_lanes(C),
                                  dtype == torch.bfloat16)
    assert torch.equal(c_matrix(d), (A.double() @ B.double() + C.double()).float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_mma_accumulates_in_fp32(dtype):
    gen = torch.Generator().manual_seed(2)
    A, B = (torch.randn(*s, generator=gen).to(dtype) for s in ((16, 16), (16, 8)))
    C = torch.randn(16, 8, generator=gen) * 100
    d = host().test_mma_fragments(a_registers(A), b_registers(B), c_lanes(C),
                                  dtype == torch.bfloat16)
    want = A.double() @ B.double() + C.double()
    # 17 terms summed in fp32: a few ulps of the largest partial sum
    torch.testing.assert_close(c_matrix(d).double(), want, atol=1e-4, rtol=1e-6)


def test_ldmatrix_fragment_layout():
    m = torch.arange(4 * 64, dtype=torch.int16).view(4, 8, 8)  # element value = its index
    out = host().test_ldmatrix_fragments(m)
    lo, hi = halves(out)
    mm = m.long()
    row = lambda i: (mm[i, G, 2 * T], mm[i, G, 2 * T + 1])  # row g, columns 2t, 2t+1
    col = lambda i: (mm[i, 2 * T, G], mm[i, 2 * T + 1, G])  # column g, rows 2t, 2t+1
    # variant 0: x4, 1: x4.trans (register i from matrix i); 2: x2, 3: x2.trans (matrices 0, 1
    # from lanes 0-15's rows; registers 2, 3 untouched)
    for variant, n, want in ((0, 4, row), (1, 4, col), (2, 2, row), (3, 2, col)):
        for i in range(n):
            assert torch.equal(lo[variant, :, i], want(i)[0]), (variant, i)
            assert torch.equal(hi[variant, :, i], want(i)[1]), (variant, i)
    assert not out[2:, :, 2:].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a_rows", [16, 11, 0])
def test_tile_products_through_cp_async_ldmatrix_mma(dtype, a_rows):
    """cp.async (two groups, zero-fill past a_rows) + ldmatrix (x4, x4.trans, x2, x2.trans) +
    mma give a @ bt^T and a @ v as torch does; a missing cp.async wait leaves NaN."""
    gen = torch.Generator().manual_seed(3 + a_rows)
    a, bt, v = (torch.randn(16, 16, generator=gen).to(dtype) for _ in range(3))
    out = host().test_tile_products(a, bt, v, a_rows)
    a64 = a.double()
    a64[a_rows:] = 0
    want = torch.stack([a64 @ bt.double().T, a64 @ v.double()] * 2)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
