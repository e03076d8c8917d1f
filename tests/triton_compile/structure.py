"""`python -m triton_compile.structure` from tests/, without TRITON_INTERPRET: the compiled
structure of representative SDPA units (fp16/bf16, d64/d128, forward and backward, sm_80 and
sm_90, the first config each autotuner keeps): registers, spill bytes, shared memory and the PTX
instructions of each loop body (the issue 18 before/after comparison; no bound is checked)."""

from __future__ import annotations

import json
import os
import sys
import tempfile

def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"):
        sys.exit("unset TRITON_INTERPRET")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnx-structure-")
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    import contextlib
    import io

    import triton

    from . import aot, capture
    from .capture import Variant

    rows = []
    for dtype in ("fp16", "bf16"):
        for d in (64, 128):
            for arch in (80, 90):
                seen = set()
                for u in capture.units(Variant("sdpa", dtype, d), arch):
                    if not u.kernel.startswith("sdpa.") or u.kernel in seen:
                        continue
                    seen.add(u.kernel)
                    src, options, target, _ = aot.prepare(u)
                    log = io.StringIO()
                    with contextlib.redirect_stdout(log):
                        k = triton.compile(src, target=target, options=options.__dict__)
                    text = log.getvalue()
                    regs = aot._PTXAS.search(text)
                    spill = aot._SPILL.search(text)
                    row = dict(kernel=u.kernel, variant=u.variant.name, arch=arch,
                               config=u.config, registers=int(regs.group(1)) if regs else None,
                               spill_bytes=(int(spill.group(1)) + int(spill.group(2))
                                            if spill else None),
                               shared=k.metadata.shared, loops=aot.loops(k.asm["ptx"]))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
