"""Benchmark harness shared by every ``bench_<op>.py``: labels each benchmark as the eager
reference or the fast path of a group (so the summary prints their ratio) and measures peak
memory above what was live before the call."""

from __future__ import annotations

from pathlib import Path

import torch

PROC_STATUS = Path("/proc/self/status")
PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def mark(benchmark, group: str, role: str, *, work: float = 0.0, unit: str = "") -> None:
    benchmark.group = group
    benchmark.extra_info.update(role=role, work=work, unit=unit)


def peak_memory_bytes(fn, device: torch.device) -> int:
    """Peak memory fn adds: CUDA allocator peak on GPU; on CPU the peak resident set (VmHWM,
    reset through /proc/self/clear_refs) above the resident set before the call."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    PROC_CLEAR_REFS.write_text("5")
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) * 1024


def _status_kib(field: str) -> int:
    for line in PROC_STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from {PROC_STATUS}")
