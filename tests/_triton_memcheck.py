"""Out-of-bounds checking for Triton's interpreter: compute-sanitizer's memcheck, without a GPU.

The interpreter runs a kernel's loads and stores on host pointers and checks none of them: a
lane that reads past its tensor gets whatever memory lies there, and one that writes past it
corrupts it silently; on a GPU the same access is an illegal address or a wrong answer. With
`install()` (tests/conftest.py, under TRITON_INTERPRET=1) every load and store lane a mask lets
through must fall inside the storage of one of the launch's tensor arguments, or the launch
raises, naming the access and the first bad address.
"""

from __future__ import annotations

import numpy as np
from triton.runtime import interpreter

# [start, end) byte ranges of the storages of the running launch's tensor arguments
_ranges: list[tuple[int, int]] = []


def _check(ptrs, mask, what: str) -> None:
    addresses = np.asarray(ptrs.data, dtype=np.uint64)
    lanes = np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)
    used = addresses[lanes]
    if used.size == 0:
        return
    size = np.uint64(np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize)
    inside = np.zeros(used.shape, dtype=bool)
    for start, end in _ranges:
        inside |= (used >= np.uint64(start)) & (used + size <= np.uint64(end))
    if not inside.all():
        bad = int(used[~inside][0])
        spans = ", ".join(f"[{s:#x}, {e:#x})" for s, e in _ranges)
        raise AssertionError(f"Triton interpreter memcheck: {what} of {int((~inside).sum())} "
                             f"lane(s) outside every tensor argument, first at {bad:#x} "
                             f"(arguments: {spans})")


def install() -> None:
    """Patches the interpreter (once per process)."""
    if getattr(interpreter, "_attnx_memcheck", False):
        return
    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store
    init_args = interpreter.GridExecutor._init_args_hst

    def checked_load(self, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile):
        _check(ptrs, mask, "load")
        return load(self, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile)

    def checked_store(self, ptrs, value, mask, cache_modifier, eviction_policy):
        _check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, cache_modifier, eviction_policy)

    def args_with_ranges(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _ranges.clear()
        for arg in (*args_hst, *kwargs_hst.values()):
            if hasattr(arg, "untyped_storage"):
                storage = arg.untyped_storage()
                _ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        return args_hst, kwargs_hst

    builder.create_masked_load = checked_load
    builder.create_masked_store = checked_store
    interpreter.GridExecutor._init_args_hst = args_with_ranges
    interpreter._attnx_memcheck = True
