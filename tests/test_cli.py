"""`attnx info` and attnx.backends() tell the truth about this installation."""

import os
import subprocess
import sys

import pytest
import torch

import attnx
from attnx import _ops


def test_info_reports_versions_and_backends():
    out = subprocess.run([sys.executable, "-m", "attnx", "info"], capture_output=True, text=True, check=True).stdout
    assert f"attnx      {attnx.__version__}" in out
    assert torch.__version__ in out
    listing = out.split("backends:")[1].splitlines()
    for name, status in attnx.backends().items():
        line = next(ln for ln in listing if ln.strip().startswith(name + " "))
        assert ("usable" == line.split()[1]) == status.usable, line


def test_backends_agree_with_reality():
    status = attnx.backends()
    assert set(status) == {"cuda", "triton", "cpu", "reference"}
    assert status["reference"].usable
    assert status["cuda"].usable == (torch.cuda.is_available() and _ops.has_kernel("sdpa_fwd", "CUDA"))
    for s in status.values():
        assert s.usable == (s.reason == "")
    if status["cpu"].usable:
        q = torch.randn(1, 2, 5, 8)
        attnx.scaled_dot_product_attention(q, q, q, backend="cpu")


def test_build_info_matches_torch():
    info = _ops.build_info()
    if _ops.LOAD_ERROR is None:
        assert info["torch"] == torch.__version__
        assert isinstance(info["cuda"], bool)


def test_unknown_command_fails():
    r = subprocess.run([sys.executable, "-m", "attnx", "frobnicate"], capture_output=True, text=True)
    assert r.returncode != 0 and "invalid choice" in r.stderr


def test_help_lists_every_command(capsys):
    from attnx import cli
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    for name in ("info", "check", "bench", "demo"):
        assert name in out.split("{", 1)[1].split("}", 1)[0], name


@pytest.mark.parametrize("argv, words", [
    (["info", "--bogus"], "unrecognized arguments: --bogus"),
    (["demo", "--quick", "--steps", "0"], "--steps: expected an int >= 1, got 0"),
    (["demo", "--quick", "--lr=-1"], "--lr: expected a finite number > 0"),
    (["demo", "--quick", "--out", "no/such/folder/x.png"], "--out: no folder"),
    # a helper's findings: the first hung (more distinct dates than there are), the others
    # named a file other than the one written, or raised after training
    (["demo", "--quick", "--test-size", "500000"], "--test-size: expected at most 20000"),
    (["demo", "--quick", "--out", "x.xyz"], "--out: expected a .png, .pdf or .svg file"),
    (["demo", "--quick", "--out", os.path.dirname(__file__)], "--out: expected the path of a file"),
    (["check", "--jobs", "0"], "--jobs: expected an int >= 1"),
    (["check", "--json", "no/such/folder/x.json"], "--json: no folder"),
    # each ran every check or the whole sweep first, then raised a traceback (a helper's finding)
    (["check", "--dtypes", ""], "--dtypes: expected a comma-separated list"),
    (["check", "--json", os.path.dirname(__file__)], "--json: expected a file path"),
    (["bench", "--quick", "--out", os.path.join(__file__, "sub")],
     "--out: cannot make the folder"),
    (["check", "--devices", "tpu"], "--devices: unknown ['tpu']"),
] + ([] if torch.cuda.is_available() else [
    # a device this machine lacks is named as such (it said "unknown ['cuda']")
    (["check", "--devices", "cuda"], "--devices: ['cuda'] not on this machine; here: ['cpu']")]))
def test_bad_arguments_are_usage_errors(argv, words, capsys):
    """Refused by argparse before any work (exit status 2), the option named: no traceback,
    and no error found only after a whole run."""
    from attnx import cli
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err
