"""Compiled resources of the CUDA kernels (csrc/cuda/), read from the built extension's cubins.

No GPU needed: for every kernel of every architecture the extension was built for (default
ATTNX_CUDA_ARCHS "8.0;9.0+PTX": sm_80 and sm_90 cubins), `cuobjdump --dump-resource-usage`
gives its registers, stack frame and static shared memory. Asserted:
  - no spills: no stack frame and no local memory, hence no local stores or loads (a kernel
    with a stack frame gets its STL/LDL bytes counted from its SASS for the report; they are
    what `ptxas -v` calls spill stores and loads);
  - static shared memory plus the dynamic shared memory its launch requests
    (attnx._C.cuda_smem_bytes: the kernels' own Config::smem_bytes, the number the cuda
    backend checks per call) within the architecture's opt-in limit per block. sm_90 cubins
    count the 1 KB the system reserves per block as static shared memory; counting it too is
    conservative by 1 KB;
  - the SDPA forward's main loop (the backward branch spanning the most HMMA in its SASS) holds
    HMMA.16816, LDSM and LDGSTS: mma.sync m16n8k16, ldmatrix and cp.async (FA2's design);
  - in the forward's and backward's main loops, a tile's exponentials (MUFU.EX2) and a masked
    tile's mask loads (LDG) each lie in one basic block: no branch per score.
The table goes to benchmarks/results/cuda-compile.json (rewritten each run, same content for
the same build).

cuobjdump is the one Triton's nvidia backend ships (triton/backends/nvidia/bin): the pinned
requirements install it wherever the tests run (CI, both torch versions), while the CUDA
toolkit of the build machines has only the compiler (/usr/local/cuda/bin has no cuobjdump).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from attnx import _ops, _validate
from attnx._backends import cuda as cuda_backend

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "cuda-compile.json"
# cudaDevAttrMaxSharedMemoryPerBlockOptin of each architecture the build targets.
OPT_IN_SHARED = {"sm_80": 166912, "sm_90": 232448}
DTYPES = {"6__half": "fp16", "13__nv_bfloat16": "bf16"}
SDPA_FWD_FAMILIES = (32, 64, 96, 128, 160, 192, 256)  # csrc/cuda/launch.h kSdpaFwdFamilies
SDPA_BWD_FAMILIES = SDPA_FWD_FAMILIES  # csrc/cuda/launch.h kSdpaBwdFamilies, all mma.sync
# Every kernel csrc/cuda/ compiles, each with the dynamic shared memory its launch requests
# (op None: none). The SDPA kernels come plain and with the score modifiers (kMods: ", mods").
SDPA_VARIANTS = {"0": "", "1": ", mods"}
# The forward comes with 1 and 2 m16 row tiles a warp up to D = 128 (", MT=2"): each arch's code
# holds the one its devices launch, the other is a stub (sdpa_fwd.cuh row_tiles).
FWD_ROW_TILES = {d: (1, 2) if d <= 128 else (1,) for d in SDPA_FWD_FAMILIES}
KERNELS = {f"sdpa_fwd<{dt}, {d}{mods}, MT={mt}>": ("sdpa_fwd", d)
           for dt in DTYPES.values() for d in SDPA_FWD_FAMILIES for mods in SDPA_VARIANTS.values()
           for mt in FWD_ROW_TILES[d]}
# The backward comes with 1 and 2 m16 key tiles a warp (", KT=2": 128-key blocks at D = 64..128,
# with softcap and ALiBi at 96..128, launched where the code and the device hold it;
# sdpa_bwd.cuh two_key_tiles), each with the shared memory of its own launch.
KERNELS.update({f"sdpa_bwd<{dt}, {d}{mods}, KT=1>": ("sdpa_bwd", d)
                for dt in DTYPES.values() for d in SDPA_BWD_FAMILIES
                for mods in SDPA_VARIANTS.values()})
KERNELS.update({f"sdpa_bwd<{dt}, {d}{mods}, KT=2>": ("sdpa_bwd_kt2", d)
                for dt in DTYPES.values() for d in SDPA_BWD_FAMILIES
                for mods in SDPA_VARIANTS.values() if (96 if mods else 64) <= d <= 128})
KERNELS.update({f"sdpa_bwd_delta<{dt}>": (None, 0) for dt in DTYPES.values()})
# The backwards' float64 reruns, each a query pass and a key pass, fp16 and bf16
# (sdpa_bwd_rerun.cu: plain and with the modifiers; additive_bwd_rerun.cu).
RERUN_PASSES = ("queries", "keys")
KERNELS.update({f"sdpa_bwd_rerun<{dt}{mods}, {rows}>": (None, 0) for dt in DTYPES.values()
                for mods in SDPA_VARIANTS.values() for rows in RERUN_PASSES})
KERNELS.update({f"additive_bwd_rerun<{dt}, {rows}>": (None, 0) for dt in DTYPES.values()
                for rows in RERUN_PASSES})
KERNELS["sdpa_bwd_dq_scan"] = (None, 0)  # the SDPA rerun's scan of dq_acc, unflagged
KERNELS.update({f"additive_{op}<{dt}>": ("additive", cuda_backend.MAX_ADDITIVE_VALUE_DIM)
                for op in ("fwd", "bwd") for dt in DTYPES.values()})
# KV-cache decoding (decode.cu): the split kernel per value columns per thread (1: Ev <= 128,
# 2: up to 256) at its largest head dims, plain and with the score modifiers; the merge with no
# shared memory, plain and with the sinks.
KVCACHE_VARIANTS = {"split": SDPA_VARIANTS, "merge": {"0": "", "1": ", sinks"}}
KERNELS.update({f"kvcache_split<{dt}, {nc}{mods}>": ("kvcache", cuda_backend.MAX_SDPA_HEAD_DIM)
                for dt in DTYPES.values() for nc in (1, 2) for mods in SDPA_VARIANTS.values()})
KERNELS.update({f"kvcache_merge<{dt}{sinks}>": (None, 0) for dt in DTYPES.values()
                for sinks in KVCACHE_VARIANTS["merge"].values()})

_SDPA = re.compile(
    r"(sdpa_fwd|sdpa_bwd)_kernelI(6__half|13__nv_bfloat16)Li(\d+)ELb([01])E(?:Li(\d)E)?")
_ADDITIVE = re.compile(r"additive_(fwd|bwd)_kernelI(6__half|13__nv_bfloat16)E")
_DELTA = re.compile(r"sdpa_bwd_delta_kernelI(6__half|13__nv_bfloat16)E")
_RERUN = re.compile(r"sdpa_bwd_rerun_kernelI(6__half|13__nv_bfloat16)Lb([01])ELb([01])E")
_ADDITIVE_RERUN = re.compile(r"additive_bwd_rerun_kernelI(6__half|13__nv_bfloat16)Lb([01])E")
_DQ_SCAN = re.compile(r"sdpa_bwd_dq_scan_kernel")
_KVCACHE = re.compile(
    r"kvcache_(split|merge)_kernelI(6__half|13__nv_bfloat16)(?:Li(\d+)E)?Lb([01])E")
_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_LOCAL_ACCESS = re.compile(r"\b(STL|LDL)((?:\.\w+)*)")
_ACCESS_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


# An extension that is not built or does not load fails these tests (LOAD_ERROR says why).
pytestmark = pytest.mark.skipif(
    _ops.LOAD_ERROR is None and not _ops.build_info()["cuda"],
    reason="attnx._C was built without CUDA (ATTNX_CUDA=0): it holds no cubins to read")


@pytest.fixture(autouse=True)
def _loaded():
    assert _ops.LOAD_ERROR is None, _ops.LOAD_ERROR


def cuobjdump() -> str:
    spec = importlib.util.find_spec("triton")
    assert spec is not None and spec.origin, "triton (which ships the cuobjdump read here) is missing"
    tool = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    assert os.access(tool, os.X_OK), f"no executable cuobjdump at {tool}"
    return str(tool)


def kernel_name(symbol: str) -> str:
    """`sdpa_fwd<bf16, 128, MT=2>` (`sdpa_fwd<bf16, 128, mods, MT=2>` with the score
    modifiers; MT: the forward's row tiles, KT: the backward's key tiles, `sdpa_bwd<bf16, 128,
    KT=2>`) for the mangled symbol of that instantiation."""
    if m := _SDPA.search(symbol):
        tiles = "MT" if m[1] == "sdpa_fwd" else "KT"
        return f"{m[1]}<{DTYPES[m[2]]}, {m[3]}{SDPA_VARIANTS[m[4]]}, {tiles}={m[5]}>"
    if m := _ADDITIVE.search(symbol):
        return f"additive_{m[1]}<{DTYPES[m[2]]}>"
    if m := _DELTA.search(symbol):
        return f"sdpa_bwd_delta<{DTYPES[m[1]]}>"
    if m := _RERUN.search(symbol):
        return f"sdpa_bwd_rerun<{DTYPES[m[1]]}{SDPA_VARIANTS[m[2]]}, {RERUN_PASSES[int(m[3])]}>"
    if m := _ADDITIVE_RERUN.search(symbol):
        return f"additive_bwd_rerun<{DTYPES[m[1]]}, {RERUN_PASSES[int(m[2])]}>"
    if _DQ_SCAN.search(symbol):
        return "sdpa_bwd_dq_scan"
    if m := _KVCACHE.search(symbol):
        return (f"kvcache_{m[1]}<{DTYPES[m[2]]}" + (f", {m[3]}" if m[3] else "")
                + f"{KVCACHE_VARIANTS[m[1]][m[4]]}>")
    raise AssertionError(f"{symbol}: a kernel this test does not know; add it to KERNELS with "
                         "the dynamic shared memory its launch requests")


def resource_usage(tool: str, lib: str) -> dict:
    """{(symbol, arch): (registers, stack, static shared, local)} of every cubin in `lib`."""
    text = subprocess.run([tool, "--dump-resource-usage", lib], check=True, capture_output=True,
                          text=True).stdout
    usage, arch, symbol, in_elf = {}, None, None, False
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Fatbin "):
            in_elf = line.startswith("Fatbin elf")
        elif line.startswith("arch = "):
            arch = line.split("=")[1].strip()
        elif in_elf and line.startswith("Function "):
            symbol = line[len("Function "):].rstrip(":")
        elif in_elf and (m := _USAGE.match(line)):
            assert (symbol, arch) not in usage, f"{symbol} appears twice for {arch}"
            usage[symbol, arch] = tuple(int(x) for x in m.groups())
    return usage


def local_traffic(tool: str, lib: str, symbols: list) -> dict:
    """{(symbol, arch): (bytes stored, bytes loaded)} by the STL/LDL in each kernel's SASS."""
    if not symbols:
        return {}
    text = subprocess.run([tool, "--dump-sass", "--function", ",".join(symbols), lib],
                          check=True, capture_output=True, text=True).stdout
    traffic, arch, symbol = {}, None, None
    for line in text.splitlines():
        if line.strip().startswith("arch = "):
            arch = line.split("=")[1].strip()
        elif (m := re.search(r"Function : (\S+)", line)):
            symbol = m[1]
            traffic.setdefault((symbol, arch), [0, 0])
        elif (m := _LOCAL_ACCESS.search(line)):
            width = next((_ACCESS_BYTES[x] for x in m[2].split(".") if x in _ACCESS_BYTES), 4)
            traffic[symbol, arch][m[1] == "LDL"] += width
    return {key: tuple(v) for key, v in traffic.items()}


