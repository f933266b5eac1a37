"""Answer extraction and answer-equivalence grading for math RLVR rewards.

What is implemented here, exactly (one job per module):

* ``extraction`` -- ``extract_boxed`` (last ``\\boxed{}``/``\\fbox{}``), ``passes_gate`` (the
  seed's 30-char gate), ``final_answer`` (gate, then the last box under the size cap).
* ``normalisation`` -- one canonical spelling of an answer (the list is in its docstring).
* ``structure`` -- tuples, intervals, sets, unions, solution lists, matrices, labelled items.
* ``numeric`` -- plain numbers: exactly written ones compare exactly, decimals with
  ``math.isclose`` semantics (relative 1e-6, absolute 1e-9); mixed numbers; undefined values
  (a zero denominator equals nothing).
* ``latex_sympy`` -- our LaTeX -> sympy converter and sympy equivalence.
* ``equivalence`` -- our pipeline: normalised strings, then numbers, then sympy, item by item.
* ``second_opinion`` -- math-verify, asked when our pipeline says a non-definite False.
* ``worker`` / ``pool`` / ``forkserver_preload`` -- worker processes that run sympy and
  math-verify under a deadline, forked warm; a pool of them keeps every caller, from any
  thread, within ``timeout`` + 0.25 s.
* ``tex`` -- TeX scanning (braced groups, macro arguments) shared by the modules above.
* ``grader`` -- ``grade`` / ``judge`` (one extracted answer), ``grade_response`` /
  ``judge_response`` (a full response), ``grade_many`` / ``judge_many`` (a batch over
  ``workers`` workers).  ``judge*`` return a ``Verdict`` with its reason.

Modes (``mode=``): ``"ours"``, ``"ours+math_verify"`` (default), ``"math_verify"``.  Limits:
``timeout`` (default 2.0 s per item, our sympy stage and math-verify together, wall clock);
answers over ``MAX_ANSWER_CHARS`` (1,000) are False without being parsed; scalars over
``MAX_SYMPY_CHARS`` (200) skip sympy.  Grading raises only on a bad argument (ValueError) or
when no worker can start at all (RuntimeError; scripts need an ``if __name__ ==
"__main__":`` guard because workers re-import the main script).
"""

from rlvr_fast.grading.extraction import MAX_ANSWER_CHARS, extract_boxed, final_answer, passes_gate
from rlvr_fast.grading.grader import (
    DEFAULT_MODE,
    DEFAULT_TIMEOUT_S,
    MODES,
    Verdict,
    grade,
    grade_many,
    grade_response,
    judge,
    judge_many,
    judge_response,
)
from rlvr_fast.grading.latex_sympy import MAX_SYMPY_CHARS
from rlvr_fast.grading.numeric import ABS_TOL, REL_TOL

__all__ = [
    "ABS_TOL",
    "DEFAULT_MODE",
    "DEFAULT_TIMEOUT_S",
    "MAX_ANSWER_CHARS",
    "MAX_SYMPY_CHARS",
    "MODES",
    "REL_TOL",
    "Verdict",
    "extract_boxed",
    "final_answer",
    "grade",
    "grade_many",
    "grade_response",
    "judge",
    "judge_many",
    "judge_response",
    "passes_gate",
]
