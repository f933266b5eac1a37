"""One timer for named ranges: a ``torch.profiler`` range, an NVTX range on CUDA (so Nsight and
Chrome traces show the same names), and, for ``Phases``, the wall time of each phase."""

from __future__ import annotations

import contextlib
import time

import torch


@contextlib.contextmanager
def profile_range(name: str, device: torch.device, *, synchronize: bool = False):
    """A profiler range named ``name``, with an NVTX range on a CUDA ``device``; with
    ``synchronize`` the range closes after the device's queued work has finished (a host sync:
    only where the range is to time that work)."""
    # Outside a profiler the range records nothing; entering it anyway costs a CPU decode
    # step about 3% (two operator calls through the dispatcher).
    recorded = torch.autograd._profiler_enabled()
    with torch.profiler.record_function(name) if recorded else contextlib.nullcontext():
        if device.type != "cuda":
            yield
            return
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if synchronize:
                torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()


class Phases:
    """Wall time per phase of a step (seconds by phase name), each phase a ``profile_range``
    closed after a device sync so that its time is its own work's."""

    def __init__(self, device: torch.device) -> None:
        self.seconds: dict[str, float] = {}
        self.device = device

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        with profile_range(name, self.device, synchronize=True):
            yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


class StepProfiler:
    """A ``torch.profiler`` trace of the first ``steps`` steps (none when 0), written as a
    Chrome trace to ``trace`` once they ran (or when the run ends first)."""

    def __init__(self, steps: int, trace) -> None:
        self.steps, self.trace = steps, trace
        self.profiler = None
        if steps and trace is not None:
            self.profiler = torch.profiler.profile()
            self.profiler.start()

    def step_done(self, steps_run: int) -> None:
        if self.profiler is not None and steps_run >= self.steps:
            self.stop()

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler.export_chrome_trace(str(self.trace))
            self.profiler = None