_SASS_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")
# Opcodes counted in an SDPA kernel's main loop (with their variants, e.g. LDSM.16.MT88.4).
MIX = ("HMMA.16816", "LDSM", "LDGSTS", "MUFU.EX2", "SHFL", "BAR", "LDS", "STS", "LDG", "STG")


def main_loops(sass: str) -> dict:
    """{(symbol, arch): its main loop's basic blocks, each a list of opcodes} from cuobjdump
    SASS: the body of the backward branch (target address <= its own) whose range holds the
    most HMMA, cut after every branch and before every branch target of the kernel."""
    loops, arch, symbol, instrs = {}, None, None, []

    def close():
        if symbol is None:
            return
        branches = [(a, int(m[1], 16)) for a, o, operands in instrs
                    if o.startswith("BRA") and (m := _BRANCH_TARGET.search(operands))]
        targets = {target for _, target in branches}
        best, hmma = (0, -1), 0
        for addr, target in branches:
            n = sum(o.startswith("HMMA") for a, o, _ in instrs if target <= a <= addr)
            if target <= addr and n > hmma:
                best, hmma = (target, addr), n
        blocks = [[]]
        for addr, op, _ in instrs:
            if not best[0] <= addr <= best[1]:
                continue
            if addr in targets and blocks[-1]:
                blocks.append([])
            blocks[-1].append(op)
            if op.startswith("BRA"):
                blocks.append([])
        loops[symbol, arch] = [b for b in blocks if b]

    for line in sass.splitlines():
        if line.strip().startswith("arch = "):
            close()
            symbol, instrs, arch = None, [], line.split("=")[1].strip()
        elif (m := re.search(r"Function : (\S+)", line)):
            close()
            symbol, instrs = m[1], []
        elif (m := _SASS_INSTR.search(line)):
            instrs.append((int(m[1], 16), m[2], m[3]))
    close()
    return loops


