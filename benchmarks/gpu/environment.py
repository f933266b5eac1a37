"""Stage 0 of the GPU suite: the machine, the versions that matter, and every runtime dependency
of rlvr_fast that is missing (the GPU machine installs the project with ``--no-deps`` and cannot
reach a registry, so a missing one is carried as a wheel; README "On a GPU"). Exits 1 when a
dependency is missing or CUDA is wanted and absent.

    python3 benchmarks/gpu/environment.py --device cuda
"""

from __future__ import annotations

import argparse
import platform
import sys
from importlib.metadata import PackageNotFoundError, requires, version

from packaging.requirements import Requirement

REPORTED = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "pytest",
    "pytest-benchmark",
    "pytest-xdist",
)


def installed_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def missing_dependencies() -> list[str]:
    """Requirements of the installed rlvr_fast (for this platform) that are not installed."""
    missing = []
    for line in requires("rlvr_fast") or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        found = installed_version(requirement.name)
        if found is None or found not in requirement.specifier:
            missing.append(f"{requirement} (installed: {found or 'none'})")
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="the device the suite runs on")
    args = parser.parse_args()
    import torch

    print(f"python {platform.python_version()} on {platform.machine()}")
    for name in REPORTED:
        print(f"{name} {installed_version(name) or 'not installed'}")
    cuda = torch.cuda.is_available()
    if cuda:
        properties = torch.cuda.get_device_properties(0)
        print(
            f"CUDA {torch.version.cuda}: {properties.name}, {properties.total_memory / 2**30:.0f} "
            f"GiB, {properties.multi_processor_count} SMs, sm_{properties.major}{properties.minor}"
        )
    else:
        print("CUDA: not available")
    try:
        missing = missing_dependencies()
    except PackageNotFoundError:
        missing = ["rlvr_fast itself (the install failed)"]
    for line in missing:
        print(f"MISSING runtime dependency: {line}")
    ok = not missing and (cuda or args.device == "cpu")
    if args.device == "cuda" and not cuda:
        print("the suite wants CUDA and torch sees no GPU")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
