"""Reads of user files are bounded and refuse what is not a regular file, in one line naming
the path, before reading anything (issue 28, item 8): FIFOs used to hang every command, a link
to /dev/zero read until MemoryError."""

from __future__ import annotations

import os

import pytest
from hang_guard import within

from rlvr_fast.utils.files import (
    UnreadableFileError,
    parse_json,
    read_bytes,
    read_json,
    read_text,
    regular_file_inside,
)


def test_a_fifo_is_refused_at_once_not_read(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    with (
        within(10),
        pytest.raises(UnreadableFileError, match=r"config.json: not a regular file \(a FIFO\)"),
    ):
        read_json(tmp_path / "config.json", 1 << 20, "model config")


def test_a_link_to_dev_zero_is_refused_at_once(tmp_path):
    os.symlink("/dev/zero", tmp_path / "ledger.jsonl")
    with within(10), pytest.raises(UnreadableFileError, match="a character device"):
        read_text(tmp_path / "ledger.jsonl", 1 << 30, "step log")


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(UnreadableFileError, match="not a regular file \\(a directory\\)"):
        read_bytes(tmp_path, 10, "problem file")


def test_a_file_over_the_cap_is_refused_before_it_is_read(tmp_path):
    """A sparse 1 TiB file: refused from its size, in no time and no memory."""
    path = tmp_path / "big.json"
    with open(path, "wb") as file:
        file.truncate(1 << 40)
    with (
        within(10),
        pytest.raises(UnreadableFileError, match="over the 1,024-byte limit of a model config"),
    ):
        read_bytes(path, 1024, "model config")
    path.write_bytes(b"x" * 1024)
    assert read_bytes(path, 1024, "model config") == b"x" * 1024


def test_missing_and_unreadable_files_are_one_line(tmp_path):
    with pytest.raises(UnreadableFileError, match="missing.json: no such file"):
        read_bytes(tmp_path / "missing.json", 10, "problem file")
    (tmp_path / "bad.txt").write_bytes(b"ok\xff")
    with pytest.raises(
        UnreadableFileError, match=r"bad.txt: not valid UTF-8 \(invalid start byte at byte 2\)"
    ):
        read_text(tmp_path / "bad.txt", 10, "problem file")


@pytest.mark.parametrize(
    "text, message",
    [
        ("[" + "1" * 4301 + "]", "unreadable JSON \\(Exceeds the limit \\(4300 digits\\)"),
        ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
        (
            '{"a": 1,}',
            "invalid JSON \\(Expecting property name enclosed in double quotes at line 1, column 9\\)",
        ),
    ],
    ids=["an integer of 4,301 digits", "deep nesting", "a syntax error"],
)
def test_json_failures_are_one_line_naming_the_file(text, message):
    with pytest.raises(UnreadableFileError, match=f"^data/x.json: {message}") as caught:
        parse_json(text, "data/x.json")
    assert "\n" not in str(caught.value)


def test_model_files_may_link_inside_the_directory_only(tmp_path):
    """Regression: vocab.json linked to a file outside the model directory was copied, with that
    file's contents, into the run's final/."""
    model, outside = tmp_path / "model", tmp_path / "secret.txt"
    model.mkdir()
    outside.write_text("not yours")
    (model / "tokenizer.json").write_text("{}")
    os.symlink("tokenizer.json", model / "alias.json")
    os.symlink(outside, model / "vocab.json")
    os.symlink(model / "missing", model / "merges.txt")
    os.mkfifo(model / "special_tokens_map.json")
    assert regular_file_inside(model, "tokenizer.json") == model / "tokenizer.json"
    assert regular_file_inside(model, "alias.json") == model / "alias.json"
    assert regular_file_inside(model, "absent.json") is None
    with pytest.raises(
        UnreadableFileError, match="vocab.json: a symlink to .*secret.txt, outside the directory"
    ):
        regular_file_inside(model, "vocab.json")
    with pytest.raises(
        UnreadableFileError, match="merges.txt: not a regular file \\(a dangling symlink\\)"
    ):
        regular_file_inside(model, "merges.txt")
    with pytest.raises(UnreadableFileError, match="not a regular file \\(a FIFO\\)"):
        regular_file_inside(model, "special_tokens_map.json")
    assert regular_file_inside(model, "vocab.json", roots=[tmp_path]) == model / "vocab.json"
