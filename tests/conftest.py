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


@pytest.fixture(autouse=True)
def _cuda_harness(request, monkeypatch):
    """A case parametrized with backend "cuda" runs through the host harness without a GPU
    (tests/_backends.py)."""
    callspec = getattr(request.node, "callspec", None)
    if (not torch.cuda.is_available() and callspec is not None
            and callspec.params.get("backend") == "cuda"):
        monkeypatch.setenv("ATTNX_CUDA_ON_CPU", "1")
