"""Issue 28's facade cases: GRPOTrainer stops on non-finite values as the CLI does (and will not
save such a model), and its ledger=True run directories pass verify, reward functions that
score nothing (TRL's None) included."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlvr_fast.analysis.verify import verify_run
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import TINY_MODEL_DIR
from rlvr_fast.train.nonfinite import NonFiniteError
from rlvr_fast.trl_compat import GRPOConfig, GRPOTrainer

ROWS = [{"prompt": render_prompt(p.question)} for p in synthetic_problems("train", 2, seed=5)]
SETTINGS = dict(
    max_steps=2,
    num_generations=4,
    per_device_train_batch_size=4,
    max_completion_length=8,
    use_cpu=True,
    disable_tqdm=True,
    save_strategy="no",
)


def varied(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


def none_for_some(completion_ids, **kwargs):
    return [None if i % 2 else 1.0 for i in range(len(completion_ids))]


def none_for_all(completion_ids, **kwargs):
    return [None] * len(completion_ids)


def facade(tmp_path, reward, **settings):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**SETTINGS, **settings})
    return GRPOTrainer(
        model=str(TINY_MODEL_DIR), reward_funcs=reward, args=args, train_dataset=ROWS
    )


def test_nonfinite_training_stops_and_save_model_refuses(tmp_path):
    trainer = facade(tmp_path, varied)
    with torch.no_grad():  # what a diverged step leaves (load_model refuses such a file)
        next(trainer.policy.model.parameters())[0, 0] = math.nan
    with pytest.raises(NonFiniteError, match=r"step 0: non-finite .*allow_nonfinite=True"):
        trainer.train()
    with pytest.raises(NonFiniteError, match="not finite"):
        trainer.save_model()
    assert not (tmp_path / "out").exists()


def test_a_learning_rate_past_float32_is_refused():
    with pytest.raises(ValueError, match=r"lr must be in \(0, 1e30\], got 1e\+38"):
        facade(Path(), varied, learning_rate=1e38)


@pytest.mark.parametrize("reward", [varied, none_for_some, none_for_all])
def test_a_ledger_run_passes_verify(tmp_path, reward):
    facade(tmp_path, reward, ledger=True).train()
    verification = verify_run(tmp_path / "out" / "ledger")
    assert verification.ok, "\n".join(verification.lines())


def test_a_ledger_run_stopped_by_a_callback_is_unfinished(tmp_path):
    from transformers import TrainerCallback

    class StopAtOnce(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = True

    trainer = facade(tmp_path, varied, ledger=True)
    trainer.add_callback(StopAtOnce())
    trainer.train()
    assert all(torch.isfinite(p).all() for p in trainer.policy.model.parameters())
    failures = [f for c in verify_run(tmp_path / "out" / "ledger").checks for f in c.failures]
    assert failures == ["unfinished run: 1 of 2 steps, no summary.json"]
