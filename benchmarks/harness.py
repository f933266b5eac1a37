"""Benchmark harness shared by every ``bench_<op>.py``: labels each benchmark as the eager
reference or the fast path of a group (so the summary prints their ratio) and measures peak
memory above what was live before the call; ``LiveBytes`` counts what operations allocate, storage
by storage (on the meta device too: the memory plan's tests); ``PhasePeaks`` the peak resident
set of each phase of a run."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that operations made and that are still alive; ``peak`` of that
    total minus ``discount()`` over every operation."""

    def __init__(self, ignore=(), discount=lambda: 0) -> None:
        super().__init__()
        self.ignore = {t.untyped_storage()._cdata for t in ignore}
        self.discount = discount
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def live(self) -> int:
        self.storages = {k: v for k, v in self.storages.items() if not v[0].expired()}
        return sum(size for _, size in self.storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage._cdata
                known = self.storages.get(key)
                if key not in self.ignore and (known is None or known[0].expired()):
                    self.storages[key] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.live() - self.discount())
        return out


class PhasePeaks:
    """The peak resident set (bytes) of each labelled phase of a run: at every change of label
    the kernel's peak since the previous change (``VmHWM``, restarted there through
    /proc/self/clear_refs) goes to the label that was current, so no peak falls between two
    samples; ``rises`` holds the most each phase's peak rose above the resident set it started
    from (the allocator keeps freed pages resident, so a phase after a larger one shows that
    one's peak; its rise is its own). Labels nest (a phase inside another is its own; the outer
    one resumes after it); what runs under no phase is ``base``."""

    def __init__(self, base: str = "other") -> None:
        self.stack = [base]
        self.peaks: dict[str, int] = {}
        self.rises: dict[str, int] = {}
        self.started = _status_kib("VmRSS") * 1024
        PROC_CLEAR_REFS.write_text("5")

    def switch(self) -> None:
        label, peak = self.stack[-1], _status_kib("VmHWM") * 1024
        self.peaks[label] = max(self.peaks.get(label, 0), peak)
        self.rises[label] = max(self.rises.get(label, 0), peak - self.started)
        PROC_CLEAR_REFS.write_text("5")
        self.started = _status_kib("VmRSS") * 1024

    def enter(self, name: str) -> None:
        self.switch()
        self.stack.append(name)

    def leave(self) -> None:
        self.switch()
        self.stack.pop()

    @contextlib.contextmanager
    def phase(self, name: str):
        self.enter(name)
        try:
            yield
        finally:
            self.leave()

    def label(self, owner, attribute: str, name: str) -> None:
        """``owner.attribute`` (a method or function) runs as phase ``name`` from now on."""
        function = getattr(owner, attribute)

        @functools.wraps(function)
        def labelled(*args, **kwargs):
            with self.phase(name):
                return function(*args, **kwargs)

        setattr(owner, attribute, labelled)

    def close(self) -> dict[str, int]:
        """The peaks, the current phase's included."""
        self.switch()
        return self.peaks
