"""GRPOConfig's sampling fields on rlvr_fast's engine: top_k, min_p, repetition_penalty and the
generation_kwargs that map onto them honoured, the others refused by name; use_vllm=True
accepted with log lines saying rollouts run on rlvr_fast's engine and the vllm_* settings have
no effect."""

from __future__ import annotations

import logging

import pytest

from rlvr_fast.models.policy import TINY_MODEL_DIR
from rlvr_fast.trl_compat import GRPOConfig, GRPOTrainer, UnsupportedFieldError
from rlvr_fast.trl_compat.run_setup import train_config
from rlvr_fast.trl_compat.support import classification
from trl_side_by_side import text_rows, varied_reward

CPU = dict(use_cpu=True, report_to="none")
LOGGER = "rlvr_fast.trl_compat.run_setup"


def sampler_fields(args) -> tuple:
    config = train_config(args, 10, 1)
    return config.top_p, config.top_k, config.min_p, config.repetition_penalty


def test_the_sampling_fields_are_honoured():
    for name in ("top_k", "min_p", "repetition_penalty", "generation_kwargs", "use_vllm"):
        assert classification(name) == "honoured", name
    assert sampler_fields(GRPOConfig(**CPU)) == (1.0, 0, 0.0, 1.0)
    args = GRPOConfig(**CPU, top_k=10, min_p=0.1, repetition_penalty=1.1, top_p=0.9)
    assert sampler_fields(args) == (0.9, 10, 0.1, 1.1)


def test_generation_kwargs_override_the_fields_as_trls_generation_config_update_does():
    kwargs = {"top_k": 5, "top_p": 0.8, "min_p": None, "do_sample": True, "use_cache": True}
    args = GRPOConfig(**CPU, top_k=10, min_p=0.1, generation_kwargs=kwargs)
    assert sampler_fields(args) == (0.8, 5, 0.0, 1.0)


@pytest.mark.parametrize(
    "kwargs", [{"num_beams": 2}, {"do_sample": False}, {"temperature": 0.5}, {"top_k": 5, "x": 1}]
)
def test_generation_kwargs_that_do_not_map_are_refused_by_name(kwargs):
    with pytest.raises(UnsupportedFieldError, match="generation_kwargs=.*takes top_p, top_k"):
        GRPOConfig(**CPU, generation_kwargs=kwargs)


@pytest.mark.parametrize(
    "settings,message",
    [({"top_k": -1}, "top_k"), ({"min_p": 2.0}, "min_p"), ({"repetition_penalty": 0}, "repet")],
)
def test_bad_sampling_values_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**CPU, **settings)


def test_use_vllm_is_accepted_and_logged_with_the_vllm_settings_that_have_no_effect(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        train_config(GRPOConfig(**CPU), 10, 1)
    assert caplog.records == [], "nothing to say without use_vllm"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        train_config(GRPOConfig(**CPU, use_vllm=True), 10, 1)
        train_config(GRPOConfig(**CPU, use_vllm=True, vllm_mode="server"), 10, 1)
    lines = [record.getMessage() for record in caplog.records]
    assert (
        lines[0]
        == lines[2]
        == ("use_vllm=True: rollouts run on rlvr_fast's engine (no vLLM is started)")
    )
    assert lines[1].endswith("no effect on rlvr_fast's engine: all at TRL's defaults")
    assert lines[3].endswith("no effect on rlvr_fast's engine: vllm_mode='server'")


def test_a_run_with_every_sampling_option_and_use_vllm_trains(tmp_path):
    args = GRPOConfig(
        **CPU,
        output_dir=str(tmp_path),
        max_steps=1,
        num_generations=4,
        per_device_train_batch_size=4,
        max_completion_length=8,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.2,
        use_vllm=True,
    )
    trainer = GRPOTrainer(
        model=str(TINY_MODEL_DIR), reward_funcs=varied_reward, args=args, train_dataset=text_rows(4)
    )
    trainer.train()
    assert trainer.state.global_step == 1
    assert trainer.trainer.config.top_k == 20
