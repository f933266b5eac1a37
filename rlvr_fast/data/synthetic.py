"""The synthetic arithmetic task: ``synthetic_problems`` / ``worked_solution``, a seeded task
used as the embedded default data on the CPU (a tiny model is pre-trained on worked solutions of
it and RL then trains on it).

Synthetic task levels (all operands are integers; questions use ASCII `` * ``):

1. ``a + b`` or ``a - b`` with a, b in 100..999 and a >= b for subtraction.
2. ``a + b + c`` or ``a + b - c`` with a, b, c in 10..99 and a result >= 0.
3. ``a * b`` with a in 10..999 and b in 2..9.
4. ``(a + b) * c`` with a, b in 10..99 and c in 2..9.

Every expression belongs to exactly one split, fixed by a SHA-256 hash of its
canonical key (e.g. ``"4|(23+45)*7"``): bucket 0 of 20 is ``test``, bucket 1 is
``val``, the rest is ``train``.  The seed only changes which problems of a split
are drawn, so splits stay disjoint for every seed.  Small levels run out: level 3
has 7,920 expressions (384 in val, 421 in test); once a level's pool in a split is used up, the round-robin over levels continues
with the remaining ones, and ``ValueError`` is raised only when all are used up.

A synthetic problem keeps its canonical expression in ``Problem.solution`` (e.g.
``"(23 + 45) * 7"``) so ``Problem`` stays generic and ``worked_solution`` needs
no side registry.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import add, mul, sub

from rlvr_fast.data.problems import MAX_PROBLEMS, Problem

SPLITS = ("train", "val", "test")
STYLES = ("derive", "guess")
LEVELS = (1, 2, 3, 4)

_TWO_DIGIT = range(10, 100)
_THREE_DIGIT = range(100, 1000)
_TWO_OR_THREE_DIGIT = range(10, 1000)
_ONE_DIGIT = range(2, 10)
_OPERAND_RANGES = {
    1: (_THREE_DIGIT, _THREE_DIGIT),
    2: (_TWO_DIGIT, _TWO_DIGIT, _TWO_DIGIT),
    3: (_TWO_OR_THREE_DIGIT, _ONE_DIGIT),
    4: (_TWO_DIGIT, _TWO_DIGIT, _ONE_DIGIT),
}
_OPERATOR_CHOICES = {
    1: (("+",), ("-",)),
    2: (("+", "+"), ("+", "-")),
    3: (("*",),),
    4: (("+", "*"),),
}
_OPERATIONS = {"+": add, "-": sub, "*": mul}
_HASH_BUCKETS = 20
_SPLIT_OF_BUCKET = {0: "test", 1: "val"}  # every other bucket is "train"
# Rejections are normal (19 of 20 draws miss the test split), so the exact pool
# size is only consulted after a long run of misses hints that a pool is empty.
_MISSES_BEFORE_POOL_CHECK = 1000

_GENERIC_TEMPLATES = (
    "What is {expr}?",
    "Compute {expr}.",
    "Calculate {expr}.",
    "Evaluate {expr}.",
    "Find the value of {expr}.",
)
_WORD_TEMPLATES = {
    ("+",): "{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
    ("-",): "{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?",
    ("+", "+"): (
        "{name} has {a} {item}, gets {b} more, and then {c} more. "
        "How many {item} does {name} have now?"
    ),
    ("+", "-"): (
        "{name} has {a} {item}, gets {b} more, and then gives away {c}. "
        "How many {item} does {name} have left?"
    ),
}
_NAMES = ("Sam", "Ana", "Leo", "Mia")
DERIVATION_OPENER = "Let's solve it step by step."
_ITEMS = ("apples", "marbles", "stickers", "coins")


@dataclass(frozen=True)
class _Expression:
    level: int
    numbers: tuple[int, ...]
    operators: tuple[str, ...]

    @property
    def text(self) -> str:
        """Display form with spaces, e.g. ``(23 + 45) * 7``."""
        if self.level == 4:
            a, b, c = self.numbers
            return f"({a} + {b}) * {c}"
        tokens = [str(self.numbers[0])]
        for operator, number in zip(self.operators, self.numbers[1:]):
            tokens += [operator, str(number)]
        return " ".join(tokens)

    @functools.cached_property
    def key(self) -> str:
        """Canonical key that decides the split, e.g. ``4|(23+45)*7``."""
        return f"{self.level}|{self.text.replace(' ', '')}"

    @property
    def value(self) -> int:
        # Left to right is also the right order for level 4's "(a + b) * c".
        result = self.numbers[0]
        for operator, number in zip(self.operators, self.numbers[1:]):
            result = _apply(result, operator, number)
        return result


def synthetic_problems(
    split: str, n: int, *, seed: int = 0, levels: Sequence[int] = LEVELS
) -> list[Problem]:
    """Draw ``n`` distinct problems of ``split``, cycling through ``levels`` in turn."""
    _check_choice("split", split, SPLITS)
    if not 0 <= n <= MAX_PROBLEMS:
        raise ValueError(
            f"n must be in [0, {MAX_PROBLEMS:,}] (the size limit of a problem set), got {n:,}"
        )
    for level in levels:
        _check_choice("level", level, LEVELS)
    if not levels:
        raise ValueError("levels must not be empty")
    rng = random.Random(f"{seed}-{split}")
    taken: set[str] = set()
    taken_per_level: Counter[int] = Counter()
    active_levels = list(levels)
    problems: list[Problem] = []
    while len(problems) < n:
        if not active_levels:
            raise ValueError(
                f"only {len(problems)} distinct {split!r} problems exist for levels "
                f"{tuple(levels)}; asked for {n}"
            )
        level = active_levels[len(problems) % len(active_levels)]
        expression = _draw_unused(level, split, rng, taken, taken_per_level[level])
        if expression is None:
            active_levels = [other for other in active_levels if other != level]
            continue
        taken.add(expression.key)
        taken_per_level[level] += 1
        problems.append(_synthetic_problem(expression, split, len(problems), rng))
    return problems


def worked_solution(problem: Problem, style: str) -> str:
    """Completion text that follows the prompt's ``Answer:`` (so it starts with a space).

    ``guess`` is just the boxed answer.  ``derive`` opens with one fixed line (so
    the choice between the two modes is a single first-token decision), writes one
    small operation per line (``x op y = z``), then the boxed answer on its own
    final line.
    """
    _check_choice("style", style, STYLES)
    expression = _expression_of(problem)
    box = f"\\boxed{{{expression.value}}}"
    if style == "guess":
        return f" {box}"
    lines = [DERIVATION_OPENER, *_derivation(expression), "The final answer is:", box]
    return " " + "\n".join(lines)


def _check_choice(name: str, value: object, valid: Sequence[object]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(map(str, valid))}")


def _split_of(expression: _Expression) -> str:
    # hashlib, not hash(): Python salts str hashes per process.
    digest = hashlib.sha256(expression.key.encode("ascii")).digest()
    return _SPLIT_OF_BUCKET.get(int.from_bytes(digest[:8], "big") % _HASH_BUCKETS, "train")


def _draw_unused(
    level: int, split: str, rng: random.Random, taken: set[str], taken_at_level: int
) -> _Expression | None:
    """A random expression of ``split`` not in ``taken``; None once the pool is used up."""
    misses = 0
    while True:
        expression = _random_expression(level, rng)
        if expression.key not in taken and _split_of(expression) == split:
            return expression
        misses += 1
        if misses % _MISSES_BEFORE_POOL_CHECK == 0 and taken_at_level >= _pool_size(level, split):
            return None


def _random_expression(level: int, rng: random.Random) -> _Expression:
    # Drawing from the operand box and rejecting invalid shapes (a < b for a
    # subtraction, a negative result) keeps the draw uniform over valid ones.
    while True:
        operators = rng.choice(_OPERATOR_CHOICES[level])
        numbers = tuple(rng.choice(values) for values in _OPERAND_RANGES[level])
        expression = _Expression(level, numbers, operators)
        if _is_valid(expression):
            return expression


def _all_expressions(level: int) -> Iterator[_Expression]:
    for operators in _OPERATOR_CHOICES[level]:
        for numbers in itertools.product(*_OPERAND_RANGES[level]):
            expression = _Expression(level, numbers, operators)
            if _is_valid(expression):
                yield expression


@functools.cache
def _pool_size(level: int, split: str) -> int:
    return sum(1 for expression in _all_expressions(level) if _split_of(expression) == split)


def _is_valid(expression: _Expression) -> bool:
    level, numbers, operators = expression.level, expression.numbers, expression.operators
    if level not in _OPERATOR_CHOICES or operators not in _OPERATOR_CHOICES[level]:
        return False
    ranges = _OPERAND_RANGES[level]
    if len(numbers) != len(ranges) or any(n not in r for n, r in zip(numbers, ranges)):
        return False
    if level == 1 and operators == ("-",):
        return numbers[0] >= numbers[1]
    return expression.value >= 0


def _synthetic_problem(
    expression: _Expression, split: str, index: int, rng: random.Random
) -> Problem:
    return Problem(
        id=f"syn-{split}-{index:05d}",
        question=_question_for(expression, rng),
        answer=str(expression.value),
        source="synthetic",
        level=expression.level,
        solution=expression.text,
    )


def _question_for(expression: _Expression, rng: random.Random) -> str:
    word_template = _WORD_TEMPLATES.get(expression.operators)
    templates = _GENERIC_TEMPLATES + ((word_template,) if word_template else ())
    template = rng.choice(templates)
    if template is word_template:
        operands = dict(zip("abc", expression.numbers))
        return template.format(**operands, name=rng.choice(_NAMES), item=rng.choice(_ITEMS))
    return template.format(expr=expression.text)


def _expression_of(problem: Problem) -> _Expression:
    """Recover the canonical expression stored in a synthetic problem's ``solution``."""
    if problem.source != "synthetic" or problem.solution is None or problem.level is None:
        raise ValueError(f"problem {problem.id!r} is not a synthetic problem with its expression")
    tokens = problem.solution.replace("(", " ").replace(")", " ").split()
    numbers, operators = tokens[0::2], tuple(tokens[1::2])
    expression = None
    if all(token.isdecimal() for token in numbers):
        expression = _Expression(problem.level, tuple(map(int, numbers)), operators)
    if expression is None or expression.text != problem.solution or not _is_valid(expression):
        raise ValueError(
            f"problem {problem.id!r}: {problem.solution!r} is not a level-{problem.level} expression"
        )
    if str(expression.value) != problem.answer:
        raise ValueError(f"problem {problem.id!r}: answer {problem.answer!r} != {expression.value}")
    return expression


