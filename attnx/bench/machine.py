"""What the numbers were measured on: device, software versions, and the device's GEMM rate."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

import torch

import attnx
# attnx.backends() is shadowed by the attnx.backends package once a backend module is imported
from attnx._dispatch import backends as backend_status

from ..info import cpu_description
from . import timing


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return cpu_description().get("model_name") or platform.processor() or platform.machine()


def cpu_kernels() -> dict:
    """What attnx's CPU kernels run on here: the float32 GEMM engine, the instruction set of the
    row operations and the micro-kernel, the micro-kernel's strip height, and how each was chosen
    (measured at first use, or fixed by the environment: csrc/cpu/cpu_choice.h; the same build
    runs differently on Zen 3, Zen 4 and Intel), with the CPU as Linux names it (vendor, model,
    ISA, caches)."""
    built = attnx._ops.build_info() or {}
    return {"gemm": built.get("cpu_gemm"), "vector": built.get("cpu_vector"),
            "strip_rows": built.get("cpu_strip_rows"), "choice": built.get("cpu_choice"),
            "cpu": cpu_description()}


def git_commit() -> str | None:
    """The commit of the attnx source tree, when it is a git checkout."""
    here = os.path.dirname(os.path.abspath(attnx.__file__))
    try:
        res = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return res.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _triton_version() -> str | None:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


def describe(device: str) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": {"type": device, "name": device_name(device),
                   "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                   "attnx_cpu_kernels": cpu_kernels()},
        "software": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "cuda": torch.version.cuda, "triton": _triton_version(),
                     "attnx": attnx.__version__, "attnx_git_commit": git_commit(),
                     "attnx_backends": {k: {"usable": s.usable, "reason": s.reason}
                                        for k, s in backend_status().items()}},
    }


def load_average():
    """1, 5 and 15-minute load averages: other work on the machine skews CPU timings."""
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def gemm_rate(device: str, repeats: int, small: bool = False) -> dict:
    """The device's dense GEMM rate: an n^3 float32 GEMM on CPU (n=2048), bf16 on GPU (n=8192,
    large enough to reach the tensor cores' sustained rate); half the size when `small`."""
    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (2048, torch.float32)
    n = n // 2 if small else n
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = timing.interleaved({"gemm": lambda: torch.mm(a, b)}, device, repeats)["gemm"]
    flops = 2.0 * n ** 3
    return {"shape": [n, n, n], "dtype": str(dtype).replace("torch.", ""),
            "flops": flops, "time": t.as_dict(), "flops_per_s": flops / t.median}
