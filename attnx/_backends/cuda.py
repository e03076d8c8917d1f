"""The `cuda` backend: the CUDA C++ kernels of `csrc/cuda/`, the default for CUDA tensors.

What the kernels serve (keep in step with csrc/cuda/): float16 and bfloat16 (masks: bool or
q's dtype, and for additive attention float32 too, as its v shared by the heads is; an SDPA
call with a float32 mask goes to triton); SDPA head dims
E, Ev up to 256 (the forward is built for the head-dim families 32, 64, 96, 128, 160, 192 and
256, the backward for the same; each zero-pads below its family);
additive value dims up to 2048 (the output tile lives in shared memory); the SDPA score
modifiers softcap, alibi_slopes and sinks, in SDPA and decoding (sdpa_mod_fwd/bwd,
kvcache_mod_fwd: the kernels' kMods instantiations; sinks' gradient from the backward's delta on
the host); KV-cache decoding
(attention_with_kvcache, csrc/cuda/decode.cu) head dims E, Ev up to 256; packed batches
(varlen_attention: the SDPA kernels, one grid z index per sequence, with and without the
modifiers); at most 65535 batches (sequences) and heads (the CUDA grid's y and z dims); a GPU
of compute capability 8.0 or more whose opt-in shared memory per block holds what the call's
kernels request, decided per call.

The shared memory a launch requests is read from the extension (`attnx._C.cuda_smem_bytes`,
the kernels' own Config::smem_bytes), never restated in code here; the figures below are as of
this writing (benchmarks/results/cuda-compile.json has them as built). Bytes per block:

  forward family    32     64     96     128     160     192     256
  forward         30720  55296  79872  104448  86016  102400  135168
  backward family   32     64     96     128     160     192     256
  backward        41472  66048  58624  75008   96000   112384  145152
  additive: 27268 + 64 * Ev

The backward's families (csrc/cuda/launch.h kSdpaBwdFamilies), all on the mma.sync design, are
the forward's, so padding wastes at most 25% (193 padded to 256: 24.6%; 129 to 160: 19.4%).
A100/H100/H200/B200 (163-227 KB) take every call. The 99 KB parts (sm86, sm89, sm120: RTX
30xx/40xx/50xx, A10, L4; 101376 bytes) take the SDPA forward for head dims up to 96 and 129-160,
with autograd up to 96 and 129-160 (the backward up to 160 fits, the forward of 97-128 does
not), and
additive for Ev up to 1157; `unsupported` names the kernel and bytes of the rest, which go to the
triton backend. Smaller tiles for them are not built: tile sizes are compile-time constants of
one instantiation per family, so fitting 99 KB takes a second instantiation of each kernel,
doubling the compiled kernels and the build.

With ATTNX_CUDA_ON_CPU=1 (a testing switch, read at each call) the backend takes CPU tensors
instead and runs the same kernels' source through the host harness (attnx._cuda_host,
csrc/cuda/host/): slow, and never chosen by backend=None, which tries it for CUDA tensors only.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from .. import _ops
from . import native

DTYPES = (torch.float16, torch.bfloat16)
MAX_SDPA_HEAD_DIM = 256
MAX_ADDITIVE_VALUE_DIM = 2048
MAX_GRID_YZ = 65535


def _device_reason(device: torch.device) -> Optional[str]:
    """Why no call at all can run on `device`; shared memory is decided per call."""
    props = torch.cuda.get_device_properties(device)
    if props.major < 8:
        return f"the cuda backend needs compute capability 8.0+, got {props.major}.{props.minor}"
    return None


def _shared_memory_limit(device: torch.device) -> tuple:
    """(name, opt-in shared memory per block in bytes) of the device."""
    return _device_limit(torch.cuda._get_device_index(device, optional=True))


@functools.lru_cache(maxsize=None)
def _device_limit(index: int) -> tuple:
    props = torch.cuda.get_device_properties(index)
    return props.name, props.shared_memory_per_block_optin


def _needs_backward(op: str, call) -> bool:
    """Whether autograd will run the backward kernels of this call."""
    if op == "additive":
        tensors = (call.q, call.k, call.value, call.v, call.mask)
    else:  # sdpa, varlen (no mask)
        tensors = (call.q, call.k, call.v, getattr(call, "mask", None), call.mods.sinks)
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _shared_memory_needed(op: str, dim: int, backward: bool) -> tuple:
    """(bytes of shared memory per block, kernel) of the largest launch a call makes: `dim` is
    max(E, Ev) for "sdpa" and "varlen" (the same kernels), Ev for "additive" (whose backward
    requests what its forward does)."""
    kernels = ("additive",) if op == "additive" else (
        ("sdpa_fwd", "sdpa_bwd") if backward else ("sdpa_fwd",))
    return max((_ops._C.cuda_smem_bytes(k, dim), k) for k in kernels)


def _shared_memory_reason(op: str, call) -> Optional[str]:
    dim = call.value.shape[-1] if op == "additive" else max(call.q.shape[-1], call.v.shape[-1])
    need, kernel = _shared_memory_needed(op, dim, _needs_backward(op, call))
    name, limit = _shared_memory_limit(call.q.device)
    if need <= limit:
        return None
    return (f"the cuda backend's {kernel} kernel needs {need} bytes of shared memory per block "
            f"for this call (dim {dim}), {name} has {limit}: its tiles are sized for A100/H100 "
            "parts (attnx/_backends/cuda.py says which calls fit less)")


def on_cpu() -> bool:
    """Whether ATTNX_CUDA_ON_CPU=1 sends the backend's calls through the host harness."""
    return os.environ.get("ATTNX_CUDA_ON_CPU") == "1"


