"""`attnx info`: what this installation is built with and which backends can run here."""

from __future__ import annotations

import glob
import os
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


# The vector extensions the CPU kernels can use (csrc/cpu/cpu_choice.h), as /proc/cpuinfo names
# them.
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16",
              "avx512_fp16", "amx_tile")


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def cpu_description() -> dict:
    """The CPU as Linux names it: vendor, model name, family and model numbers, the vector
    extensions attnx's CPU kernels can use and the cache sizes of CPU 0 (what results files
    record and `attnx info` prints). Fields Linux does not give are left out."""
    out: dict = {}
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]
    except OSError:
        return {"model_name": platform.processor() or platform.machine()}
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    for key, name in (("vendor_id", "vendor"), ("model name", "model_name"),
                      ("cpu family", "family"), ("model", "model")):
        if key in fields:
            out[name] = fields[key]
    flags = set(fields.get("flags", "").split())
    out["isa"] = [f for f in _ISA_FLAGS if f in flags]
    caches = {}
    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            level, kind, size = (_read(os.path.join(index, f)) for f in ("level", "type", "size"))
        except OSError:
            continue
        suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
        caches[f"L{level}{suffix}"] = size
    if caches:
        out["caches"] = caches
    return out


def _cpu_line(cpu: dict) -> str:
    ident = ", ".join(x for x in (cpu.get("vendor"), f"family {cpu['family']} model {cpu['model']}"
                                  if "family" in cpu and "model" in cpu else None) if x)
    caches = ", ".join(f"{k} {v}" for k, v in cpu.get("caches", {}).items() if k != "L1i")
    parts = [p for p in (ident, " ".join(cpu.get("isa", [])), caches) if p]
    return f"{cpu.get('model_name', '?')} ({'; '.join(parts)})"


def _choice_line(built: dict) -> str:
    """The CPU kernels' choices (csrc/cpu/cpu_choice.h) and what each was chosen by."""
    how = built.get("cpu_choice", {})
    gemm = f"{built.get('cpu_gemm')} ({how.get('gemm', '?')}"
    if "gemm_seconds" in how:
        t = how["gemm_seconds"]
        gemm += (f": a small forward and backward {t['panels'] * 1e3:.2f} ms on the panels, "
                 f"{t['blas'] * 1e3:.2f} on BLAS")
    vector = f"{built.get('cpu_vector')} ({how.get('vector', '?')}"
    if "vector_seconds" in how:
        t = how["vector_seconds"]
        vector += (f": a tile's products {t['avx512'] * 1e6:.1f} us on AVX-512, "
                   f"{t['avx2'] * 1e6:.1f} on AVX2")
    line = f"float32 GEMM {gemm}), vector ISA {vector})"
    if built.get("cpu_vector") == "avx512":
        rows = f"{built.get('cpu_strip_rows')} ({how.get('strip_rows', '?')}"
        if "strip_seconds" in how:
            t = how["strip_seconds"]
            rows += (f": a tile's products {t['12'] * 1e6:.1f} us in 12-row strips, "
                     f"{t['6'] * 1e6:.1f} in 6-row")
        line += f", strips of {rows})"
    return line


def report() -> str:
    built = _ops.build_info()
    if built:
        ext = "built for torch {}, {}, OpenMP {}".format(
            built["torch"],
            f"CUDA {built['cuda_version']} (archs {built['cuda_archs']})" if built["cuda"] else "without CUDA",
            "on" if built["openmp"] else "off")
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
        f"CPU        {_cpu_line(cpu_description())}",
        f"extension  {ext}",
        "backends:",
    ]
    if built:
        lines.insert(-1, f"CPU kernels {_choice_line(built)}")
    for name, status in backends().items():
        lines.append(f"  {name:<10} {'usable' if status.usable else 'unusable: ' + status.reason}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse
    import sys

    argparse.ArgumentParser(prog="attnx info", description="what is built and usable here").parse_args(
        sys.argv[1:] if argv is None else argv)
    print(report())
    return 0
