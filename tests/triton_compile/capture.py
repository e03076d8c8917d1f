"""Every kernel launch the attnx Triton ops make for one variant, recorded instead of run.

The ops are called on CPU tensors in a process without TRITON_INTERPRET, with
`attnx.triton.common.launcher` replaced by a recorder: the arguments, constexprs, grids and the
autotuner's configs (after its own pruning) are what a GPU launch of the same call would see.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, Optional

import torch
import triton

from attnx.triton import additive, common, decode, sdpa, varlen

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One call of an op: the kernels' constexprs follow from these fields."""
    op: str                 # "sdpa", "additive", "kvcache" or "varlen"
    dtype: str              # key of DTYPES
    head_dim: int           # E = Ev for sdpa; A = Ev for additive
    mask: str = "none"      # "none", "bool", "float" (q's dtype), "float32" (float masks also
                            # take their gradient, of the mask's dtype)
    dropout: bool = False
    gqa: bool = False       # sdpa, varlen: 4 query heads on 2 kv heads
    weights: bool = False   # additive: return_weights and a loss on them
    shared_v: bool = False  # additive, 16-bit: v given as (A,), which goes in as float32
    paged: bool = False     # kvcache: a paged cache (block table) instead of a contiguous one
    softcap: bool = False   # sdpa, kvcache, varlen: the score modifiers
    huge_cap: bool = False  # with softcap: a cap of 1e6, past attnx/triton/common.py
                            # EXACT_TANH_CAP (SOFTCAP = 2: tanh's exact branch in 16-bit kernels)
    alibi: bool = False
    sinks: bool = False

    @property
    def name(self) -> str:
        flags = [f for f in ("dropout", "gqa", "weights", "shared_v", "paged", "softcap",
                             "huge_cap", "alibi", "sinks") if getattr(self, f)]
        mask = [] if self.mask == "none" else [f"{self.mask}-mask"]
        return "/".join([self.op, self.dtype, f"d{self.head_dim}", *mask, *flags])


@dataclasses.dataclass
class Unit:
    """One compile: a kernel's JIT function, its bound arguments with one config applied."""
    kernel: str
    variant: Variant
    fn: Any                  # triton JITFunction
    args: dict               # every parameter by name (constexprs included)
    options: dict            # num_warps, num_stages, maxnreg
    config: dict             # the config's constexprs and options, for the report
    grid: tuple
    arch: int
    shared_estimate: Optional[int]  # the pruning rule's bytes (common.pruner), autotuned only
    launch: int = 0          # which of the variant's launches (a kernel may take several)


@dataclasses.dataclass
class Launch:
    """One recorded launch: `kernel[grid](*args, **kwargs)` (kernel an Autotuner or JIT function)."""
    kernel: Any
    grid: Any
    args: tuple
    kwargs: dict


class _Recorder:
    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid) -> Callable:
        return lambda *args, **kwargs: self.launches.append(Launch(self.kernel, grid, args, kwargs))


@contextlib.contextmanager
def recording(launches: list):
    """Within it, kernel launches of the ops append to `launches` instead of running."""
    real = common.launcher
    common.launcher = lambda kernel: _Recorder(kernel, launches)
    try:
        yield
    finally:
        common.launcher = real


L = 256  # a multiple of 16 like most real lengths: the JIT specialises divisibility


