"""rlvr_fast's ``GRPOConfig`` against the installed trl's: the same 191 fields with TRL's types
and defaults (189 under transformers 5.17, whose TrainingArguments lacks two later fields), each classified (honoured, no effect, refused with the reason), refused at
construction and on assignment, built by ``HfArgumentParser`` / ``TrlParser`` as TRL's is."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from rlvr_fast.trl_compat import GRPOConfig, UnsupportedFieldError
from rlvr_fast.trl_compat.config import field_default
from rlvr_fast.trl_compat.support import (
    HONOURED,
    LATER_TRANSFORMERS_FIELDS,
    NO_EFFECT,
    REFUSED,
    VALUE_LIMITS,
    classification,
)

CPU = dict(use_cpu=True, report_to="none")


def trl():
    return pytest.importorskip("trl")


def trl_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(trl().GRPOConfig)}


def test_every_trl_field_exists_with_trls_type_and_default_and_is_classified():
    ours = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    theirs = trl_fields()
    later = LATER_TRANSFORMERS_FIELDS - set(theirs)  # absent from an older transformers
    assert len(theirs) + len(later) == 191, "trl's GRPOConfig changed: classify the new fields"
    for name, field in theirs.items():
        assert classification(name) is not None, f"{name} is not classified"
        assert name in ours, name
        assert ours[name].type == field.type, name
        assert field_default(ours[name]) == field_default(field), name


def test_the_tables_are_disjoint_and_name_only_trl_fields():
    theirs = set(trl_fields()) | LATER_TRANSFORMERS_FIELDS
    tables = [set(HONOURED), set(NO_EFFECT), set(REFUSED)]
    assert sum(len(t) for t in tables) == len(set().union(*tables)) == len(theirs)
    assert set().union(*tables) == theirs
    assert set(VALUE_LIMITS) <= set(HONOURED)


def other_value(default):
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 3
    if isinstance(default, str):
        return default + "-other"
    if isinstance(default, list):
        return ["other"]
    return "other"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_every_refused_field_is_refused_by_name_with_its_reason(name):
    default = field_default(trl_fields()[name])
    GRPOConfig(**CPU, **{name: default})
    with pytest.raises(
        UnsupportedFieldError, match=rf"^GRPOConfig: {name}=.*{re.escape(REFUSED[name][:20])}"
    ):
        GRPOConfig(**CPU, **{name: other_value(default)})


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_assigning_a_refused_value_after_construction_is_refused(name):
    args = GRPOConfig(**CPU)
    default = field_default(trl_fields()[name])
    with pytest.raises(UnsupportedFieldError, match=rf"^GRPOConfig: {name}="):
        setattr(args, name, other_value(default))


@pytest.mark.parametrize(
    "settings,message",
    [
        (
            dict(optim="sgd"),
            "optim='sgd' is not supported by rlvr_fast: rlvr_fast steps AdamW or Adafactor",
        ),
        (dict(multi_objective_aggregation="max"), "multi_objective_aggregation='max'"),
        (dict(beta=-0.1), "beta=-0.1"),
        (dict(report_to="mlflow"), "report_to='mlflow'"),
        (dict(delta=0.0), "delta=0.0"),
        (dict(model_init_kwargs={"quantization_config": {}}), "model_init_kwargs="),
    ],
)
def test_values_of_honoured_fields_it_cannot_honour_are_refused(settings, message):
    with pytest.raises(UnsupportedFieldError, match=message):
        GRPOConfig(**{**CPU, **settings})


@pytest.mark.parametrize(
    "settings,message",
    [
        (
            dict(steps_per_generation=2, gradient_accumulation_steps=4),
            r"steps_per_generation \(2\) must be a multiple of gradient_accumulation_steps",
        ),
        (dict(generation_batch_size=16, steps_per_generation=2), "cannot both be set"),
        (dict(num_generations=3, per_device_train_batch_size=3), "num_generations must be even"),
        (dict(num_generations=6), "divisible by num_generations"),
        (
            dict(loss_type="bnpo", per_device_train_batch_size=4, gradient_accumulation_steps=2),
            "loss_type='bnpo'",
        ),
        (dict(arm="no_such_arm"), "arm must be one of"),
        (
            dict(entropy_coef=0.01, per_device_train_batch_size=16),
            "entropy_coef take TRL's micro-batch",
        ),
        (
            dict(top_entropy_quantile=0.2, use_adaptive_entropy=True, steps_per_generation=2),
            "top_entropy_quantile, use_adaptive_entropy take TRL's micro-batch",
        ),
    ],
)
def test_combinations_it_cannot_honour_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**{**CPU, **settings})


def test_several_prompts_per_step_are_counted_as_trl_counts_them():
    args = GRPOConfig(**CPU, per_device_train_batch_size=4, gradient_accumulation_steps=4)
    assert (args.steps_per_generation, args.generation_batch_size) == (4, 16)
    assert args.prompts_per_step == 2
    theirs = trl().GRPOConfig(**CPU, per_device_train_batch_size=4, gradient_accumulation_steps=4)
    assert theirs.generation_batch_size == args.generation_batch_size


def test_a_generation_batch_larger_than_a_step_is_counted_as_trl_counts_it():
    """generation_batch_size set directly, or steps_per_generation: TRL's derived counts, and
    the optimizer steps one generation batch serves."""
    for settings in (dict(generation_batch_size=32), dict(steps_per_generation=8)):
        args = GRPOConfig(
            **CPU, per_device_train_batch_size=4, gradient_accumulation_steps=2, **settings
        )
        theirs = trl().GRPOConfig(
            **CPU, per_device_train_batch_size=4, gradient_accumulation_steps=2, **settings
        )
        assert (args.steps_per_generation, args.generation_batch_size) == (
            theirs.steps_per_generation,
            theirs.generation_batch_size,
        )
        assert (args.generation_steps, args.prompts_per_step) == (4, 32 // args.num_generations)


def test_no_effect_fields_take_any_value():
    GRPOConfig(
        **CPU, gradient_checkpointing=False, vllm_gpu_memory_utilization=0.9, log_level="info"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--scale_rewards", "batch", "--beta", "0.0", "--use_vllm", "false"],
        ["--gradient_checkpointing", "--log_level", "info", "--push_to_hub", "false"],
        ["--per_device_train_batch_size", "16", "--report_to", "none", "--max_prompt_length", "64"],
    ],
)
def test_hf_argument_parser_builds_it_as_it_builds_trls(argv, tmp_path):
    from transformers import HfArgumentParser

    argv = ["--output_dir", str(tmp_path), "--use_cpu", *argv]
    (ours,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(argv)
    (theirs,) = HfArgumentParser(trl().GRPOConfig).parse_args_into_dataclasses(
        [a for a in argv if a not in ("--max_prompt_length", "64")]
    )
    for name in trl_fields():
        if name not in ("accelerator_config",):
            assert getattr(ours, name) == getattr(theirs, name), name


def test_trl_parser_reads_a_yaml_recipe(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"output_dir: {tmp_path}\nuse_cpu: true\nreport_to: none\nuse_vllm: false\n"
        "beta: 0.0\nscale_rewards: group\nlog_level: info\nlearning_rate: 3.0e-6\n"
    )
    (args,) = trl().TrlParser((GRPOConfig,)).parse_args_and_config(["--config", str(recipe)])
    assert isinstance(args, GRPOConfig)
    assert (args.learning_rate, args.log_level, args.report_to) == (3e-6, "info", [])


def test_fp16_is_fp16_mixed_on_cuda_and_float32_on_the_cpu_as_accelerate_does(monkeypatch):
    """accelerate turns native AMP (fp16 autocast and its GradScaler) on only off the CPU, so
    TRL's fp16=True trains on the CPU in float32 (its gradient is fp16=False's, bit for bit);
    on CUDA it is mixed precision with a dynamic loss scale: rlvr_fast's fp16-mixed."""
    accelerate = pytest.importorskip("accelerate")
    from rlvr_fast.trl_compat.run_setup import train_config

    theirs = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    assert not theirs.native_amp and theirs.scaler is None
    assert train_config(GRPOConfig(**CPU, fp16=True), 10, 1).precision == "fp32"
    on_cuda, bf16_on_cuda = GRPOConfig(**CPU, fp16=True), GRPOConfig(**CPU)
    on_cuda.use_cpu = bf16_on_cuda.use_cpu = False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert train_config(on_cuda, 10, 1).precision == "fp16-mixed"
    assert train_config(bf16_on_cuda, 10, 1).precision is None  # bf16-mixed on CUDA
