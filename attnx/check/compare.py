"""How far a result may be from the float64 golden value, as attnx's tests bound it.

The bound is a small multiple of the error that the same PyTorch math, done naively in the
result's dtype, makes on the same inputs (flash-attention's test style): 2x for outputs, 3x for
gradients. The floor, for where that error is ~0 (float64, or PyTorch's rounding happening to
cancel on a small problem), scales with the largest golden value, since a gradient such as
additive attention's dv sums B * Lq * Lk terms; for float16 and bfloat16 it is about one unit
in the last place, as results are rounded to that dtype whatever the kernel does.
"""

from __future__ import annotations

from typing import Optional

import torch

FACTOR = {"out": 2.0, "lse": 2.0, "weights": 2.0}
GRAD_FACTOR = 3.0
FLOOR = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def compare(name: str, actual: Optional[torch.Tensor], golden: Optional[torch.Tensor],
            baseline: Optional[torch.Tensor], dtype: torch.dtype) -> dict:
    """{"err", "bound", "baseline", "ratio", "ok", "why"} for one result against its golden
    value. Entries where the golden value is -inf (the lse of an empty row) must be -inf in the
    result too and are left out of the error."""
    if golden is None or actual is None:
        ok = golden is None and actual is None
        return {"ok": ok, "why": "" if ok else f"{name}: present in only one of result and golden"}
    if tuple(actual.shape) != tuple(golden.shape):
        return {"ok": False, "why": f"{name}: shape {tuple(actual.shape)}, expected {tuple(golden.shape)}"}
    empty = torch.isneginf(golden)
    if not torch.equal(torch.isneginf(actual), empty):
        return {"ok": False, "why": f"{name}: -inf entries differ from the golden value's"}
    actual, golden, baseline = (t.masked_fill(empty, 0.0) for t in (actual, golden, baseline))
    if not torch.isfinite(actual).all():
        return {"ok": False, "why": f"{name}: non-finite values"}
    err, base = max_err(actual, golden), max_err(baseline, golden)
    floor = FLOOR[torch.float32] if name == "lse" else FLOOR[dtype]  # lse is float32 always
    scale = max(1.0, golden.abs().max().item()) if golden.numel() else 1.0
    bound = max(floor * scale, FACTOR.get(name, GRAD_FACTOR) * base)
    ok = err <= bound
    why = "" if ok else f"{name}: max error {err:.3g} > bound {bound:.3g} (PyTorch's own: {base:.3g})"
    return {"err": err, "bound": bound, "baseline": base, "ratio": err / bound, "ok": ok, "why": why}