def instruction_mix(blocks: list) -> dict:
    """Counts of the MIX opcodes (static instructions) in a loop's basic blocks, its length,
    its blocks, and the most exponentials (MUFU.EX2) and global loads (LDG) one block holds."""
    body = [o for b in blocks for o in b]
    mix = {op: sum(o == op or o.startswith(op + ".") for o in body) for op in MIX}
    most = lambda op: max((sum(o == op or o.startswith(op + ".") for o in b) for b in blocks),
                          default=0)
    mix.update(total=len(body), blocks=len(blocks), ex2_per_block=most("MUFU.EX2"),
               ldg_per_block=most("LDG"))
    return mix


def built_archs() -> set:
    """sm_XY of each compute capability in the build's ATTNX_CUDA_ARCHS."""
    archs = _ops.build_info()["cuda_archs"]
    return {f"sm_{a}{b}" for a, b in re.findall(r"(\d+)\.(\d+)", archs)}


@pytest.fixture(scope="module")
def table():
    """One row per (kernel, arch), written to RESULTS before any assertion."""
    tool, lib = cuobjdump(), _ops._C.__file__
    usage = resource_usage(tool, lib)
    # Without a stack frame or local memory a kernel has nowhere to spill to: only the others'
    # SASS is read (reading all of it takes ~10 s).
    spilling = sorted({s for (s, _), u in usage.items() if u[1] or u[3]})
    traffic = local_traffic(tool, lib, spilling)
    sdpa = sorted({s for s, _ in usage if kernel_name(s).startswith(("sdpa_fwd<", "sdpa_bwd<"))})
    loops = main_loops(subprocess.run([tool, "--dump-sass", "--function", ",".join(sdpa), lib],
                                      check=True, capture_output=True, text=True).stdout)
    rows = []
    for (symbol, arch), (regs, stack, static, local) in usage.items():
        name = kernel_name(symbol)
        op, dim = KERNELS[name]
        stores, loads = traffic.get((symbol, arch), (0, 0))
        rows.append(dict(kernel=name, arch=arch, registers=regs, stack_frame_bytes=stack,
                         local_bytes=local, spill_store_bytes=stores, spill_load_bytes=loads,
                         static_shared_bytes=static,
                         dynamic_shared_bytes=_ops._C.cuda_smem_bytes(op, dim) if op else 0))
        if op in ("sdpa_fwd", "sdpa_bwd", "sdpa_bwd_kt2"):
            rows[-1]["main_loop"] = instruction_mix(loops.get((symbol, arch), []))
    rows.sort(key=lambda r: (r["kernel"], r["arch"]))
    version = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
    RESULTS.write_text(json.dumps(dict(
        about="Resources of the CUDA kernels as compiled into attnx._C, read with cuobjdump "
              "(tests/test_cuda_resources.py); dynamic shared memory: what each launch requests, "
              f"additive at its largest value dim ({cuda_backend.MAX_ADDITIVE_VALUE_DIM}); "
              "main_loop: static SASS instruction counts of the SDPA kernels' main loops",
        cuobjdump=re.findall(r"release [\d.]+, V[\d.]+", version),
        build={k: _ops.build_info()[k] for k in ("cuda_version", "cuda_archs")},
        opt_in_shared_bytes=OPT_IN_SHARED,
        kernels=rows), indent=1) + "\n")
    return rows