def _derivation(expression: _Expression) -> list[str]:
    a, b = expression.numbers[:2]
    first = expression.operators[0]
    if len(expression.operators) == 1:
        return _steps(a, first, b)
    # Levels 2 and 4 chain two single-operation derivations.
    second, c = expression.operators[1], expression.numbers[2]
    partial = _apply(a, first, b)
    return [
        f"First, {a} {first} {b}.",
        *_steps(a, first, b),
        f"Then, {partial} {second} {c}.",
        *_steps(partial, second, c),
    ]


def _steps(x: int, operator: str, y: int) -> list[str]:
    return {"+": _addition_steps, "-": _subtraction_steps, "*": _multiplication_steps}[operator](
        x, y
    )


def _addition_steps(x: int, y: int) -> list[str]:
    # Adding place by place leaves one-digit facts with zeros appended (40 + 50 = 90);
    # the partial sums are then combined from the largest place down.
    lines = ["We add by place value."]
    partials = []
    for unit in _place_units(max(x, y)):
        x_part, y_part = x // unit % 10 * unit, y // unit % 10 * unit
        if x_part and y_part:
            lines.append(f"{x_part} + {y_part} = {x_part + y_part}")
        if x_part or y_part:
            partials.append(x_part + y_part)
    total = partials[0]
    for partial in partials[1:]:
        lines.append(f"{total} + {partial} = {total + partial}")
        total += partial
    return lines


