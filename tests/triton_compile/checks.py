"""What a compile result must satisfy (issue 18), and the exceptions, each with its reason."""

from __future__ import annotations

from typing import Callable

from attnx.triton import sdpa_bwd_rerun

from .aot import SHARED_LIMIT

# (kernel, variant, arch) allowed to spill registers at fp16/bf16 head dims <= 128, and why.
SPILL_EXCEPTIONS: dict[tuple[str, str, int], str] = {
    ("additive._dk_kernel", "additive/fp16/d128/bool-mask/dropout", 90):
        "12 B: the fixed 32x32x4 CUDA-core config (additive._blocks, not autotuned), which ptxas "
        "holds at 168 registers on sm_90 with the mask and dropout hash live; sm_80 does not spill",
    **{("sdpa._dkdv_kernel", f"sdpa/{dtype}/d64/float-mask/dropout/gqa", 80):
       "124 B in the (16, 64, 8, 2) config only, with a float mask, dropout and GQA at once (the "
       "register rule adds their costs; together they cost more): the autotuner also keeps "
       "(16, 32, 4, 2) and (16, 16, 4, 1), which do not spill. Found by the --full run."
       for dtype in ("fp16", "bf16")},
    **{("sdpa._dkdv_kernel", f"sdpa/{dtype}/d64/float-mask/dropout/gqa/softcap/alibi/sinks", arch):
       "every flag at once (as the float-mask/dropout/gqa exception, plus the modifiers): 364 B "
       "in (16, 64, 8, 2) on sm_80, 12 B in (16, 32, 4, 2) on sm_90; the autotuner also keeps "
       "(16, 16, 4, 1), which does not spill"
       for dtype in ("fp16", "bf16") for arch in (80, 90)},
    # Triton 3.6 only (CI's torch 2.11 stage); Triton 3.8 compiles these without spills
    ("sdpa._dkdv_kernel", "sdpa/fp16/d64", 80):
        "12 B with Triton 3.6 (torch 2.11) in the (32, 64, 8, 3) config; Triton 3.8 compiles the "
        "same config without spills",
    ("sdpa._fwd_kernel", "sdpa/fp16/d64", 90):
        "128 B with Triton 3.6 (torch 2.11) in the (128, 128, 8, 3) config; Triton 3.8 compiles "
        "the same config without spills",
    ("sdpa._dkdv_kernel", "sdpa/bf16/d64/gqa/alibi", 80):
        "32 B with Triton 3.6 (torch 2.11) in the (16, 64, 8, 2) config; Triton 3.8 compiles the "
        "same config without spills",
}

# Kernels allowed to spill at any head dim: slow paths that run (past a load of their flag) only
# where a first pass overflowed.
SLOW_PATHS: dict[str, str] = {
    f"sdpa_bwd_rerun.{kernel}":
        "the SDPA backward's float64 rerun (attnx/triton/sdpa_bwd_rerun.py): DMMA operands of "
        "whole head dims (up to 128 a chunk), 16-row tiles replicated across the warps; it runs "
        "only where dP or D overflowed"
    for kernel in ("_rows_kernel", "_keys_kernel")}
SLOW_PATHS["sdpa_fwd_rerun._forward_kernel"] = (
    "the SDPA forward's float64 rerun (attnx/triton/sdpa_fwd_rerun.py): the backward rerun's "
    "tiles; it runs only where scores passed float32's range")
SLOW_PATHS["decode_rerun._rerun_kernel"] = (
    "decoding's float64 rerun (attnx/triton/decode_rerun.py): the SDPA reruns' tiles; it runs "
    "only where scores passed float32's range")
SLOW_PATHS.update({
    f"additive_bwd_rerun.{kernel}":
        "the additive backward's float64 rerun (attnx/triton/additive_bwd_rerun.py): float64 "
        "16 x 16 x 8 elementwise tiles, no tl.dot; it runs only where dP or delta overflowed"
    for kernel in ("_rows_kernel", "_keys_kernel")})

# wgmma multiplies 64 rows per warpgroup: an sm_90 SDPA config whose dots all have fewer rows
# (BLOCK_M; BLOCK_N for the key-major dots of dK/dV) runs mma.sync. Such configs are kept for
# heads over 128 and fp32, where larger tiles do not fit; every config with a 64-row dot must
# use wgmma.
WGMMA_ROWS = {"sdpa._fwd_kernel": ("BLOCK_M",), "sdpa._prep_kernel": ("BLOCK_M",),
              "sdpa._dq_kernel": ("BLOCK_M",), "sdpa._dkdv_kernel": ("BLOCK_N",)}