def test_every_kernel_is_compiled_for_every_arch(table):
    archs = built_archs()
    assert archs <= OPT_IN_SHARED.keys(), f"no opt-in shared memory limit known for {archs}"
    found = {(r["kernel"], r["arch"]) for r in table}
    assert found == {(k, a) for k in KERNELS for a in archs}


def head_dim(kernel: str) -> int:
    """An SDPA kernel's head-dim family."""
    return int(re.search(r", (\d+)", kernel)[1])


def row_tiles(kernel: str) -> int:
    """A forward kernel's m16 row tiles a warp (1 for the other kernels)."""
    return int(m[1]) if (m := re.search(r"MT=(\d)", kernel)) else 1


def key_tiles(kernel: str) -> int:
    """A backward kernel's m16 key tiles a warp (1 for the other kernels)."""
    return int(m[1]) if (m := re.search(r"KT=(\d)", kernel)) else 1


def launched(row: dict) -> bool:
    """Whether a (kernel, arch) row is what that arch's devices can launch; the other variants
    are stubs. Forward: sdpa_fwd.cuh row_tiles, two row tiles from sm_90 on up to D = 128.
    Backward: one key tile everywhere (the fallback); two (sdpa_bwd.cuh two_key_tiles) from
    sm_90 on (below, D = 64's and 128's shared memory does not fit, and ptxas spills D = 96),
    with the modifiers from D = 96 (no D = 64 instance of those is built)."""
    kernel = row["kernel"]
    if kernel.startswith("sdpa_fwd<"):
        return row_tiles(kernel) == (2 if sm90(row["arch"]) and head_dim(kernel) <= 128 else 1)
    if kernel.startswith("sdpa_bwd<") and key_tiles(kernel) == 2:
        return sm90(row["arch"])
    return True


