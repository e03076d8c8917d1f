"""Every Triton kernel of attnx compiled ahead of time for sm_80 and sm_90 without a GPU (issue 18).

The interpreter runs the kernels here but is no compiler: it accepts kernels that no GPU compile
accepts, and says nothing of shared memory or registers. `tests/triton_compile` records every
launch the ops make (their own arguments, constexprs and autotuner configs after pruning for the
arch's shared memory) and compiles each with `triton.compile(ASTSource(...), GPUTarget(...))`.
By default a CI set covering every kernel x every config per arch over a representative set of
variants runs; ATTNX_TRITON_COMPILE_FULL=1 runs the full cross-product
(`cd tests && python -m triton_compile --full --json ../benchmarks/results/triton-compile.json`
writes the committed results; ~100 minutes of two idle cores: a run cut short goes on with
`--resume ../benchmarks/results/triton-compile.json`, which compiles only the units missing).
ATTNX_TRITON_COMPILE_ARCHS (e.g. "90") narrows the archs: CI's torch 2.11 stage compiles for
sm_90 only (the GPU machines' Triton and arch; sm_80 was compiled in the stage before).
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
           "additive._dk_kernel", "additive._dq_kernel", "decode._split_kernel",
           "decode_rerun._rerun_kernel",
           "sdpa_fwd_rerun._forward_kernel", "sdpa_bwd_rerun._rows_kernel",
           "sdpa_bwd_rerun._keys_kernel",
           "additive_bwd_rerun._rows_kernel", "additive_bwd_rerun._keys_kernel"}
ARCHS = [int(a) for a in os.environ.get("ATTNX_TRITON_COMPILE_ARCHS", "80 90").replace(",", " ").split()]


def _triton_compile(*args: str) -> subprocess.CompletedProcess:
    """`python -m triton_compile *args` in a process without TRITON_INTERPRET (tests/conftest.py
    sets it for this one)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(TESTS),
                                                      env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "triton_compile", *args], cwd=TESTS, env=env,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The JSON of one `python -m triton_compile` run."""
    out = tmp_path_factory.mktemp("triton-compile") / "triton-compile.json"
    full = ["--full"] if os.environ.get("ATTNX_TRITON_COMPILE_FULL") == "1" else []
    proc = _triton_compile("--json", str(out), "--arch", *map(str, ARCHS), *full)
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


def test_every_kernel_and_config_is_compiled_on_each_arch(results):
    rows = results["units"]
    assert {r["arch"] for r in rows} == set(ARCHS)
    for arch in ARCHS:
        assert {r["kernel"] for r in rows if r["arch"] == arch} == KERNELS
    assert results["summary"]["units"] == len(rows) > 0


def test_the_variants_cover_each_dtype_head_dim_and_flag(results):
    names = {v for r in results["units"] for v in r["variants"]}
    parts = {p for n in names for p in n.split("/")}
    assert {"fp32", "fp16", "bf16", "d16", "d64", "d96", "d128", "d192", "d256", "bool-mask",
            "float-mask", "float32-mask", "dropout", "gqa", "weights", "shared_v",
            "paged", "softcap", "huge_cap", "alibi", "sinks"} <= parts



def test_the_forward_in_band_loop_has_no_mask_arithmetic(results):
    """Issue 18 item 10, on the compiled PTX: key blocks inside the band run a loop without
    band, bounds or mask arithmetic, exp2 fed by one FMA per score, and that FMA takes the
    score's distance to the max, not the raw score (aot.folded_exp2: the fold gave NaN at
    scaled scores of 1e9 on the H200, which the interpreter, not fusing, cannot show). The
    loops the forward had before are refused: a runtime branch per tile with exp after a separate
    scale and subtract, and (3a56550, sm_80 and sm_90 alike) exp2(qk * c - m) as one FMA; in
    fp16's, the lost-score check (a min a score) that only bf16's and fp32's dots need."""
    from triton_compile import checks

    concerned = [r for r in results["units"] if checks.in_band_applies(r) and not r["error"]]
    assert {r["arch"] for r in concerned} == set(ARCHS)
    assert [checks.in_band_broken(r) for r in concerned] == [None] * len(concerned)
    before = dict(concerned[0], in_band_loop={"instructions": 398, "setp/selp": 28, "fma": 2,
                                              "ex2": 34, "mma": 13})
    assert checks.in_band_broken(before)
    folded = dict(concerned[0], in_band_loop={"instructions": 314, "setp/selp": 7, "fma": 34,
                                              "ex2": 34, "mma": 13, "folded_exp2": 32})
    assert "folds the row max" in checks.in_band_broken(folded)
    # fp16 (16b8403's loop): a min a score, looking for dots past float32's range
    fp16 = next(r for r in concerned if r["variant"].split("/")[1] == "fp16")
    checked = dict(fp16, in_band_loop={"instructions": 390, "setp/selp": 7, "fma": 38, "ex2": 34,
                                       "mma": 13, "min": 36, "max": 36})
    assert "overflowed dots" in checks.in_band_broken(checked)


def test_folded_exponents_are_told_from_distances():
    """aot.folded_exp2 on PTX of both shapes: an ex2 of fma(tensor-core result, c, -m) counts,
    one of fma(c, result - m, d) does not."""
    from triton_compile import aot

    body = ["wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%r1,%r2}, %rd1, %rd2, p, 1, 1, 0, 1;",
            "fma.rn.f32 %r10, %r2, %r34, %r9;", "ex2.approx.ftz.f32 %r11, %r10;",
            "sub.f32 %r12, %r1, %r9;", "fma.rn.f32 %r13, %r34, %r12, %r8;",
            "ex2.approx.ftz.f32 %r14, %r13;", "@%p1 ex2.approx.ftz.f32 %r15, %r12;"]
    assert aot.folded_exp2(body) == 1
    assert aot.folded_exp2(body[:1] + body[3:]) == 0


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



def test_a_run_cut_short_resumes_from_its_json(results, tmp_path):
    """--resume keeps the rows of an earlier run whose unit keys are unchanged and compiles only
    the units it lacks (here the one row taken out); a JSON made by another aot.py (or Triton)
    is refused before any work."""
    arch = str(ARCHS[0])
    rows = [r for r in results["units"] if r["arch"] == ARCHS[0]]
    cut = dict(results, units=rows[1:], complete=False)
    del cut["log"]
    earlier, out = tmp_path / "earlier.json", tmp_path / "resumed.json"
    earlier.write_text(json.dumps(cut))
    proc = _triton_compile("--arch", arch, "--json", str(out), "--resume", str(earlier))
    assert f"{len(rows)} units" in proc.stdout and f"{len(rows) - 1} of them from" in proc.stdout, proc.stdout[-3000:]
    resumed = json.loads(out.read_text())
    assert resumed["complete"] and resumed["units_planned"] == len(rows) == len(resumed["units"])
    key = ("kernel", "variant", "config", "arch")
    assert sorted(tuple(str(r[k]) for k in key) for r in resumed["units"]) == sorted(
        tuple(str(r[k]) for k in key) for r in rows)
    assert resumed["summary"]["units"] == len(rows)

    earlier.write_text(json.dumps(dict(cut, analysis="0" * 64)))
    proc = _triton_compile("--arch", arch, "--json", str(out), "--resume", str(earlier))
    assert proc.returncode != 0 and "its analysis is '0000" in proc.stderr, proc.stderr[-2000:]
