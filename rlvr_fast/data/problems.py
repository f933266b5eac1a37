"""Problem data: the ``Problem`` record, the prompt template and the dataset loaders.

What is implemented here, exactly:

* ``Problem`` -- one math problem with its gold answer (a frozen dataclass).
* ``render_prompt`` -- the study's prompt template, character for character.
* ``load_problems`` / ``save_problems`` -- read ``.json`` / ``.jsonl`` files in the
  MATH / MATH-500, GSM8K and AMC-style row formats (detected per row), and write
  problems back as JSONL atomically.  Any malformed input raises ``DataError``
  whose message names the file, the location (``path:LINE`` for JSONL lines and
  JSON syntax errors, ``path:item N`` for the N-th element of a JSON array) and
  the offending field.
* the synthetic arithmetic task of the embedded default is ``rlvr_fast.data.synthetic``.

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rlvr_fast.utils.files import (
    UnreadableFileError,
    file_kind,
    open_regular,
    read_text,
    unique_keys,
    write_text_atomic,
)

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
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(
            f"{path}: not a regular file ({file_kind(path.stat().st_mode)}); data is a .json or "
            ".jsonl file"
        )
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
    decoder = json.JSONDecoder(object_pairs_hook=unique_keys)
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
        return json.loads(text, object_pairs_hook=unique_keys)
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