def sm90(arch: str) -> bool:
    """Whether code of `arch` (sm_80, sm_90, sm_90a, ...) is compiled with __CUDA_ARCH__ >= 900."""
    return int(re.match(r"sm_(\d+)", arch)[1]) >= 90


@pytest.mark.parametrize("kernel", ["sdpa_fwd<", "sdpa_bwd<"])
def test_each_arch_holds_the_variants_it_launches(table, kernel):
    """A variant an arch does not launch is a stub (no loop, a few registers), so the build
    compiles no more than it runs; the launched ones are the real kernels."""
    rows = [r for r in table if r["kernel"].startswith(kernel)]
    stubs = [r for r in rows if not launched(r)]
    # every arch's code has forward stubs; the backward's are sm_80 code's (an sm_90-only build,
    # CI's torch 2.11 stage, has none)
    assert stubs or (kernel == "sdpa_bwd<" and all(sm90(a) for a in built_archs()))
    assert all(r["registers"] <= 16 and not r["main_loop"]["HMMA.16816"] for r in stubs), stubs
    assert all(r["main_loop"]["HMMA.16816"] for r in rows if launched(r))


def test_no_spills(table):
    spills = [r for r in table if r["stack_frame_bytes"] or r["local_bytes"]
              or r["spill_store_bytes"] or r["spill_load_bytes"]]
    assert not spills, "kernels that spill to local memory:\n" + "\n".join(
        f"  {r['kernel']} {r['arch']}: {r['registers']} registers, stack frame "
        f"{r['stack_frame_bytes']} B, local {r['local_bytes']} B, stores "
        f"{r['spill_store_bytes']} B, loads {r['spill_load_bytes']} B" for r in spills)


def test_shared_memory_fits_each_arch(table):
    over = [r for r in table if launched(r)
            and r["static_shared_bytes"] + r["dynamic_shared_bytes"] > OPT_IN_SHARED[r["arch"]]]
    assert not over, "\n".join(
        f"{r['kernel']} {r['arch']}: {r['static_shared_bytes']} + {r['dynamic_shared_bytes']} B "
        f"of shared memory > {OPT_IN_SHARED[r['arch']]}" for r in over)


# The cuda backend's per-call shared memory check (attnx/_backends/cuda.py), on CPU tensors with
# the device's limit given: what its docstring promises for 99 KB parts (sm86/sm89/sm120) and for
# A100, from the numbers the extension reports.
SM86_OPT_IN = 101376


def sdpa_call(e, ev=None, grad=False):
    q, k = (torch.randn(1, 2, 5, e, dtype=torch.float16, requires_grad=grad) for _ in range(2))
    v = torch.randn(1, 2, 5, ev or e, dtype=torch.float16)
    return _validate.sdpa_call(q, k, v, None, 0.0, False, None, False, None, "cuda", False)


