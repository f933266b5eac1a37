"""Shared benchmark harness: every fast path runs beside its eager reference in the same session.

A benchmark marks itself with ``mark(benchmark, group, role, work=..., unit=...)``; role is
"eager" (the reference) or "fast". At the end of a timed run (``pytest benchmarks --benchmark``,
``make bench``) the summary prints, per group, each side's mean time, throughput (work / s),
memory traffic (``extra_info["bytes"]`` per call, as GB/s) where a benchmark states it, and the
eager/fast speed ratio. ``--benchmark`` times the benchmarks only (``--benchmark-only``) and
writes pytest-benchmark's JSON to ``benchmarks/results/benchmarks-STAMP.json`` unless
``--benchmark-json`` names a file. Under ``--benchmark-disable`` (CI's smoke check) each
benchmark body simply runs once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

RESULTS = Path(__file__).parent / "results"


def pytest_addoption(parser):
    parser.addoption(
        "--benchmark",
        action="store_true",
        help="time every benchmark beside its eager reference, print the ratio "
        "table and write the JSON to benchmarks/results/",
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-benchmark reads its options
def pytest_configure(config):
    if not config.getoption("benchmark"):
        return
    config.option.benchmark_only = True
    if config.option.benchmark_json is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        config.option.benchmark_json = RESULTS / f"benchmarks-{stamp}.json"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or session.disabled or not session.benchmarks:
        return
    groups: dict[str, dict[str, object]] = {}
    failed: dict[str, list[str]] = {}
    for bench in session.benchmarks:
        if bench.has_error:  # it raised: no timings, and no ratio for its group
            failed.setdefault(bench.group, []).append(bench.name)
        elif bench.stats is not None and "role" in bench.extra_info:
            groups.setdefault(bench.group, {})[bench.extra_info["role"]] = bench
    terminalreporter.section("fast path vs eager (same run)")
    for group in sorted(set(groups) | set(failed)):
        sides = groups.get(group, {})
        line = [f"{group}:"] + [f"{name} FAILED;" for name in failed.get(group, [])]
        for role in ("eager", "fast"):
            bench = sides.get(role)
            if bench is None:
                continue
            mean = bench.stats.mean
            work, unit = bench.extra_info["work"], bench.extra_info["unit"]
            rate = f", {work / mean:,.0f} {unit}/s" if work else ""
            peak = bench.extra_info.get("peak_mib")
            memory = f", peak +{peak:,.0f} MiB" if peak is not None else ""
            moved = bench.extra_info.get("bytes")
            traffic = f", {moved / mean / 1e9:,.0f} GB/s" if moved is not None else ""
            line.append(f"{role} {bench.name} {mean * 1e3:.1f} ms{rate}{memory}{traffic};")
        if "eager" in sides and "fast" in sides:
            line.append(f"speed-up {sides['eager'].stats.mean / sides['fast'].stats.mean:.2f}x")
            peaks = [sides[r].extra_info.get("peak_mib") for r in ("eager", "fast")]
            if None not in peaks and peaks[1] > 0:
                line.append(f"memory {peaks[0] / peaks[1]:.2f}x less")
        terminalreporter.write_line(" ".join(line))
    for bench in session.benchmarks:
        counts = bench.extra_info.get("counts")
        if bench.stats is not None and not bench.has_error and counts:
            terminalreporter.write_line(
                f"{bench.name}: "
                + ", ".join(
                    f"{key} {value:,}" if isinstance(value, int) else f"{key} {value:.3f}"
                    for key, value in counts.items()
                )
            )
