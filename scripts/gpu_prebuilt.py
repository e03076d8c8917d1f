"""Whether an attnx._C built elsewhere (scripts/gpu_prebuild.sh) serves the GPU machine as it is.

    python scripts/gpu_prebuilt.py digest ROOT     # the digest of ROOT's sources (gpu_prebuild.sh stamps it)
    python scripts/gpu_prebuilt.py check ROOT ARCH # gpu_check.sh's build step: exit 0 to skip the compile

`check` answers yes (exit 0) only where ROOT/attnx/_C<this Python's extension suffix> exists,
its stamp holds the digest of ROOT's C++/CUDA sources and setup.py as they are now (a build of
another tree would run other kernels than the tests read), and the built module reports CUDA
for exactly ARCH against the torch this Python imports. Otherwise it says why and exits 1, and
gpu_check.sh compiles as it always did.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import sysconfig


def sources(root: str) -> list[str]:
    """setup.py and csrc/'s files, relative to root: in a git checkout those the device tool
    sends (tracked, or untracked and not ignored); elsewhere (the copy it sends) every file."""
    res = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                          "--", "setup.py", "csrc"], cwd=root, capture_output=True)
    if res.returncode == 0 and res.stdout:
        return sorted({p for p in res.stdout.decode().split("\0") if p})
    paths = ["setup.py"]
    for top, _, files in os.walk(os.path.join(root, "csrc")):
        paths += [os.path.relpath(os.path.join(top, f), root) for f in files]
    return sorted(paths)


def digest(root: str) -> str:
    """sha1 over the sources' paths and contents, in path order."""
    h = hashlib.sha1()
    for p in sources(root):
        h.update(p.encode() + b"\0")
        with open(os.path.join(root, p), "rb") as f:
            h.update(f.read() + b"\0")
    return h.hexdigest()


def module_path(root: str) -> str:
    return os.path.join(root, "attnx", "_C" + sysconfig.get_config_var("EXT_SUFFIX"))


def why_not(root: str, arch: str) -> str | None:
    so = module_path(root)
    if not os.path.exists(so):
        return f"no {os.path.relpath(so, root)}"
    try:
        with open(so + ".sources") as f:
            stamp = f.read().strip()
    except OSError:
        return f"no stamp {os.path.relpath(so, root)}.sources (scripts/gpu_prebuild.sh writes it)"
    if stamp != digest(root):
        return "built from other sources than this tree's csrc/ and setup.py"
    # in a child: this process must not keep a module that the compile may replace
    probe = ("import json, torch, attnx; print(json.dumps([attnx._ops.build_info(), "
             "torch.__version__, getattr(attnx._ops, 'LOAD_ERROR', None)]))")
    res = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True)
    if res.returncode != 0:
        last = res.stderr.strip().splitlines()
        return f"importing attnx failed: {last[-1] if last else res.returncode}"
    info, torch_version, load_error = json.loads(res.stdout.strip().splitlines()[-1])
    if load_error:
        return f"it does not load: {load_error}"
    if not info or not info.get("cuda"):
        return f"built without CUDA ({info})"
    if info["cuda_archs"] != arch:
        return f"built for CUDA architectures {info['cuda_archs']!r}, the GPU is {arch!r}"
    if info["torch"] != torch_version:
        return f"built against torch {info['torch']}, this machine's is {torch_version}"
    return None


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "digest":
        print(digest(argv[1]))
        return 0
    if len(argv) == 3 and argv[0] == "check":
        reason = why_not(argv[1], argv[2])
        print("prebuilt attnx._C: " + ("taken, no compile" if reason is None else
                                      f"not taken ({reason}): compiling"))
        return 0 if reason is None else 1
    print("\n".join(__doc__.strip().splitlines()[2:4]), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