def additive_call(ev, grad=False):
    q, k = (torch.randn(1, 2, 5, 8, dtype=torch.float16, requires_grad=grad) for _ in range(2))
    value = torch.randn(1, 2, 5, ev, dtype=torch.float16)
    v = torch.randn(8, dtype=torch.float16)
    return _validate.additive_call(q, k, value, v, None, 0.0, False, None, "cuda", False)


def reason(monkeypatch, limit, op, call):
    monkeypatch.setattr(cuda_backend, "_shared_memory_limit", lambda device: ("GPU", limit))
    return cuda_backend._shared_memory_reason(op, call)


@pytest.mark.parametrize("e, ev, grad", [(64, 64, False), (8, 64, False), (64, 1, False),
                                         (17, 33, False), (65, 64, False), (96, 96, True),
                                         (160, 150, False), (150, 150, True), (160, 160, True)])
def test_99kb_parts_take_the_sdpa_up_to_96_and_129_to_160(monkeypatch, e, ev, grad):
    assert reason(monkeypatch, SM86_OPT_IN, "sdpa", sdpa_call(e, ev, grad)) is None


@pytest.mark.parametrize("e, ev, grad, kernel", [
    (97, 64, False, "sdpa_fwd"), (64, 128, False, "sdpa_fwd"), (128, 128, True, "sdpa_fwd"),
    (161, 64, False, "sdpa_fwd"), (256, 256, False, "sdpa_fwd")])
def test_99kb_parts_refuse_what_does_not_fit(monkeypatch, e, ev, grad, kernel):
    why = reason(monkeypatch, SM86_OPT_IN, "sdpa", sdpa_call(e, ev, grad))
    assert why is not None and f"{kernel} kernel needs" in why and str(SM86_OPT_IN) in why


def test_no_backward_is_planned_without_autograd():
    call = sdpa_call(64, grad=True)
    with torch.no_grad():
        assert not cuda_backend._needs_backward("sdpa", call)
    assert cuda_backend._needs_backward("sdpa", call)


def test_99kb_parts_take_additive_up_to_ev_1157(monkeypatch):
    assert reason(monkeypatch, SM86_OPT_IN, "additive", additive_call(1157, grad=True)) is None
    why = reason(monkeypatch, SM86_OPT_IN, "additive", additive_call(1158))
    assert why is not None and "additive kernel needs" in why


@pytest.mark.parametrize("e, ev", [(64, 64), (128, 128), (256, 256), (200, 64)])
def test_a100_takes_every_sdpa_call(monkeypatch, e, ev):
    assert reason(monkeypatch, OPT_IN_SHARED["sm_80"], "sdpa", sdpa_call(e, ev, grad=True)) is None
    big = additive_call(cuda_backend.MAX_ADDITIVE_VALUE_DIM, grad=True)
    assert reason(monkeypatch, OPT_IN_SHARED["sm_80"], "additive", big) is None


def test_every_part_takes_the_kvcache_kernel():
    """The decoding split kernel's shared memory at its largest head dims (256) fits 99 KB
    parts, as the cuda backend assumes (it makes no per-call check for attention_with_kvcache)."""
    assert _ops._C.cuda_smem_bytes("kvcache", cuda_backend.MAX_SDPA_HEAD_DIM) <= SM86_OPT_IN


def test_forward_main_loops_are_fa2_instructions(table):
    """Every sdpa_fwd kernel's main loop (each arch's cubin) runs on mma.sync m16n8k16
    (HMMA.16816), ldmatrix (LDSM) and cp.async (LDGSTS), with S, P and O in registers."""
    bad = [f"{r['kernel']} {r['arch']}: {r['main_loop']}" for r in table
           if r["kernel"].startswith("sdpa_fwd<") and launched(r)
           and not all(r["main_loop"][op] for op in ("HMMA.16816", "LDSM", "LDGSTS"))]
    assert not bad, "forward main loops without HMMA.16816, LDSM and LDGSTS:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- the SDPA backward

def test_99kb_parts_take_the_sdpa_backward_up_to_160():
    """The mma.sync backward's 64-key variant (BM = 64 or 32 query rows), which every launch can
    fall back on, fits 99 KB parts up to the 160 family: their calls are decided by the
    forward's needs alone (which refuse 97-128 there); 161-256 need more."""
    for dim in range(1, 161):
        assert _ops._C.cuda_smem_bytes("sdpa_bwd", dim) <= SM86_OPT_IN
    assert _ops._C.cuda_smem_bytes("sdpa_bwd", 161) > SM86_OPT_IN


