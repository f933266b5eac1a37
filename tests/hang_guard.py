"""``within(seconds)``: a block that must not hang (a FIFO read would block forever) fails the
test instead of stopping the suite. Main thread only (SIGALRM)."""

from __future__ import annotations

import contextlib
import signal


class Hung(AssertionError):
    pass


@contextlib.contextmanager
def within(seconds: int):
    def fail(signum, frame):
        raise Hung(f"still running after {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
