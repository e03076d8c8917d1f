"""Where the tests' inputs live per backend, and whether the cuda backend can run here.

Without a GPU the cuda backend's cases run on CPU tensors through the host harness
(ATTNX_CUDA_ON_CPU=1, csrc/cuda/host/): conftest.py switches it on for every test
parametrized with backend "cuda"; the triton backend runs in Triton's interpreter.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from attnx import _dispatch, _ops

ON_GPU = torch.cuda.is_available()  # else the cuda backend runs through the host harness
INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def cuda_reason() -> Optional[str]:
    """Why the cuda backend's cases cannot run here (None when they can)."""
    if ON_GPU:
        status = _dispatch.backends()["cuda"]
        return None if status.usable else status.reason
    return _ops.cuda_host()  # None once attnx._cuda_host is built and loaded


def device(backend: str) -> str:
    """Where a backend's inputs live: the triton backend takes CUDA tensors unless it is
    interpreting, the cuda backend unless it runs through the host harness."""
    gpu = (backend == "triton" and not INTERPRET) or (backend == "cuda" and ON_GPU)
    return "cuda" if gpu else "cpu"
