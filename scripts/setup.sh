#!/usr/bin/env bash
# Sets up a development environment from a fresh checkout: a virtualenv (.venv, or $ATTNX_VENV)
# with the pinned dependencies (requirements.txt, or $ATTNX_REQUIREMENTS) and attnx built in
# place (editable), CUDA half included whenever a CUDA toolkit is found (ATTNX_CUDA=0 skips it),
# and with it the CUDA host harness (attnx._cuda_host: the kernels on the CPU, for the tests).
# Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(realpath -m "${ATTNX_VENV:-.venv}")"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# This machine's pip configuration warns about every missing local index entry: keep the rest.
pip_install() { "$venv/bin/python" -m pip install -q "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }; }
pip_install --upgrade pip
pip_install -r "${ATTNX_REQUIREMENTS:-requirements.txt}"
export PATH="$venv/bin:$PATH" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
pip_install --no-build-isolation --no-deps -e .
"$venv/bin/attnx" info
