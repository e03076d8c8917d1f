"""`attnx check`: passes on this machine, writes well-formed JSON, and fails (exit status 1)
when a backend returns wrong numbers, wrong gradients or a wrong dropout pattern."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import attnx
from attnx import check
from attnx._backends import cpu as cpu_backend
from attnx.check import cases

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_cpu = pytest.mark.skipif(not attnx.backends()["cpu"].usable,
                               reason=f"cpu backend: {attnx.backends()['cpu'].reason}")


def _check(tmp_path, *args):
    path = tmp_path / "check.json"
    rc = check.main(["--json", str(path), *args])
    return rc, json.loads(path.read_text())


def test_passes_here_and_writes_json(tmp_path):
    """The command as a user runs it (no interpreter switch: cpu and reference, and the GPU
    backends where there is a GPU)."""
    path = tmp_path / "check.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ATTNX_CUDA_ON_CPU")}
    res = subprocess.run([sys.executable, "-m", "attnx", "check", "--json", str(path)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(path.read_text())
    assert doc["schema"] == "attnx-check/1" and doc["passed"] is True
    assert set(doc["backends"]) == {"cuda", "triton", "cpu", "reference"}
    checked = {(r["backend"], r["device"], r["dtype"]) for r in doc["results"]}
    assert {("reference", "cpu", d) for d in ("float32", "float16", "bfloat16")} <= checked
    if doc["backends"]["cpu"]["usable"]:
        assert {("cpu", "cpu", d) for d in ("float64", "float32", "bfloat16", "float16")} <= checked
    for r in doc["results"]:
        assert r["passed"] and r["error"] is None, r
        assert {"out", "dq", "dk"} <= set(r["quantities"])
        for q in r["quantities"].values():
            assert q["ok"] and q["err"] <= q["bound"]
        line = f"{r['backend']} {r['device']} {r['dtype']} {r['case']} ok"
        assert line in " ".join(res.stdout.split()), line
    n_cases = {op: sum(c.op == op for c in cases.CASES) for op in ("sdpa", "additive")}
    per_target = {}
    for r in doc["results"]:
        key = (r["backend"], r["device"], r["dtype"], r["op"])
        per_target[key] = per_target.get(key, 0) + 1
    assert all(n == n_cases[key[3]] for key, n in per_target.items())
    assert f"{len(doc['results'])} checks, 0 failed" in res.stdout


def _wrong_forward(call):
    out, lse = cpu_backend.native.sdpa(call)
    return out * 1.001, lse  # 0.1%: far under what a user would notice by eye


def _wrong_backward(call):
    out, lse = cpu_backend.native.sdpa(call)
    return out + 0.01 * (out - out.detach()), lse  # the same values, gradients 1% too large


def _wrong_dropout(call):
    seed = None if call.seed is None else call.seed + 1
    return cpu_backend.native.sdpa(dataclasses.replace(call, seed=seed))


def _raises(call):
    raise RuntimeError("kernel launch failed")


@needs_cpu
@pytest.mark.parametrize("broken,expect", [
    (_wrong_forward, "out: max error"), (_wrong_backward, "dq: max error"),
    (_wrong_dropout, "dropped differently"), (_raises, "RuntimeError: kernel launch failed")])
def test_fails_when_a_backend_is_wrong(tmp_path, monkeypatch, broken, expect):
    monkeypatch.setattr(cpu_backend, "sdpa", broken)
    rc, doc = _check(tmp_path, "--backends", "cpu", "--dtypes", "float32")
    assert rc == 1 and doc["passed"] is False
    sdpa = [r for r in doc["results"] if r["op"] == "sdpa"]
    failed = [r for r in sdpa if not r["passed"]]
    if broken is _wrong_dropout:  # only the dropout case draws a seed
        assert [r["case"] for r in failed] == ["sdpa dropout"]
    else:
        assert failed == sdpa
    assert all(expect in r["error"] for r in failed), [r["error"] for r in failed]
    if broken is _wrong_backward:
        assert all(r["quantities"]["out"]["ok"] for r in failed)
    # the additive op does not go through the broken function: its checks still pass
    assert all(r["passed"] for r in doc["results"] if r["op"] == "additive")


def test_fails_when_nothing_is_checked(tmp_path, capsys):
    rc, doc = _check(tmp_path, "--backends", "reference", "--dtypes", "float64")
    assert rc == 1 and doc["results"] == [] and doc["passed"] is False
    assert "nothing was checked" in capsys.readouterr().out
    assert doc["skipped"][0]["reason"] == check.GOLDEN_ITSELF


def test_rejects_unknown_names(capsys):
    with pytest.raises(SystemExit) as exc:
        check.main(["--backends", "cpu,nope"])
    assert exc.value.code == 2 and "--backends: unknown ['nope']" in capsys.readouterr().err


def test_dtypes_the_dispatcher_refuses_are_listed_not_checked():
    """(The triton backend, through its interpreter on CPU tensors, refuses float64.)"""
    status = {"triton": attnx.backends()["triton"], "cuda": attnx.backends()["cuda"]}
    targets, skipped = check.plan(status, ["cpu"], ["float64", "float32"])
    if status["triton"].usable:
        assert ("triton", "cpu", "float32", "sdpa") in targets
        assert any(s["backend"] == "triton" and s["dtype"] == "float64" and "float64" in s["reason"]
                   for s in skipped)
    if not status["cuda"].usable:
        assert {"backend": "cuda", "device": None, "dtype": None, "op": None,
                "reason": status["cuda"].reason} in skipped


@pytest.mark.skipif(not attnx.backends()["triton"].usable, reason="triton backend unusable here")
def test_triton_backend_under_the_interpreter(tmp_path):
    """On a CPU machine (tests/conftest.py sets TRITON_INTERPRET=1) the triton backend is checked
    on CPU tensors; float32 keeps the interpreter's time down."""
    rc, doc = _check(tmp_path, "--backends", "triton", "--dtypes", "float32")
    devices = {r["device"] for r in doc["results"]}
    assert devices == ({"cuda"} if torch.cuda.is_available() else {"cpu"})
    assert rc == 0, [r["error"] for r in doc["results"] if not r["passed"]]
    assert len(doc["results"]) == len(cases.CASES)


@needs_cpu
def test_jobs_give_the_same_results(tmp_path):
    """--jobs runs the checks in spawned worker processes: the same rows, in the same order, with
    the same verdicts and the same errors of the backend under test (whose results do not depend
    on the thread count). The baselines may differ: a worker runs torch on fewer threads, and
    torch's float32 GEMMs sum in another order then, so bounds and ratios are not compared."""
    rc1, one = _check(tmp_path, "--backends", "cpu", "--dtypes", "float32")
    rc2, two = _check(tmp_path, "--backends", "cpu", "--dtypes", "float32", "--jobs", "2")
    assert rc1 == rc2 == 0

    def rows(doc):
        return [{k: v for k, v in r.items() if k not in ("seconds", "quantities", "worst")}
                for r in doc["results"]]

    def errors(doc):
        return [{name: q["err"] for name, q in (r.get("quantities") or {}).items()}
                for r in doc["results"]]

    assert rows(one) == rows(two)
    # the float64 golden values may round differently on another thread count
    assert errors(two) == [{n: pytest.approx(e, rel=1e-6) for n, e in r.items()} for r in errors(one)]
