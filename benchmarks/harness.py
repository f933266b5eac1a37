"""Benchmark harness shared by every ``bench_<op>.py``: labels each benchmark as the eager
reference or the fast path of a group, so the summary can print their ratio."""

from __future__ import annotations


def mark(benchmark, group: str, role: str, *, work: float = 0.0, unit: str = "") -> None:
    benchmark.group = group
    benchmark.extra_info.update(role=role, work=work, unit=unit)
