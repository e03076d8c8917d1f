"""`attnx info`: what this installation is built with and which backends can run here."""

from __future__ import annotations

import platform

import torch

from . import _ops
from ._dispatch import backends
from ._version import __version__


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def report() -> str:
    built = _ops.build_info()
    if built:
        ext = "built for torch {}, {}, OpenMP {}".format(
            built["torch"],
            f"CUDA {built['cuda_version']} (archs {built['cuda_archs']})" if built["cuda"] else "without CUDA",
            "on" if built["openmp"] else "off")
        ext += (f", CPU float32 GEMM: {built.get('cpu_gemm')},"
                f" vector ISA (row operations, micro-kernel): {built.get('cpu_vector')}")
        if built["torch"] != torch.__version__:
            ext += f"  WARNING: running under torch {torch.__version__}; rebuild attnx"
    else:
        ext = _ops.LOAD_ERROR
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
    lines = [
        f"attnx      {__version__}",
        f"python     {platform.python_version()} ({platform.machine()})",
        f"torch      {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})",
        f"triton     {_triton_version()}",
        f"GPU        {gpu}",
        f"extension  {ext}",
        "backends:",
    ]
    for name, status in backends().items():
        lines.append(f"  {name:<10} {'usable' if status.usable else 'unusable: ' + status.reason}")
    return "\n".join(lines)


def main(argv=None) -> int:
    print(report())
    return 0
