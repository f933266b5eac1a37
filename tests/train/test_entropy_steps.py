"""TRL's entropy options on the native trainer: an adaptive entropy run (zero-reward groups
pulled by the bonus, over the top-entropy tokens) resumes after a kill to the same bytes, its
controller state in the checkpoint; verify re-derives each step's coefficient and catches a
changed one; the control is TRL's; the combinations rlvr_fast cannot honour are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from rlvr_fast.analysis.verify import verify_run
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import load_policy
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.policy import EntropyControl, entropy_coefficients
from rlvr_fast.train.trainer import RLVRTrainer
from killed_runs import kill_during_step

# The tiny model's entropies straddle 0.5 nats: the coefficient moves both ways.
ADAPTIVE_RUN = dict(
    steps=4,
    checkpoint_every=2,
    group_size=2,
    max_new_tokens=6,
    eval_before=False,
    lr=1e-3,
    loss_order="token_weighted",
    loss_type="grpo",
    use_adaptive_entropy=True,
    entropy_coef=0.02,
    entropy_target=0.5,
    entropy_coef_delta=0.01,
    top_entropy_quantile=0.5,
)


def trainer(out_dir, resume=False):
    config = TrainConfig.from_arm("zg_flat", **ADAPTIVE_RUN)
    problems = synthetic_problems("train", 3, seed=4)
    return RLVRTrainer(
        load_policy("tiny"), config, problems, out_dir=out_dir, resume=resume, progress=False
    )


def ledger(out_dir) -> list[dict]:
    lines = [json.loads(x) for x in (out_dir / "ledger.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k != "seconds"} for line in lines]


def test_an_adaptive_entropy_run_resumes_to_the_same_bytes_and_verifies(tmp_path):
    whole = trainer(tmp_path / "whole")
    whole.train()
    interrupted = trainer(tmp_path / "resumed")
    kill_during_step(interrupted, 3)
    resumed = trainer(tmp_path / "resumed", resume=True)
    assert resumed.start_step == 2
    assert resumed.kind.entropy_control.state_dict() != EntropyControl(resumed.config).state_dict()
    resumed.train()
    for (name, a), (_, b) in zip(
        whole.policy.model.named_parameters(), resumed.policy.model.named_parameters()
    ):
        assert torch.equal(a, b), name
    lines = ledger(tmp_path / "whole")
    assert lines == ledger(tmp_path / "resumed")
    policies = [line["policy"] for line in lines]
    assert all(line["active"] for line in lines), "the bonus pulls every group"
    assert all(0.4 <= p["high_entropy_fraction"] <= 0.6 for p in policies)
    coefficients = [p["entropy_coef"] for p in policies]
    assert len(set(coefficients)) > 1, "the coefficient never moved"
    verification = verify_run(tmp_path / "whole")
    assert verification.ok, "\n".join(verification.lines())
    # A coefficient the control would not have reached fails the entropy check alone.
    path = tmp_path / "whole" / "ledger.jsonl"
    changed = [json.loads(x) for x in path.read_text().splitlines()]
    changed[1]["policy"]["entropy_coef"] += 0.5
    path.write_text("".join(json.dumps(line) + "\n" for line in changed))
    failures = [c for c in verify_run(tmp_path / "whole").checks if not c.ok]
    assert [c.name for c in failures] == ["entropy"]
    assert "step 1 policy.entropy_coef" in failures[0].failures[0]


def test_the_adaptive_control_is_trls():
    config = TrainConfig.from_arm("zg_flat", **ADAPTIVE_RUN)
    control = EntropyControl(config)
    assert control.applied() == 0.0, "no entropy measured before the first step"
    control.after_step(0.4)
    assert (control.coef, control.applied()) == (pytest.approx(0.03), pytest.approx(0.03))
    control.after_step(0.9)
    assert (control.coef, control.applied()) == (pytest.approx(0.02), 0.0)
    limits = dict(ADAPTIVE_RUN, entropy_coef_max=0.025, entropy_coef_min=0.015)
    assert entropy_coefficients(
        TrainConfig.from_arm("zg_flat", **limits), [0.1, 0.1, 0.9, 0.9, 0.9]
    ) == pytest.approx([0.025, 0.025, 0.015, 0.015, 0.015])


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(loss_type="sum", entropy_coef=0.01), "entropy_coef is a setting of TRL's loss"),
        (
            dict(top_entropy_quantile=0.2, questions_per_step=2, combine_questions="pooled"),
            "top_entropy_quantile is taken over one question's group",
        ),
        (dict(entropy_coef=0.1, generation_steps=2), "entropy_coef is taken over one"),
        (dict(top_entropy_quantile=1.5), "top_entropy_quantile must be in"),
    ],
)
def test_entropy_settings_it_cannot_honour_are_refused_by_name(settings, message):
    base = dict(loss_order="token_weighted", loss_type="dapo", group_size=4)
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_arm("zg_flat", **{**base, **settings})
