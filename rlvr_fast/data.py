"""Problem data: the prompt template, dataset loaders and the synthetic arithmetic task.

What is implemented here, exactly:

* ``Problem`` -- one math problem with its gold answer (a frozen dataclass).
* ``render_prompt`` -- the study's prompt template, character for character.
* ``load_problems`` / ``save_problems`` -- read ``.json`` / ``.jsonl`` files in the
  MATH / MATH-500, GSM8K and AMC-style row formats (detected per row), and write
  problems back as JSONL atomically.  Any malformed input raises ``DataError``
  whose message names the file, the location (``path:LINE`` for JSONL lines and
  JSON syntax errors, ``path:item N`` for the N-th element of a JSON array) and
  the offending field.
* ``synthetic_problems`` / ``worked_solution`` -- a seeded arithmetic task used as
  the embedded default data on CPU: a tiny model is pre-trained on worked
  solutions of it and RL then trains on it.

Row formats accepted by ``load_problems``:

* MATH / MATH-500: ``problem`` plus ``answer``, or ``problem`` plus ``solution``
  whose last ``\\boxed{}``/``\\fbox{}`` content is the answer.  ``level``
  ("Level 3" or 3) is kept when it parses, ``solution`` is kept, and so is the subject
  (``subject`` as MATH-500 names it, or a string ``type`` as MATH does; any row format).
* GSM8K: ``question`` plus a worked ``answer`` text ending in ``#### <x>`` (a
  ``question`` row whose string answer contains ``####`` or a newline and which has
  no ``solution`` key).  The gold answer is ``x`` without thousands commas and
  surrounding whitespace; the full answer text becomes ``solution``.
* AMC-style: ``problem`` or ``question`` plus an ``answer`` that is a string or a
  number (whole floats are written as ints: 36.0 -> "36").
* ``id`` comes from the first of ``id``, ``unique_id``, ``idx``, ``problem_id``
  present, else ``f"{file_stem}-{row_index}"`` (0-based); ids must be unique.
* ``source`` is the row's string ``source`` field when present (so files written
  by ``save_problems`` round-trip), else the file name.

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

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import random
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import add, mul, sub
from pathlib import Path

from rlvr_fast.files import UnreadableFileError, open_regular, read_text, write_text_atomic

# Input size limits: past them a set takes minutes and gigabytes to build or to tokenize, and no
# math problem set comes near them (MATH has 12,500 problems, its longest under 5,000 chars).
# A JSONL file is read line by line (memory follows the rows kept, not the file); a line holds
# one row, whose three texts of MAX_TEXT_CHARS take at most ~2 MB even escaped. A .json file is
# parsed whole, and a parse takes up to ~26 bytes of memory per byte of JSON (`[{}, {}, ...]`):
# its cap keeps that under 2 GB. Its top-level array is parsed row by row, so rows past a limit
# are never built.
MAX_PROBLEMS = 50_000
MAX_TEXT_CHARS = 100_000
MAX_FILE_BYTES = 512 << 20
MAX_LINE_BYTES = 4 << 20
MAX_JSON_FILE_BYTES = 64 << 20


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    answer: str
    source: str
    level: int | None = None
    solution: str | None = None
    subject: str | None = None

    def __post_init__(self) -> None:
        for name in ("id", "question", "answer", "source", "solution", "subject"):
            value = getattr(self, name)
            if value is None and name in ("solution", "subject"):
                continue
            if not isinstance(value, str):
                raise ValueError(f"Problem.{name} must be a string, got {_type_name(value)}")
            surrogate = lone_surrogate(value)
            if surrogate is not None:
                raise ValueError(f"Problem.{name}: {surrogate}")
        if self.level is not None and (
            isinstance(self.level, bool) or not isinstance(self.level, int)
        ):
            raise ValueError(f"Problem.level must be an integer or None, got {self.level!r}")


def lone_surrogate(text: str) -> str | None:
    """Why ``text`` is not text, when it holds a lone UTF-16 surrogate (JSON's "\\ud800"
    parses to one; no tokenizer or UTF-8 file can take it); None when it is text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"a lone surrogate U+{ord(text[err.start]):04X} at character {err.start}; not text"
    return None


