"""The checks `attnx check` runs: small odd-sized problems, each run forward and backward by
one backend, by the reference backend in float64 (the golden value) and by the same math done
naively in the backend's dtype (PyTorch's own error, which sets the bound; see compare.py).

Dropout cases use the identity as the value matrix (Lk = Ev), so the output is the dropped
probability matrix itself: which entries are zero must match the golden value's exactly, as
every backend draws the same hash mask for one seed (attnx/_rng.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from .. import _dispatch, _validate
from .._backends import reference
from .compare import compare

SEED = 1234  # torch.manual_seed before every run, so all three draw the same dropout seed
EMPTY_ROW = 3  # a query row that the mask cases mask out entirely


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem. sdpa shape: (B, Hq, Hkv, Lq, Lk, E, Ev); additive: (B, H, Lq, Lk, A, Ev)."""
    name: str
    op: str
    shape: tuple
    mask: Optional[str] = None  # "bool" or "float", (B, 1, Lq, Lk), with row EMPTY_ROW masked out
    is_causal: bool = False
    window: Optional[tuple] = None
    dropout_p: float = 0.0


# Few distinct lengths: on a GPU the Triton backend autotunes once per length.
CASES = (
    Case("sdpa", "sdpa", (2, 3, 3, 37, 45, 32, 32)),
    Case("sdpa causal", "sdpa", (1, 2, 2, 45, 37, 32, 24), is_causal=True),
    Case("sdpa bool mask", "sdpa", (2, 2, 2, 37, 45, 32, 32), mask="bool"),
    Case("sdpa float mask", "sdpa", (2, 2, 2, 37, 45, 32, 32), mask="float"),
    Case("sdpa window", "sdpa", (1, 2, 2, 37, 45, 32, 32), is_causal=True, window=(9, None)),
    Case("sdpa gqa", "sdpa", (1, 4, 2, 37, 45, 32, 32), is_causal=True),
    Case("sdpa dropout", "sdpa", (2, 2, 1, 37, 45, 32, 45), mask="float", dropout_p=0.25),
    Case("additive", "additive", (2, 2, 21, 29, 16, 16), mask="float"),
    Case("additive causal", "additive", (1, 2, 29, 21, 16, 16), is_causal=True),
    Case("additive bool mask", "additive", (2, 1, 21, 29, 16, 16), mask="bool", window=(12, 5)),
    Case("additive dropout", "additive", (1, 2, 21, 29, 16, 29), dropout_p=0.25),
)


def probe(op: str, backend: str, device: str, dtype: torch.dtype) -> Optional[str]:
    """Why `backend` cannot run `op` on (device, dtype) inputs, or None when it can: asked of
    the dispatcher, the one place that decides, without running anything."""
    t = torch.zeros(1, 1, 4, 8, device=device, dtype=dtype)
    if op == "sdpa":
        call = _validate.sdpa_call(t, t, t, None, 0.0, False, None, False, None, backend, False)
    else:
        call = _validate.additive_call(t, t, t, t[0, 0, 0], None, 0.0, False, None, backend, False)
    try:
        _dispatch.select(op, call)
    except _dispatch.BackendUnavailableError as exc:
        return str(exc)
    return None


