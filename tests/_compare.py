"""Error bounds in the style of flash-attention's tests.

A backend's result in some dtype is compared with a float64 golden value; the bound is a small
multiple of the error that plain PyTorch makes on the same inputs in the same dtype (the
baseline), with a floor for dtypes where that error is ~0.
"""

from __future__ import annotations

import torch

import attnx


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def assert_within(actual: torch.Tensor, golden: torch.Tensor, baseline: torch.Tensor,
                  factor: float = 2.0, floor: float = 1e-5, what: str = "output") -> None:
    assert actual.shape == golden.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(golden.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err, base = max_err(actual, golden), max_err(baseline, golden)
    bound = max(floor, factor * base)
    assert err <= bound, f"{what}: max error {err:.3g} > bound {bound:.3g} (PyTorch's own: {base:.3g})"


def ulp_floor(golden: torch.Tensor, dtype: torch.dtype, ulps: int = 4) -> float:
    """A bound's floor of a few ulp of the golden's largest magnitude: where the fixed floors
    (1e-5 in float32) would pass many times PyTorch's own error on small values."""
    return ulps * torch.finfo(dtype).eps * golden.abs().max().item()


def assert_near_largest(name: str, got: torch.Tensor, want: torch.Tensor,
                        bound: float = 2e-2) -> None:
    """got finite and within `bound` of want's largest magnitude (where an output's rounding,
    not PyTorch's error on the same inputs, is the measure)."""
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = (got.cpu().double() - want.double()).abs().max() / want.double().abs().max()
    assert err <= bound, f"{name}: max error {err:.3g} of its largest"


def causal_varlen_run(q, k, v, do, cu_q, cu_k, backend, dtype, **kw):
    """(out, lse, dq, dk, dv) of a causal `attnx.varlen_attention` on `backend` (kw: its other
    arguments), its inputs and grad_out cast to dtype: the packed past-range tests of
    test_cuda.py and test_triton.py."""
    leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
    out, lse = attnx.varlen_attention(*leaves, cu_q, cu_k, is_causal=True, backend=backend,
                                      return_lse=True, **kw)
    return (out, lse, *torch.autograd.grad(out, leaves, do.to(dtype)))


def _fp16_ds_inputs(rows, keys, heads=2, e=16):
    """float64 q, k, v, dO (packed: (rows, heads, e)) whose fp16 backward forms dS past 65504
    though every gradient is ~100: q, k ~1e-3 (near-uniform attention over a few keys), values
    of +-3e4 alternating by key, dO of ones, so dP = dO . v = +-4.8e5 and dS = P (dP - D) ~1e5
    over 2-3 keys."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads, e, generator=gen, dtype=torch.float64) * 1e-3
    k = torch.randn(keys, heads, e, generator=gen, dtype=torch.float64) * 1e-3
    sign = 1.0 - 2.0 * (torch.arange(keys, dtype=torch.float64) % 2)
    v = (3e4 * sign).view(keys, 1, 1).expand(keys, heads, e).clone()
    return q, k, v, torch.ones(rows, heads, e, dtype=torch.float64)


def check_fp16_ds_past_its_range(backend, device, keys=None):
    """The fp16 kernels cast dS to half for the dS K and dS^T Q products: past 65504 it was
    inf there, and dQ and dK came out NaN (_fp16_ds_inputs); the dK/dV and dQ accumulators
    flag it and the float64 rerun redoes them, so each gradient must be within 2% of the
    float64 one's largest. keys: SDPA over that many keys; None: causal varlen_attention over
    two sequences of 3 (row 1 of each sees two keys at P = 1/2: dS 2.4e5)."""
    if keys is None:
        q, k, v, do = _fp16_ds_inputs(6, 6)
        cu = torch.tensor([0, 3, 6], dtype=torch.int32)
        got = causal_varlen_run(*(t.to(device) for t in (q, k, v, do)), cu.to(device),
                                cu.to(device), backend, torch.float16)[2:]
        want = causal_varlen_run(q, k, v, do, cu, cu, "reference", torch.float64)[2:]
    else:
        q, k, v, do = (t.transpose(0, 1)[None] for t in _fp16_ds_inputs(5, keys))
        leaves = [t.to(device, torch.float16).requires_grad_() for t in (q, k, v)]
        out = attnx.scaled_dot_product_attention(*leaves, backend=backend)
        got = torch.autograd.grad(out, leaves, do.to(device, torch.float16))
        gold = [t.requires_grad_() for t in (q, k, v)]
        want = torch.autograd.grad(attnx.scaled_dot_product_attention(*gold, backend="reference"),
                                   gold, do)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_near_largest(name, g, w)


def check_fp16_out_past_its_range(kind, backend, device):
    """An fp16 output past 65504 is saved as inf: values ~2e4 over 3 keys under dropout 0.99
    (a kept probability times 100). delta = rowsum(dO * O) from it is inf and dS NaN: the GPU
    backends' float64 rerun took delta from O too (NaN gradients). It now sums P dP. Every
    gradient must be NaN-free, within 1% of the golden's largest where the golden fits fp16,
    and inf with the golden's sign where it passes fp16's range by more than a rounding.
    kind: "sdpa" or "additive"; the golden is the reference backend in float64 on the same
    fp16 values and dropout (one seed: every backend draws the same hash)."""
    gen = torch.Generator().manual_seed(0)
    shape = (4, 8, 3, 32)
    qk_scale = 0.1 if kind == "sdpa" else 0.5
    q, k = (torch.randn(shape, generator=gen, dtype=torch.float64) * qk_scale for _ in range(2))
    v = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2e4).clamp(-6e4, 6e4)
    do = torch.randn(shape, generator=gen, dtype=torch.float64)
    inputs = [q, k, v] + ([torch.randn(8, 32, generator=gen, dtype=torch.float64)]
                          if kind == "additive" else [])
    inputs = [t.half().double() for t in inputs]  # the golden's inputs: the fp16 values

    def run(tensors, backend, grad_out):
        leaves = [t.detach().requires_grad_() for t in tensors]
        fn = attnx.scaled_dot_product_attention if kind == "sdpa" else attnx.additive_attention
        with torch.random.fork_rng():
            torch.manual_seed(5)  # the dropout seed: one draw, the same for both runs
            out = fn(*leaves, dropout_p=0.99, backend=backend)
        return out, torch.autograd.grad(out, leaves, grad_out)

    out, got = run([t.to(device, torch.float16) for t in inputs], backend,
                   do.to(device, torch.float16))
    gold_out, want = run(inputs, "reference", do)
    fp16_max = torch.finfo(torch.float16).max
    assert (gold_out.abs() > 2 * fp16_max).any() and not out.isnan().any()  # the case's premise
    for name, g, w in zip(("dq", "dk", "dv", "dw"), got, want):
        g = g.cpu().double()
        assert not g.isnan().any(), f"{name}: NaN"
        fits, past = w.abs() < fp16_max * 0.999, w.abs() > 65520 * 1.001  # 65520 rounds to inf
        assert fits.any()
        assert g[fits].isfinite().all(), f"{name}: inf where the golden fits fp16"
        err = (g[fits] - w[fits]).abs().max() / w[fits].abs().max()
        assert err <= 1e-2, f"{name}: max error {err:.3g} of its largest"
        assert (g[past] == w[past].sign() * float("inf")).all(), f"{name}: finite past the range"


def lost_key_qkv(lq, lk, e=64, seed=0):
    """float64 q, k, v (1 head) where key 0 is every row's largest score, 0, but its dot's
    partial sums pass float32's lowest: the first e / 2 products are -2e38 each, the others +2e38
    (a sum in order, or by chunks of 16 as an MMA's, is -inf from the second product on). The
    other keys score -2.6 to -5.1 (entries ~1e-37, bf16 normals), so key 0 holds about a third
    of each row's probability (more in short causal rows), and dropping it as -inf (exp(-inf) =
    0, the row's sum still positive: no sign of the loss) moves out and dv by ~1."""
    gen = torch.Generator().manual_seed(seed)
    sign = torch.cat([torch.ones(e // 2), -torch.ones(e - e // 2)]).double()
    q = (2e35 * sign).expand(1, 1, lq, e).clone()
    c = 0.02 * (1 + torch.rand(lk, 1, generator=gen, dtype=torch.float64))
    k = (-1e-35 * c * sign).view(1, 1, lk, e).clone()
    k[0, 0, 0] = -1000.0
    v = torch.randn(1, 1, lk, e, generator=gen, dtype=torch.float64)
    return q, k, v


def wrong_sign_qk(hq, lq, hkv, lk, e=128):
    """float64 q, k whose dot overflows float32 with the wrong sign where summed in order:
    the first 16 products, 1e38 each, pass float32's largest (+inf, a k16 MMA chunk's or a
    sum's in order), the other e - 16, -2e37 each (-3.2e38 a chunk of 16: finite), bring the
    true score to -6.4e38 at e = 128. Key 0 is ordinary (~1e-19 entries): its score ~10.
    Under a softcap every such score is -cap; float32's +inf makes it +cap, finite, unflagged
    (the lse stays ordinary) where not taken as an overflow. (The golden is the reference in
    float64, with these values cast to the tested dtype first.)"""
    gen = torch.Generator().manual_seed(3)
    q = torch.full((1, hq, lq, e), 1e19, dtype=torch.float64)
    k = torch.full((1, hkv, lk, e), -2e18, dtype=torch.float64)
    k[..., :16] = 1e19
    k[:, :, 0] = torch.randn(hkv, e, generator=gen, dtype=torch.float64) * 1e-19
    return q, k
