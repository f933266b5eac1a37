"""select-data never overwrites what it did not write, and its rates are of the questions'
content (issue 28, item 4): `--out` on its own input turned 8 rows into 0 bytes, on a run's
ledger replaced it, and changed questions under the same ids reused stale pass rates."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hang_guard import within

from rlvr_fast.cli.main import main
from rlvr_fast.data.problems import save_problems
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.engine import RolloutEngine
from rlvr_fast.models.policy import load_policy
from rlvr_fast.rollouts.selection import PassRange, SelectionSettings, rates_path, select_data

SETTINGS = SelectionSettings(model="tiny", k=2, max_new_tokens=16, seed=5)
PROBLEMS = synthetic_problems("train", 4, seed=4)


@pytest.fixture(scope="module")
def tiny():
    policy = load_policy("tiny")
    return policy, RolloutEngine.for_policy(policy, kv_blocks=256)


def select(tiny, out, problems=PROBLEMS, **kwargs):
    policy, engine = tiny
    return select_data(
        policy, engine, problems, SETTINGS, PassRange(0.0, 1.0), out, progress=False, **kwargs
    )


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_out_on_its_own_input_is_refused_and_the_input_kept(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    save_problems(synthetic_problems("train", 8), data)
    before = digest(data)
    argv = ["select-data", "--data", str(data), "--k", "2", "--out", str(data), "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out is the --data file" in err
    assert digest(data) == before
    assert sorted(os.listdir(tmp_path)) == ["train.jsonl"], "no rates file, no lock"


def test_out_on_a_runs_ledger_is_refused(tiny, tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match="ledger.jsonl: exists and select-data did not write it"):
        select(tiny, ledger)
    assert ledger.read_text() == '{"step": 0}\n'


def test_a_selection_is_replaced_by_its_own_rerun_but_never_when_it_is_the_data(tiny, tmp_path):
    out = tmp_path / "zpd.jsonl"
    select(tiny, out)
    first = digest(out)
    select(tiny, out, limit=2)
    assert digest(out) != first, "its own output: re-selected"
    with pytest.raises(ValueError, match="zpd.jsonl: --out is the --data file"):
        select(tiny, out, data_path=out)


def test_changed_questions_under_the_same_ids_are_not_read_from_the_old_rates(tiny, tmp_path):
    out = tmp_path / "zpd.jsonl"
    select(tiny, out)
    changed = [dataclasses.replace(PROBLEMS[0], question="What is 1 + 1?"), *PROBLEMS[1:]]
    with pytest.raises(ValueError, match="measured with other problems_sha256"):
        select(tiny, out, problems=changed)


def test_a_rates_file_that_is_a_fifo_is_refused_at_once(tiny, tmp_path):
    out = tmp_path / "zpd.jsonl"
    os.mkfifo(rates_path(out))
    with within(30), pytest.raises(ValueError, match=r"not a regular file \(a FIFO\)"):
        select(tiny, out)


HOLD = """
import sys
from rlvr_fast.utils.locks import lock_output
lock_output(sys.argv[1])
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_second_select_data_on_one_out_is_refused_naming_the_first(tiny, tmp_path):
    out = tmp_path / "zpd.jsonl"
    root = str(Path(__file__).resolve().parents[2])
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(ValueError, match=f"zpd.jsonl: in use by process {holder.pid} "):
            select(tiny, out)
    finally:
        holder.communicate("")
    assert not rates_path(out).exists()


def test_help_names_the_rates_file_it_writes(capsys):
    with pytest.raises(SystemExit):
        main(["select-data", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"{rates_path(Path('OUT')).name} holds the rates measured so far" in help_text


def test_select_data_whose_lock_file_is_removed_stops_before_its_next_write(
    tiny, tmp_path, monkeypatch
):
    """Issue 39, item 1 for select-data: its lock (in the cache directory) removed while it
    runs: it stops at its next write, the selection unwritten."""
    from rlvr_fast.rollouts import selection
    from rlvr_fast.utils.locks import LockLostError, lock_output

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "zpd.jsonl"
    sample = selection.sample_groups

    def sample_then_lose_the_lock(*args, **kwargs):
        lock_output(out).path.unlink()
        return sample(*args, **kwargs)

    monkeypatch.setattr(selection, "sample_groups", sample_then_lose_the_lock)
    with pytest.raises(LockLostError, match="was removed or replaced"):
        select(tiny, out, batch_questions=2)
    assert not out.exists()
    assert len(rates_path(out).read_text().splitlines()) == 1, "the header, no batch"
