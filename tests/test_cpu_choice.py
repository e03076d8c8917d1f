"""The CPU kernels' choices made at first use (csrc/cpu/cpu_choice.h): measured where the CPU
offers two, fixed by the environment where it says so, and shown by `attnx info`.

Each case runs in a subprocess: the choices are made once per process (and tests/conftest.py
fixes them for the suite's own process)."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys

import pytest

from attnx import _ops
from attnx.info import cpu_description

MARGIN, STRIP_MARGIN = 0.10, 0.02  # cpu_choice.h's kMargin, kStripMargin
ISA = set(cpu_description().get("isa", []))
HAS_AVX2 = {"avx2", "fma"} <= ISA
HAS_AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= ISA

# The CPU's extensions are read from /proc/cpuinfo's flags (x86 Linux); elsewhere the tests could
# not tell what the extension should have found.
pytestmark = [
    pytest.mark.skipif(_ops.LOAD_ERROR is not None, reason="no native extension"),
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64", "i686") or not ISA,
                       reason="x86 Linux: /proc/cpuinfo names the CPU's vector extensions"),
]


def cpu_env(**env_vars) -> dict:
    """This process's environment with ATTNX_CPU_* set as given only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNX_CPU_")}
    env.update(env_vars)
    return env


def fresh(expression: str, **env_vars):
    """`expression` (over _ops and cpu_kernels) as JSON from a fresh process whose environment
    has ATTNX_CPU_* set as given only."""
    code = ("import json; from attnx import _ops; from attnx.bench.machine import cpu_kernels; "
            f"print(json.dumps({expression}))")
    out = subprocess.run([sys.executable, "-c", code], env=cpu_env(**env_vars), check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def choices(**env_vars) -> dict:
    """build_info() of a fresh process whose environment has ATTNX_CPU_* set as given only."""
    return fresh("_ops.build_info()", **env_vars)


def test_choices_are_measured_and_follow_the_rule():
    info = choices()
    how = info["cpu_choice"]
    if not HAS_AVX2:
        assert (info["cpu_gemm"], how["gemm"]) == ("blas", "no AVX2 and FMA")
        assert info["cpu_vector"] == "baseline"
        return
    assert how["gemm"] == "measured"
    t = how["gemm_seconds"]
    assert t["panels"] > 0 and t["blas"] > 0
    # BLAS only where it is faster by the margin: a close call keeps the panels
    assert info["cpu_gemm"] == ("blas" if t["blas"] < (1 - MARGIN) * t["panels"] else "panels")
    if not HAS_AVX512:
        assert (info["cpu_vector"], how["vector"]) == ("avx2", "no AVX-512")
        return
    assert how["vector"] == "measured"
    t = how["vector_seconds"]
    assert t["avx512"] > 0 and t["avx2"] > 0
    assert info["cpu_vector"] == ("avx2" if t["avx2"] < (1 - MARGIN) * t["avx512"] else "avx512")
    if info["cpu_vector"] == "avx512":
        # the 512-bit kernel's strip height: 12 rows unless 6 are faster by the strip margin
        assert how["strip_rows"] == "measured"
        t = how["strip_seconds"]
        assert t["12"] > 0 and t["6"] > 0
        assert info["cpu_strip_rows"] == (6 if t["6"] < (1 - STRIP_MARGIN) * t["12"] else 12)


@pytest.mark.skipif(not HAS_AVX2, reason="one engine and one width only: nothing to fix")
@pytest.mark.parametrize("value", ["0", "1"])
def test_environment_fixes_the_choices(value):
    info = choices(ATTNX_CPU_PANELS=value, ATTNX_CPU_AVX512=value)
    how = info["cpu_choice"]
    assert how["gemm"] == f"ATTNX_CPU_PANELS={value}" and "gemm_seconds" not in how
    assert info["cpu_gemm"] == ("panels" if value == "1" else "blas")
    if HAS_AVX512:
        assert how["vector"] == f"ATTNX_CPU_AVX512={value}" and "vector_seconds" not in how
        assert info["cpu_vector"] == ("avx512" if value == "1" else "avx2")
        assert how["strip_rows"] == ("measured" if value == "1" else "AVX-512 not chosen")
    else:
        assert (info["cpu_vector"], how["vector"]) == ("avx2", "no AVX-512")


@pytest.mark.skipif(not HAS_AVX2, reason="one engine and one width only: nothing to fix")
def test_a_value_the_switches_do_not_take_is_warned_of_and_measured():
    """A mistyped switch ("yes", "2") was ignored without a word: the choice measured where
    the user meant to fix it. An empty one stays unset."""
    env = cpu_env(ATTNX_CPU_PANELS="yes", ATTNX_CPU_AVX512="2", ATTNX_CPU_STRIP_ROWS="")
    run = subprocess.run([sys.executable, "-c", "import json; from attnx import _ops; "
                          "print(json.dumps(_ops.build_info()))"], env=env, check=True,
                         capture_output=True, text=True)
    how = json.loads(run.stdout.strip().splitlines()[-1])["cpu_choice"]
    assert how["gemm"] == "measured"
    assert "ATTNX_CPU_PANELS: expected 0 or 1, got 'yes'" in run.stderr
    if HAS_AVX512:
        assert how["vector"] == "measured"
        assert "ATTNX_CPU_AVX512: expected 0 or 1, got '2'" in run.stderr
    assert "ATTNX_CPU_STRIP_ROWS" not in run.stderr


@pytest.mark.skipif(not HAS_AVX512, reason="the strip height is the 512-bit kernel's")
@pytest.mark.parametrize("rows", [6, 12])
def test_environment_fixes_the_strip_height(rows):
    info, kernels = fresh("[_ops.build_info(), cpu_kernels()]", ATTNX_CPU_AVX512="1",
                          ATTNX_CPU_STRIP_ROWS=str(rows))
    how = info["cpu_choice"]
    assert info["cpu_strip_rows"] == rows and how["strip_rows"] == f"ATTNX_CPU_STRIP_ROWS={rows}"
    assert "strip_seconds" not in how
    # and results files (attnx.bench.machine.cpu_kernels) record the height run
    assert kernels["strip_rows"] == rows


@pytest.mark.skipif(not HAS_AVX512, reason="the strip height is the 512-bit kernel's")
def test_strip_height_never_changes_a_result():
    """Each score and output is the same FMA chain whatever strip holds its row: 12-row and
    6-row strips give bitwise the same forward and backward (Lq 300 and 97: tiles of 66 rows,
    causal edges of 30, backward blocks of 192, each ending on a 6-row strip or a shorter one)."""
    code = ("import torch, attnx, hashlib\n"
            "g = torch.Generator().manual_seed(0)\n"
            "h = hashlib.sha256()\n"
            "for lq, lk, e, causal in ((300, 260, 64, True), (97, 333, 40, False)):\n"
            "    q = torch.randn(1, 2, lq, e, generator=g, requires_grad=True)\n"
            "    k, v = (torch.randn(1, 2, lk, e, generator=g, requires_grad=True) for _ in '12')\n"
            "    o = attnx.scaled_dot_product_attention(q, k, v, is_causal=causal, backend='cpu')\n"
            "    o.backward(torch.randn(o.shape, generator=g))\n"
            "    for t in (o, q.grad, k.grad, v.grad):\n"
            "        h.update(t.detach().numpy().tobytes())\n"
            "print(h.hexdigest())\n")
    digests = {}
    for rows in (6, 12):
        env = cpu_env(ATTNX_CPU_PANELS="1", ATTNX_CPU_AVX512="1", ATTNX_CPU_STRIP_ROWS=str(rows))
        digests[rows] = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                       capture_output=True, text=True).stdout.split()[-1]
    assert digests[6] == digests[12]