def sass_mix(symbol: str, arch: str) -> dict:
    """{opcode: count} of a kernel's SASS for `arch` (opcodes without their modifiers, except
    HMMA's shape)."""
    text = subprocess.run([cuobjdump(), "--dump-sass", "--gpu-architecture", arch, "--function",
                           symbol, _ops._C.__file__], check=True, capture_output=True,
                          text=True).stdout
    mix = {}
    for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text):
        key = "HMMA.16816" if op.startswith("HMMA.16816") else op.split(".")[0]
        mix[key] = mix.get(key, 0) + 1
    return mix


def test_backward_is_built_on_mma_ldmatrix_and_cp_async(table):
    """The sdpa backward kernels of the mma.sync design: tensor-core m16n8k16 products
    (HMMA.16816), ldmatrix (LDSM) and cp.async (LDGSTS) loads, no spills (test_no_spills), for
    every architecture built."""
    symbols = {(kernel_name(sym), arch): sym
               for sym, arch in resource_usage(cuobjdump(), _ops._C.__file__)}
    wanted = {(r["kernel"], r["arch"]) for r in table
              if r["kernel"].startswith("sdpa_bwd<") and launched(r)}
    assert {(f"sdpa_bwd<{dt}, {d}{mods}, KT=1>", a) for dt in DTYPES.values()
            for d in SDPA_BWD_FAMILIES for mods in SDPA_VARIANTS.values()
            for a in built_archs()} <= wanted
    for name, arch in sorted(wanted):
        mix = sass_mix(symbols[name, arch], arch)
        missing = [op for op in ("HMMA.16816", "LDSM", "LDGSTS") if not mix.get(op)]
        assert not missing, f"{name} {arch}: no {missing} in its SASS ({mix})"


def test_128_key_backward_reads_half_an_ldmatrix_per_mma_or_less(table):
    """The backward's 128-key variant (sdpa_bwd.cuh KT = 2: 32 keys by 32 queries or more a warp
    in S^T and dP^T, each ldmatrix x4 of Q or dO feeding four MMAs; dK and dV split by head
    dims, their P^T and dS^T read from shared memory) issues at most one LDSM per two HMMA in
    its main loop, where the 64-key variant issues 0.54-0.62 (16 keys a warp):
    shared memory, not the tensor cores, is what bounds mma.sync on Hopper (an ldmatrix x4
    moves 512 bytes at 128 bytes a clock an SM, an m16n8k16 takes about one clock of its four
    tensor cores)."""
    rows = [r for r in table if r["kernel"].startswith("sdpa_bwd<") and key_tiles(r["kernel"]) == 2
            and launched(r)]
    assert rows
    heavy = [f"{r['kernel']} {r['arch']}: {r['main_loop']['LDSM']} LDSM, "
             f"{r['main_loop']['HMMA.16816']} HMMA" for r in rows
             if 2 * r["main_loop"]["LDSM"] > r["main_loop"]["HMMA.16816"]]
    assert not heavy, "\n".join(heavy)


def exponentials_per_tile(kernel: str) -> int:
    """The exponentials one thread computes per tile of an SDPA kernel: its share of the
    forward's 128 x BN scores (BN = 64 keys, 32 where MT D > 128; 256 threads with one row
    tile a warp, 128 with two; sdpa_fwd.cuh Config) or of the backward's BN x BM step (KT = 1:
    64 keys, BM = 64 queries up to D = 64, else 32, split over two warps above D = 128; KT = 2:
    128 keys, 64 queries (128 at D = 64), 256 threads; sdpa_bwd.cuh Config)."""
    d = head_dim(kernel)
    if kernel.startswith("sdpa_fwd<"):
        mt = row_tiles(kernel)
        return 128 * (32 if d * mt > 128 else 64) // (256 // mt)
    if key_tiles(kernel) == 2:
        return 128 * (128 if d == 64 else 64) // 256
    threads = 128 * (2 if d > 128 else 1)
    return 64 * (64 if d <= 64 else 32) // threads


