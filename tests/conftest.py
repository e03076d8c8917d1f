import os
import sys

import pytest
import torch

# The Triton kernels are tested on every machine: through Triton's interpreter when there is no
# GPU. It must be switched on before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite's own process runs the panel engine and AVX-512 bodies wherever the CPU has them,
# whatever the first-use measurement would pick (csrc/cpu/cpu_choice.h): the other engine and
# width are tested by the ATTNX_CPU_PANELS=0 / ATTNX_CPU_AVX512=0 reruns (tests/_rerun.py), and
# the measured choice itself by tests/test_cpu_choice.py.
os.environ.setdefault("ATTNX_CPU_PANELS", "1")
os.environ.setdefault("ATTNX_CPU_AVX512", "1")

# Test helpers (golden.py, _compare.py) are imported by their plain names.
sys.path.insert(0, os.path.dirname(__file__))

# Under the interpreter every Triton load and store is bounds-checked (tests/_triton_memcheck.py):
# what compute-sanitizer would report on a GPU fails the test here.
if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"):
    try:
        import _triton_memcheck
    except ImportError:  # no Triton: its tests skip themselves
        pass
    else:
        _triton_memcheck.install()


@pytest.fixture(autouse=True)
def _cuda_harness(request, monkeypatch):
    """A case parametrized with backend "cuda" runs through the host harness without a GPU
    (tests/_backends.py)."""
    callspec = getattr(request.node, "callspec", None)
    if (not torch.cuda.is_available() and callspec is not None
            and callspec.params.get("backend") == "cuda"):
        monkeypatch.setenv("ATTNX_CUDA_ON_CPU", "1")


# On a GPU machine (scripts/gpu_check.sh) a failing kernel must not cost the rest of the run:
# an illegal memory access leaves the process's CUDA context unusable, so every later test of
# that process would fail for it. After each test the context is checked; a broken one ends the
# process (pytest-xdist reports the test as crashed and starts a fresh worker) or, without
# xdist, the session, naming the test.
@pytest.fixture(autouse=True)
def _cuda_context_survives():
    yield
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:  # sticky: every later CUDA call fails the same way
        message = f"the CUDA context is unusable after this test: {exc}"
        if os.environ.get("PYTEST_XDIST_WORKER"):
            print(message, file=sys.stderr, flush=True)
            os._exit(3)
        pytest.exit(message, returncode=3)


# The longest files run first: those whose module fixtures take minutes (the Triton AOT compile
# of every kernel, cuobjdump over the CUDA cubins), then the kernels under the Triton interpreter
# and the CUDA host harness (4-8 minutes each on 2 cores). Under pytest-xdist (`-n auto --dist
# loadfile`: CI and the README's command) each worker takes whole files in collection order
# (xdist's own order, most tests first, is switched off), so these start beside each other
# and the short files fill in after them, instead of one long file ending the run alone (3
# minutes of the 19 on a 2-core Zen 4 when test_triton.py came last in alphabetical order).
_LONG_FILES = ("test_triton_compile.py", "test_cuda_resources.py", "test_triton.py",
               "test_cuda.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --no-loadscope-reorder
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(_LONG_FILES)))  # stable


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, at most 8 (each holds torch and Triton, ~1.4 GB; whole files
    are dealt, and past 8 workers the longest file bounds the run)."""
    return max(1, min(os.cpu_count() or 1, 8))


def pytest_runtest_logreport(report):
    """ATTNX_REPORT_FAILURES_AT_ONCE=1: a failure's traceback is printed when it happens, not
    in the summary at the end, which a run stopped by its time limit never prints (under
    pytest-xdist this runs in the controller, for every worker's reports)."""
    if (report.failed and os.environ.get("ATTNX_REPORT_FAILURES_AT_ONCE") == "1"
            and not os.environ.get("PYTEST_XDIST_WORKER")):
        print(f"\n----- {report.nodeid} ({report.when}) failed:\n{report.longreprtext}\n",
              file=sys.stderr, flush=True)
