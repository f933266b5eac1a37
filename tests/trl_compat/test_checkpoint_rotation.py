"""The facade's save_total_limit as transformers' own (issue 39, item 4): limits <= 0 keep every
checkpoint, and rotation only ever touches the checkpoints the run wrote (recorded in their
manifests), never a user's directory, a user's file inside one, or a symlink; two trainers on
one output_dir both finish."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import TrainerCallback

from rlvr_fast.models.policy import TINY_MODEL_DIR
from rlvr_fast.trl_compat import GRPOConfig, GRPOTrainer

SETTINGS = dict(
    max_steps=3,
    num_generations=4,
    per_device_train_batch_size=4,
    max_completion_length=8,
    learning_rate=1e-3,
    save_strategy="steps",
    save_steps=1,
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
)
ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]


def varied(completions, **kwargs):
    return [float(len(c) % 3) for c in completions]


def trainer_for(out: Path, callbacks=None, **settings) -> GRPOTrainer:
    args = GRPOConfig(output_dir=str(out), **{**SETTINGS, **settings})
    return GRPOTrainer(
        model=str(TINY_MODEL_DIR),
        reward_funcs=varied,
        args=args,
        train_dataset=ROWS,
        callbacks=callbacks,
    )


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob("checkpoint-*"))


@pytest.mark.parametrize("limit", [0, -1, None])
def test_a_limit_of_zero_or_less_keeps_every_checkpoint(tmp_path, limit):
    """Regression: save_total_limit=0 or -1 kept only the newest checkpoint."""
    trainer_for(tmp_path, save_total_limit=limit).train()
    assert checkpoints(tmp_path) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_a_users_checkpoint_directories_and_files_are_never_rotated(tmp_path):
    """Regression: a user's checkpoint-99 sorted as newest, so save_total_limit=1 deleted every
    checkpoint the run wrote; a user's file inside checkpoint-1/ was deleted; a symlinked
    checkpoint-0 killed train() (OSError: Cannot call rmtree on a symbolic link)."""
    (tmp_path / "checkpoint-99").mkdir(parents=True)
    (tmp_path / "checkpoint-99" / "mine.txt").write_text("keep")
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("keep")
    (tmp_path / "checkpoint-0").symlink_to(elsewhere)

    class NoteInCheckpointOne(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 1:
                (tmp_path / "checkpoint-1" / "notes.txt").write_text("mine")

    trainer_for(tmp_path, callbacks=[NoteInCheckpointOne()], save_total_limit=1).train()
    assert (tmp_path / "checkpoint-99" / "mine.txt").read_text() == "keep"
    assert (elsewhere / "precious.txt").read_text() == "keep"
    assert (tmp_path / "checkpoint-0").is_symlink()
    assert sorted(p.name for p in (tmp_path / "checkpoint-1").iterdir()) == ["notes.txt"]
    assert not (tmp_path / "checkpoint-2").exists()
    assert (tmp_path / "checkpoint-3" / "trainer_state.json").is_file()


def test_a_resumed_run_rotates_the_checkpoints_it_wrote_before(tmp_path):
    trainer_for(tmp_path, max_steps=2).train()
    manifest = json.loads((tmp_path / "checkpoint-2" / "rlvr_fast" / "manifest.json").read_text())
    assert manifest["checkpoints_written"] == ["checkpoint-1", "checkpoint-2"]
    trainer_for(tmp_path, save_total_limit=1).train(resume_from_checkpoint=True)
    assert checkpoints(tmp_path) == ["checkpoint-3"]


def test_two_trainers_on_one_output_dir_both_finish(tmp_path):
    """Regression: two trainers on one output_dir, one crashed with FileNotFoundError. Here the
    second trains (and rotates) inside the first one's first save."""
    second = trainer_for(tmp_path, save_total_limit=1)

    class TrainTheOther(TrainerCallback):
        done = False

        def on_save(self, args, state, control, **kwargs):
            if not self.done:
                self.done = True
                second.train()

    first = trainer_for(tmp_path, callbacks=[TrainTheOther()], save_total_limit=2)
    assert first.train().global_step == 3
    assert second.state.global_step == 3
    assert (tmp_path / "checkpoint-3" / "trainer_state.json").is_file()