def test_softmax_exponentials_share_one_basic_block(table):
    """Each SDPA kernel's main loop computes a tile's exponentials in one straight run (one
    basic block of at least as many MUFU.EX2 as a thread has scores in the tile): a per-element
    branch (an unhoisted `interior`, `fold` or dropout test) puts each in a block of its own,
    where its latency cannot overlap the others' (what the first H100 run's forward had)."""
    rows = [r for r in table
            if r["kernel"].startswith(("sdpa_fwd<", "sdpa_bwd<")) and launched(r)]
    assert rows
    short = [f"{r['kernel']} {r['arch']}: {r['main_loop']['ex2_per_block']} < "
             f"{exponentials_per_tile(r['kernel'])}" for r in rows
             if r["main_loop"]["ex2_per_block"] < exponentials_per_tile(r["kernel"])]
    assert not short, "main loops whose exponentials are split over blocks:\n" + "\n".join(short)


def test_mask_loads_share_one_basic_block(table):
    """A masked tile's mask elements are read by predicated loads in one straight run: one block
    of the main loop holds at least half as many LDG as a thread has scores in the tile (ptxas
    may schedule a load or two into a neighbouring block). With a branch per element, each
    block held one or two, and each load's latency was waited for before the next was issued."""
    rows = [r for r in table
            if r["kernel"].startswith(("sdpa_fwd<", "sdpa_bwd<")) and launched(r)]
    assert rows
    short = [f"{r['kernel']} {r['arch']}: {r['main_loop']['ldg_per_block']} < "
             f"{exponentials_per_tile(r['kernel']) // 2}" for r in rows
             if r["main_loop"]["ldg_per_block"] < exponentials_per_tile(r["kernel"]) // 2]
    assert not short, "main loops whose mask loads are split over blocks:\n" + "\n".join(short)


# -------------------------------------------------------------------------------------- additive

def innermost_loops(symbol: str, arch: str) -> list:
    """{opcode: count} of each innermost loop (a backward branch whose range holds no other
    loop) of a kernel's SASS for `arch`; MUFU keeps its function (MUFU.RCP, MUFU.EX2)."""
    text = subprocess.run([cuobjdump(), "--dump-sass", "--gpu-architecture", arch, "--function",
                           symbol, _ops._C.__file__], check=True, capture_output=True,
                          text=True).stdout
    instrs = [(int(a, 16), op) for a, op, _ in _SASS_INSTR.findall(text)]
    loops = [(int(m[1], 16), a) for a, op, operands in _SASS_INSTR.findall(text)
             if op.startswith("BRA") and (m := _BRANCH_TARGET.search(operands))
             for a in [int(a, 16)] if int(m[1], 16) <= a]
    inner = [(t, a) for t, a in loops
             if not any((t, a) != (t2, a2) and t <= t2 and a2 <= a for t2, a2 in loops)]
    mixes = []
    for t, a in inner:
        mix = {}
        for addr, op in instrs:
            if t <= addr <= a:
                key = ".".join(op.split(".")[:2]) if op.startswith("MUFU") else op.split(".")[0]
                mix[key] = mix.get(key, 0) + 1
        mixes.append(mix)
    return mixes


def test_additive_score_loop_takes_one_reciprocal_per_two_terms(table):
    """The additive forward's score loop over exponentials (additive.cu chunk_scores, r_pair)
    issues one MUFU.RCP per two terms: per pair of terms two FFMA for the denominators and two
    for the sums (one RCP per four FFMA; at most one per three is asked, a margin for the
    compiler, where one reciprocal a term gives one per two), where one reciprocal a term held
    the SFU (16 lanes a clock an SM) twice as long as the loop took to issue. The loop over raw q, k
    (exponentials per term, MUFU.EX2) is the rare path and is left out; the score loop is the
    innermost loop with the most reciprocals (the others divide integers or floats)."""
    symbols = {(kernel_name(sym), arch): sym
               for sym, arch in resource_usage(cuobjdump(), _ops._C.__file__)}
    rows = [r for r in table if r["kernel"].startswith("additive_fwd<")]
    assert rows
    for r in rows:
        loops = [m for m in innermost_loops(symbols[r["kernel"], r["arch"]], r["arch"])
                 if m.get("MUFU.RCP") and not m.get("MUFU.EX2")]
        assert loops, f"{r['kernel']} {r['arch']}: no score loop over exponentials found"
        score = max(loops, key=lambda m: m["MUFU.RCP"])
        assert 3 * score["MUFU.RCP"] <= score.get("FFMA", 0), (
            f"{r['kernel']} {r['arch']}: one reciprocal a term or more: {score}")
