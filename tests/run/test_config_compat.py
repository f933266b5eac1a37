"""Run directories written before the restructuring (main 0f54c67) resume on today's code: the
settings and the run signature that ``--resume`` compares are the bytes that commit wrote
(``data/main-0f54c67/*.json``: the config.json sections of three finished runs, one flat, one
multi-question tree run with a Polyak tail, one parallel-path run), and those of a flat run
that sets every setting of TRL's policy loss, the sampler options and other settings written
only when set, as main 0df4f26 wrote them before the policy loss's settings were derived from
the op's declarations (``data/main-0df4f26/policy.json``): their order in config.json kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import load_policy
from rlvr_fast.run.directory import run_signature
from rlvr_fast.train.config import TrainConfig

RECORDED = Path(__file__).with_name("data")
POLICY = dict(
    loss_type="dapo",
    loss_order="token_weighted",
    kl_beta=0.04,
    use_bias_correction_kl=True,
    sync_ref_model=True,
    ref_model_sync_steps=4,
    ref_model_mixup_alpha=0.5,
    importance_sampling_level="sequence",
    epsilon=0.3,
    epsilon_high=0.28,
    delta=2.0,
    sapo_temperature_pos=0.9,
    sapo_temperature_neg=1.1,
    vespo_k_pos=2.5,
    vespo_lambda_pos=3.5,
    vespo_k_neg=3.5,
    vespo_lambda_neg=2.5,
    num_iterations=2,
    checkpoint_every=4,
    top_entropy_quantile=0.8,
    entropy_coef=0.01,
    use_adaptive_entropy=True,
    entropy_target=0.3,
    entropy_coef_min=0.001,
    entropy_coef_max=0.5,
    entropy_coef_delta=0.01,
    off_policy_mask_threshold=0.5,
    top_k=5,
    min_p=0.05,
    repetition_penalty=1.1,
    kv_blocks=64,
    adamw_fused=True,
    fused_zero_grad_step=False,
    advantage_std="batch",
)
RUNS = {
    "base": ("main-0f54c67", "baseline", {}),
    "accum": ("main-0f54c67", "accum4", {"polyak_start": 1}),
    "shap": ("main-0f54c67", "shapley_vote", {}),
    "policy": ("main-0df4f26", "baseline", POLICY),
}
SETTINGS = dict(steps=2, max_new_tokens=16, eval_max_new_tokens=16, t_min=4, t_max=8)


@pytest.mark.parametrize("name", RUNS)
def test_config_json_and_the_resume_signature_keep_their_bytes(name):
    commit, arm, overrides = RUNS[name]
    recorded = json.loads((RECORDED / commit / f"{name}.json").read_text())
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
