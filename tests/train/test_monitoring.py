"""Monitoring a run while it trains (``rlvr_fast.train.monitor``): the loggers' scalars read back
from their files, evaluations and Hugging Face checkpoints during training, and that none of it
changes what the run trains."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file

from rlvr_fast.cli.main import main
from rlvr_fast.ledger.metrics import step_metrics
from rlvr_fast.run.layout import HF_CHECKPOINT_MARKER
from rlvr_fast.run.recorder import RunRecorder

SHORT = ["--set", "max_new_tokens=32", "--set", "eval_max_new_tokens=32", "--quiet"]
EVAL = ["--eval", "t=synthetic:test:4"]


def train(out, *extra, steps=4, arm="baseline"):
    argv = ["train", "--arm", arm, "--steps", str(steps), "--out", str(out), *SHORT, *extra]
    assert main(argv) == 0


def ledger(out) -> list[dict]:
    return [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]


def without_seconds(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in line.items() if k != "seconds"} for line in lines]


def test_tensorboard_holds_every_step_figures_under_trl_tags(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    train(out, *EVAL, "--report-to", "tensorboard", "--eval-every", "2")
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/reward", "train/accuracy", "train/loss", "train/grad_norm"):
        assert tag in tags
    assert {"train/tokens/gen", "train/seconds/rollout", "eval/t/accuracy"} <= tags
    for line in ledger(out):
        for name, value in step_metrics(line).items():
            (event,) = [e for e in events.Scalars(f"train/{name}") if e.step == line["step"] + 1]
            assert event.value == pytest.approx(value, rel=1e-6), name
    # Evaluated before (0), during (2) and after (4) training.
    assert [e.step for e in events.Scalars("eval/t/accuracy")] == [0, 2, 4]


def wandb_history(run_file) -> list[dict]:
    """The history rows of a W&B run file (LevelDB's log format: 32 KiB blocks of records with a
    7-byte header, after W&B's own 7-byte file header), each value as W&B's JSON."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending, rows = run_file.read_bytes(), 7, b"", []
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (kind == 0 and length == 0):
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


def test_wandb_runs_offline_without_a_login_and_logs_every_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "run"
    train(out, "--report-to", "wandb", steps=2)
    (run_file,) = out.glob("wandb/offline-run-*/run-*.wandb")
    rows = wandb_history(run_file)
    assert [row["_step"] for row in rows] == [1, 2]
    for row, line in zip(rows, ledger(out)):
        assert row["train/reward"] == pytest.approx(step_metrics(line)["reward"])
        assert row["train/loss"] == pytest.approx(line["loss"])


def test_report_to_refuses_an_unknown_logger_before_anything_is_written(tmp_path, capsys):
    argv = ["train", "--arm", "baseline", "--out", str(tmp_path / "run"), "--report-to", "mlflow"]
    assert main(argv) == 2
    assert (
        "--report-to 'mlflow': expected none or a comma-separated list" in capsys.readouterr().err
    )
    assert not (tmp_path / "run").exists()


def test_eval_every_writes_each_evaluation_and_changes_no_training_bit(tmp_path, capsys):
    train(tmp_path / "plain", *EVAL)
    out = tmp_path / "evaluated"
    train(out, *EVAL, "--eval-every", "1")
    assert without_seconds(ledger(out)) == without_seconds(ledger(tmp_path / "plain"))
    assert (out / "final" / "model.safetensors").read_bytes() == (
        tmp_path / "plain" / "final" / "model.safetensors"
    ).read_bytes()
    lines = [json.loads(line) for line in (out / "eval_steps.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3, 4]
    assert (
        lines[-1]["sets"]["t"] == json.loads((out / "summary.json").read_text())["eval_after"]["t"]
    )
    for step in (1, 2, 3):
        assert len((out / "evals" / f"step-{step}" / "t.jsonl").read_text().splitlines()) == 4
    assert not (tmp_path / "plain" / "eval_steps.jsonl").exists()
    # verify re-grades the evaluations during training and recounts their summaries.
    assert main(["verify", str(out)]) == 0
    assert "evals/step-3/t.jsonl 4" in capsys.readouterr().out
    lines[2]["sets"]["t"]["correct"] += 1
    (out / "eval_steps.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["verify", str(out)]) == 1
    assert "eval_steps.jsonl step 2 t.correct: recorded" in capsys.readouterr().out
    (out / "eval_steps.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines[:2]))
    # report draws the accuracy at each evaluation beside the ledger's curves.
    assert main(["report", str(out), "--out", str(tmp_path / "report")]) == 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "](eval_over_steps.png)" in report and "](training_over_steps.png)" in report


def test_save_every_writes_checkpoints_that_transformers_and_eval_load(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "run"
    train(out, "--save-every", "2")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    final = load_file(out / "final" / "model.safetensors")
    saved = load_file(out / "checkpoint-4" / "model.safetensors")
    assert final.keys() == saved.keys() and all(torch.equal(final[k], saved[k]) for k in final)
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "checkpoint-2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "checkpoint-2")
    ids = tokenizer("1 + 1 =", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] >= len(tokenizer)
    capsys.readouterr()
    assert main(["eval", str(out / "checkpoint-2"), *EVAL, "--max-new-tokens", "32"]) == 0
    assert capsys.readouterr().out.startswith("t: ")


def test_save_total_limit_deletes_only_the_run_own_older_checkpoints(tmp_path):
    out = tmp_path / "run"
    train(out, "--save-every", "1", steps=2)
    # A checkpoint-N/ the run did not write: another run's marker, and none at all.
    shutil.copytree(out / "checkpoint-1", out / "checkpoint-0")
    (out / "checkpoint-0" / HF_CHECKPOINT_MARKER).write_text('{"run": "another", "steps": 0}')
    (out / "checkpoint-9").mkdir()
    train(out, "--save-every", "1", "--save-total-limit", "2", "--resume", steps=4)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [
        "checkpoint-0",
        "checkpoint-3",
        "checkpoint-4",
        "checkpoint-9",
    ]


def test_a_resume_drops_the_evaluations_after_its_checkpoint(tmp_path):
    recorder = RunRecorder(tmp_path)
    lines = [{"step": s, "sets": {}} for s in (0, 2, 4)]
    recorder.layout.eval_steps.write_text(
        "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 6, "se'
    )
    recorder.lock = type("Held", (), {"check": lambda self: None})()
    recorder.keep_eval_steps(2)
    kept = recorder.layout.eval_steps.read_text().splitlines()
    assert [json.loads(line)["step"] for line in kept] == [0, 2]


@pytest.mark.parametrize(
    "option, message",
    [
        (["--eval-every", "2"], "--eval-every N evaluates the --eval sets: give at least one"),
        (["--save-total-limit", "2"], "--save-total-limit limits the checkpoints of --save-every"),
        (["--save-every", "-1"], "--save-every must be >= 0, got -1"),
    ],
)
def test_bad_monitoring_options_are_refused_in_one_line(tmp_path, capsys, option, message):
    assert main(["train", "--arm", "baseline", "--out", str(tmp_path / "run"), *option]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_resumed_run_monitors_as_one_that_was_not_stopped(tmp_path):
    tensorboard = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    options = [
        *EVAL,
        "--eval-every",
        "1",
        "--report-to",
        "tensorboard",
        "--set",
        "checkpoint_every=1",
    ]
    train(tmp_path / "whole", *options)
    out = tmp_path / "resumed"
    train(out, *options, steps=2)
    train(out, *options, "--resume")
    assert without_seconds(ledger(out)) == without_seconds(ledger(tmp_path / "whole"))
    history = [(out / "eval_steps.jsonl"), (tmp_path / "whole" / "eval_steps.jsonl")]
    resumed, whole = ([json.loads(line) for line in p.read_text().splitlines()] for p in history)
    assert [line["step"] for line in resumed] == [0, 1, 2, 3, 4]
    assert [line["sets"] for line in resumed] == [line["sets"] for line in whole]
    events = tensorboard.EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/reward")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("eval/t/accuracy")] == [0, 1, 2, 3, 4]


def test_a_checkpoint_swap_cut_by_a_kill_is_restored_by_the_resume(tmp_path):
    out = tmp_path / "run"
    train(out, "--save-every", "2", steps=2)
    # Killed between the swap's two renames: the old directory moved aside, no new one yet.
    (out / "checkpoint-2").rename(out / ".checkpoint-2.old")
    train(out, "--save-every", "2", "--resume", steps=3)
    assert (out / "checkpoint-2" / "model.safetensors").is_file()
    assert not (out / ".checkpoint-2.old").exists()
