"""Builds rlvr_fast, installs kernels/ as rlvr_fast.kernels, and compiles csrc/*.cpp into rlvr_fast._C.

Metadata lives in pyproject.toml; this file only adds what needs code: the package_dir mapping and
the C++ extension (built only when csrc/ has sources). RLVR_FAST_EXTENSION=inplace leaves the
extension out of an install: `make install` builds it with `setup.py build_ext --inplace` while pip
installs the dependencies (a compile uses both cores; pip's unpacking one).
"""

import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
CPP_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
CPP_HEADERS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.h"))


def cpp_extension():
    if not CPP_SOURCES or os.environ.get("RLVR_FAST_EXTENSION") == "inplace":
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    # -ffp-contract=off: the compiler may fuse no multiply-add that torch does not fuse, or the
    # zero-gradient AdamW kernel stops being bitwise equal to torch.optim.AdamW.
    # -fopenmp: at::parallel_for is a header template that runs its loop through
    # `#pragma omp parallel` when torch is built with OpenMP; without the flag the pragma is
    # ignored and every "parallel" loop silently runs on one thread.
    # -g0: Python's own build flags ask for debug information, which makes each compile slower
    # and larger (module.o: 16 MB) for symbols nobody reads in a release build.
    extension = CppExtension(
        "rlvr_fast._C",
        CPP_SOURCES,
        extra_compile_args=["-O3", "-g0", "-std=c++17", "-ffp-contract=off", "-fopenmp"],
        extra_link_args=["-fopenmp"],
        depends=CPP_HEADERS,
    )
    return [extension], {"build_ext": BuildExtension}


ext_modules, cmdclass = cpp_extension()

setup(
    packages=find_packages(include=["rlvr_fast", "rlvr_fast.*"]) + ["rlvr_fast.kernels"],
    package_dir={"rlvr_fast.kernels": "kernels"},
    package_data={"rlvr_fast": ["assets/tiny/*", "assets/configs/*"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
