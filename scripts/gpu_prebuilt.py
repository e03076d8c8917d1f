"""Whether an attnx._C built elsewhere (scripts/gpu_prebuild.sh) serves the GPU machine as it is.

    python scripts/gpu_prebuilt.py stamp ROOT SO   # after a build: SO.sources <- digest of ROOT's sources
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


def digest(root: str) -> str:
    """sha1 over csrc/'s files and setup.py, by their paths and contents, in path order."""
    paths = [os.path.join(root, "setup.py")]
    for top, _, files in os.walk(os.path.join(root, "csrc")):
        paths += [os.path.join(top, f) for f in files]
    h = hashlib.sha1()
    for p in sorted(paths, key=lambda p: os.path.relpath(p, root)):
        h.update(os.path.relpath(p, root).encode() + b"\0")
        with open(p, "rb") as f:
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
    probe = ("import json, torch, attnx; "
             "print(json.dumps([attnx._ops.build_info(), torch.__version__]))")
    res = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True)
    if res.returncode != 0:
        return f"importing it failed: {res.stderr.strip().splitlines()[-1:]}"
    info, torch_version = json.loads(res.stdout.strip().splitlines()[-1])
    if not info or not info.get("cuda"):
        return f"built without CUDA ({info})"
    if info["cuda_archs"] != arch:
        return f"built for CUDA architectures {info['cuda_archs']!r}, the GPU is {arch!r}"
    if info["torch"] != torch_version:
        return f"built against torch {info['torch']}, this machine's is {torch_version}"
    return None


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "stamp":
        root, so = argv[1], argv[2]
        with open(so + ".sources", "w") as f:
            f.write(digest(root) + "\n")
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