def _run_variant(v: Variant) -> None:
    dtype = DTYPES[v.dtype]
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape, dt=dtype: torch.randn(shape, generator=gen).to(dt)  # noqa: E731
    b, h, d = 1, 4 if v.gqa else 2, v.head_dim
    hkv = 2
    mask = None
    if v.mask == "bool":
        mask = torch.rand((b, h, L, L), generator=gen) > 0.3
    elif v.mask == "float":
        mask = rand(b, h, L, L)
    elif v.mask == "float32":  # torch's other float mask dtype, with any q
        mask = rand(b, h, L, L, dt=torch.float32)
    p = 0.1 if v.dropout else 0.0
    seed = torch.tensor([12345, 678], dtype=torch.int64) if v.dropout else None
    lo, hi = -L, L
    mask_grad = v.mask in ("float", "float32")
    qb = {"kvcache": 2, "varlen": 3}.get(v.op, b)  # the slopes' rows: batches or sequences
    mods = ((1e6 if v.huge_cap else 30.0) if v.softcap else None,
            torch.rand((qb, h), generator=gen) if v.alibi else None,
            torch.randn((h,), generator=gen) if v.sinks else None)
    if v.op == "kvcache":  # one decoding step (Lq = 1) of 2 sequences over a cache of L
        q = rand(2, h, 1, d)
        lens = torch.tensor([L - 3, L // 2], dtype=torch.int32)
        if v.paged:
            k, val = rand(2 * L // 16, hkv, 16, d), rand(2 * L // 16, hkv, 16, d)
            table = torch.randperm(2 * L // 16, generator=gen).view(2, L // 16).to(torch.int32)
        else:
            k, val, table = rand(2, hkv, L, d), rand(2, hkv, L, d), None
        decode.kvcache_fwd(q, k, val, lens, table, d ** -0.5, -L - 1, 0, *mods)
    elif v.op == "varlen":  # 3 sequences (L, L / 2 - 3, L / 4), Lq != Lk in the last, causal
        lq, lk = (L, L // 2 - 3, L // 4), (L, L // 2 - 3, L // 2)
        cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32)
                      for n in (lq, lk))
        q, k, val = rand(sum(lq), h, d), rand(sum(lk), hkv, d), rand(sum(lk), hkv, d)
        out, lse = varlen.varlen_fwd(q, k, val, cu_q, cu_k, L, L, d ** -0.5, -L, 0, p, seed,
                                     *mods)
        varlen.varlen_bwd(rand(sum(lq), h, d), q, k, val, cu_q, cu_k, L, L, rand(sum(lq), h, d),
                          torch.zeros(h, sum(lq)), d ** -0.5, -L, 0, p, seed,
                          torch.zeros(h, sum(lq)), *mods)
    elif v.op == "sdpa":
        q, k, val = rand(b, h, L, d), rand(b, hkv, L, d), rand(b, hkv, L, d)
        out, lse = sdpa.sdpa_fwd(q, k, val, mask, d ** -0.5, lo, hi, p, seed, *mods)
        sdpa.sdpa_bwd(rand(b, h, L, d), q, k, val, mask, rand(b, h, L, d),
                      torch.zeros(b, h, L), d ** -0.5, lo, hi, p, seed, mask_grad,
                      torch.zeros(b, h, L), *mods)
    else:
        q, k, val = rand(b, h, L, d), rand(b, h, L, d), rand(b, h, L, d)
        # a shared v: float32, broadcast over the heads (attnx/_validate.py additive_call)
        w = rand(1, d, dt=torch.float32).expand(h, d) if v.shared_v else rand(h, d)
        additive.additive_fwd(q, k, val, w, mask, lo, hi, p, seed, v.weights)
        additive.additive_bwd(rand(b, h, L, d), q, k, val, w, mask, rand(b, h, L, d),
                              torch.zeros(b, h, L), lo, hi, p, seed, mask_grad,
                              torch.zeros(b, h, L), rand(b, h, L, L) if v.weights else None)


def _units_of(launch: Launch, index: int, v: Variant, arch: int) -> list[Unit]:
    """The units of one launch: one per config its autotuner keeps for sm_<arch> (the launch's
    own options for a kernel that is not autotuned)."""
    kernel = launch.kernel
    if isinstance(kernel, triton.runtime.Autotuner):
        nargs = dict(zip(kernel.arg_names, launch.args))
        kernel.nargs = nargs
        configs = kernel.prune_configs(launch.kwargs)  # the autotuner's own pruning
        kernel.nargs = None
        needs = kernel.early_config_prune.needs  # common.pruner's shared-memory estimate
        fn = kernel.fn
        chosen = [({**c.kwargs}, dict(num_warps=c.num_warps, num_stages=c.num_stages,
                                      maxnreg=c.maxnreg),
                   needs(c, nargs, **launch.kwargs)) for c in configs]
    else:
        fn = kernel
        kwargs = dict(launch.kwargs)
        opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
        launch = dataclasses.replace(launch, kwargs=kwargs)
        chosen = [({}, opts, None)]
    units = []
    for consts, opts, estimate in chosen:
        args = dict(zip(fn.arg_names, launch.args))
        args.update(launch.kwargs)
        args.update(consts)
        grid = launch.grid(args) if callable(launch.grid) else launch.grid
        # The tile sizes a config picks (the head blocks follow from the variant).
        blocks = {k: args[k] for k in args
                  if k.startswith("BLOCK_") and k not in ("BLOCK_D", "BLOCK_D2", "BLOCK_DV",
                                                          "BLOCK_DV2")}
        name = f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"  # sdpa._fwd_kernel
        units.append(Unit(name, v, fn, args, opts, {**blocks, **opts}, tuple(grid), arch,
                          estimate, index))
    return units


# SMs of the A100 and the H100 SXM: the launches' GQA split (sdpa._gqa_split) counts them.
SMS = {80: 108, 90: 132}


@contextlib.contextmanager
def _device_limit(arch: int):
    """The ops and autotuners see sm_<arch>'s shared memory (common.shared_memory_limit), SM
    count (common.multiprocessors) and arch (common.target_arch)."""
    from .aot import SHARED_LIMIT
    real = common.shared_memory_limit, common.multiprocessors, common.target_arch
    common.shared_memory_limit = lambda: SHARED_LIMIT[arch]
    common.multiprocessors = lambda: SMS[arch]
    common.target_arch = lambda: arch
    try:
        yield
    finally:
        common.shared_memory_limit, common.multiprocessors, common.target_arch = real


def units(v: Variant, arch: int) -> list[Unit]:
    """The compile units of one variant for sm_<arch>: every launch x every config its
    autotuner may pick there."""
    launches: list[Launch] = []
    with recording(launches), torch.no_grad(), _device_limit(arch):
        _run_variant(v)
    with _device_limit(arch):
        return [u for i, launch in enumerate(launches) for u in _units_of(launch, i, v, arch)]
