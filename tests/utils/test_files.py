"""The one atomic-write helper: a failed or killed writer leaves the old file whole, its temp
files are cleaned on start, and a directory swap cut between its renames is undone."""

from __future__ import annotations

import os

import pytest

from rlvr_fast.utils.files import (
    append_line,
    atomic_path,
    files_into,
    remove_stale_files,
    replaced_directory,
    write_json_atomic,
    write_text_atomic,
)
from rlvr_fast.utils.locks import lock_directory


class Killed(Exception):
    pass


def test_a_writer_that_fails_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "config.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(Killed):
        with atomic_path(path) as temp:
            temp.write_text("half")
            raise Killed
    assert path.read_text() == '{\n  "a": 1\n}\n'
    assert os.listdir(tmp_path) == ["config.json"]


def test_stale_temp_files_are_removed_on_start(tmp_path):
    """A SIGKILL skips the writer's cleanup: its temp file stays until the next start. Only
    the names our writers use go; look-alikes of other programs stay."""
    (tmp_path / "evals").mkdir()
    # .tmpAbC123: safetensors' own temp file, found beside a checkpoint killed mid-save.
    for name in (
        ".config.json.abc12345.tmp",
        "evals/.t.jsonl.x1y2z3w4.tmp",
        "keep.jsonl",
        ".keep",
        ".tmpfile",
        ".notes.tmp",
        ".tmpAB12CD",
    ):
        (tmp_path / name).write_text("x")
    (tmp_path / "evals/.tmpAbC123").write_bytes((2).to_bytes(8, "little") + b"{}")
    (tmp_path / ".final.q1w2e3r4.tmp").mkdir()
    with lock_directory(tmp_path) as lock:
        removed = remove_stale_files(lock, ["final"])
    assert len(removed) == 4
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        ".keep",
        ".notes.tmp",
        ".rlvr_fast.lock",
        ".tmpAB12CD",
        ".tmpfile",
        "evals",
        "keep.jsonl",
    ]


def test_a_leftover_final_old_does_not_break_the_next_save(tmp_path):
    """A kill between the swap's two renames left .final.old and no final/: the next save
    succeeds and leaves only the new directory (it used to fail and move files away)."""
    (tmp_path / ".final.old").mkdir()
    (tmp_path / ".final.old" / "tokenizer.json").write_text("old")
    with replaced_directory(tmp_path / "final") as staging:
        (staging / "model.safetensors").write_text("new")
        (staging / "tokenizer.json").write_text("new")
    assert sorted(os.listdir(tmp_path)) == ["final"]
    assert (tmp_path / "final" / "tokenizer.json").read_text() == "new"


def test_a_directory_swap_cut_between_its_renames_is_undone_on_start(tmp_path):
    (tmp_path / ".final.old").mkdir()
    (tmp_path / ".final.old" / "model.safetensors").write_text("last good")
    (tmp_path / ".thesis.old").mkdir()
    lock = lock_directory(tmp_path)
    remove_stale_files(lock, ["final"])
    assert (tmp_path / "final" / "model.safetensors").read_text() == "last good"
    listing = [".rlvr_fast.lock", ".thesis.old", "final"]
    assert sorted(os.listdir(tmp_path)) == listing, "only a swapped directory's .old is ours"
    (tmp_path / ".final.old").mkdir()
    remove_stale_files(lock, ["final"])
    lock.release()
    assert sorted(os.listdir(tmp_path)) == listing, "a finished swap's .old is removed"


def test_a_failed_directory_write_leaves_the_old_directory(tmp_path):
    write_text_atomic(tmp_path / "final" / "config.json", "old")
    with pytest.raises(Killed):
        with replaced_directory(tmp_path / "final") as staging:
            (staging / "config.json").write_text("new")
            raise Killed
    assert (tmp_path / "final" / "config.json").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["final"]


def test_appended_lines_are_whole(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    append_line(path, '{"step": 0}')
    append_line(path, '{"step": 1}')
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'


def test_files_into_adds_files_whole_and_keeps_the_rest(tmp_path):
    """A Hugging Face save_model into a directory that also holds checkpoints and a ledger run
    replaces its own files and leaves every other entry; a failed write changes nothing."""
    (tmp_path / "out" / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "out" / "config.json").write_text("old")
    with files_into(tmp_path / "out") as staging:
        (staging / "config.json").write_text("new")
        (staging / "model.safetensors").write_text("weights")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "checkpoint-2",
        "config.json",
        "model.safetensors",
    ]
    assert (tmp_path / "out" / "config.json").read_text() == "new"
    with pytest.raises(RuntimeError), files_into(tmp_path / "out") as staging:
        (staging / "config.json").write_text("newer")
        raise RuntimeError
    assert (tmp_path / "out" / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "no staging directory left"


def test_one_atomic_write_helper():
    """Renames and temp files live in rlvr_fast/utils/files.py only: every other writer goes through
    it (there used to be five, each with its own temp-file names)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sources = [
        p
        for folder in ("rlvr_fast", "scripts")
        for p in (root / folder).rglob("*.py")
        if p != root / "rlvr_fast" / "utils" / "files.py"
    ]
    writers = (
        "os.replace(",
        "os.rename(",
        "tempfile.mkstemp",
        "shutil.move(",
        "NamedTemporaryFile",
    )
    found = [
        f"{p.relative_to(root)}: {w}"
        for p in sources
        for w in writers
        if w in p.read_text(encoding="utf-8")
    ]
    assert not found, found