def _ops_library():
    return torch.ops.attnx_cuda_host if on_cpu() else torch.ops.attnx


def sdpa(call):
    return native.sdpa(call, _ops_library())


def additive(call):
    return native.additive(call, _ops_library())


def kvcache(call):
    return native.kvcache(call, _ops_library())


def varlen(call):
    return native.varlen(call, _ops_library())


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
    mask = getattr(call, "mask", None)
    if op == "sdpa" and mask is not None and mask.dtype not in (torch.bool, call.q.dtype):
        # the SDPA kernels read a float mask as q's dtype (csrc/cuda/kernel_ops.cpp mask_view)
        return (f"the cuda backend's SDPA takes a bool attn_mask or one of q's dtype "
                f"{call.q.dtype}, got {mask.dtype}")
    reason = availability() if on_cpu() else _device_reason(call.q.device)
    if reason is not None:
        return reason
    # varlen: one grid z index per sequence, q (total_q, Hq, E)
    b, h = (len(call.lens), call.q.shape[1]) if op == "varlen" else call.q.shape[:2]
    if b > MAX_GRID_YZ or h > MAX_GRID_YZ:
        what = "sequences" if op == "varlen" else "batches"
        return f"the cuda backend takes at most {MAX_GRID_YZ} {what} and heads, got ({b}, {h})"
    if op in ("sdpa", "kvcache", "varlen"):
        v = call.v_cache if op == "kvcache" else call.v
        dims = (call.q.shape[-1], v.shape[-1])
        if max(dims) > MAX_SDPA_HEAD_DIM:
            return f"the cuda backend takes head dims up to {MAX_SDPA_HEAD_DIM}, got (E, Ev) = {dims}"
    elif call.value.shape[-1] > MAX_ADDITIVE_VALUE_DIM:
        return (f"the cuda backend takes additive value dims up to {MAX_ADDITIVE_VALUE_DIM}, "
                f"got {call.value.shape[-1]}")
    if on_cpu():  # the harness: an H100's shared memory, no device to ask
        return None
    if op == "kvcache":  # its 51904 bytes at most (E = Ev = 256) fit every sm80+ part
        return native.missing_kernel(op, "CUDA")
    return native.missing_kernel(op, "CUDA") or _shared_memory_reason(op, call)
