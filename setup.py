"""Builds rlvr_fast, installs kernels/ as rlvr_fast.kernels, and compiles csrc/*.cpp into rlvr_fast._C.

Metadata lives in pyproject.toml; this file only adds what needs code: the package_dir mapping and
the C++ extension (built only when csrc/ has sources). RLVR_FAST_EXTENSION=inplace leaves the
extension out of an install: `make install` builds it with `setup.py build_ext --inplace` while pip
installs the dependencies.

The sources compile as one translation unit (build/rlvr_fast_C.cpp includes each csrc/*.cpp):
parsing torch's headers is most of a file's compile, so ten files cost ten parses — 280 s of CPU
against 48 s for the one unit (g++ -O3, torch 2.13). Each source still compiles on its own (the
scalar build in scripts/check_scalar_build.py compiles two of them).
"""

import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
CPP_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
CPP_HEADERS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.h"))
UNITY_SOURCE = ROOT / "build" / "rlvr_fast_C.cpp"


def unity_source() -> str:
    """Writes the one translation unit (only when its text changes: a new mtime would rebuild)."""
    text = "".join(f'#include "{ROOT / source}"\n' for source in CPP_SOURCES)
    if not UNITY_SOURCE.exists() or UNITY_SOURCE.read_text() != text:
        UNITY_SOURCE.parent.mkdir(exist_ok=True)
        UNITY_SOURCE.write_text(text)
    return str(UNITY_SOURCE.relative_to(ROOT))


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
        [unity_source()],
        extra_compile_args=["-O3", "-g0", "-std=c++17", "-ffp-contract=off", "-fopenmp"],
        extra_link_args=["-fopenmp"],
        depends=CPP_SOURCES + CPP_HEADERS,
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
