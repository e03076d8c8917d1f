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
that faults fails its own case, and one that does not fit the device's shared memory skips. A
config the pruning never runs for a shape's dtype (common.warps_fit: fp32 over 8 warps and
fewer than 128 rows, which faulted or miscomputed on an H200) is not a case.
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
ROWS_AT = {"fwd": 0, "sums": 0, "dkdv": 1, "dq": 0}  # the config's block of accumulator rows
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
    """Every config on every shape, but those the pruning never runs for the shape's dtype
    (common.warps_fit)."""
    for name, (_, shapes) in KERNELS.items():
        for config in shapes:
            for shape in SHAPES:
                if common.warps_fit(SHAPES[shape][0].itemsize, config[2], config[ROWS_AT[name]]):
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


def _kept(kernel, arch, monkeypatch, dtype=torch.bfloat16, head=128, groups=1, per=1,
          mask_kind=0, autotune=True):
    """The (BLOCK_M, BLOCK_N, warps, stages) the autotuner's pruning keeps for a call on sm_<arch>
    (its shared memory and arch), of every GPU config; ATTNX_TRITON_AUTOTUNE=0 unless
    `autotune` (whatever the environment: gpu_check.sh's test step sets it)."""
    auto, shapes = KERNELS[kernel]
    if autotune:
        monkeypatch.delenv("ATTNX_TRITON_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("ATTNX_TRITON_AUTOTUNE", "0")
    monkeypatch.setattr(common, "shared_memory_limit", lambda: {80: 166912, 90: 232448}[arch])
    monkeypatch.setattr(common, "target_arch", lambda: arch)
    q = torch.empty(1, dtype=dtype)
    named = {"Q": q, "M": torch.empty(1, dtype=torch.bool)}
    meta = dict(BLOCK_D=head, BLOCK_D2=0, BLOCK_DV=head, BLOCK_DV2=0, MASK_KIND=mask_kind,
                DROPOUT=False, GROUPS=groups, PER=per, SOFTCAP=False, ALIBI=False, VARLEN=False)
    kept = auto.early_config_prune(common.gpu_configs(shapes), named, **meta)
    return {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept}


def test_sm90_keeps_the_wide_backward_tiles_its_compiles_fit(monkeypatch):
    """On sm_90 the backward's autotuners also keep the wgmma-wide tiles that compile there
    without spills (sdpa._dkdv_sm90_fits / _dq_sm90_fits: 32 queries x 128 keys for dK/dV,
    128 x 64 for dQ), which the register rule refuses (it counts wgmma's shared-memory operands
    as registers); not on sm_80, not for fp32, and dK/dV not where a program loops over several
    query heads of a GQA group (PER > 1: that spills) nor with 128 keys and a mask at head
    block 128."""
    wide_dkdv, wide_dq = (32, 128, 8, 3), (128, 64, 8, 2)
    assert wide_dkdv in _kept("dkdv", 90, monkeypatch)
    assert wide_dq in _kept("dq", 90, monkeypatch)
    assert {(64, 64, 8, 3), (64, 128, 8, 3)} <= _kept("dkdv", 90, monkeypatch,
                                                     dtype=torch.float16, head=64)
    assert (64, 128, 8, 3) not in _kept("dkdv", 90, monkeypatch, head=64, mask_kind=1)
    assert wide_dkdv not in _kept("dkdv", 80, monkeypatch)
    assert wide_dq not in _kept("dq", 80, monkeypatch)
    assert wide_dkdv not in _kept("dkdv", 90, monkeypatch, dtype=torch.float32)
    assert wide_dkdv not in _kept("dkdv", 90, monkeypatch, groups=4, per=4)
    assert wide_dkdv in _kept("dkdv", 90, monkeypatch, groups=4, per=1)
    assert wide_dq in _kept("dq", 90, monkeypatch, groups=4)
    assert wide_dkdv not in _kept("dkdv", 90, monkeypatch, head=256)
    assert wide_dkdv not in _kept("dkdv", 90, monkeypatch, mask_kind=1)
    assert (32, 64, 8, 3) in _kept("dkdv", 90, monkeypatch, mask_kind=1)
    assert wide_dkdv in _kept("dkdv", 90, monkeypatch, head=64, mask_kind=1)
    assert wide_dq in _kept("dq", 90, monkeypatch, mask_kind=1)
    # the register rule's own configs stay
    assert (16, 64, 8, 2) in _kept("dkdv", 90, monkeypatch)


@pytest.mark.parametrize("arch", [80, 90])
def test_fp32_keeps_eight_warps_only_over_128_rows(monkeypatch, arch):
    """fp32's 8-warp configs over fewer than 128 accumulator rows (dK/dV: keys; dQ and the
    forward: queries) faulted or miscomputed on an H200 (common.warps_fit); the
    4-warp configs and the 128-row 8-warp ones stay."""
    for kernel, rows_at in ROWS_AT.items():
        for head in (16, 64):
            kept = _kept(kernel, arch, monkeypatch, dtype=torch.float32, head=head)
            assert kept and all(c[2] <= 4 or c[rows_at] >= 128 for c in kept), (kernel, head, kept)
            assert any(c[2] == 4 for c in kept), (kernel, head, kept)
    assert (32, 128, 8, 3) in _kept("dkdv", arch, monkeypatch, dtype=torch.float32, head=16)
    half = _kept("dkdv", arch, monkeypatch, dtype=torch.float16, head=64)
    assert any(c[2] == 8 and c[1] < 128 for c in half)  # 16-bit inputs keep them


def test_autotune_off_keeps_the_first_config(monkeypatch):
    """ATTNX_TRITON_AUTOTUNE=0 (scripts/gpu_check.sh's test step): one config, nothing to tune."""
    every = _kept("dq", 90, monkeypatch)
    first = _kept("dq", 90, monkeypatch, autotune=False)
    assert len(every) > 1 and len(first) == 1 and first <= every
