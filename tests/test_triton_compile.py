"""Every Triton kernel of attnx compiled ahead of time for sm_80 and sm_90 without a GPU (issue 18).

The interpreter runs the kernels here but is no compiler: it accepts kernels that no GPU compile
accepts, and says nothing of shared memory or registers. `tests/triton_compile` records every
launch the ops make (their own arguments, constexprs and autotuner configs after pruning for the
arch's shared memory) and compiles each with `triton.compile(ASTSource(...), GPUTarget(...))`.
By default a CI set covering every kernel x every config per arch over a representative set of
variants runs; ATTNX_TRITON_COMPILE_FULL=1 runs the full cross-product
(`cd tests && python -m triton_compile --full --json ../benchmarks/results/triton-compile.json`
writes the committed results).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
KERNELS = {"sdpa._fwd_kernel", "sdpa._prep_kernel", "sdpa._dkdv_kernel", "sdpa._dq_kernel",
           "additive._fwd_kernel", "additive._weights_kernel", "additive._row_sums_kernel",
           "additive._dk_kernel", "additive._dq_kernel", "decode._split_kernel"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The JSON of one `python -m triton_compile` run, in a process without TRITON_INTERPRET
    (tests/conftest.py sets it for this one)."""
    out = tmp_path_factory.mktemp("triton-compile") / "triton-compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(TESTS),
                                                      env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "triton_compile", "--json", str(out)]
    if os.environ.get("ATTNX_TRITON_COMPILE_FULL") == "1":
        cmd.append("--full")
    proc = subprocess.run(cmd, cwd=TESTS, env=env, capture_output=True, text=True)
    assert out.exists(), f"triton_compile wrote no results:\n{proc.stdout}\n{proc.stderr}"
    data = json.loads(out.read_text())
    data["log"] = proc.stdout + proc.stderr
    return data


def test_every_unit_compiles_within_the_bounds(results):
    """Compiles; shared memory within the arch's opt-in limit and the pruning rule's estimate
    (attnx/triton/common.py pruner), so no config the autotuner may pick fails at launch; no
    spills in fp16/bf16 at head
    dims <= 128 (less the listed exceptions); wgmma in the sm_90 SDPA kernels."""
    assert results["failures"] == [], "\n".join(results["failures"])


def test_every_kernel_and_config_is_compiled_on_both_archs(results):
    rows = results["units"]
    for arch in (80, 90):
        assert {r["kernel"] for r in rows if r["arch"] == arch} == KERNELS
    assert results["summary"]["units"] == len(rows) > 0


def test_the_variants_cover_each_dtype_head_dim_and_flag(results):
    names = {v for r in results["units"] for v in r["variants"]}
    parts = {p for n in names for p in n.split("/")}
    assert {"fp32", "fp16", "bf16", "d16", "d64", "d96", "d128", "d192", "d256", "bool-mask",
            "float-mask", "dropout", "gqa", "weights", "paged"} <= parts



def test_the_forward_in_band_loop_has_no_mask_arithmetic(results):
    """Issue 18 item 10, on the compiled PTX: key blocks inside the band run a loop without
    band, bounds or mask arithmetic, exp2 fed by one FMA per score. The loop the forward had
    before (a runtime branch per tile, exp after a separate scale and subtract; sm_90 fp16 d64)
    is refused."""
    from triton_compile import checks

    concerned = [r for r in results["units"] if checks.in_band_applies(r) and not r["error"]]
    assert {r["arch"] for r in concerned} == {80, 90}
    assert [checks.in_band_broken(r) for r in concerned] == [None] * len(concerned)
    before = dict(concerned[0], in_band_loop={"instructions": 398, "setp/selp": 28, "fma": 2,
                                              "ex2": 34, "mma": 13})
    assert checks.in_band_broken(before)


def test_no_index_product_is_32_bit(results):
    """Issue 18 item 6: every product of an index and a stride or a length is int64 in every
    compiled kernel (a per-head mask at H=32, L=8192 already has h * stride past 2^31). The
    detector finds the products the kernels had (TTIR of `offs_m[:, None] * smm` before)."""
    from triton_compile import aot

    assert all(r["narrow_products"] == [] for r in results["units"] if not r["error"])
    before = """
    %h = arith.remsi %bh, %H : i32
    %p = arith.muli %h, %smh : i32 loc(#loc12)
    %q_34 = tt.expand_dims %offs_m {axis = 1 : i32} : tensor<128xi32> -> tensor<128x1xi32>
    %q_35 = tt.splat %sqm : i32 -> tensor<128x1xi32>
    %q_36 = arith.muli %q_34, %q_35 : tensor<128x1xi32>
    %c128_i32 = arith.constant 128 : i32
    %m0 = arith.muli %tile, %c128_i32 : i32
    %wide = arith.muli %h64, %smh64 : i64
    """
    assert [line.split(" =")[0] for line in aot.narrow_products(before)] == ["%p", "%q_36"]


def test_the_backward_transposes_no_computed_tile(results):
    """Issue 18 item 9: the dK/dV kernel works in key-major tiles (K Q^T, V dO^T: q and dO read
    transposed), so no probability or score-gradient tile is transposed in registers. The
    detector refuses the transposes the kernel had (trans(p.to(fp16)) each step)."""
    from triton_compile import aot

    dkdv = [r for r in results["units"] if r["kernel"] == "sdpa._dkdv_kernel" and not r["error"]]
    assert dkdv and all(r["computed_transposes"] == [] for r in dkdv)
    before = """
    %do = tt.load %ptrs, %mask, %cst : tensor<32x64x!tt.ptr<f16>>
    %pf = arith.truncf %p : tensor<32x64xf32> to tensor<32x64xf16>
    %pt = tt.trans %pf {order = array<i32: 1, 0>} : tensor<32x64xf16> -> tensor<64x32xf16>
    %dot = tt.trans %do {order = array<i32: 1, 0>} : tensor<32x64xf16> -> tensor<64x32xf16>
    """
    assert [line.split(" =")[0] for line in aot.computed_transposes(before)] == ["%pt"]

