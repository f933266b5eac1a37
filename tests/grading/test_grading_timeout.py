"""A grading timeout is a number of seconds in [0, 3600] (issue 28, item 12): NaN used to grade
every answer False silently, 1e300 to raise OverflowError from the pool's wait."""

from __future__ import annotations

import math

import pytest

from rlvr_fast.grading import grade, grade_response
from rlvr_fast.grading.grader import grade_many, judge


@pytest.mark.parametrize("timeout", [math.nan, 1e300, math.inf, -1.0, "2", True])
@pytest.mark.parametrize(
    "call",
    [
        lambda t: grade("1/2", "0.5", timeout=t),
        lambda t: judge("x^2", "x*x", timeout=t),
        lambda t: grade_response("so \\boxed{3}", "3", timeout=t),
        lambda t: grade_response("no box", "3", timeout=t),
        lambda t: grade_many(["1"], ["1"], timeout=t),
    ],
    ids=["grade", "judge", "grade_response", "grade_response without a box", "grade_many"],
)
def test_a_timeout_that_is_not_seconds_is_a_clear_value_error(call, timeout):
    with pytest.raises(ValueError, match="grading timeout must be") as err:
        call(timeout)
    assert "\n" not in str(err.value)


def test_zero_and_the_largest_timeout_are_accepted():
    assert grade("1/2", "0.5", timeout=0) is True, "the cheap stages settle it"
    assert grade("1/2", "0.5", timeout=3600) is True
