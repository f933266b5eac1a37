"""One-line errors at the extremes (issue 39, item 5): numbers past any device, a regular
expression that does not compile, LoRA targets that match nothing, in ``plan`` as in ``train``."""

from __future__ import annotations

import contextlib

import pytest

from rlvr_fast.cli.main import main
from rlvr_fast.models.lora import LoraSettings
from rlvr_fast.models.policy import TINY_MODEL_DIR

HUGE = "9" * 401


def plan(*extra: str) -> list[str]:
    return ["plan", "--model", str(TINY_MODEL_DIR), "--device-memory", "24GB", *extra]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--device-memory", "1e400"), "a size is at most 16 EiB"),
        (("--device-memory", "1e308GiB"), "a size is at most 16 EiB"),
        (("--device-memory", HUGE), "a size is at most 16 EiB"),
        (
            ("--group-size", HUGE),
            "group_size must be at most 1,099,511,627,776, got a number of 401",
        ),
        (("--max-new-tokens", HUGE), "max_new_tokens must be at most"),
        (("--lora-r", "8", "--lora-target-modules", "no_such_proj"), "match none of the model"),
    ],
)
def test_plan_refuses_with_one_line_and_exit_2(capsys, extra, message):
    """Regression: OverflowError tracebacks; unknown LoRA targets planned 0 adapter parameters
    with exit 0 while train refused them."""
    with pytest.raises(SystemExit) if extra[0] == "--device-memory" else contextlib.nullcontext():
        status = main(plan(*extra))
        assert status == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("targets", ["([", "(?P<x", "a{99999999999999999999}"])
def test_a_lora_target_regex_that_does_not_compile_is_one_value_error(targets):
    """Regression: `--set 'lora_target_modules=(['` and LoraConfig(target_modules='([') raised
    re.error."""
    with pytest.raises(ValueError, match="not a regular expression"):
        LoraSettings(rank=4, targets=targets)


def test_train_refuses_a_bad_lora_regex_before_writing(tmp_path, capsys):
    out = tmp_path / "run"
    status = main(
        [
            "train",
            "--arm",
            "zg_flat",
            "--steps",
            "1",
            "--quiet",
            "--train-data",
            "synthetic:train:2",
            "--set",
            "lora_r=4",
            "--set",
            "lora_target_modules=([",
            "--out",
            str(out),
        ]
    )
    assert status == 2
    assert "not a regular expression" in capsys.readouterr().err
    assert not out.exists()
