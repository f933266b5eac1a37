"""``benchmarks.harness.PhasePeaks``: each phase gets the peak resident set reached while it
was current, a nested phase its own, and a labelled method runs as its phase."""

from __future__ import annotations

import numpy as np

from benchmarks.harness import PhasePeaks

MB = 2**20


def touched(megabytes: int) -> np.ndarray:
    """``megabytes`` of resident memory (every page written)."""
    return np.ones(megabytes * MB, dtype=np.uint8)


def test_each_phase_gets_its_own_peak():
    peaks = PhasePeaks()
    with peaks.phase("big"):
        block = touched(160)
        del block
    with peaks.phase("small"):
        block = touched(8)
        with peaks.phase("inner"):
            inner = touched(80)
            del inner
        del block
    result = peaks.close()
    assert set(result) == {"other", "big", "small", "inner"}
    # big's 160 MB came and went before small started: small never saw them
    assert result["big"] - result["small"] > 100 * MB
    assert result["inner"] - result["small"] > 50 * MB
    # each phase's rise is its own, whatever stayed resident before it
    assert peaks.rises["big"] > 150 * MB and peaks.rises["inner"] > 75 * MB
    assert peaks.rises["small"] < 50 * MB


def test_a_labelled_method_runs_as_its_phase():
    class Worker:
        def work(self, megabytes):
            block = touched(megabytes)
            return len(block)

    worker = Worker()
    peaks = PhasePeaks()
    peaks.label(worker, "work", "work")
    assert worker.work(120) == 120 * MB
    assert peaks.stack == ["other"]
    result = peaks.close()
    assert result["work"] - result["other"] > 80 * MB
