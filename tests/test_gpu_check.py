"""The parts of scripts/gpu_check.sh and benchmarks/gpu.py that need no GPU: argument handling,
the dry run, the no-GPU run, step records, timeouts, the JSON document and its merging, the
benchmark's FLOP count, order, deadline and tables."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import attnx
from attnx.bench.shapes import Case

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
HAS_GPU = shutil.which("nvidia-smi") is not None and torch.cuda.is_available()
pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _load("gpu_check_report", "scripts/gpu_check_report.py")
bench = _load("gpu_bench", "benchmarks/gpu.py")
prebuilt = _load("gpu_prebuilt", "scripts/gpu_prebuilt.py")


def _script(*args, env=None):
    full = dict(os.environ, PYTHON=sys.executable, **(env or {}))
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=300)


# ---------------------------------------------------------------- scripts/gpu_error_paths.py


def test_error_paths_raise_here_and_a_crash_is_reported():
    errors = _load("gpu_error_paths", "scripts/gpu_error_paths.py")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_error_paths.py")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "attnx._C CPU op: ok: RAISED" in res.stdout and "CXX=" in res.stdout
    assert errors.probe("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)") == (
        False, "crashed with signal 11")
    passed, what = errors.probe("x = 1")
    assert not passed and what.startswith("DID NOT RAISE")


def test_a_crash_gets_a_native_backtrace_and_a_wrapper_its_commands(tmp_path):
    errors = _load("gpu_error_paths", "scripts/gpu_error_paths.py")
    wrapper = tmp_path / "g++"
    wrapper.write_text("#!/bin/sh\n# a comment\nexec g++-real -static-libstdc++ \"$@\"\n")
    assert errors.wrapper_commands(str(wrapper)) == ['exec g++-real -static-libstdc++ "$@"']
    assert errors.wrapper_commands(sys.executable) == []  # a binary: nothing to show
    if shutil.which("cuda-gdb") is None and shutil.which("gdb") is None:
        assert errors.backtrace("x = 1") == []
        return
    lines = errors.backtrace("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert any("SIGSEGV" in x for x in lines) and any(x.startswith("#0") for x in lines), lines


def test_failures_are_reported_as_they_happen(tmp_path):
    """ATTNX_REPORT_FAILURES_AT_ONCE (tests/conftest.py): a failure's traceback comes out before
    the session ends, so a run killed by its time limit still shows it."""
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_x.py").write_text("def test_a():\n    assert 1 == 2, 'planted'\n\n"
                                        "def test_b():\n    pass\n")
    env = dict(os.environ, ATTNX_REPORT_FAILURES_AT_ONCE="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--no-header", "-x", str(tmp_path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1
    assert "----- test_x.py::test_a (call) failed:" in res.stderr and "planted" in res.stderr


# ---------------------------------------------------------------- scripts/gpu_check.sh


def test_dry_run_lists_every_step_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    res = _script(str(out), "--dry-run")
    assert res.returncode == 0, res.stderr
    for step, cap in (("build", 300), ("errors", 260), ("test_cuda", 120), ("test_triton", 240),
                      ("check", 90), ("memcheck", 120), ("racecheck", 120), ("bench", 600)):
        assert any(line.split()[:3] == [step, "cap", str(cap)] for line in res.stdout.splitlines()), step
    assert "tests/test_cuda.py" in res.stdout and "compute-sanitizer --tool racecheck" in res.stdout
    assert "tests/test_triton_configs.py" in res.stdout and "CUDA_LAUNCH_BLOCKING=1" in res.stdout
    assert not out.exists()
    # the host CPU's targets only when named (device time goes to the GPU first)
    assert not any(line.split()[:1] == ["cpu"] for line in res.stdout.splitlines())
    named = _script(str(out), "--dry-run", "--steps", "build,cpu").stdout
    (cpu,) = [line for line in named.splitlines() if line.split()[:3] == ["cpu", "cap", "120"]]
    assert "taskset -c 0,1" in cpu and "cpu_sdpa_targets.py" in cpu and "cpu_decode_targets.py" in cpu
    # the profile too: ncu with the clocks left alone, only the cases' profiled range
    assert not any(line.split()[:1] == ["profile"] for line in res.stdout.splitlines())
    named = _script(str(out), "--dry-run", "--steps", "profile", env={"NCU": "/x/ncu"}).stdout
    (prof,) = [line for line in named.splitlines() if line.split()[:3] == ["profile", "cap", "240"]]
    assert "/x/ncu --profile-from-start off --clock-control none" in prof
    assert "--section WarpStateStats" in prof and "gpu_profile_cases.py" in prof
    assert "--page raw --csv" in prof and "gpu_profile_report.py" in prof


def _prebuilt_tree(tmp_path, info, load_error=None) -> str:
    """A tree with sources, and an attnx package whose build_info() says `info`; returns the
    path of its (empty) module, stamped as built from the tree's sources."""
    (tmp_path / "csrc" / "cuda").mkdir(parents=True, exist_ok=True)
    (tmp_path / "csrc" / "cuda" / "k.cu").write_text("a kernel\n")
    (tmp_path / "setup.py").write_text("setup()\n")
    (tmp_path / "attnx").mkdir(exist_ok=True)
    (tmp_path / "attnx" / "__init__.py").write_text(
        f"class _ops:\n    LOAD_ERROR = {load_error!r}\n    @staticmethod\n"
        f"    def build_info():\n        return {info!r}\n")
    so = prebuilt.module_path(str(tmp_path))
    open(so, "w").close()
    with open(so + ".sources", "w") as f:
        f.write(prebuilt.digest(str(tmp_path)) + "\n")
    return so


