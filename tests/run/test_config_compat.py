"""Run directories written before the restructuring (main 0f54c67) resume on today's code: the
settings and the run signature that ``--resume`` compares are the bytes that commit wrote
(``data/main-0f54c67/*.json``: the config.json sections of three finished runs, one flat, one
multi-question tree run with a Polyak tail, one parallel-path run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import load_policy
from rlvr_fast.run.directory import run_signature
from rlvr_fast.train.config import TrainConfig

RECORDED = Path(__file__).with_name("data") / "main-0f54c67"
RUNS = {
    "base": ("baseline", {}),
    "accum": ("accum4", {"polyak_start": 1}),
    "shap": ("shapley_vote", {}),
}
SETTINGS = dict(steps=2, max_new_tokens=16, eval_max_new_tokens=16, t_min=4, t_max=8)


@pytest.mark.parametrize("name", RUNS)
def test_config_json_and_the_resume_signature_keep_their_bytes(name):
    arm, overrides = RUNS[name]
    recorded = json.loads((RECORDED / f"{name}.json").read_text())
    config = json.loads(json.dumps(TrainConfig.from_arm(arm, **SETTINGS, **overrides).to_json()))
    signature = run_signature(
        config,
        load_policy("tiny"),
        synthetic_problems("train", 8, seed=1),
        {"t": synthetic_problems("test", 2, seed=1)},
    )
    assert json.dumps(config) == json.dumps(recorded["config"])
    assert json.dumps(signature) == json.dumps(recorded["rlvr_fast_run"])
    assert TrainConfig(**recorded["config"]) == TrainConfig.from_arm(arm, **SETTINGS, **overrides)
