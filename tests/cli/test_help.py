"""The command line's conventions: help for every option with its default, --version, the
settings listed by section, Lightning's precision names, --device auto, and the nearest names
and expected type for a bad --set."""

from __future__ import annotations

import argparse

import pytest
import torch

import rlvr_fast
from rlvr_fast.cli.main import build_parser, main
from rlvr_fast.cli.options import parse_device, training_precision
from rlvr_fast.cli.plan import build_parser as build_plan_parser
from rlvr_fast.train.config import setting_fields
from rlvr_fast.train.precision import PRECISION_ALIASES, PRECISIONS
from rlvr_fast.train.settings_reference import UNLISTED, settings


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"rlvr-fast": parser, **commands.choices, "plan module": build_plan_parser()}


@pytest.mark.parametrize("name", list(command_parsers()))
def test_every_option_has_help_and_shows_its_default(name):
    parser = command_parsers()[name]
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        assert action.help, f"{name}: {action.option_strings or action.dest} has no help"
        shown = action.default not in (None, False, [], argparse.SUPPRESS)
        if shown and action.option_strings:
            assert f"(default: {action.default})" in " ".join(text.split()), (
                f"{name}: {action.option_strings[0]}'s default is not shown"
            )


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"rlvr-fast {rlvr_fast.__version__}\n"


def test_help_settings_lists_every_setting_by_section(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["train", "--help-settings"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for field in setting_fields().values():
        assert f"\n  {field.name} = " in text, field.name
    assert "\noptimizer:\n  lr = 1e-05  (float)\n      AdamW learning rate\n" in text
    assert "  max_grad_norm = 1.0  (float or null)" in text
    assert "  betas = [0.9, 0.999]  ([float, float])" in text


def test_every_setting_has_a_section_and_help():
    """A new field is named under "Settings by section" in TrainConfig's docstring."""
    found = settings()
    assert [s.name for s in found if s.section == UNLISTED] == []
    assert [s.name for s in found if not s.help.strip()] == []
    assert sorted(s.name for s in found) == sorted(setting_fields())


def test_lightning_precision_names_are_aliases():
    assert training_precision("32-true", "auto") == "fp32"
    assert training_precision("32", "fp32") == "fp32"
    assert training_precision("16-mixed", "auto") == "fp16-mixed"
    assert training_precision("16", "auto") == "fp16-mixed"
    assert training_precision("bf16", "bf16") == "bf16-mixed"
    assert training_precision("bf16-true", "auto") == "bf16-true"
    assert set(PRECISION_ALIASES.values()) <= set(PRECISIONS)
    with pytest.raises(ValueError, match="--dtype fp32 contradicts --precision bf16-mixed"):
        training_precision("bf16", "fp32")
    train_help = " ".join(command_parsers()["train"].format_help().split())
    assert "16-mixed = fp16-mixed" in train_help and "bf16 = bf16-mixed" in train_help


def test_device_auto_is_cuda_where_torch_sees_a_gpu():
    assert parse_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert command_parsers()["train"].get_default("device") == "auto"


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        ("lrr=1e-4", "unknown setting 'lrr' (did you mean lr or lora_r?"),
        ("learning_rate=1e-4", "(did you mean lr?"),
        ("groupsize=4", "(did you mean group_size?"),
        ("lr=abc", "lr is of type float, got 'abc'"),
        ("max_grad_norm=yes", "max_grad_norm is of type float or null, got 'yes'"),
        ("skip_zero_var=1", "skip_zero_var is of type bool, got 1"),
    ],
)
def test_a_bad_set_names_the_nearest_settings_or_the_type(tmp_path, capsys, pair, message):
    out = tmp_path / "run"
    assert main(["train", "--arm", "ra_flat", "--set", pair, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlvr-fast: error:") and "\n" not in err and message in err, err
    assert len(err) < 200, "the nearest names, not all of them"
    assert not out.exists()