def test_a_prebuilt_module_is_taken_only_for_its_sources_gpu_and_torch(tmp_path, capsys):
    root = str(tmp_path)
    so = _prebuilt_tree(tmp_path, {"cuda": True, "cuda_archs": "9.0", "torch": torch.__version__})
    assert prebuilt.why_not(root, "9.0") is None and prebuilt.main(["check", root, "9.0"]) == 0
    assert "taken, no compile" in capsys.readouterr().out
    assert prebuilt.why_not(root, "8.0") == "built for CUDA architectures '9.0', the GPU is '8.0'"
    assert prebuilt.main(["check", root, "8.0"]) == 1
    assert "not taken (built for CUDA architectures" in capsys.readouterr().out
    # any source changed, added or removed since the build
    other = "built from other sources than this tree's csrc/ and setup.py"
    for change in (lambda: (tmp_path / "setup.py").write_text("setup(changed=True)\n"),
                   lambda: (tmp_path / "csrc" / "cuda" / "k.cu").write_text("another kernel\n"),
                   lambda: (tmp_path / "csrc" / "new.h").write_text("\n")):
        _prebuilt_tree(tmp_path, {"cuda": True, "cuda_archs": "9.0", "torch": torch.__version__})
        change()
        assert prebuilt.why_not(root, "9.0") == other
    (tmp_path / "csrc" / "new.h").unlink()
    for info, load_error, reason in (
            ({"cuda": False}, None, "built without CUDA"),
            ({"cuda": True, "cuda_archs": "9.0", "torch": "0.1"}, None, "built against torch 0.1"),
            (None, "attnx._C is not built or failed to load (GLIBCXX)", "it does not load: attnx._C")):
        _prebuilt_tree(tmp_path, info, load_error)
        assert prebuilt.why_not(root, "9.0").startswith(reason)
    _prebuilt_tree(tmp_path, {})
    (tmp_path / "attnx" / "__init__.py").write_text("raise ImportError('planted')\n")
    assert prebuilt.why_not(root, "9.0") == "importing attnx failed: ImportError: planted"
    os.remove(so + ".sources")
    assert "no stamp" in prebuilt.why_not(root, "9.0")
    os.remove(so)
    assert prebuilt.why_not(root, "9.0").startswith("no attnx/_C.")
    # the build step compiles unless the check says yes; the errors step's rebuild always does
    dry = _script("out", "--dry-run", "--steps", "build,errors").stdout
    (build,) = [line for line in dry.splitlines() if line.split()[:1] == ["build"]]
    (errors,) = [line for line in dry.splitlines() if line.split()[:1] == ["errors"]]
    assert "scripts/gpu_prebuilt.py check . " in build and "|| { env ATTNX_CUDA=1" in build
    assert "CXX=/usr/bin/g++ env ATTNX_CUDA=1" in errors and "gpu_prebuilt.py" not in errors


