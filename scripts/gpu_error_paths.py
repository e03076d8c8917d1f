"""Whether a C++ error raised inside attnx._C reaches Python as an exception on this machine.

    python scripts/gpu_error_paths.py        # scripts/gpu_check.sh's `errors` step

On the first GPU machine (H100, 2026-11-26) the first CUDA-op call that had to raise
(tests/test_cuda.py::test_sizes_past_the_grid_raise_before_they_are_narrowed) killed the
process with SIGSEGV instead, while the extension had been built there with /opt/gcc's
compilers. Each probe below runs in its own process, so a crash is reported rather than
suffered: torch's own C++ error, an attnx CPU op's and an attnx CUDA op's (a shape check in
csrc/cuda/kernel_ops.cpp), with the compilers that built the extension (and the commands of a
compiler that is a wrapper script). A probe that crashes runs again under cuda-gdb or gdb, which
print its native stack. Exit status 1 when a probe crashed or did not raise.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each probe must raise RuntimeError from C++; a probe's process prints RAISED when it did.
PROBES = {
    "torch (CPU)": "torch.ones(2).view(3)",
    "attnx._C CPU op": "torch.ops.attnx.sdpa_fwd(t(1, 1, 4, 8), t(1, 1, 5, 8), t(1, 1, 6, 8), "
                       "None, 0.1, -9, 9, 0.0, None)",
    "attnx._C CUDA op": "torch.ops.attnx.sdpa_fwd(t(1, 1, 4, 8, dev='cuda'), "
                        "t(1, 1, 5, 8, dev='cuda'), t(1, 1, 6, 8, dev='cuda'), None, 0.1, -9, 9, "
                        "0.0, None)",
}
PRELUDE = """
import sys, torch
sys.path.insert(0, {root!r})
import attnx
def t(*shape, dev="cpu"):
    return torch.randn(*shape, device=dev, dtype=torch.float16)
try:
    {call}
except RuntimeError as exc:
    print("RAISED", str(exc).splitlines()[0][:160])
else:
    print("DID NOT RAISE")
"""


def compilers() -> list[str]:
    lines = []
    for var, default in (("CC", "cc"), ("CXX", "c++")):
        exe = os.environ.get(var) or default
        path = shutil.which(exe) or exe
        try:
            version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                     timeout=20).stdout.splitlines()[:1]
        except OSError as exc:
            version = [f"not runnable: {exc}"]
        lines.append(f"{var}={os.environ.get(var, '(unset)')} -> {path}: {' '.join(version)}")
        lines += [f"  {var} wrapper: {x}" for x in wrapper_commands(path)]
    # which C++ runtime and unwinder the extension resolves (a mismatch is a crash suspect)
    for lib in glob.glob(os.path.join(ROOT, "attnx", "_C*.so")):
        ldd = subprocess.run(["ldd", lib], capture_output=True, text=True).stdout.splitlines()
        lines += [f"{os.path.basename(lib)}: {x.strip()}" for x in ldd
                  if "libstdc++" in x or "libgcc_s" in x or "libgomp" in x]
    return lines


def _command(call: str) -> list[str]:
    """The process that runs `call` after PRELUDE's setup."""
    return [sys.executable, "-c", PRELUDE.format(root=ROOT, call=call)]


def wrapper_commands(path: str, most: int = 12) -> list[str]:
    """The command lines of a compiler that is a script (the GPU machines' /opt/gcc/bin/g++ is a
    wrapper of g++-real whose builds link libstdc++ statically: the flags it adds), else []."""
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
    except OSError:
        return []
    if not head.startswith(b"#!"):
        return []
    text = head.decode(errors="replace").splitlines()[1:]
    return [x.strip() for x in text if x.strip() and not x.lstrip().startswith("#")][:most]


def backtrace(call: str, frames: int = 30) -> list[str]:
    """The native stack where `call` crashes, from cuda-gdb (the GPU machines have no gdb) or
    gdb: the frames and the signal's line; [] without a debugger."""
    gdb = shutil.which("cuda-gdb") or shutil.which("gdb")
    if gdb is None:
        return []
    cmd = [gdb, "-batch", "-nx", "-ex", "run", "-ex", f"bt {frames}", "--args", *_command(call)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        return [f"{os.path.basename(gdb)}: no backtrace within 90 s"]
    return [x[:300] for x in res.stdout.splitlines() if x.startswith("#") or "received signal" in x]


def probe(call: str) -> tuple[bool, str]:
    """(raised, what happened) of running `call` after PRELUDE's setup in its own process."""
    res = subprocess.run(_command(call), capture_output=True, text=True, timeout=120)
    out = res.stdout.strip().splitlines()
    if res.returncode < 0:
        return False, f"crashed with signal {-res.returncode}"
    if out and out[-1].startswith("RAISED"):
        return True, out[-1]
    return False, (out[-1] if out else "") + f" (exit {res.returncode}) {res.stderr[-300:]}"


def main() -> int:
    import torch
    for line in compilers():
        print(line)
    ok = True
    for name, call in PROBES.items():
        if "cuda" in call and not torch.cuda.is_available():
            print(f"{name}: not run (no CUDA device)")
            continue
        passed, what = probe(call)
        ok &= passed
        print(f"{name}: {'ok' if passed else 'FAILED'}: {what}")
        if what.startswith("crashed"):
            for line in backtrace(call):
                print(f"  {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