# The in-band key loop of the fp16/bf16 SDPA forward without mask or dropout (issue 18 item 10):
# no band, bounds or mask arithmetic (the loop's own control and the pipeline's predicates take
# about 7 compares and selects; a masked loop takes 130-200), and every exp2 fed by one FMA
# (the score's distance to its tile's max, scaled, plus the row's offset: a separate multiply
# and add per score makes no FMA). fp16's takes no minimum a score (the lost-score check of bf16
# and fp32: fp16's dots cannot pass float32's range).
IN_BAND_SELECTS = 16


def in_band_applies(row) -> bool:
    """Whether item 10's structure is asked of the unit: fp16/bf16 SDPA forwards without mask,
    dropout, softcap or ALiBi (those two change every score: a tanh, a distance; sinks only the
    final normalisation)."""
    parts = row["variant"].split("/")
    return (row["kernel"] == "sdpa._fwd_kernel" and parts[1] != "fp32"
            and not any(p.endswith("-mask") or p in ("dropout", "softcap", "alibi")
                        for p in parts))


def in_band_broken(row) -> str | None:
    """Why the unit's forward in-band loop breaks item 10's structure, or None (also for rows
    it does not concern)."""
    if not in_band_applies(row):
        return None
    loop = row.get("in_band_loop")
    if loop is None:
        return "no loop with tensor-core instructions"
    if loop.get("setp/selp", 0) > IN_BAND_SELECTS or loop.get("fma", 0) < loop.get("ex2", 0):
        return f"in-band loop not lean: {loop}"
    if loop.get("folded_exp2", 0):
        return f"in-band loop folds the row max into a raw score's FMA (aot.folded_exp2): {loop}"
    if _dtype_and_dim(row)[0] == "fp16" and 2 * loop.get("min", 0) > loop.get("max", 0):
        # a min a score beside the row max's max a score: the check (2-4 min a loop without)
        return f"fp16 in-band loop looks for overflowed dots, which fp16's cannot be: {loop}"
    return None


def _dtype_and_dim(row) -> tuple[str, int]:
    _, dtype, dim = row["variant"].split("/")[:3]
    return dtype, int(dim[1:])