def render_prompt(question: str) -> str:
    return (
        "You are a helpful math assistant.\n"
        "Answer the question and write the final result on a new line as:\n"
        "\\boxed{ANSWER}\n\n"
        f"Question:\n{question}\n\nAnswer:"
    )


class DataError(ValueError):
    """A data file is malformed; the message names file, line or item, and field."""


# ---------------------------------------------------------------------------
# Loading and saving
# ---------------------------------------------------------------------------

_ID_FIELDS = ("id", "unique_id", "idx", "problem_id")
_MATH_ANSWER_HINT = "MATH rows need 'problem' and 'answer' or a boxed 'solution'"


def load_problems(path: str | os.PathLike[str], *, limit: int | None = None) -> list[Problem]:
    """Read problems from a ``.json`` or ``.jsonl`` file (formats: module docstring)."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    path = Path(path)
    problems: list[Problem] = []
    first_seen: dict[str, str] = {}
    # islice stops before reading past ``limit`` rows, so later bad rows don't matter; one row
    # past the size limit is enough to refuse the file.
    rows = min(MAX_PROBLEMS + 1, MAX_PROBLEMS + 1 if limit is None else limit)
    for index, (where, row) in enumerate(itertools.islice(_read_rows(path), rows)):
        if index == MAX_PROBLEMS:
            raise DataError(
                f"{path}: more than {MAX_PROBLEMS:,} problems (the size limit of a problem set)"
            )
        problem = _parse_row(row, where, default_id=f"{path.stem}-{index}", file_name=path.name)
        if problem.id in first_seen:
            raise DataError(
                f"{where}: duplicate value {problem.id!r} in field 'id' "
                f"(first seen at {first_seen[problem.id]})"
            )
        first_seen[problem.id] = where
        problems.append(problem)
    return problems


def save_problems(problems: Iterable[Problem], path: str | os.PathLike[str]) -> None:
    """Write problems as JSONL; a crash never leaves a half-written file at ``path``."""
    path = Path(path)
    if path.suffix != ".jsonl":
        # load_problems picks the parser by suffix, so only .jsonl reads back.
        raise ValueError(f"{path}: save_problems writes JSONL; use a .jsonl path")
    write_text_atomic(
        path,
        "".join(json.dumps(dataclasses.asdict(p), ensure_ascii=False) + "\n" for p in problems),
    )


def _read_rows(path: Path) -> Iterator[tuple[str, object]]:
    """Rows with their location, ``path:LINE`` (JSONL) or ``path:item N`` (JSON array)."""
    if path.suffix == ".jsonl":
        return _jsonl_rows(path)
    if path.suffix == ".json":
        return _json_array_rows(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    raise DataError(f"{path}: unsupported file type {path.suffix!r} (expected .json or .jsonl)")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    # Lines end at b"\n" only: str.splitlines() would also break on U+2028 and friends,
    # which json.dumps(ensure_ascii=False) leaves raw inside strings.
    with _opened(path, MAX_FILE_BYTES, "problem file") as file:
        line_number = 0
        while line := file.readline(MAX_LINE_BYTES + 1):
            line_number += 1
            if len(line) > MAX_LINE_BYTES:
                raise DataError(
                    f"{path}:{line_number}: over {MAX_LINE_BYTES:,} bytes, the limit of a line"
                )
            text = _decoded(line.removeprefix(b"\xef\xbb\xbf") if line_number == 1 else line)
            if text is None:
                raise DataError(f"{path}:{line_number}: not valid UTF-8")
            if text.strip():
                yield f"{path}:{line_number}", _decode_json(text, path, line_number=line_number)


def _json_array_rows(path: Path) -> Iterator[tuple[str, object]]:
    try:
        text = read_text(path, MAX_JSON_FILE_BYTES, "JSON problem file (use .jsonl above it)")
    except UnreadableFileError as err:
        raise DataError(str(err)) from None
    start = len(text) - len(text.lstrip())
    if not text.startswith("[", start):
        document = _decode_json(text, path, line_number=None)
        yield from (
            (f"{path}:item {n}", row) for n, row in enumerate(_top_level_list(document, path), 1)
        )
        return
    for item_number, row in enumerate(_array_items(text, start + 1, path), start=1):
        yield f"{path}:item {item_number}", row


def _array_items(text: str, index: int, path: Path) -> Iterator[object]:
    """The items of the JSON array opening before ``text[index]``, one at a time."""
    decoder = json.JSONDecoder()
    index = _skip_space(text, index)
    if text.startswith("]", index):
        return _end_of_document(text, index + 1, path)
    while True:
        item, index = _raw_decode(decoder, text, index, path)
        yield item
        index = _skip_space(text, index)
        if text.startswith("]", index):
            return _end_of_document(text, index + 1, path)
        if not text.startswith(",", index):
            raise _syntax_error(text, index, path, "Expecting ',' delimiter")
        index = _skip_space(text, index + 1)


def _end_of_document(text: str, index: int, path: Path) -> None:
    if text[index:].strip():
        raise _syntax_error(text, _skip_space(text, index), path, "Extra data")


def _raw_decode(decoder: json.JSONDecoder, text: str, index: int, path: Path):
    try:
        return decoder.raw_decode(text, index)
    except json.JSONDecodeError as err:
        raise _syntax_error(text, err.pos, path, err.msg) from None
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply") from None
    except ValueError as err:  # an integer past sys.get_int_max_str_digits()
        line = text.count("\n", 0, index) + 1
        raise DataError(f"{path}:{line}: unreadable JSON ({_first_line(err)})") from None


def _syntax_error(text: str, position: int, path: Path, message: str) -> DataError:
    error = json.JSONDecodeError(message, text, position)
    return DataError(f"{path}:{error.lineno}: invalid JSON: {message} (column {error.colno})")


def _skip_space(text: str, index: int) -> int:
    while index < len(text) and text[index] in " \t\n\r":
        index += 1
    return index


@contextlib.contextmanager
def _opened(path: Path, limit: int, what: str):
    try:
        with open_regular(path, limit, what) as file:
            yield file
    except UnreadableFileError as err:
        raise DataError(str(err)) from None


def _decoded(line: bytes) -> str | None:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _decode_json(text: str, path: Path, *, line_number: int | None) -> object:
    """Parse ``text``; ``line_number`` is the file line of a JSONL line, None for a whole file."""
    where = path if line_number is None else f"{path}:{line_number}"
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        # A JSONL line is parsed on its own, so the decoder's line is always 1 there.
        line = err.lineno if line_number is None else line_number
        raise DataError(f"{path}:{line}: invalid JSON: {err.msg} (column {err.colno})") from err
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply") from None
    except ValueError as err:  # an integer past sys.get_int_max_str_digits()
        raise DataError(f"{where}: unreadable JSON ({_first_line(err)})") from None


def _first_line(err: Exception) -> str:
    return str(err).strip().split("\n")[0]


def _top_level_list(document: object, path: Path) -> list[object]:
    if isinstance(document, list):
        return document
    if isinstance(document, dict):
        lists = [value for value in document.values() if isinstance(value, list)]
        if len(lists) == 1:
            return lists[0]
    raise DataError(
        f"{path}: expected a JSON array of objects or an object with exactly one "
        f"list-valued key, got {_type_name(document)}"
    )


def _parse_row(row: object, where: str, *, default_id: str, file_name: str) -> Problem:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {_type_name(row)}")
    if "problem" in row:
        question = _required_text(row, "problem", where)
        answer, solution = _math_answer(row, where)
    elif "question" in row:
        question = _required_text(row, "question", where)
        answer, solution = (_gsm8k_answer if _is_gsm8k(row) else _plain_answer)(row, where)
    else:
        raise DataError(f"{where}: missing field 'problem' (or 'question')")
    source = row.get("source")
    if isinstance(source, str):
        source = _within_limit(source, "source", where)
    return Problem(
        id=_id_of(row, where) or default_id,
        question=question,
        answer=answer,
        source=source if isinstance(source, str) and source else file_name,
        level=_level_of(row, where),
        solution=solution,
        subject=_subject_of(row, where),
    )


def _is_gsm8k(row: dict[str, object]) -> bool:
    # GSM8K rows carry the worked solution in 'answer'; rows with an explicit
    # 'solution' key (ours, AMC-style) hold a short gold answer there instead.
    answer = row.get("answer")
    return (
        "solution" not in row and isinstance(answer, str) and ("####" in answer or "\n" in answer)
    )


def _math_answer(row: dict[str, object], where: str) -> tuple[str, str | None]:
    solution = _optional_text(row, "solution", where)
    if row.get("answer") is not None:
        return _answer_text(row["answer"], where), solution
    if solution is None:
        raise DataError(f"{where}: missing field 'answer' ({_MATH_ANSWER_HINT})")
    from rlvr_fast.grading import extract_boxed

    boxed = extract_boxed(solution)
    if boxed is None or not boxed.strip():
        raise DataError(
            f"{where}: field 'solution' has no balanced, non-empty \\boxed{{}} answer "
            f"and there is no 'answer' ({_MATH_ANSWER_HINT})"
        )
    return boxed.strip(), solution


def _gsm8k_answer(row: dict[str, object], where: str) -> tuple[str, str | None]:
    text = _within_limit(str(row["answer"]), "answer", where)
    _, marker, tail = text.rpartition("####")
    gold = tail.replace(",", "").strip()
    if not marker:
        raise DataError(f"{where}: field 'answer' has no '#### <answer>' line (GSM8K format)")
    if not gold:
        raise DataError(f"{where}: field 'answer' has nothing after '####' (GSM8K format)")
    return gold, text


def _plain_answer(row: dict[str, object], where: str) -> tuple[str, str | None]:
    if row.get("answer") is None:
        raise DataError(f"{where}: missing field 'answer' (rows with 'question' need an 'answer')")
    return _answer_text(row["answer"], where), _optional_text(row, "solution", where)


def _answer_text(value: object, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(
            f"{where}: field 'answer' must be a string or number, got {_type_name(value)}"
        )
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DataError(f"{where}: field 'answer' is not a finite number ({value})")
        value = int(value) if value.is_integer() else value
    text = str(value).strip()
    if not text:
        raise DataError(f"{where}: field 'answer' is empty")
    return _within_limit(text, "answer", where)


def _required_text(row: dict[str, object], field: str, where: str) -> str:
    value = row[field]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{field}' must be a string, got {_type_name(value)}")
    if not value.strip():
        raise DataError(f"{where}: field '{field}' is empty")
    return _within_limit(value.strip(), field, where)


def _within_limit(text: str, field: str, where: str) -> str:
    if len(text) > MAX_TEXT_CHARS:
        raise DataError(
            f"{where}: field '{field}' has {len(text):,} characters, over the "
            f"{MAX_TEXT_CHARS:,} limit"
        )
    surrogate = lone_surrogate(text)
    if surrogate is not None:
        raise DataError(f"{where}: field '{field}' holds {surrogate}")
    return text


def _optional_text(row: dict[str, object], field: str, where: str) -> str | None:
    if row.get(field) is None:
        return None
    return _required_text(row, field, where)


def _id_of(row: dict[str, object], where: str) -> str | None:
    for field in _ID_FIELDS:
        value = row.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise DataError(
                f"{where}: field '{field}' must be a string or integer, got {_type_name(value)}"
            )
        if not str(value).strip():
            raise DataError(f"{where}: field '{field}' is empty")
        return _within_limit(str(value).strip(), field, where)
    return None


def _level_of(row: dict[str, object], where: str) -> int | None:
    value = row.get("level")
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        # MATH writes "Level 3"; a few rows have "Level ?", which carries no level.
        match = re.fullmatch(r"\s*(?:level\s*)?(\d+)\s*", value, flags=re.IGNORECASE)
        return int(match.group(1)) if match else None
    raise DataError(f"{where}: field 'level' must be a string or integer, got {_type_name(value)}")


def _subject_of(row: dict[str, object], where: str) -> str | None:
    subject = _optional_text(row, "subject", where)
    if subject is not None:
        return subject
    # MATH's 'type' is its subject; other formats may use the key for something else.
    kind = row.get("type")
    return kind.strip() if isinstance(kind, str) and kind.strip() else None


def _type_name(value: object) -> str:
    names = {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
    }
    return names.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__
    )


# ---------------------------------------------------------------------------
# Synthetic arithmetic task
# ---------------------------------------------------------------------------

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