def _subtraction_steps(x: int, y: int) -> list[str]:
    # Taking y off x one place value at a time never goes below zero when x >= y.
    lines = ["We subtract by place value."]
    for part in _place_values(y):
        lines.append(f"{x} - {part} = {x - part}")
        x -= part
    return lines


def _place_units(number: int) -> list[int]:
    """Place units of ``number``, largest first: 347 -> [100, 10, 1]."""
    return [10**k for k in reversed(range(len(str(number))))]


def _multiplication_steps(x: int, digit: int) -> list[str]:
    # Splitting by place value leaves only one-digit facts with zeros appended
    # (900 * 9 = 8100), which a tiny model can learn; partial sums then add up.
    parts = _place_values(x)
    products = [part * digit for part in parts]
    lines = [f"Split {x} into {' + '.join(map(str, parts))}."] if len(parts) > 1 else []
    lines += [f"{part} * {digit} = {product}" for part, product in zip(parts, products)]
    total = products[0]
    for product in products[1:]:
        lines.append(f"{total} + {product} = {total + product}")
        total += product
    return lines


def _place_values(number: int) -> list[int]:
    """Non-zero place-value parts, largest first: 943 -> [900, 40, 3]."""
    digits = str(number)
    parts = [int(d) * 10 ** (len(digits) - 1 - i) for i, d in enumerate(digits) if d != "0"]
    return parts or [0]


def _apply(x: int, operator: str, y: int) -> int:
    return _OPERATIONS[operator](x, y)
