#!/usr/bin/env bash
# scripts/gpu_prebuild.sh [ARCH]
#
# Builds here, on a machine without a GPU, the attnx._C that gpu_check.sh's build step would
# compile on the GPU machine: for that machine's Python (3.12) and torch (2.11.0), the CUDA half
# for one architecture (ARCH, default 9.0: the H100 and the H200), without the host harness,
# debug sections stripped so that it travels (the device tool carries at most 64 MiB in all).
# Device time is the scarce thing: the build took 121 s of the H200's 15 minutes on 2026-12-04,
# and a second one after a crashing probe 170 more; here it costs only this machine's time
# (a venv of ~6 GB in .venv-gpu, ignored by git, and the compile).
#
# Then carry it in the device call; gpu_check.sh's build step takes it where it reports CUDA for
# the GPU's architecture and was built against the machine's torch, and compiles as before
# otherwise (a fresh machine, another torch or another GPU):
#   run(command="bash scripts/gpu_check.sh $OUT", timeout_s=600,
#       carry=["attnx/_C.cpython-312-x86_64-linux-gnu.so", "attnx/_C.cpython-312-x86_64-linux-gnu.so.sources"])
# (the stamp beside it holds the digest of the csrc/ and setup.py it was built from:
# scripts/gpu_prebuilt.py; a tree changed since is compiled there as before). A run meant to
# test the GPU machine's own compilers (gpu_check.sh's errors step: whether a C++ error reaches
# Python from a module built there) must not carry it.
#
# ATTNX_GPU_PYTHON: the Python to build for (default: python3.12 on the PATH; with pyenv,
# e.g. ~/.pyenv/versions/3.12.1/bin/python3.12).
set -euo pipefail
arch="${1:-9.0}"
[[ "$arch" =~ ^[0-9]+\.[0-9]$ ]] || { echo "gpu_prebuild.sh: ARCH: expected e.g. 9.0, got '$arch'" >&2; exit 2; }
cd "$(dirname "$0")/.."
python="${ATTNX_GPU_PYTHON:-python3.12}"
"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null ||
  { echo "gpu_prebuild.sh: '$python' is no working Python 3.12 (set ATTNX_GPU_PYTHON)" >&2; exit 2; }
venv=.venv-gpu
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# torch and the build requirements as the GPU machines have them (requirements-torch2.11.txt)
"$venv/bin/python" -m pip install -q torch==2.11.0 pybind11==3.1.0 ninja==1.13.2 \
  setuptools==81.0.0 wheel numpy==2.2.6 2>&1 | { grep -v '^WARNING: Location' || true; }
tag="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
[[ "$tag" == *cpython-312* ]] || { echo "gpu_prebuild.sh: $venv is not a CPython 3.12 venv ($tag): remove it" >&2; exit 2; }
so="attnx/_C$tag"
rm -f "$so.sources"  # a failed build below leaves no stamp
# The sources' digest before the build: an edit during it (minutes) must not be stamped as built.
before="$("$venv/bin/python" scripts/gpu_prebuilt.py digest .)"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" PATH="$venv/bin:$PATH"
unset ATTNX_NATIVE  # -march=native code would not run on the GPU machines' host CPU
ATTNX_CUDA=1 ATTNX_CUDA_ARCHS="$arch" ATTNX_CUDA_HOST=0 "$venv/bin/python" setup.py build_ext --inplace
objcopy --strip-debug "$so"
# Stamped with the digest taken before the build, then the check gpu_check.sh makes: it loads,
# reports CUDA for ARCH against this torch, and the sources are still those (else no stamp).
echo "$before" > "$so.sources"
"$venv/bin/python" scripts/gpu_prebuilt.py check . "$arch" ||
  { rm -f "$so.sources"
    echo "gpu_prebuild.sh: not fit to carry (above; sources edited during the build: run it again)" >&2
    exit 1; }
ls -l "$so" "$so.sources"
