"""Every GPU autotuning config of the Triton SDPA kernels, each run alone, against the float64
reference.

On a GPU the autotuner runs one config per shape bucket, and in Triton's interpreter the
kernels take one small 16x16 config, so most of the GPU's configs (BLOCK_M up to 128, BLOCK_N
up to 128, BLOCK_M != BLOCK_N) had never been executed when the first GPU session (H100,
2026-11-26) saw an illegal memory access in float32 runs. Here each config of each kernel
(forward, row sums, dK/dV, dQ) is pinned in turn, the other kernels on their smallest config,
on shapes that cross the configs' block edges (Lk = 1, lengths off every block size, a GQA
float mask under a window). Under the interpreter every load and store is bounds-checked
(tests/_triton_memcheck.py); on a GPU (scripts/gpu_check.sh, CUDA_LAUNCH_BLOCKING=1) a config
that faults fails its own case, and one that does not fit the device's shared memory skips.
"""

from __future__ import annotations

import pytest
import torch

from test_triton import DEVICE, INTERPRET, check_sdpa  # skips the module without Triton

import triton  # noqa: E402
from attnx.triton import common, sdpa as ts  # noqa: E402

KERNELS = {  # name: (autotuned kernel, its GPU configs' (BLOCK_M, BLOCK_N, warps, stages))
    "fwd": (ts._fwd_kernel, ts._FWD_SHAPES),
    "sums": (ts._prep_kernel, ts._SUMS_SHAPES),
    "dkdv": (ts._dkdv_kernel, ts._DKDV_SHAPES),
    "dq": (ts._dq_kernel, ts._DQ_SHAPES),
}
SMALLEST = common.gpu_configs([(16, 16, 4, 1)])

# (dtype, B, Hq, Hkv, Lq, Lk, E, Ev, extra check_sdpa arguments): the first two are the shapes
# of the two float32 tests that faulted on the H100 (test_triton.py's test_sdpa_plain[f32] and
# test_sdpa_odd_sizes_and_head_dims[33-1-64-16]), the third a GQA float mask under a window.
SHAPES = {
    "plain-f32": (torch.float32, 2, 2, 2, 17, 33, 24, 24, {}),
    "one-key-f32": (torch.float32, 1, 2, 2, 33, 1, 64, 16, {}),
    "float-mask-window-gqa-f16": (torch.float16, 1, 2, 1, 20, 130, 40, 40,
                                  dict(mask_kind="float", mask_shape=(1, 2, 20, 130),
                                       window=(100, 30))),
}


def _cases():
    for name, (_, shapes) in KERNELS.items():
        for config in shapes:
            for shape in SHAPES:
                yield pytest.param(name, config, shape,
                                   id=f"{name}-{'x'.join(map(str, config))}-{shape}")


@pytest.fixture
def pinned(monkeypatch):
    """pin(name, config): that kernel runs `config` alone, the others their smallest config."""
    def pin(name, config):
        for other, (kernel, _) in KERNELS.items():
            chosen = common.gpu_configs([config]) if other == name else SMALLEST
            monkeypatch.setattr(kernel, "configs", chosen)
    return pin


@pytest.mark.parametrize("kernel,config,shape", list(_cases()))
def test_every_config_matches_the_reference(pinned, kernel, config, shape):
    dtype, b, hq, hkv, lq, lk, e, ev, extra = SHAPES[shape]
    pinned(kernel, config)
    try:
        check_sdpa(dtype, b, hq, hkv, lq, lk, e, ev, **extra)
    except triton.runtime.errors.OutOfResources as exc:  # only compiled code has limits
        pytest.skip(f"does not fit this device: {exc}")


@pytest.mark.skipif(not INTERPRET, reason="checks the interpreter's bounds check")
def test_the_interpreter_memcheck_catches_an_access_past_a_tensor():
    """The check can fail: a kernel reading one element past its input, or writing two past its
    output, raises."""
    import triton.language as tl

    @triton.jit
    def _copy(X, Y, SHIFT_IN: tl.constexpr, SHIFT_OUT: tl.constexpr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(Y + offs + SHIFT_OUT, tl.load(X + offs + SHIFT_IN))

    x, y = torch.arange(16.0, device=DEVICE), torch.empty(16, device=DEVICE)
    _copy[(1,)](x, y, 0, 0, 16)
    assert torch.equal(x, y)
    with pytest.raises(Exception, match="memcheck: load of 1 lane"):
        _copy[(1,)](x, y, 1, 0, 16)
    with pytest.raises(Exception, match="memcheck: store of 2 lane"):
        _copy[(1,)](torch.arange(32.0, device=DEVICE), y, 0, 2, 16)
