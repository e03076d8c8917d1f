"""Builds attnx._C: the C++ CPU kernels always, the CUDA kernels when a toolkit is present;
and attnx._cuda_host: the CUDA kernels' source compiled by the host compiler against the host
harness (csrc/cuda/host/), which runs them on CPU tensors for the tests (ATTNX_CUDA_ON_CPU=1).

Switches (environment):
  ATTNX_CUDA=0/1       force the CUDA half off/on (default: on when torch is a CUDA build and
                       a CUDA toolkit is found, whether or not a GPU is present)
  ATTNX_CUDA_HOST=0/1  force attnx._cuda_host off/on (default: on when the toolkit's headers
                       are found; it needs neither nvcc nor a GPU)
  ATTNX_CUDA_ARCHS     compute capabilities, default "8.0;9.0+PTX"
  MAX_JOBS             parallel compile jobs (ninja)
"""

import glob
import os
import sys
import sysconfig

import torch
from setuptools import find_packages, setup
# torch guesses CUDA_HOME from the `nvcc` on PATH; when that is a wrapper script outside the
# toolkit (here /usr/local/bin/nvcc -> CUDA_HOME=/usr/local, which has no CUDA headers), point it
# at the standard toolkit location instead. Must run before cpp_extension is imported.
if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")) and os.path.exists(
        "/usr/local/cuda/include/cuda_runtime_api.h"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _version() -> str:
    scope = {}
    with open(os.path.join(ROOT, "attnx", "_version.py")) as f:
        exec(f.read(), scope)
    return scope["__version__"]


def _want_cuda() -> bool:
    flag = os.environ.get("ATTNX_CUDA")
    if flag is not None:
        return flag == "1"
    return torch.version.cuda is not None and CUDA_HOME is not None


def _sources(pattern: str) -> list:
    # Relative paths keep absolute build paths out of the wheel's metadata.
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def extension():
    with_cuda = _want_cuda()
    sources = _sources("csrc/*.cpp") + _sources("csrc/cpu/*.cpp")
    define = [("ATTNX_TORCH_VERSION", f'"{torch.__version__}"')]
    cxx = ["-O3", "-fopenmp"]  # the -std level is the one torch asks for
    if os.environ.get("ATTNX_NATIVE") == "1":  # opt-in: binaries built this way won't travel
        cxx.append("-march=native")
    # libstdc++ named explicitly: a compiler wrapper that links it statically (the GPU machines'
    # /opt/gcc/bin/g++) then still links the shared one, as every other build does. Such a
    # static build crashed (SIGSEGV) at a cuda op's first C++ error on the H100 and the H200,
    # where the same source built by /usr/bin/g++ raised (scripts/gpu_error_paths.py); whether
    # this line is the cure is for the next GPU run's errors step to show.
    kwargs = dict(extra_link_args=["-fopenmp", "-lstdc++"])
    if not with_cuda:
        return CppExtension("attnx._C", sources, define_macros=define,
                            extra_compile_args={"cxx": cxx}, **kwargs)
    archs = os.environ.get("ATTNX_CUDA_ARCHS", "8.0;9.0+PTX")
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs  # read by cpp_extension for -gencode flags
    sources += _sources("csrc/cuda/*.cpp") + _sources("csrc/cuda/*.cu")
    define += [("ATTNX_WITH_CUDA", None), ("ATTNX_CUDA_VERSION", f'"{torch.version.cuda}"'),
               ("ATTNX_CUDA_ARCHS", f'"{archs}"')]
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo",
            "-DATTNX_WITH_CUDA", "--threads", "2"]
    return CUDAExtension("attnx._C", sources, define_macros=define,
                         extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kwargs)


def _cuda_headers():
    """The CUDA toolkit's include folder (the harness needs cuda_fp16.h and friends), or None."""
    include = os.path.join(CUDA_HOME or "/usr/local/cuda", "include")
    return include if os.path.exists(os.path.join(include, "cuda_fp16.h")) else None


def host_harness_extension():
    flag = os.environ.get("ATTNX_CUDA_HOST")
    include = _cuda_headers()
    if flag == "0" or (flag is None and include is None):
        return []
    if include is None:
        raise RuntimeError("ATTNX_CUDA_HOST=1 needs a CUDA toolkit's headers (set CUDA_HOME)")
    sources = (_sources("csrc/cuda/host/*.cpp") + ["csrc/cuda/kernel_ops.cpp"])
    # -fno-strict-aliasing: the kernels read 16-bit tiles as uint4, as the device allows.
    # Hidden symbols: the kernels' host twins must never stand in for attnx._C's.
    cxx = ["-O2", "-fno-strict-aliasing", "-fvisibility=hidden", "-Wno-unknown-pragmas"]
    return [CppExtension("attnx._cuda_host", sources, include_dirs=[include],
                         define_macros=[("ATTNX_CUDA_HOST", None)],
                         extra_compile_args={"cxx": cxx})]


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    """Each extension's objects in its own folder under the tree's build/, whatever the kind of
    build, so that ninja finds them again: pip's editable install (scripts/setup.sh) compiles in
    a temporary folder otherwise, and a wheel built after it (CI) compiled the whole extension
    again (~10 minutes with the CUDA half on 2 cores). One folder per extension because the two
    share csrc/cuda/kernel_ops.cpp with different flags (same object name). ninja reuses objects
    only when the same ninja runs again (torch runs the first on PATH): .ci/run says why."""

    def build_extension(self, ext):
        tag = f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
        self.build_temp = os.path.join(ROOT, "build", tag, ext.name)
        super().build_extension(ext)


setup(
    name="attnx",
    version=_version(),
    packages=find_packages(include=["attnx", "attnx.*"]),
    ext_modules=[extension()] + host_harness_extension(),
    cmdclass={"build_ext": BuildExt},
    include_package_data=False,
)
