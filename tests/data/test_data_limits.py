"""Problem files are read bounded and every failure is one line naming the file (issue 28,
items 8, 10, 12): a lone surrogate used to be a TypeError from the tokenizer, a 4,301-digit
integer a ValueError naming nothing, a FIFO a hang, a 150 MB JSON of `{}` 3.9 GB of memory."""

from __future__ import annotations

import json
import os
import re
import tracemalloc

import pytest
from hang_guard import within

from rlvr_fast.data.problems import (
    MAX_JSON_FILE_BYTES,
    MAX_LINE_BYTES,
    DataError,
    Problem,
    load_problems,
    render_prompt,
)
from rlvr_fast.models.policy import TINY_MODEL_DIR
from rlvr_fast.models.tokenizer import Tokenizer


def one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_lone_surrogate_in_a_question_is_one_line_naming_the_row(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text('{"problem": "ok", "answer": "1"}\n{"problem": "x \\ud800 y", "answer": "2"}\n')
    with pytest.raises(DataError) as err:
        load_problems(path)
    assert one_line(err) == (
        f"{path}:2: field 'problem' holds a lone surrogate U+D800 at character 2; not text"
    )


@pytest.mark.parametrize("field", ["answer", "id", "source", "solution"])
def test_a_lone_surrogate_in_any_text_field_is_refused(tmp_path, field):
    path = tmp_path / "set.jsonl"
    row = {"problem": "ok", "answer": "1", field: "\udfff"}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=f"set.jsonl:1: field '{field}' holds a lone surrogate"):
        load_problems(path)


def test_endoftext_inside_a_question_stays_text_in_the_prompt(tmp_path):
    """Regression: `<|endoftext|>` inside a question became an EOS token in the prompt. The
    question loads as written; the tokenizer encodes the spelling as characters."""
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({"problem": "1 + 1 <|endoftext|>?", "answer": "2"}) + "\n")
    (problem,) = load_problems(path)
    assert problem.question == "1 + 1 <|endoftext|>?"
    tokenizer = Tokenizer.from_directory(TINY_MODEL_DIR)
    assert tokenizer.eos_token_id not in tokenizer.encode(render_prompt(problem.question))


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(answer=None), "Problem.answer must be a string, got null"),
        (dict(question=3), "Problem.question must be a string, got a number"),
        (dict(question="\ud800"), "Problem.question: a lone surrogate U+D800 at character 0"),
        (dict(level="3"), "Problem.level must be an integer or None, got '3'"),
    ],
)
def test_a_problem_is_refused_at_construction(fields, message):
    """Regression: Problem(answer=None) was accepted (and graded every answer wrong)."""
    base = dict(id="p", question="What is 1 + 1?", answer="2", source="api")
    with pytest.raises(ValueError, match=re.escape(message)):
        Problem(**{**base, **fields})


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_an_integer_of_4301_digits_is_one_line_naming_the_file(tmp_path, suffix):
    path = tmp_path / f"set{suffix}"
    row = '{"problem": "big", "answer": ' + "7" * 4301 + "}"
    path.write_text(row + "\n" if suffix == ".jsonl" else f"[\n{row}\n]")
    with pytest.raises(DataError) as err:
        load_problems(path)
    assert one_line(err).startswith(f"{path}:")
    assert "Exceeds the limit (4300 digits)" in str(err.value)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_fifo_or_a_link_to_dev_zero_is_refused_at_once(tmp_path, suffix):
    """Regression: a FIFO as an eval file hung `train` and `eval` forever."""
    fifo, zero = tmp_path / f"fifo{suffix}", tmp_path / f"zero{suffix}"
    os.mkfifo(fifo)
    os.symlink("/dev/zero", zero)
    with within(20):
        with pytest.raises(DataError, match=r"not a regular file \(a FIFO\)"):
            load_problems(fifo)
        with pytest.raises(DataError, match=r"not a regular file \(a character device\)"):
            load_problems(zero)


def test_a_json_array_is_parsed_row_by_row(tmp_path):
    """Regression: a 150 MB JSON of `{}` took 3.9 GB before the first row was looked at. Now
    the first bad row stops the read, and a limit stops it after that many rows: memory stays
    near the file's size."""
    path = tmp_path / "set.json"
    path.write_text("[" + ", ".join(["{}"] * 2_000_000) + "]")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="set.json:item 1: missing field 'problem'"):
            load_problems(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * size, f"peak {peak:,} bytes for a {size:,}-byte file"
    good = '{"problem": "q", "answer": "1", "id": "%d"}'
    path.write_text("[" + ", ".join(good % i for i in range(3)) + ", not json]")
    assert [p.id for p in load_problems(path, limit=3)] == ["0", "1", "2"]
    with pytest.raises(DataError, match="set.json:1: invalid JSON: Expecting value"):
        load_problems(path)


def test_json_syntax_errors_keep_their_line_and_column(tmp_path):
    path = tmp_path / "set.json"
    path.write_text('[\n{"problem": "q", "answer": "1"}\n{"problem": "r", "answer": "2"}\n]')
    with pytest.raises(
        DataError, match="set.json:3: invalid JSON: Expecting ',' delimiter \\(column 1\\)"
    ):
        load_problems(path)
    path.write_text('[{"problem": "q", "answer": "1"}] trailing')
    with pytest.raises(DataError, match="set.json:1: invalid JSON: Extra data \\(column 35\\)"):
        load_problems(path)
    path.write_text('{"rows": [{"problem": "q", "answer": "1"}]}')
    assert [p.question for p in load_problems(path)] == ["q"], "an object with one list"


def test_a_json_file_over_its_cap_and_a_jsonl_line_over_its_cap_are_refused_unread(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as file:
        file.truncate(MAX_JSON_FILE_BYTES + 1)
    with (
        within(20),
        pytest.raises(DataError, match="limit of a JSON problem file \\(use .jsonl above it\\)"),
    ):
        load_problems(big)
    long = tmp_path / "long.jsonl"
    long.write_text('{"problem": "q", "answer": "1"}\n' + " " * (MAX_LINE_BYTES + 1) + "\n")
    with pytest.raises(DataError, match=f"long.jsonl:2: over {MAX_LINE_BYTES:,} bytes"):
        load_problems(long)
