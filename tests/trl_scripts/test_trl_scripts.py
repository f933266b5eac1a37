"""Published GRPO scripts (this folder, each citing its source), run twice as a user would run
them: as published, ``from trl import GRPOConfig, GRPOTrainer``, and with only that import
changed to ``from rlvr_fast import GRPOConfig, GRPOTrainer``. Each runs as ``__main__`` with its
command line in ``sys.argv`` (in the test's process, which has imported trl and transformers
already: a process per script would spend most of its time importing them) on the embedded model
(with a chat template) and a local dataset of the published one's columns.

Where both run, their outputs are compared: both finish, print the same metric names at the same
steps (transformers' progress or printer callback), and leave a model that loads. Where
rlvr_fast refuses a feature the script uses, the refusal must name the setting.
"""

from __future__ import annotations

import ast
import json
import runpy
import sys
from pathlib import Path

import pytest

from rlvr_fast.data.synthetic import synthetic_problems
from trl_side_by_side import chat_model_dir, tool_model_dir, trl_modules

HERE = Path(__file__).parent
TRL_IMPORT = "from trl import GRPOConfig, GRPOTrainer  # drop-in: the line the tests swap"
OURS_IMPORT = "from rlvr_fast import GRPOConfig, GRPOTrainer  # drop-in: the line the tests swap"


def problems(count: int, seed: int):
    return synthetic_problems("train", count, seed=seed)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def deepmath(directory: Path) -> None:
    rows = [
        {"prompt": [{"role": "user", "content": p.question}], "solution": p.answer}
        for p in problems(8, 3)
    ]
    write_jsonl(directory / "train.jsonl", rows)
    write_jsonl(directory / "test.jsonl", rows[:2])


def gsm8k(directory: Path) -> None:
    rows = [{"question": p.question, "answer": f"work\n#### {p.answer}"} for p in problems(8, 4)]
    write_jsonl(directory / "train.jsonl", rows)


def countdown(directory: Path) -> None:
    rows = [{"target": 3 * i + 4, "nums": [i + 1, 3, 4 + i]} for i in range(10)]
    write_jsonl(directory / "train.jsonl", rows)


def numina(directory: Path) -> None:
    rows = [
        {
            "problem": p.question,
            "solution": p.answer,
            "messages": [{"role": "user", "content": p.question}],
        }
        for p in problems(8, 6)
    ]
    write_jsonl(directory / "train.jsonl", rows)
    write_jsonl(directory / "test.jsonl", rows[:4])


def biogrid(directory: Path) -> None:
    """grpo_agent.py's two datasets: BioGRID interactions (its column names, spaces and all) and
    yes/no questions about them."""
    interactions = [
        {"Alt IDs Interactor A": a, "Alt IDs Interactor B": b, "Aliases Interactor A": a.lower()}
        for a, b in (("JNKK", "MAPK8"), ("TP53", "MDM2"), ("BRCA1", "BARD1"))
    ]
    write_jsonl(directory / "biogrid" / "train.jsonl", interactions)
    questions = [
        {"question": f"Does the gene {a} interact with {b}?", "answer": answer}
        for a, b, answer in (("TP53", "MDM2", "Yes"), ("JNKK", "TP53", "No"))
    ] * 2 + [{"question": "Which genes interact with TP53?", "answer": "MDM2"}]
    write_jsonl(directory / "biogrid_qa" / "train.jsonl", questions)


