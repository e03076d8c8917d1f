"""The benchmark and GPU-check scripts answer --help without running anything, their help says
whole sentences, and the CPU targets scripts never overwrite an earlier results file."""

import ast
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _source(script: str) -> str:
    with open(os.path.join(ROOT, script)) as f:
        return f.read()


SCRIPTS = sorted(
    script
    for script in (os.path.relpath(p, ROOT) for folder in ("benchmarks", "scripts")
                   for p in glob.glob(os.path.join(ROOT, folder, "*.py")))
    if "argparse" in _source(script) and not os.path.basename(script).startswith(("test_", "conftest"))
)


def test_scripts_found():
    assert "benchmarks/fma_peak.py" in SCRIPTS and "benchmarks/cpu_sdpa_targets.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_whole_sentences_and_runs_nothing(script, tmp_path):
    # from an empty folder: a script that ran its benchmark would write results or take minutes
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "benchmarks")))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:"), proc.stdout[:200]
    assert list(tmp_path.iterdir()) == []
    source = _source(script)
    if "description=__doc__" in source:
        first = ast.get_docstring(ast.parse(source)).split("\n\n")[0].rstrip()
        assert first[-1] in ".):", f"{script}: help ends mid-sentence: {first[-60:]!r}"
        assert " ".join(first.split()[-4:]) in " ".join(proc.stdout.split())


def test_results_files_are_not_overwritten(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from cpu_sdpa_targets import unused_path
    finally:
        sys.path.pop(0)
    path = str(tmp_path / "cpu-decode-2026-01-01-t2.json")
    assert unused_path(path) == path
    open(path, "w").close()
    assert unused_path(path) == str(tmp_path / "cpu-decode-2026-01-01-t2-2.json")
    open(str(tmp_path / "cpu-decode-2026-01-01-t2-2.json"), "w").close()
    assert unused_path(path) == str(tmp_path / "cpu-decode-2026-01-01-t2-3.json")
    for script in ("cpu_sdpa_targets", "cpu_decode_targets", "cpu_decode_short", "cpu_varlen_targets"):
        assert "args.out or unused_path(" in _source(f"benchmarks/{script}.py"), script