def _inputs(case: Case, device: str, dtype: torch.dtype) -> dict:
    """Random inputs rounded to `dtype` (the golden run upcasts these very values)."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(device, dtype)

    if case.op == "sdpa":
        b, hq, hkv, lq, lk, e, ev = case.shape
        x = {"q": randn(b, hq, lq, e), "k": randn(b, hkv, lk, e), "v": randn(b, hkv, lk, ev)}
        heads = hq
    else:
        b, heads, lq, lk, a, ev = case.shape
        x = {"q": randn(b, heads, lq, a), "k": randn(b, heads, lk, a),
             "value": randn(b, heads, lk, ev), "w": randn(heads, a) / a ** 0.5}
        x["dweights"] = randn(b, heads, lq, lk)
    if case.dropout_p:
        x["v" if case.op == "sdpa" else "value"] = (
            torch.eye(lk, device=device, dtype=dtype).expand(b, x["k"].shape[1], lk, lk).contiguous())
    x["dout"] = randn(b, heads, lq, ev)
    if case.mask == "bool":
        x["mask"] = (torch.rand((b, 1, lq, lk), generator=gen) > 0.3).to(device)
        x["mask"][:, :, EMPTY_ROW] = False
    elif case.mask == "float":
        x["mask"] = randn(b, 1, lq, lk)
        x["mask"][:, :, EMPTY_ROW] = float("-inf")
    return x


def _naive_sdpa(q, k, v, mask, case):
    """SDPA done plainly in the inputs' dtype: PyTorch's own error in that dtype."""
    call = _validate.sdpa_call(q, k, v, mask, case.dropout_p, case.is_causal, None,
                               q.shape[1] != k.shape[1], case.window, "reference", True)
    groups = call.q.shape[1] // call.k.shape[1]
    k, v = call.k.repeat_interleave(groups, 1), call.v.repeat_interleave(groups, 1)
    s = torch.matmul(call.q, k.transpose(-2, -1)) * call.scale
    p, lse = reference.masked_softmax(s, call.mask, call.window_lo, call.window_hi)
    return torch.matmul(reference.apply_dropout(p, call.dropout_p, call.seed), v), lse


def _naive_additive(q, k, value, w, mask, case):
    call = _validate.additive_call(q, k, value, w, mask, case.dropout_p, case.is_causal,
                                   case.window, "reference", True)
    s = (torch.tanh(call.q.unsqueeze(3) + call.k.unsqueeze(2))
         * call.v.view(1, call.v.shape[0], 1, 1, -1)).sum(-1)
    p, _ = reference.masked_softmax(s, call.mask, call.window_lo, call.window_hi)
    p = reference.apply_dropout(p, call.dropout_p, call.seed)
    return torch.matmul(p, call.value), p


def _run(case: Case, x: dict, backend: str, dtype: torch.dtype) -> dict:
    """Forward and backward of one method on copies of `x` in `dtype`: name -> tensor."""
    names = ("q", "k", "v") if case.op == "sdpa" else ("q", "k", "value", "w")
    leaves = {n: x[n].detach().to(dtype).requires_grad_() for n in names}
    mask = x.get("mask")
    if mask is not None and mask.dtype != torch.bool:
        mask = leaves["mask"] = mask.detach().to(dtype).requires_grad_()
    torch.manual_seed(SEED)
    if case.op == "sdpa":
        q, k, v = leaves["q"], leaves["k"], leaves["v"]
        if backend == "naive":
            out, extra = _naive_sdpa(q, k, v, mask, case)
        else:
            out, extra = _dispatch.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=case.dropout_p, is_causal=case.is_causal,
                enable_gqa=q.shape[1] != k.shape[1], window=case.window, backend=backend,
                return_lse=True)
        results = {"out": out, "lse": extra}
        loss = (out * x["dout"].to(out.dtype)).sum()
    else:
        args = (leaves["q"], leaves["k"], leaves["value"], leaves["w"], mask)
        if backend == "naive":
            out, extra = _naive_additive(*args, case)
        else:
            out, extra = _dispatch.additive_attention(
                *args, dropout_p=case.dropout_p, is_causal=case.is_causal, window=case.window,
                backend=backend, return_weights=True)
        results = {"out": out, "weights": extra}
        loss = (out * x["dout"].to(out.dtype)).sum() + (extra * x["dweights"].to(extra.dtype)).sum()
    wrt = list(leaves.values())
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    results = {n: t.detach() for n, t in results.items()}
    results.update({"d" + n: g for n, g in zip(leaves, grads)})
    return results


def _dropout_pattern(case: Case, actual: dict, golden: dict) -> Optional[str]:
    """Why the dropped entries differ from the golden value's, or None when they match."""
    name = "out" if case.op == "sdpa" else "weights"
    lk = case.shape[4] if case.op == "sdpa" else case.shape[3]
    a, g = actual[name][..., :lk] == 0, golden[name][..., :lk] == 0
    if torch.equal(a, g):
        return None
    return f"dropout: {(a != g).sum().item()} of {a.numel()} entries dropped differently"


def run(case: Case, backend: str, device: str, dtype: torch.dtype) -> dict:
    """One check: {"passed", "error", "worst", "quantities": {name: compare(...)}, "seconds"}."""
    start = time.perf_counter()
    row = {"case": case.name, "op": case.op, "passed": False, "error": None, "worst": None,
           "quantities": {}}
    try:
        x = _inputs(case, device, dtype)
        golden = _run(case, x, "reference", torch.float64)
        baseline = _run(case, x, "naive", dtype)
        actual = _run(case, x, backend, dtype)
        for name, g in golden.items():
            row["quantities"][name] = compare(name, actual.get(name), g, baseline.get(name), dtype)
        failures = [q["why"] for q in row["quantities"].values() if not q["ok"]]
        if case.dropout_p:
            why = _dropout_pattern(case, actual, golden)
            if why:
                failures.append(why)
        rated = {n: q["ratio"] for n, q in row["quantities"].items() if "ratio" in q}
        if rated:
            row["worst"] = max(rated, key=rated.get)
        row["passed"] = not failures
        row["error"] = "; ".join(failures) or None
    except Exception as exc:  # a backend that raises fails its check; the others still run
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
    row["seconds"] = round(time.perf_counter() - start, 3)
    return row
