"""Wall-clock time of grading calls under threads, against the per-item budget.

    python scripts/grading_budget.py [--threads 4] [--rounds 3] [--timeout 2.0]

Each thread grades, round after round, the same mix: answers that run past any budget
(``9^{9^{9^{9}}}``, ``(10^6)!``, ``(x+1)^{100000}``), answers sympy or math-verify settle in
milliseconds, and a 10 MB boxed response.  Prints the slowest call, the slowest call that came
right after a timed-out one in the same thread (what a worker restart would cost), and the
budget + 0.5 s bound.  The pool is started before timing, as a trainer's first step does.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from rlvr_fast.grading import grade, grade_response

PATHOLOGICAL = [("9^{9^{9^{9}}}", "1"), ("(10^6)!", "1"), ("(x+1)^{100000}", "(x+1)^{100001}")]
QUICK = [("\\sqrt{8}", "2\\sqrt{2}"), ("x^2+2x+1", "(x+1)^2"), ("\\binom{5}{2}", "10")]
HUGE_BOX = "We find \\boxed{" + "1" * 10_000_000 + "}"


def one_thread(rounds: int, timeout: float) -> list[tuple[str, float]]:
    """(kind, seconds) of every call, in order; kind is "slow", "quick" or "huge"."""
    calls = []
    for _ in range(rounds):
        for slow, quick in zip(PATHOLOGICAL, QUICK):
            for kind, (pred, gold) in (("slow", slow), ("quick", quick)):
                start = time.monotonic()
                grade(pred, gold, timeout=timeout)
                calls.append((kind, time.monotonic() - start))
        start = time.monotonic()
        grade_response(HUGE_BOX, "1", timeout=timeout)
        calls.append(("huge", time.monotonic() - start))
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args()
    grade("\\sqrt{8}", "2\\sqrt{2}")  # start the pool
    with ThreadPoolExecutor(args.threads) as threads:
        per_thread = list(
            threads.map(lambda _: one_thread(args.rounds, args.timeout), range(args.threads))
        )
    calls = [call for thread in per_thread for call in thread]
    after_slow = [
        seconds
        for thread in per_thread
        for (before, _), (_, seconds) in zip(thread, thread[1:])
        if before == "slow"
    ]
    print(
        f"{args.threads} threads x {len(per_thread[0])} calls, budget {args.timeout:g} s: "
        f"slowest call {max(s for _, s in calls):.2f} s, slowest call after a timeout "
        f"{max(after_slow):.2f} s, 10 MB box {max(s for k, s in calls if k == 'huge'):.3f} s; "
        f"bound {args.timeout + 0.5:g} s"
    )


if __name__ == "__main__":
    main()