# name: (script, its data, its command line (MODEL, DATA, OUT filled in), what rlvr_fast does:
# "runs", or the pattern of the refusal it must print)
SCRIPTS = {
    "trl_docs_quickstart": ("grpo_quickstart.py", deepmath, [], "runs"),
    "trl_docs_multitask": ("grpo_multitask.py", None, [], "runs"),
    "trl_scripts_grpo_yaml": (
        "trl_grpo.py",
        deepmath,
        ["--config", "{HERE}/trl_grpo_recipe.yaml", "--model_name_or_path", "{MODEL}"]
        + ["--dataset_name", "{DATA}", "--output_dir", "{OUT}"],
        "runs",
    ),
    "trl_examples_gspo": (
        "gspo.py",
        numina,
        ["--model_name_or_path", "{MODEL}", "--output_dir", "{OUT}", "--learning_rate", "1e-5"]
        + ["--dtype", "float32", "--max_completion_length", "16", "--log_completions"]
        + ["--per_device_train_batch_size", "1", "--num_generations", "4"]
        + ["--importance_sampling_level", "sequence", "--epsilon", "3e-4"]
        + ["--epsilon_high", "4e-4", "--beta", "0.0", "--loss_type", "grpo"]
        + ["--gradient_accumulation_steps", "2", "--steps_per_generation", "8"]
        + ["--use_cpu", "--max_steps", "1", "--report_to", "none", "--logging_steps", "1"],
        "runs",
    ),
    "hf_cookbook_grpo_peft_model": ("cookbook_grpo_peft.py", numina, [], "runs"),
    "trl_examples_grpo_agent": (
        "grpo_agent.py",
        biogrid,
        ["--model_name_or_path", "{MODEL}", "--output_dir", "{OUT}", "--use_cpu"]
        + ["--max_completion_length", "24", "--num_generations", "4"]
        + ["--per_device_train_batch_size", "4", "--max_steps", "2", "--log_completions"]
        + ["--report_to", "none", "--logging_steps", "1", "--max_tool_calling_iterations", "2"],
        "runs",
    ),
    "community_willccbb_gsm8k": ("willccbb_grpo_demo.py", gsm8k, [], "runs"),
    "community_philschmid_mini_r1": (
        "philschmid_run_r1_grpo.py",
        countdown,
        ["--config", "{HERE}/philschmid_recipe.yaml", "--model_name_or_path", "{MODEL}"]
        + ["--dataset_id_or_path", "{DATA}", "--output_dir", "{OUT}"],
        "runs",
    ),
}


def run(script: str, side: str, argv: list[str], fill: dict, cwd: Path, monkeypatch) -> None:
    """Runs ``script`` as ``__main__`` with ``side``'s import and ``argv`` (placeholders filled)."""
    source = (HERE / script).read_text()
    assert TRL_IMPORT in source, f"{script} has no marked import line"
    if side == "rlvr_fast":
        source = source.replace(TRL_IMPORT, OURS_IMPORT)
    path = cwd / f"{side}_{script}"
    path.write_text(source)
    args = []
    for arg in argv:
        for key, value in fill.items():
            arg = arg.replace(key, value)
        args.append(arg)
    with monkeypatch.context() as patch:
        patch.setattr(sys, "argv", [str(path), *args])
        patch.setenv("TRL_SCRIPT_OUT", fill["{OUT}"])
        runpy.run_path(str(path), run_name="__main__")


def printed_logs(output: str) -> list[dict]:
    """The metric dicts transformers' callbacks print, one per log."""
    logs = []
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("{") and ("'loss'" in line or "'train_runtime'" in line):
            logs.append(ast.literal_eval(line.replace("nan", "None")))
    return logs


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_published_script_runs_with_only_its_import_changed(name, tmp_path, monkeypatch, capsys):
    trl_modules()
    script, make_data, argv, expected = SCRIPTS[name]
    # A tool-calling script's model has a chat template that renders and parses tool calls.
    model = (tool_model_dir if "tools=" in (HERE / script).read_text() else chat_model_dir)(
        tmp_path
    )
    data = tmp_path / "data"
    if make_data is not None:
        make_data(data)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRL_SCRIPT_MODEL", str(model))
    monkeypatch.setenv("TRL_SCRIPT_DATA", str(data))
    fill = {"{HERE}": str(HERE), "{MODEL}": str(model), "{DATA}": str(data)}
    run(script, "trl", argv, fill | {"{OUT}": str(tmp_path / "out-trl")}, tmp_path, monkeypatch)
    theirs = capsys.readouterr()
    our_out = tmp_path / "out-rlvr_fast"
    if expected != "runs":
        with pytest.raises(ValueError, match=expected):
            run(script, "rlvr_fast", argv, fill | {"{OUT}": str(our_out)}, tmp_path, monkeypatch)
        return
    run(script, "rlvr_fast", argv, fill | {"{OUT}": str(our_out)}, tmp_path, monkeypatch)
    ours = capsys.readouterr()
    their_logs = printed_logs(theirs.out + theirs.err)
    our_logs = printed_logs(ours.out + ours.err)
    assert their_logs and len(our_logs) == len(their_logs)
    for mine, their in zip(our_logs, their_logs):
        assert set(mine) == set(their)
    assert_saved_model_loads(our_out, model)


def assert_saved_model_loads(output_dir: Path, base_model: Path) -> None:
    """The model rlvr_fast saved in ``output_dir`` loads: a whole model by rlvr_fast, an
    adapter by peft onto the base model."""
    from rlvr_fast.models.policy import load_policy

    saved = [p.parent for p in output_dir.rglob("model.safetensors")]
    if saved:
        load_policy(saved[0])
        return
    adapters = [p.parent for p in output_dir.rglob("adapter_model.safetensors")]
    assert adapters, "rlvr_fast saved no model and no adapter"
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), adapters[0])