def _config(row) -> tuple:
    c = row["config"]
    return (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"])


# Spills accepted by pattern (the --full run finds them across many variants), each where the
# autotuner keeps another config of the same kernel, variant and arch that does not spill:
# failures() checks that part on the rows themselves.
SPILL_RULES: list[tuple[Callable[[dict], bool], str]] = [
    (lambda r: (r["kernel"] == "sdpa._fwd_kernel" and r["variant"].startswith("varlen/")
                and r["arch"] == 80 and _config(r) == (64, 32, 4, 4)
                and _dtype_and_dim(r)[1] in (96, 128)),
     "the VARLEN forward's (64, 32, 4, 4) config at head dims 96 and 128 (one 128-wide block): "
     "the register rule puts it at exactly its limit (128 words a thread), sm_80 holds it at 255 "
     "registers and the sequence's lengths, band and row bases spill 184-232 B; (64, 32, 8, 2), "
     "(32, 32, 4, 2) and (32, 16, 4, 1) are kept too"),
    (lambda r: (r["kernel"] == "sdpa._dkdv_kernel" and r["arch"] == 80
                and r["variant"].endswith("/dropout/gqa/softcap/alibi/sinks")
                and _config(r) == (16, 64, 8, 2)),
     "every flag of the dK/dV kernel at once (dropout, GQA and the three modifiers), as the sdpa "
     "all-flags exception above: (16, 64, 8, 2) on sm_80; smaller configs are kept too"),
    # Found by the --full run of this session's kernels (the SDPA kernels of 2e925ee)
    (lambda r: (r["kernel"] == "sdpa._fwd_kernel" and r["arch"] == 80
                and r["variant"] in ("sdpa/fp16/d64/bool-mask", "sdpa/bf16/d64/bool-mask")
                and _config(r) == (64, 64, 4, 2)),
     "64 B in the (64, 64, 4, 2) config with a bool mask (its byte tile beside the scores: the "
     "register rule counts it as one fp32 tile, 112 words a thread); the other kept configs "
     "((64, 32, 4, 4), (64, 32, 8, 2), ...) do not spill"),
    (lambda r: (r["kernel"] == "sdpa._dkdv_kernel" and r["arch"] == 90
                and r["variant"].endswith("/d64/float-mask/dropout/gqa")
                and _config(r) == (16, 32, 4, 2)),
     "72-80 B in (16, 32, 4, 2) on sm_90 with a float mask, dropout and GQA at once (sm_80 spills "
     "in (16, 64, 8, 2) instead: SPILL_EXCEPTIONS above); (16, 16, 4, 1) is kept and does not"),
    (lambda r: (r["kernel"] == "sdpa._dkdv_kernel" and r["arch"] == 80
                and r["variant"] in ("sdpa/fp16/d64/float-mask", "sdpa/fp16/d64/float-mask/sinks")
                and _config(r) == (32, 64, 8, 3)),
     "42 B in (32, 64, 8, 3) on sm_80 (255 registers), fp16 with a float mask, with or without "
     "sinks (sinks do not change the dK/dV kernel); smaller configs are kept and do not spill"),
]


def _accepted_spills(rows: list[dict]) -> set:
    """ids of the spilling rows SPILL_EXCEPTIONS, SLOW_PATHS or SPILL_RULES accept: listed, or
    matching a rule where, if the run compiled other configs of the same kernel, variant and arch
    (the --full run does; the CI set mostly compiles one), one of them does not spill."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["variant"], r["arch"]), []).append(r)
    accepted = set()
    for group, members in groups.items():
        clean = len(members) == 1 or any(not m["error"] and not m["spill_bytes"] for m in members)
        for r in members:
            if (group in SPILL_EXCEPTIONS or r["kernel"] in SLOW_PATHS
                    or (clean and any(rule(r) for rule, _ in SPILL_RULES))):
                accepted.add(id(r))
    return accepted


def failures(rows: list[dict]) -> list[str]:
    """One line per broken bound: a compile error; shared memory over the arch's opt-in limit
    or over the pruning rule's estimate; spills of a fp16/bf16 unit at head dim <= 128 (less
    SPILL_EXCEPTIONS, SLOW_PATHS and SPILL_RULES); a 32-bit product of two runtime integers in
    the TTIR (aot.narrow_products);
    an SDPA kernel transposing computed tiles (aot.computed_transposes); an sm_90 fp16/bf16
    SDPA kernel without wgmma though its config has a 64-row dot (WGMMA_ROWS); an fp16/bf16
    SDPA forward without mask or dropout whose in-band loop does mask arithmetic or does not
    feed exp2 with FMAs (in_band_broken)."""
    out = []
    accepted = _accepted_spills(rows)
    for r in rows:
        what = f"{r['kernel']} {r['variant']} {r['config']} sm_{r['arch']}"
        if r["error"]:
            out.append(f"{what}: {r['error']}")
            continue
        if r["shared"] > SHARED_LIMIT[r["arch"]]:
            out.append(f"{what}: shared {r['shared']} B > {SHARED_LIMIT[r['arch']]} B")
        # The pruning rule (attnx/triton/common.py pruner) must bound what the compiler
        # allocates, and must have found a config within the limit.
        estimate = r.get("shared_estimate")
        if estimate is not None and not r["shared"] <= estimate <= SHARED_LIMIT[r["arch"]]:
            out.append(f"{what}: pruning estimate {estimate} B against shared {r['shared']} B, "
                       f"limit {SHARED_LIMIT[r['arch']]} B")
        dtype, dim = _dtype_and_dim(r)
        # The SDPA reruns' launches decide by this bound whether a device holds them (fits).
        if (r["kernel"].startswith(("sdpa_bwd_rerun.", "sdpa_fwd_rerun.", "decode_rerun."))
                and r["shared"] > sdpa_bwd_rerun.shared_bytes(dim, dim)):
            out.append(f"{what}: shared {r['shared']} B > sdpa_bwd_rerun.shared_bytes "
                       f"{sdpa_bwd_rerun.shared_bytes(dim, dim)} B")
        low = dtype in ("fp16", "bf16")
        if low and dim <= 128 and r["spill_bytes"] and id(r) not in accepted:
            out.append(f"{what}: {r['spill_bytes']} spill bytes")
        if r.get("narrow_products"):
            out.append(f"{what}: 32-bit products of indices and strides or lengths (wrap past "
                       f"2^31 elements): {r['narrow_products'][:3]}")
        if r["kernel"].startswith("sdpa.") and r.get("computed_transposes"):
            out.append(f"{what}: computed tiles transposed: {r['computed_transposes'][:2]}")
        why = in_band_broken(r)
        if why:
            out.append(f"{what}: {why}")
        rows = WGMMA_ROWS.get(r["kernel"], ())
        if (low and r["arch"] == 90 and any(r["config"][b] >= 64 for b in rows)
                and not r["wgmma"]):
            out.append(f"{what}: no wgmma in the sm_90 PTX")
    return out


def summary(rows: list[dict]) -> dict:
    """Counts: units, errors, over the shared-memory limit, fp16/bf16 d<=128 spilling."""
    ok = [r for r in rows if not r["error"]]
    spilling = [r for r in ok if r["spill_bytes"] and _dtype_and_dim(r)[0] != "fp32"
                and _dtype_and_dim(r)[1] <= 128]
    return dict(units=len(rows), errors=len(rows) - len(ok),
                over_shared=sum(r["shared"] > SHARED_LIMIT[r["arch"]] for r in ok),
                spilling_low_precision=len(spilling),
                spilling_any=sum(bool(r["spill_bytes"]) for r in ok),
                seconds=round(sum(r["seconds"] for r in rows), 1))
