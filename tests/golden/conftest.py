"""The golden test's closing line: which of its two paths the session took (bit for bit, or
determinism and figures within tolerance), read from the property each golden test leaves on its
report (reports come back from xdist's workers with their properties)."""

from __future__ import annotations

GOLDEN_PATH = "golden_path"


def pytest_terminal_summary(terminalreporter):
    paths: dict[str, int] = {}
    diverged: list[str] = []
    for report in terminalreporter.stats.get("passed", []):
        if report.when != "call":
            continue
        for name, value in getattr(report, "user_properties", []):
            if name == GOLDEN_PATH:
                paths[value] = paths.get(value, 0) + 1
            elif name == f"{GOLDEN_PATH}_diverged":
                diverged.append(value)
    for path, arms in paths.items():
        line = f"golden outputs: {path} ({arms} arms passed)"
        if diverged:
            line += f"; rollouts compared up to a near-tie: {', '.join(diverged)}"
        terminalreporter.write_line(line)
