"""The package's layers, read from the source (AST): a module imports only modules of its own
layer or of a lower one. ``LAYERS`` lists the layers from the bottom up; a module belongs to the
layer of the longest prefix that names it. ``KNOWN_VIOLATIONS`` holds the upward imports that
exist today: the test fails on a new one, and on a listed one that no longer exists (so the
list can only shrink)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rlvr_fast"

LAYERS: list[tuple[str, ...]] = [
    ("rlvr_fast.utils", "rlvr_fast._C", "rlvr_fast.kernels"),
    ("rlvr_fast.ops", "rlvr_fast.grading"),
    ("rlvr_fast.models", "rlvr_fast.data"),
    ("rlvr_fast.engine",),
    ("rlvr_fast.rollouts",),
    ("rlvr_fast.credit",),
    ("rlvr_fast.ledger",),
    ("rlvr_fast.run",),
    ("rlvr_fast.train",),
    ("rlvr_fast.analysis",),
    ("rlvr_fast.cli", "rlvr_fast.trl_compat", "rlvr_fast.demo", "rlvr_fast"),
]

KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    if path.is_relative_to(ROOT / "kernels"):
        parts = ["rlvr_fast", "kernels", *path.relative_to(ROOT / "kernels").with_suffix("").parts]
    else:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(name: str) -> bool:
    return name.endswith("__init__")


def sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))


def known_modules() -> set[str]:
    return {module_name(path) for path in sources()} | {"rlvr_fast._C"}


def imported(path: Path, modules: set[str]) -> set[str]:
    """The rlvr_fast modules that ``path`` imports, anywhere in it (function bodies too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                # ``from pkg import sub`` imports the submodule when there is one.
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in modules else source)
    return {m for m in found if m == "rlvr_fast" or m.startswith("rlvr_fast.")}


def layer(name: str) -> int:
    best, rank = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    if rank is None:
        raise AssertionError(f"{name} is in no layer: add it to LAYERS")
    return rank


def upward_imports() -> set[tuple[str, str]]:
    modules = known_modules()
    found = set()
    for path in sources():
        source = module_name(path)
        for target in imported(path, modules):
            if layer(target) > layer(source):
                found.add((source, target))
    return found


def test_every_module_is_in_a_layer():
    for name in sorted(known_modules()):
        layer(name)


def test_no_module_imports_from_a_higher_layer():
    found = upward_imports()
    new = sorted(found - KNOWN_VIOLATIONS)
    assert not new, "imports from a higher layer:\n" + "\n".join(f"{a} -> {b}" for a, b in new)
    gone = sorted(KNOWN_VIOLATIONS - found)
    assert not gone, "fixed, remove from KNOWN_VIOLATIONS:\n" + "\n".join(
        f"{a} -> {b}" for a, b in gone
    )


def test_importing_the_ops_loads_no_driver_module():
    """``import rlvr_fast.ops`` (and the engine) stays light: the top-level names are lazy."""
    import subprocess
    import sys

    heavy = ("train", "grading", "ledger", "analysis", "credit", "run", "rollouts", "trl_compat")
    script = (
        "import sys, rlvr_fast.ops, rlvr_fast.engine; "
        "print('\\n'.join(m for m in sys.modules if m.startswith('rlvr_fast')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split()
    assert "rlvr_fast.ops" in loaded
    assert [m for m in loaded if m.split(".")[1:2] and m.split(".")[1] in heavy] == []


def test_every_public_name_imports_from_the_top_level():
    import rlvr_fast

    for name in rlvr_fast.__all__:
        assert getattr(rlvr_fast, name).__name__ == name
    assert set(rlvr_fast.__all__) <= set(dir(rlvr_fast))