@pytest.mark.parametrize("args,message", [
    ((), "OUTDIR is required"), (("a", "b"), "one OUTDIR"), (("o", "--steps", "build,nope"), "unknown step 'nope'"),
    (("o", "--frob"), "unknown option --frob"), (("o", "--budget", "ten"), "--budget: expected whole seconds")])
def test_bad_arguments_exit_2(tmp_path, args, message):
    res = subprocess.run(["bash", SCRIPT, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and message in res.stderr, res.stderr


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_without_a_gpu_nothing_runs_and_the_json_says_why(tmp_path):
    res = _script(str(tmp_path), "--steps", "build,bench")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "nothing run" in res.stdout
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["schema"] == "attnx-gpu-check/1" and doc["status"] == "skipped"
    assert doc["reason"] and doc["steps_requested"] == ["build", "bench"]
    assert [(s["name"], s["status"], s["summary"]["note"]) for s in doc["steps"]] == [
        ("build", "skipped", doc["reason"]), ("bench", "skipped", doc["reason"])]
    assert doc["machine"]["torch"] == torch.__version__
    assert "nothing run" in (tmp_path / "gpu_check.log").read_text()
    assert sorted(os.listdir(tmp_path)) == ["gpu_check.json", "gpu_check.log"]


def test_a_step_past_its_cap_is_recorded_as_timed_out(tmp_path):
    res = _script(str(tmp_path), "--force", "--steps", "check", env={"GPU_CHECK_CAP_check": "1"})
    assert res.returncode == 1, res.stdout + res.stderr
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    (step,) = doc["steps"]
    assert step["name"] == "check" and step["status"] == "timed_out" and step["timeout_s"] == 1
    assert doc["status"] == "failed" and doc["check"] is None
    assert "check (timeout 1 s)" in (tmp_path / "gpu_check.log").read_text()


def test_steps_past_the_budget_are_skipped(tmp_path):
    res = _script(str(tmp_path), "--force", "--steps", "check,bench", "--budget", "0")
    assert res.returncode == 1
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(s["name"], s["status"]) for s in doc["steps"]] == [("check", "skipped"), ("bench", "skipped")]
    assert all("out of time" in s["summary"]["note"] for s in doc["steps"])


# ---------------------------------------------------------------- scripts/gpu_check_report.py

PYTEST_OUT = """\
tests/test_cuda.py::test_a[float16] PASSED                                [ 25%]
tests/test_cuda.py::test_a[bfloat16] FAILED                               [ 50%]
tests/test_cuda.py::test_b SKIPPED (no reason)                            [ 75%]
tests/test_cuda.py::test_c ERROR                                          [100%]
=========== 1 failed, 1 passed, 1 skipped, 1 error in 3.21s ===========
"""
SANITIZER_OUT = """\
cuda: sanitize cases ran
========= ERROR SUMMARY: 0 errors
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""


XDIST_OUT = """\
[gw1] [ 50%] PASSED tests/test_triton.py::test_sdpa_plain[dtype0]
[gw0] [100%] FAILED tests/test_triton.py::test_sdpa_gqa[dtype1]
=========================== short test summary info ============================
FAILED tests/test_triton.py::test_sdpa_gqa[dtype1] - AssertionError: dq: max error
========================= 1 failed, 1 passed in 9.00s ==========================
"""


def test_summaries_of_pytest_and_sanitizer_output():
    s = report.summarize(PYTEST_OUT, 1)
    assert s["tests"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 1}
    assert s["failed_tests"] == ["tests/test_cuda.py::test_a[bfloat16]", "tests/test_cuda.py::test_c"]
    assert s["pytest"] == "1 failed, 1 passed, 1 skipped, 1 error in 3.21s"
    assert s["tail"][-1].startswith("===")
    s = report.summarize(XDIST_OUT, 1)
    assert s["tests"] == {"passed": 1, "failed": 1}  # the summary line repeats, not adds
    assert s["failed_tests"] == ["tests/test_triton.py::test_sdpa_gqa[dtype1]"]
    s = report.summarize(SANITIZER_OUT, 1)
    assert s["sanitizer_errors"] == 1 and len(s["sanitizer"]) == 2
    assert "tail" not in report.summarize(SANITIZER_OUT, 0)


def test_step_status():
    assert report.step_status(0, {"tests": {"passed": 3}}, False) == "passed"
    assert report.step_status(0, {"tests": {"skipped": 3}}, False) == "failed"  # all skipped
    assert report.step_status(1, {}, False) == "failed"
    assert report.step_status(124, {}, True) == "timed_out"


@pytest.fixture
def no_machine(monkeypatch):
    """finish() without reading the machine (a child process importing torch: seconds)."""
    monkeypatch.setattr(report, "machine", lambda: {"stub": True})


def _fake_run(tmp_path, name, check_passed=True, bench_rows=(), profile=None):
    scratch, out = tmp_path / f"{name}-scratch", tmp_path / name
    scratch.mkdir()
    out.mkdir()
    (scratch / "test_cuda.out").write_text(PYTEST_OUT)
    report.record(scratch / "steps.jsonl", "test_cuda", 1, 12, 120, scratch / "test_cuda.out", "pytest")
    (scratch / "check.json").write_text(json.dumps({"schema": "attnx-check/1", "results": [
        {"passed": check_passed}]}))
    with open(scratch / "bench.jsonl", "w") as f:
        for row in bench_rows:
            f.write(json.dumps(row) + "\n")
        f.write('{"kind": "result", "cut off by a ki')  # a line a kill left unfinished
    if profile is not None:
        (scratch / "profile.json").write_text(json.dumps(profile))
    return report.finish(str(out), str(scratch), 570, ["test_cuda", "check", "bench"]), out


def test_finish_writes_one_document(tmp_path, no_machine):
    rows = [{"kind": "meta", "gemm": {}}, {"kind": "result", "tflops": 1.0},
            {"kind": "autotune", "kernel": "sdpa._dq_kernel", "key": [], "config": {}}]
    doc, out = _fake_run(tmp_path, "run", bench_rows=rows)
    assert json.loads((out / "gpu_check.json").read_text()) == doc
    assert doc["status"] == "failed" and doc["steps"][0]["status"] == "failed"
    assert doc["steps"][0]["summary"]["tests"]["failed"] == 1
    assert doc["check"]["results"] == [{"passed": True}]
    assert doc["bench"]["meta"] == rows[0] and doc["bench"]["results"] == rows[1:2]
    assert doc["bench"]["autotune"] == rows[2:]
    assert doc["bench"]["end"] is None  # the benchmark was stopped before its last line
    assert doc["profile"] is None  # no profile step ran
    text = report.report(doc)
    assert "test_cuda" in text and "1 checks, 0 failed" in text


def test_merge_of_two_runs(tmp_path, no_machine, capsys):
    a, _ = _fake_run(tmp_path, "a", bench_rows=[{"kind": "result", "tflops": 1.0}])
    profile = {"schema": "attnx-gpu-profile/1", "kernels": [{"kernel": "k"}]}
    b, _ = _fake_run(tmp_path, "b", bench_rows=[{"kind": "meta"}, {"kind": "result", "tflops": 2.0},
                                               {"kind": "end", "measured": 1}], profile=profile)
    for i, d in enumerate((a, b)):
        path = tmp_path / f"{i}.json"
        path.write_text(json.dumps(d))
    rc = report.main(["merge", "-o", str(tmp_path / "all.json"), str(tmp_path / "0.json"),
                      str(tmp_path / "1.json")])
    assert rc == 1  # the fake runs' test step failed
    doc = json.loads((tmp_path / "all.json").read_text())
    assert [s["run"] for s in doc["steps"]] == [0, 1] and doc["runs"] == [a["date"], b["date"]]
    assert [r["tflops"] for r in doc["bench"]["results"]] == [1.0, 2.0]
    assert doc["bench"]["end"] == [None, {"kind": "end", "measured": 1}]
    assert doc["status"] == "failed" and doc["budget_s"] == 1140
    assert doc["profile"] == profile and "profile: 1 kernels" in report.report(doc)
    (tmp_path / "junk.json").write_text("{}")
    assert report.main(["merge", "-o", str(tmp_path / "x.json"), str(tmp_path / "junk.json")]) == 2
    assert "not gpu_check results" in capsys.readouterr().err


def _result(provider, tflops, spread, head_dim=128):
    case = {"op": "sdpa", "batch": 4, "heads": 16, "seqlen_q": 4096, "seqlen_k": 4096,
            "head_dim": head_dim, "causal": False, "dtype": "bfloat16"}
    return {"kind": "result", "provider": provider, "pass": "forward", "case": case,
            "tflops": tflops, "tflops_min_max": [tflops - spread, tflops + spread]}


def test_compare_sets_a_run_against_a_committed_jsonl(tmp_path, no_machine, capsys):
    """A gpu_check JSON against an earlier benchmark JSONL: the cases both measured, slower or
    faster only where the sample ranges are apart and the medians past the machines' noise;
    different devices do not compare."""
    meta = {"kind": "meta", "device": {"name": "NVIDIA H200"}}
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps(r) + "\n" for r in (
        meta, _result("attnx-cuda", 238.0, 5.0), _result("attnx-triton", 354.0, 10.0),
        _result("torch-flash", 400.0, 4.0), _result("attnx-cuda", 200.0, 2.0, head_dim=64))))
    # attnx-cuda: ranges apart, 3% slower (the machines' noise); triton 15% slower; flash 7.5%
    # faster
    new_rows = [meta, _result("attnx-cuda", 230.0, 1.0), _result("attnx-triton", 300.0, 10.0),
                _result("torch-flash", 430.0, 4.0), {"kind": "end"}]
    run, _ = _fake_run(tmp_path, "new", bench_rows=new_rows)
    new = tmp_path / "new.json"
    new.write_text(json.dumps(run))
    rows = report.compare(report.bench_rows(str(new))[1], report.bench_rows(str(old))[1])
    assert [(r[0], r[-1]) for r in rows] == [("attnx-cuda", ""), ("attnx-triton", "slower"),
                                             ("torch-flash", "faster")]
    assert rows[1][5] == pytest.approx(300.0 / 354.0)
    assert report.main(["compare", str(new), str(old)]) == 1  # a case got slower
    out = capsys.readouterr().out
    assert "3 cases measured in both (NVIDIA H200)" in out and "0.85x slower" in out
    h100 = tmp_path / "h100.jsonl"
    h100.write_text(old.read_text().replace("NVIDIA H200", "NVIDIA H100"))
    assert report.main(["compare", str(new), str(h100)]) == 2
    assert "different devices" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("")
    assert report.main(["compare", str(new), str(tmp_path / "empty.jsonl")]) == 2


# ---------------------------------------------------------------- the profile step

profile_report = _load("gpu_profile_report", "scripts/gpu_profile_report.py")

# ncu --page raw --csv as ncu writes it: a header, a row of units, a row per kernel, numbers
# with thousands separators (a metric a section did not collect is simply absent)
NCU_RAW = """"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","gpu__time_duration.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed","sm__warps_active.avg.pct_of_peak_sustained_active","launch__registers_per_thread","smsp__inst_executed.sum","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio","sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active","sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"
"","","","","","","","","","","","usecond","%","%","register/thread","inst","ratio","ratio","ratio","%","%"
"0","7","python3","h","void attnx::cuda::(anonymous namespace)::additive_fwd_kernel<__nv_bfloat16>(attnx::cuda::AdditiveParams)","1","7","(128, 1, 1)","(16, 1, 64)","0","9.0","684.50","41.2","38.9","96","12,345,678","2.10","0.40","1.30","35.5","48.0"
"1","7","python3","h","_attn_bwd_dkdv","1","7","(256, 1, 1)","(32, 16, 4)","0","9.0","1,210.00","80.0","20.1","255","99","n/a","0.9","0.2","1.0","70.0"
"""


def test_profile_report_reads_ncus_raw_page(tmp_path, capsys):
    raw = tmp_path / "raw.csv"
    raw.write_text(NCU_RAW)
    assert profile_report.main([str(raw), str(tmp_path / "p.json")]) == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["schema"] == "attnx-gpu-profile/1"
    fwd, bwd = doc["kernels"]
    assert fwd["kernel"] == "additive_fwd_kernel<__nv_bfloat16>" and bwd["kernel"] == "_attn_bwd_dkdv"
    assert fwd["grid"] == "(16, 1, 64)" and fwd["duration_us"] == 684.5 and bwd["duration_us"] == 1210.0
    assert fwd["metrics"] == {"sm_throughput_pct": 41.2, "achieved_occupancy_pct": 38.9,
                              "registers_per_thread": 96.0, "instructions": 12345678.0}
    assert list(fwd["stalls"]) == ["barrier", "short_scoreboard", "long_scoreboard"]
    assert bwd["stalls"] == {"long_scoreboard": 0.9, "short_scoreboard": 0.2}  # n/a left out
    assert fwd["pipes"] == {"fma": 48.0, "xu": 35.5}
    table = capsys.readouterr().out
    assert "additive_fwd_kernel" in table and "barrier 2.1" in table
    # nanoseconds too; a file without ncu's header has no kernels (exit 1)
    raw.write_text(NCU_RAW.replace("usecond", "nsecond"))
    assert profile_report.main([str(raw), str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["kernels"][0]["duration_us"] == 0.6845
    raw.write_text("==PROF== nothing profiled\n")
    assert profile_report.main([str(raw), str(tmp_path / "p.json")]) == 1
    assert profile_report.main([str(raw)]) == 2


def test_profile_cases_run_small_on_cpu_tensors():
    """Each case's forward and backward, at a few rows: cuda through the host harness, triton in
    Triton's interpreter (nothing profiled: a check of the script)."""
    env = dict(os.environ, ATTNX_CUDA_ON_CPU="1", TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "scripts/gpu_profile_cases.py", "--small"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == [w for n in ("additive-cuda", "sdpa-d128-cuda", "sdpa-d64-cuda",
                                               "sdpa-d128-triton") for w in (n + ":", "ran")]
    res = subprocess.run([sys.executable, "scripts/gpu_profile_cases.py", "nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "unknown cases ['nope']" in res.stderr


# ---------------------------------------------------------------- benchmarks/gpu.py


def _args(*argv):
    p = bench.parser()
    args = p.parse_args(list(argv))
    bench.validate(args, p)
    return args


def test_flops_are_counted_as_flash_attention_counts_them():
    case = Case("sdpa", 2, 16, 1024, 1024, 128, 128, True, "bfloat16", "cuda")
    fwd = bench.result_row(case, "forward", "x", {"median_ms": 2.0, "min_ms": 1.0, "max_ms": 4.0})
    assert fwd["flops"] == 4 * 2 * 16 * 1024 * 1024 * 128 / 2
    assert fwd["tflops"] == pytest.approx(fwd["flops"] / 2e-3 / 1e12)
    assert fwd["tflops_min_max"] == pytest.approx([fwd["flops"] / 4e-3 / 1e12, fwd["flops"] / 1e-3 / 1e12])
    bwd = bench.result_row(case, "backward", "x", {"median_ms": 2.0, "min_ms": 1.0, "max_ms": 4.0})
    assert bwd["flops"] == 2.5 * fwd["flops"]
    full = Case("sdpa", 2, 16, 1024, 1024, 128, 128, False, "bfloat16", "cuda")
    assert bench.result_row(full, "forward", "x", {"error": "e"})["flops"] == 2 * fwd["flops"]
    assert "tflops" not in bench.result_row(full, "forward", "x", {"error": "e"})


def test_default_work_covers_the_sweep_most_important_first():
    items = bench.work(_args())
    assert len(items) == 2 * 2 * 6 * 2 * 2  # dtypes x head dims x lengths x causal x passes
    first = items[0][0]
    assert (first.dtype, first.head_dim, first.seqlen_q) == ("bfloat16", 128, 512)
    assert {c.seqlen_q for c, _ in items} == {512, 1024, 2048, 4096, 8192, 16384}
    assert all(c.batch * c.seqlen_q == 16384 and c.heads * c.head_dim == 2048 for c, _ in items)
    assert {p for _, p in items} == {"forward", "backward"} and {c.causal for c, _ in items} == {False, True}
    assert items[-1][0].dtype == "float16" and items[-1][0].head_dim == 64


@pytest.mark.parametrize("argv", [("--dtypes", "fp8"), ("--passes", "sideways"),
                                  ("--providers", "nope"), ("--seqlens", "0")])
def test_benchmark_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as exc:
        _args(*argv)
    assert exc.value.code == 2


def test_benchmark_stops_at_its_deadline_and_keeps_what_it_measured():
    items = bench.work(_args("--dtypes", "bf16", "--head-dims", "64", "--seqlens", "512,1024"))
    now = [0.0]

    def measure(case, pass_):
        now[0] += 10.0
        return [bench.result_row(case, pass_, "p", {"median_ms": 1.0, "min_ms": 1.0, "max_ms": 1.0})]

    written = []
    end = bench.run(items, measure, written.append, deadline_s=25.0, clock=lambda: now[0])
    assert end["measured"] == 3 and len(end["not_measured"]) == len(items) - 3
    assert [r["kind"] for r in written] == ["result"] * 3 + ["end"]
    assert "L=1024" in end["not_measured"][-1]


def test_benchmark_table_and_ratios(tmp_path, capsys):
    rows = []
    for provider, tf in (("attnx-triton", 300.0), ("torch-flash", 400.0), ("torch-cudnn", 500.0)):
        for length in (512, 4096):
            case = Case("sdpa", 1, 16, length, length, 128, 128, False, "bfloat16", "cuda")
            row = bench.result_row(case, "forward", provider,
                                   {"median_ms": 1.0, "min_ms": 1.0, "max_ms": 1.0})
            row["tflops"] = tf
            rows.append(row)
    rows.append(bench.result_row(case, "backward", "attnx-cuda", {"error": "no kernel"}))
    path = tmp_path / "b.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "res')
    text = bench.table(bench.read_jsonl(str(path)))
    assert "| bfloat16 | 128 | no | forward | torch-cudnn | 500.0 | 500.0 |" in text
    assert "| bfloat16 | 128 | no | forward | attnx-triton | 0.60 | 0.60 |" in text  # over cuDNN
    assert "| bfloat16 | 128 | no | backward | attnx-cuda | - | err |" in text
    assert "| bfloat16 | 128 | no | backward | attnx-cuda | - | - |" in text  # only in the ratios
    assert bench.main(["--table", str(path)]) == 0 and text in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_benchmark_without_a_gpu_says_so(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path / "x.jsonl")]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()
    assert bench.main(["--plan"]) == 0
    assert capsys.readouterr().out.strip().endswith("96 measurements x 5 providers")


# ---------------------------------------------------------------- benchmarks/gpu_decode.py

decode = _load("gpu_decode", "benchmarks/gpu_decode.py")


def test_decode_plan_and_bytes(capsys):
    assert decode.main(["--plan", "--dtypes", "bf16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("bf16 B=1 L=32768") and lines[-1] == "9 cases x 5 providers"
    # K and V of one full sequence: Hkv 8 x L x 2 x D 128 x 2 bytes
    assert decode.kv_bytes(1, 2048) == 8 * 2048 * 2 * 128 * 2


def test_decode_bad_dtypes_and_no_gpu(capsys):
    with pytest.raises(SystemExit):
        decode.main(["--plan", "--dtypes", "fp32"])
    if not HAS_GPU:
        assert decode.main(["--out", "unused.jsonl"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


# ---------------------------------------------------------------- benchmarks/gpu_varlen.py

varlen_bench = _load("gpu_varlen", "benchmarks/gpu_varlen.py")


def test_varlen_plan_lengths_and_flops(capsys):
    lens = varlen_bench.lengths(16384)
    assert sum(lens) == 16384 and lens == varlen_bench.lengths(16384)  # fixed by its seed
    assert all(varlen_bench.SHORTEST <= n <= varlen_bench.LONGEST for n in lens[:-1])
    assert varlen_bench.lengths(10) == [10]
    # causal forward 4 Hq D sum L^2 / 2, the step 3.5x that
    assert varlen_bench.flops([2, 3], 64, "forward") == 4 * 16 * 64 * 13 / 2
    assert varlen_bench.flops([2, 3], 64, "step") == 3.5 * 4 * 16 * 64 * 13 / 2
    assert varlen_bench.main(["--plan", "--dtypes", "bf16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("bf16 D=128 step") and out[-1] == "4 cases x 4 providers"
    with pytest.raises(SystemExit):
        varlen_bench.main(["--plan", "--providers", "flash"])


def test_varlen_providers_agree_on_the_cpu():
    """The padded peer's packing and unpacking, against attnx's varlen reference on the CPU
    (the GPU run checks every provider against it before timing)."""
    lens = [5, 1, 9]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(15, 16, 8, generator=g)
    k, v = (torch.randn(15, 4, 8, generator=g) for _ in range(2))
    fns = varlen_bench._providers(lens, q, k, v)
    want = fns["torch-sdpa-padded"](q, k, v)
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    got = attnx.varlen_attention(q, k, v, cu, cu, is_causal=True, backend="reference")
    torch.testing.assert_close(want, got, atol=1e-5, rtol=1e-5)


def test_autotune_choices_name_each_kernel_key_and_config(monkeypatch):
    """The bench's "autotune" rows: what each attnx Triton autotuner picked, per key."""
    triton = pytest.importorskip("triton")
    from attnx.triton import sdpa

    chosen = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2)
    monkeypatch.setattr(sdpa._dq_kernel, "cache", {(1024, "torch.bfloat16"): chosen})
    rows = [r for r in bench.autotune_choices() if r["kernel"] == "sdpa._dq_kernel"]
    assert rows == [{"kind": "autotune", "kernel": "sdpa._dq_kernel",
                     "key": ["1024", "torch.bfloat16"],
                     "config": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}}]
