"""`python -m triton_compile.sweep OUT.jsonl [--arch 90 80] [--kernels dkdv dq]` from tests/,
without TRITON_INTERPRET: every GPU config of the SDPA backward kernels, the register rule of
attnx/triton/common.py switched off (shared memory still bounds them), compiled for each
variant below, one JSON row per unit (registers and spill bytes from ptxas). The rows behind
attnx/triton/sdpa.py's `_dkdv_sm90_fits` / `_dq_sm90_fits`
(benchmarks/results/triton-sm90-backward-configs.md); run it again with another Triton
(PYTHONPATH=<its site-packages>) or after changing those kernels."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile

from .capture import Variant

VARIANTS = [Variant("sdpa", dt, d) for dt, d in (("bf16", 128), ("fp16", 64), ("fp16", 96))] + [
    Variant("sdpa", "bf16", 128, mask="bool", dropout=True),
    Variant("sdpa", "fp16", 64, mask="bool", dropout=True),
    Variant("sdpa", "fp16", 128, softcap=True),
    Variant("sdpa", "bf16", 64, alibi=True),
    Variant("sdpa", "bf16", 128, gqa=True),
    Variant("sdpa", "bf16", 128, mask="float", dropout=True, gqa=True),
    Variant("sdpa", "fp16", 64, mask="float"),
    Variant("sdpa", "bf16", 128, mask="bool", dropout=True, softcap=True, alibi=True, sinks=True),
    Variant("sdpa", "fp16", 64, mask="float", dropout=True, gqa=True, softcap=True, alibi=True,
            sinks=True),
    Variant("varlen", "fp16", 128, softcap=True, alibi=True, sinks=True),
    Variant("varlen", "bf16", 128, dropout=True),
]
_UNITS: list = []


def _compile(i: int) -> dict:
    from .aot import compile_unit
    u = _UNITS[i]
    r = compile_unit(u)
    c = u.config
    return dict(kernel=u.kernel, variant=u.variant.name, arch=u.arch,
                cfg=[c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]],
                regs=r.get("registers"), spill=r.get("spill_bytes"), shared=r.get("shared"),
                error=r.get("error"))


def main() -> None:
    ap = argparse.ArgumentParser(prog="triton_compile.sweep")
    ap.add_argument("out")
    ap.add_argument("--arch", type=int, nargs="+", default=[90])
    ap.add_argument("--kernels", nargs="+", default=["dkdv", "dq"])
    args = ap.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnx-triton-sweep-")
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # a fresh cache: every unit runs ptxas
    from attnx.triton import common
    from .capture import units
    common.REGISTER_WORDS = float("inf")
    names = tuple(f"sdpa._{k}_kernel" for k in args.kernels)
    _UNITS.extend(u for v in VARIANTS for a in args.arch for u in units(v, a) if u.kernel in names)
    print(f"{len(_UNITS)} units", flush=True)
    with multiprocessing.Pool() as pool, open(args.out, "w") as f:  # fork: workers share _UNITS
        for row in pool.imap_unordered(_compile, range(len(_UNITS))):
            f.write(json.dumps(row) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
