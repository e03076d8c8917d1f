"""Reruns part of a test file in a subprocess with an environment switch set.

This is how one machine tests the CPU paths it would not take by itself (tests/conftest.py fixes
the panels and AVX-512 for the main run, where the CPU has them): `ATTNX_CPU_AVX512=0`
(the 8-lane AVX2 bodies CPUs without AVX-512 run) and `ATTNX_CPU_PANELS=0` (the BLAS engine
CPUs without AVX2 run). The switches are read once per process, hence the subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from attnx import _ops


def skip_unless_avx512() -> None:
    """Under ATTNX_CPU_AVX512=0 a CPU without AVX-512 reruns what its main run already tested."""
    if _ops.build_info().get("cpu_vector") != "avx512":
        pytest.skip("no AVX-512 here: the main run already tests the 8-lane bodies")


def rerun_under(env_var: str, test_file: str, selection: str, probe: str | None = None,
                expect: tuple = ()) -> None:
    """Runs `pytest test_file -k selection` with env_var=0 and asserts it passed. With `probe`,
    first checks that the switch took: `_ops.build_info()[probe]` must be one of `expect`."""
    env = dict(os.environ, **{env_var: "0"})
    if probe is not None:
        code = f"from attnx import _ops; print(_ops.build_info()[{probe!r}])"
        got = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                             capture_output=True, text=True).stdout.strip()
        assert got in expect, f"{env_var}=0: build_info()[{probe!r}] is {got!r}, not one of {expect}"
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          test_file, "-k", selection],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:]
    # a selection that matches nothing exits 5, but one that deselects everything it should run
    # would pass silently: require passed tests
    assert " passed" in res.stdout, res.stdout[-2000:]
