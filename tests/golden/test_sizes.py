"""Sizes that keep the code readable (read from the source): no module over 600 lines, no class
over 350, no function over 120, and at most 12 modules directly in ``rlvr_fast/``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "rlvr_fast").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))
MAX_MODULE, MAX_CLASS, MAX_FUNCTION, MAX_TOP_LEVEL = 600, 350, 120, 12


def spans(path: Path):
    """(kind, qualified name, lines) of every class and function in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                yield kind, name, child.end_lineno - child.lineno + 1
                yield from walk(child, name + ".")

    yield from walk(tree, "")


def test_no_module_class_or_function_is_too_long():
    too_long = []
    for path in SOURCES:
        where = path.relative_to(ROOT)
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE:
            too_long.append(f"{where}: {lines} lines")
        for kind, name, count in spans(path):
            limit = MAX_CLASS if kind == "class" else MAX_FUNCTION
            if count > limit:
                too_long.append(f"{where}: {kind} {name} {count} lines")
    assert not too_long, "\n".join(too_long)


def test_the_top_level_holds_few_modules():
    modules = sorted(p.name for p in (ROOT / "rlvr_fast").glob("*.py"))
    assert len(modules) <= MAX_TOP_LEVEL, modules
