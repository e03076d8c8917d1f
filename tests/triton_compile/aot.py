"""Compiles one recorded launch (capture.Unit) ahead of time for an NVIDIA arch, no GPU needed.

The signature, constexprs and divisibility attributes come from Triton's own binder, as at a
launch (`JITFunction.run`); the compile is `triton.compile(ASTSource(...), target=GPUTarget)`.
Registers and spill bytes are read from the ptxas log (TRITON_DUMP_PTXAS_LOG), so the Triton
cache must be fresh: a cached kernel runs no ptxas (__main__ points TRITON_CACHE_DIR at a
temporary folder).
"""

from __future__ import annotations

import collections
import contextlib
import io
import re
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

# The opt-in shared memory per block (cudaDevAttrMaxSharedMemoryPerBlockOptin).
SHARED_LIMIT = {80: 166912, 90: 232448}

_PTXAS = re.compile(r"Used (\d+) registers.*?(?:\n|$)", re.S)
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")

_LABEL = re.compile(r"^\s*(\$L__BB\d+_\d+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
# What the loop counts break down: the exponentials, multiply/FMA, selects and compares (the
# mask arithmetic), global loads, tensor-core instructions.
_KINDS = {"ex2": r"^ex2", "fma": r"^fma", "mul": r"^mul\.", "add/sub": r"^(add|sub)\.",
          "setp/selp": r"^(setp|selp)", "ld.global": r"^ld\.global", "cp.async": r"^cp\.async",
          "mma": r"^(mma|wgmma)", "mov": r"^mov", "min": r"^min\.", "max": r"^max\."}


def loops(ptx: str) -> list[dict]:
    """Each backward branch's body (label .. branch): its instruction count and kinds."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    where = {}
    out = []
    for i, ln in enumerate(lines):
        m = _LABEL.match(ln)
        if m:
            where[m.group(1)] = i
        b = _BRANCH.search(ln)
        if b and b.group(1) in where:  # a label seen before: a loop back edge
            body = lines[where[b.group(1)] + 1:i + 1]
            ops = [x.split()[1] if x.startswith("@") else x.split()[0]  # @%p predicated
                   for x in body if x and not x.startswith(("$", "//", "{", "}", "."))]
            kinds = collections.Counter()
            for op in ops:
                for name, pat in _KINDS.items():
                    if re.match(pat, op):
                        kinds[name] += 1
            out.append(dict(instructions=len(ops), **kinds, folded_exp2=folded_exp2(body)))
    return out


# An instruction's opcode and destination (one register, or a tensor-core result's braced list).
_DEST = re.compile(r"^(?:@!?%\w+\s+)?([a-z][\w.]*)\s+(\{[^}]*\}|%\w+)")


def folded_exp2(body: list[str]) -> int:
    """The ex2s of a loop body whose argument is an FMA with a tensor-core result (a raw score)
    as a factor: exp2(s c - m) in one rounding, whose value for the row max is the rounding of
    fl(m c) itself (2^16 and more at scaled scores of 3e8: the H200 run's NaN, 2026-12-04). The
    forward's in-band loop subtracts the max first: its FMAs take the distance."""
    defs = {}
    for ln in body:
        m = _DEST.match(ln)
        if m:
            for reg in re.findall(r"%\w+", m.group(2)):
                defs[reg] = (m.group(1), ln)
    count = 0
    for ln in body:
        m = _DEST.match(ln)
        if not (m and m.group(1).startswith("ex2")):
            continue
        op, arg_line = defs.get(re.findall(r"%\w+", ln)[-1], ("", ""))
        if op.startswith(("fma", "mad")):
            factors = re.findall(r"%\w+", arg_line.split(None, 1)[1])[1:3]
            count += any(defs.get(f, ("",))[0].startswith(("mma", "wgmma")) for f in factors)
    return count


_DEF = re.compile(r"^\s*(%[\w#$.-]+) = ([\w.]+)\s*(.*)$")
_CONSTANT_OF = ("tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape")


def narrow_products(ttir: str) -> list[str]:
    """The 32-bit integer multiplies in the TTIR of two values neither of which is a constant:
    an index times a stride or a length, which wraps past 2^31 elements (issue 18 item 6).
    Products by a constant (tile sizes, the dropout hash) are exempt."""
    constant = set()
    out = []
    for line in ttir.splitlines():
        line = re.sub(r"\s+loc\(.*\)$", "", line)
        m = _DEF.match(line)
        if not m:
            continue
        name, op, rest = m.groups()
        operands = re.findall(r"%[\w#$.-]+", rest.split(":")[0])
        if op == "arith.constant" or (op in _CONSTANT_OF and operands
                                      and all(o in constant for o in operands)):
            constant.add(name)
        elif op == "arith.muli" and re.search(r"\bi32\b|xi32>", rest.rsplit(":", 1)[-1]):
            if not any(o in constant for o in operands):
                out.append(line.strip())
    return out


def computed_transposes(ttir: str) -> list[str]:
    """The tt.trans in the TTIR whose operand is not a tile loaded from memory: a transpose of
    computed values (probabilities, score gradients) through registers and shared memory each
    step (issue 18 item 9); a loaded tile's transpose is only another view of its staging."""
    op_of = {}
    out = []
    for line in ttir.splitlines():
        m = _DEF.match(re.sub(r"\s+loc\(.*\)$", "", line))
        if not m:
            continue
        name, op, rest = m.groups()
        op_of[name] = op
        if op == "tt.trans" and op_of.get(rest.split()[0]) != "tt.load":
            out.append(m.group(0).strip())
    return out


def in_band_loop(ptx: str) -> dict | None:
    """The leanest loop body with tensor-core instructions (fewest selects and compares): the
    forward's in-band key loop, or None."""
    dots = [lp for lp in loops(ptx) if lp.get("mma")]
    return min(dots, key=lambda lp: lp.get("setp/selp", 0)) if dots else None


def prepare(unit):
    """(source, options, target, key) of `unit`, bound as a launch binds it; the key is the
    same for units that compile to the same kernel."""
    arch = unit.arch
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(unit.fn.signature, unit.fn.params, backend)
    kwargs = dict(unit.options, debug=False)
    bound, specialization, options = binder(**unit.args, **kwargs)
    options, signature, constexprs, attrs = unit.fn._pack_args(backend, kwargs, bound,
                                                               specialization, options)
    src = ASTSource(unit.fn, signature, constexprs, attrs)
    return src, options, target, (src.hash(), str(options), arch)


def compile_unit(unit) -> dict:
    """Compiles `unit` for its arch: a result row (kernel, variant, config, arch, shared and the
    pruning rule's estimate, registers, spill and stack bytes, compile seconds, wgmma, error)."""
    row = dict(kernel=unit.kernel, variant=unit.variant.name, config=unit.config, arch=unit.arch,
               grid=list(unit.grid), shared_estimate=unit.shared_estimate)
    src, options, target, _ = prepare(unit)
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(src, target=target, options=options.__dict__)
    except Exception as e:  # noqa: BLE001 - every failure is a result row
        row.update(seconds=round(time.perf_counter() - t0, 2),
                   error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
        return row
    text = log.getvalue()
    regs = _PTXAS.search(text)
    spill = _SPILL.search(text)
    stack = _STACK.search(text)
    row.update(seconds=round(time.perf_counter() - t0, 2), error=None,
               shared=kernel.metadata.shared,
               registers=int(regs.group(1)) if regs else None,
               spill_bytes=int(spill.group(1)) + int(spill.group(2)) if spill else None,
               stack_bytes=int(stack.group(1)) if stack else None,
               wgmma="wgmma" in kernel.asm["ptx"], in_band_loop=in_band_loop(kernel.asm["ptx"]),
               narrow_products=narrow_products(kernel.asm["ttir"]),
               computed_transposes=computed_transposes(kernel.asm["ttir"]))
    return row
