import os
import sys

import pytest
import torch

# The Triton kernels are tested on every machine: through Triton's interpreter when there is no
# GPU. It must be switched on before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