def test_first_use_leaves_torchs_random_stream_alone():
    code = ("import torch; from attnx import _ops\n"
            "torch.manual_seed(0); _ops.build_info(); a = torch.rand(4)\n"
            "torch.manual_seed(0); b = torch.rand(4)\n"
            "print(bool((a == b).all()))")
    out = subprocess.run([sys.executable, "-c", code], env=cpu_env(), check=True,
                         capture_output=True, text=True).stdout
    assert out.strip().splitlines()[-1] == "True"


def info_output(**env_vars) -> str:
    return subprocess.run([sys.executable, "-m", "attnx", "info"], env=cpu_env(**env_vars),
                          check=True, capture_output=True, text=True).stdout


def test_info_names_the_cpu_and_the_choices():
    out = info_output()
    cpu = cpu_description()
    line = next(ln for ln in out.splitlines() if ln.startswith("CPU        "))
    assert cpu["model_name"] in line
    for flag in cpu.get("isa", []):
        assert flag in line
    for level, size in cpu.get("caches", {}).items():
        if level != "L1i":
            assert f"{level} {size}" in line
    # measured: the choice and its times (another process could measure a close call the
    # other way, so only the form is checked here)
    kernels = next(ln for ln in out.splitlines() if ln.startswith("CPU kernels"))
    assert re.search(r"GEMM (panels|blas) \(measured: a small forward and backward [0-9.]+ ms "
                     r"on the panels, [0-9.]+ on BLAS\)", kernels), kernels
    if HAS_AVX512:
        assert re.search(r"vector ISA (avx512|avx2) \(measured: a tile's products [0-9.]+ us on "
                         r"AVX-512, [0-9.]+ on AVX2\)", kernels), kernels
        if "vector ISA avx512" in kernels:
            assert re.search(r"strips of (6|12) \(measured: a tile's products [0-9.]+ us in "
                             r"12-row strips, [0-9.]+ in 6-row\)", kernels), kernels
    # fixed by the environment: exactly what was asked
    kernels = next(ln for ln in info_output(ATTNX_CPU_PANELS="0", ATTNX_CPU_AVX512="0")
                   .splitlines() if ln.startswith("CPU kernels"))
    assert "GEMM blas (ATTNX_CPU_PANELS=0)" in kernels
    assert ("vector ISA avx2 (ATTNX_CPU_AVX512=0)" if HAS_AVX512
            else "vector ISA avx2 (no AVX-512)") in kernels


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="Linux names the CPU there")
def test_cpu_description_reads_cpuinfo():
    cpu = cpu_description()
    with open("/proc/cpuinfo") as f:
        text = f.read()
    assert cpu["model_name"] in text and cpu["vendor"] in text
    flags = next(ln for ln in text.splitlines() if ln.startswith("flags")).split(":", 1)[1].split()
    assert set(cpu["isa"]) <= set(flags)
    assert ("avx2" in flags) == ("avx2" in cpu["isa"])
