"""``train --config FILE`` and ``--print-config``: the round trip to the same run signature, the
command line over the file, and one-line errors for a bad file or setting (nothing written)."""

from __future__ import annotations

import json

import pytest

from rlvr_fast.cli.commands import train_inputs
from rlvr_fast.cli.main import build_parser, main
from rlvr_fast.models.policy import load_policy
from rlvr_fast.run.directory import run_signature

RUN = [
    "train",
    "--arm",
    "ra_flat",
    "--steps",
    "3",
    "--precision",
    "bf16",
    "--eval",
    "test=synthetic:test:8",
    "--set",
    "lr=1e-4",
    "--set",
    "max_grad_norm=null",
    "--set",
    'lora_target_modules=["q_proj","v_proj"]',
    "--set",
    "lora_r=4",
]


def printed_config(argv: list[str], capsys) -> str:
    assert main([*argv, "--print-config"]) == 0
    return capsys.readouterr().out


def signature(argv: list[str]) -> dict:
    args = build_parser(config_path_of(argv)).parse_args(argv)
    config, _, train_data, eval_sets = train_inputs(args)
    return run_signature(config.to_json(), load_policy("tiny"), train_data, eval_sets)


def config_path_of(argv: list[str]):
    from rlvr_fast.cli.config_file import config_path

    return config_path(argv)


def test_print_config_reads_back_to_the_same_run(tmp_path, capsys):
    argv = [*RUN, "--out", str(tmp_path / "run")]
    text = printed_config(argv, capsys)
    assert (
        "lr: 0.0001" in text and "precision: bf16-mixed" in text and "\nmax_grad_norm: null" in text
    )
    path = tmp_path / "run.yaml"
    path.write_text(text)
    from_file = ["train", "--config", str(path)]
    assert printed_config(from_file, capsys) == text
    assert signature(from_file) == signature(argv)
    assert not (tmp_path / "run").exists(), "--print-config writes nothing"


def test_the_command_line_overrides_the_file(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(
        "arm: ra_flat\nout: runs/x\nsteps: 7\nlr: 1e-5\ngroup_size: 4\n"
        "eval: {a: 'synthetic:test:4'}\n"
    )
    argv = ["train", "--config", str(path), "--steps", "9", "--set", "lr=3e-4"]
    text = printed_config([*argv, "--eval", "b=synthetic:test:5"], capsys)
    assert "\nsteps: 9\n" in text and "\nlr: 0.0003\n" in text
    assert "\neval: {a: 'synthetic:test:4', b: 'synthetic:test:5'}\n" in text, "--eval adds"
    assert "\ngroup_size: 4\n" in text and "\nlr: 1.0e-05" not in text


def test_a_run_trains_from_a_config_file(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    out = tmp_path / "run"
    path.write_text(
        f"arm: ra_flat\nout: {out}\nsteps: 2\neval: {{test: 'synthetic:test:4'}}\nquiet: true\n"
        "max_new_tokens: 32\neval_max_new_tokens: 32\nlr: 1e-4\n"
    )
    assert main(["train", "--config", str(path)]) == 0
    assert "test: accuracy" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["lr"] == 1e-4 and config["max_new_tokens"] == 32 and config["steps"] == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("arm: ra_flat\nout: r\nlrr: 1e-5\n", "unknown key 'lrr' (did you mean lr or lora_r?)"),
        ("arm: ra_flat\nout: r\ntrain-data: x.json\n", "(did you mean train_data?)"),
        ("arm: ra_flat\nout: r\nsteps: 2.5\n", "steps: expected an integer, got 2.5"),
        ("arm: ra_flat\nout: r\nquiet: 1\n", "quiet: expected true or false"),
        ("arm: ra_flat\nout: r\nprecision: 16-true\n", "precision: expected one of fp32"),
        ("arm: ra_flat\nout: r\neval: [1]\n", "eval: expected a mapping of names to data"),
        ("arm: ra_flat\nout: r\nlr: abc\n", "lr is of type float, got 'abc'"),
        ("arm: ra_flat\nout: r\nbetas: 0.9\n", "betas is of type [float, float], got 0.9"),
        ("arm: [ra_flat\n", "not YAML at line 2"),
        ("- arm\n", "expected a mapping of option and setting names to values"),
    ],
)
def test_a_bad_config_file_is_one_line_and_writes_nothing(tmp_path, capsys, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    (tmp_path / "work").mkdir()
    assert main(["train", "--config", str(path), "--out", str(tmp_path / "work" / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlvr-fast: error:") and "\n" not in err and message in err, err
    assert not any((tmp_path / "work").iterdir())


def test_an_option_the_file_leaves_out_is_still_required(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("out: r\n")
    with pytest.raises(SystemExit) as exited:
        main(["train", "--config", str(path)])
    assert exited.value.code == 2
    assert "the following arguments are required: --arm" in capsys.readouterr().err


def test_a_missing_config_file_is_one_line(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "none.yaml")]) == 2
    assert capsys.readouterr().err.strip().endswith("none.yaml: No such file or directory")


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("arm: ra_flat\nout: r\nlr: 1e-5\neps: -2E+3\n")
    assert main(["train", "--config", str(path), "--print-config"]) == 2  # eps must be > 0
    assert "eps must be > 0, got -2000.0" in capsys.readouterr().err
    path.write_text("arm: ra_flat\nout: r\nlr: 2e-5\njudge_model: 1e-5x\n")
    text = printed_config(["train", "--config", str(path)], capsys)
    assert "\nlr: 2.0e-05\n" in text and "\njudge_model: 1e-5x\n" in text
