"""Agreement of each grading mode with the expected verdicts of a case table.

    python scripts/grading_agreement.py [tests/grading/grading_heldout.tsv] [--timeout SECONDS]

The table is tab-separated: prediction, gold, expected (1 / 0), answer form; lines starting
with ``#`` are comments.  Prints, per mode, the agreement, the false accepts (graded correct,
expected wrong), the false rejects, the items/s of ``grade_many`` and every disagreement.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rlvr_fast.grading import MODES, judge_many
from rlvr_fast.grading.grader import DEFAULT_TIMEOUT_S

DEFAULT_TABLE = Path(__file__).resolve().parents[1] / "tests" / "grading" / "grading_heldout.tsv"


def read_cases(path: Path) -> list[tuple[str, str, bool, str]]:
    cases = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            pred, gold, expected, form = line.split("\t")
            cases.append((pred, gold, expected == "1", form))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", nargs="?", type=Path, default=DEFAULT_TABLE)
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="each item's wall-clock budget in seconds (default: the grader's, %(default)s); "
        "a machine busy with other work needs more for the same verdicts",
    )
    args = parser.parse_args()
    table = args.table
    if not table.is_file():
        print(f"grading_agreement: error: {table}: no such file", file=sys.stderr)
        raise SystemExit(2)
    cases = read_cases(table)
    for mode in MODES:
        start = time.perf_counter()
        verdicts = judge_many(
            [c[0] for c in cases], [c[1] for c in cases], mode=mode, timeout=args.timeout
        )
        seconds = time.perf_counter() - start
        agree = sum(v.correct == c[2] for v, c in zip(verdicts, cases))
        false_accepts = sum(v.correct and not c[2] for v, c in zip(verdicts, cases))
        false_rejects = sum(not v.correct and c[2] for v, c in zip(verdicts, cases))
        print(
            f"{mode}: agreement {agree}/{len(cases)} = {100 * agree / len(cases):.1f}%, "
            f"false accepts {false_accepts}, false rejects {false_rejects}, "
            f"{len(cases) / seconds:,.0f} items/s"
        )
        for verdict, (pred, gold, expected, form) in zip(verdicts, cases):
            if verdict.correct != expected:
                print(f"    [{form}] {pred!r} vs {gold!r}: expected {expected}, {verdict.reason}")


if __name__ == "__main__":
    main()
