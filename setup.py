"""Build fgpsdp_runtime and its extension fgpsdp_runtime._C.

The CPU kernels are always built. The CUDA kernels (csrc/cuda/*.cu) are added
when torch was built with CUDA and nvcc is found, unless FGPSDP_SKIP_CUDA=1.
Build without isolation so the extension links against the torch you run:
    pip install --no-build-isolation -e .
"""
import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda() -> bool:
    if os.environ.get("FGPSDP_SKIP_CUDA", "0") == "1":
        return False
    if torch.version.cuda is None:
        return False
    nvcc = shutil.which("nvcc") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None)
    return bool(nvcc and os.path.exists(nvcc))


# A compiler that links its own libstdc++ statically (on 2026-12-04 an H200 image's
# /opt/gcc did) puts a second C++ runtime in the extension beside the shared one
# torch loaded. Its code then binds some of its data (the locale facets' ids) to
# the shared copy's: the first number written into an error message crashed
# (TORCH_CHECK's message; on Debian's g++ 12 the message was cut short instead).
# Keeping a static archive's symbols local makes that copy self-contained; it
# changes nothing where libstdc++ is linked as a shared library.
# tests/test_build_flags.py checks it with a small library.
HIDE_STATIC_LIBS = "-Wl,--exclude-libs,ALL"


def _link_args() -> list:
    return ["-fopenmp"] + ([HIDE_STATIC_LIBS] if sys.platform.startswith("linux") else [])


def _extension():
    include = [os.path.join(ROOT, "csrc", "include")]
    sources = ["csrc/bindings.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    # No -std flag: torch.utils.cpp_extension adds the one its headers need (torch
    # 2.14 headers require C++20); an explicit -std=c++17 would override it.
    cxx_flags = ["-O3", "-fopenmp"]
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
    if _want_cuda() and cuda_sources:
        # No GPU visible at build time (CI, a docker build, a login node): machine
        # code for Turing, Ampere (sm_8x GPUs run sm_80 code) and Hopper, plus
        # Hopper's PTX, which the driver compiles for newer GPUs (Blackwell) at
        # first use. (Volta is not in CUDA 13; name it in TORCH_CUDA_ARCH_LIST.)
        if not torch.cuda.is_available():
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "7.5;8.0;9.0+PTX")
        return CUDAExtension(
            "fgpsdp_runtime._C", sources + cuda_sources, include_dirs=include,
            define_macros=[("FGPSDP_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-lineinfo"]},
            extra_link_args=_link_args())
    return CppExtension("fgpsdp_runtime._C", sources, include_dirs=include,
                        extra_compile_args={"cxx": cxx_flags}, extra_link_args=_link_args())


def _max_jobs() -> str:
    # nvcc and the torch headers take ~1.5 GiB per job; bound jobs by memory.
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = 8
    return str(max(1, min(os.cpu_count() or 1, int(mem_gib // 2))))


os.environ.setdefault("MAX_JOBS", _max_jobs())

setup(
    name="fgpsdp_runtime",
    version="0.1.0",
    description="Fine-grained partially sharded data parallel training for PyTorch",
    packages=find_packages(include=["fgpsdp_runtime", "fgpsdp_runtime.*"]),
    python_requires=">=3.9",
    # 2.4: the oldest torch the test suite was run on (docs/compatibility.md);
    # before 2.3 torch.amp.GradScaler, which ShardedGradScaler extends, is missing.
    install_requires=["torch>=2.4"],
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
