"""The `cuda` backend: the CUDA C++ kernels of `csrc/cuda/`, the default for CUDA tensors.

What the kernels serve (keep in step with csrc/cuda/): float16 and bfloat16; SDPA head dims
E, Ev up to 256 (kernels are built for the families 64, 128 and 256 and zero-pad below them);
additive value dims up to 2048 (the output tile lives in shared memory); at most 65535 batches
and heads (the CUDA grid's y and z dims); a GPU of compute capability 8.0 or more with at least
MIN_SHARED_MEMORY bytes of shared memory per block (A100, H100, H200, B200; not the 99 KB of
sm86/sm89/sm120 parts), which the largest SDPA tiles (backward, head dims 65-128) need.

With ATTNX_CUDA_ON_CPU=1 (a testing switch, read at each call) the backend takes CPU tensors
instead and runs the same kernels' source through the host harness (attnx._cuda_host,
csrc/cuda/host/): slow, and never chosen by backend=None, which tries it for CUDA tensors only.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .. import _ops
from . import native

DTYPES = (torch.float16, torch.bfloat16)
MAX_SDPA_HEAD_DIM = 256
MAX_ADDITIVE_VALUE_DIM = 2048
MAX_GRID_YZ = 65535
MIN_SHARED_MEMORY = 157184  # bytes, csrc/cuda/sdpa_bwd.cuh Config<128>::smem_bytes


def _device_reason(device: torch.device) -> Optional[str]:
    props = torch.cuda.get_device_properties(device)
    if props.major < 8:
        return f"the cuda backend needs compute capability 8.0+, got {props.major}.{props.minor}"
    smem = getattr(props, "shared_memory_per_block_optin", MIN_SHARED_MEMORY)
    if smem < MIN_SHARED_MEMORY:
        return (f"the cuda backend needs {MIN_SHARED_MEMORY} bytes of shared memory per block, "
                f"{props.name} has {smem}")
    return None


def on_cpu() -> bool:
    """Whether ATTNX_CUDA_ON_CPU=1 sends the backend's calls through the host harness."""
    return os.environ.get("ATTNX_CUDA_ON_CPU") == "1"


def _ops_library():
    return torch.ops.attnx_cuda_host if on_cpu() else torch.ops.attnx


def sdpa(call):
    return native.sdpa(call, _ops_library())


def additive(call):
    return native.additive(call, _ops_library())


def availability() -> Optional[str]:
    if on_cpu():
        return _ops.cuda_host()
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    return native.missing_kernel("sdpa", "CUDA")


def unsupported(op: str, call) -> Optional[str]:
    if on_cpu():
        if call.q.device.type != "cpu":
            return f"with ATTNX_CUDA_ON_CPU=1 the cuda backend takes CPU tensors, got {call.q.device}"
    elif call.q.device.type != "cuda":
        return f"the cuda backend takes CUDA tensors, got device {call.q.device}"
    if call.q.dtype not in DTYPES:
        return f"the cuda backend takes float16 and bfloat16, got {call.q.dtype}"
    reason = availability() if on_cpu() else _device_reason(call.q.device)
    if reason is not None:
        return reason
    b, h = call.q.shape[:2]
    if b > MAX_GRID_YZ or h > MAX_GRID_YZ:
        return f"the cuda backend takes at most {MAX_GRID_YZ} batches and heads, got ({b}, {h})"
    if op == "sdpa":
        dims = (call.q.shape[-1], call.v.shape[-1])
        if max(dims) > MAX_SDPA_HEAD_DIM:
            return f"the cuda backend takes head dims up to {MAX_SDPA_HEAD_DIM}, got (E, Ev) = {dims}"
    elif call.value.shape[-1] > MAX_ADDITIVE_VALUE_DIM:
        return (f"the cuda backend takes additive value dims up to {MAX_ADDITIVE_VALUE_DIM}, "
                f"got {call.value.shape[-1]}")
    return None if on_cpu() else native.missing_kernel(op, "CUDA")
