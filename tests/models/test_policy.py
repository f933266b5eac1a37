"""The embedded tiny checkpoint, load_policy, tokenizer files, and the demo entry point."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from arithmetic import arithmetic_fingerprint

from rlvr_fast import demo
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.engine import SamplingParams
from rlvr_fast.rollouts.generation import sample
from rlvr_fast.rollouts.evaluation import evaluate
from rlvr_fast.models.checkpoint import CheckpointError
from rlvr_fast.models.policy import TINY_MODEL_DIR, load_policy
from rlvr_fast.models.tokenizer import TokenizerError


# The 500 greedy evaluations of the base model per arithmetic (tests/arithmetic.py) where they
# were recorded: their responses hash and correct count.
BASE_EVAL = Path(__file__).with_name("base_eval.json")


@pytest.fixture(scope="module")
def tiny():
    return load_policy("tiny")


def test_tiny_is_small_and_shipped_in_hf_format(tiny):
    assert tiny.num_parameters() <= 10_000_000
    assert sum(p.numel() for p in tiny.model.parameters()) == tiny.num_parameters()
    size = sum(f.stat().st_size for f in TINY_MODEL_DIR.iterdir())
    assert size <= 25 * 2**20
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "model_card.json",
    ):
        assert (TINY_MODEL_DIR / name).is_file()


def test_tokenizer_round_trips_prompts_and_knows_eos(tiny):
    text = render_prompt("What is 23 + 45?") + " We add.\n20 + 40 = 60\n\\boxed{68}"
    assert tiny.tokenizer.decode(tiny.tokenizer.encode(text)) == text
    assert tiny.tokenizer.eos_token_ids == [tiny.tokenizer.token_to_id("<|endoftext|>")]
    digits = tiny.tokenizer.encode("12345")
    assert len(digits) == 5, "digits are tokenized one by one"


def test_tiny_matches_transformers(tiny):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR).eval()
    ids = torch.tensor([tiny.tokenizer.encode(render_prompt("Compute 17 * 6."))])
    with torch.no_grad():
        assert (hf(ids).logits - tiny.model(ids)).abs().max() <= 1e-5
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    assert hf_tokenizer.encode(render_prompt("What is 5 + 7?")) == tiny.tokenizer.encode(
        render_prompt("What is 5 + 7?")
    )


def test_base_accuracy_is_low_with_both_modes(tiny):
    """The model card's figure is re-derived here, and the shipped model has RL head-room."""
    card = json.loads((TINY_MODEL_DIR / "model_card.json").read_text())
    settings = card["settings"]
    problems = synthetic_problems("test", settings["eval_problems"], seed=settings["seed"])
    result = evaluate(tiny, problems, max_new_tokens=256, progress=False)
    summary = result.summary()
    recorded = json.loads(BASE_EVAL.read_text())["arithmetic"].get(arithmetic_fingerprint())
    if recorded is not None:  # an arithmetic this evaluation was recorded on: every token alike
        responses = json.dumps([item.response for item in result.items]).encode()
        assert hashlib.sha256(responses).hexdigest() == recorded["responses_sha256"]
        assert summary["correct"] == recorded["correct"] == card["greedy_test"]["correct"]
    else:  # another arithmetic may flip a few of the 500 items' greedy tokens
        assert summary["accuracy"] == pytest.approx(card["greedy_test"]["accuracy"], abs=0.01)
    assert 0.10 <= summary["accuracy"] <= 0.35
    assert 0.0 < summary["short_guess_fraction"] < 1.0
    assert summary["derivation_accuracy"] > summary["short_guess_accuracy"]


def test_sampling_the_tiny_model_is_reproducible(tiny):
    prompt = render_prompt(synthetic_problems("train", 1)[0].question)
    params = SamplingParams(max_new_tokens=64)
    a = sample(tiny, [prompt] * 4, params, generator=torch.Generator().manual_seed(3))
    b = sample(tiny, [prompt] * 4, params, generator=torch.Generator().manual_seed(3))
    assert a.tokens == b.tokens and a.texts == b.texts


def test_saved_policy_reloads_identically(tiny, tmp_path):
    tiny.save(tmp_path / "copy")
    again = load_policy(tmp_path / "copy")
    for (name, p), (_, q) in zip(tiny.model.named_parameters(), again.model.named_parameters()):
        assert torch.equal(p, q), name
    assert again.tokenizer.encode("Question: 1 + 2") == tiny.tokenizer.encode("Question: 1 + 2")


def test_bad_model_paths_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not a model directory"):
        load_policy(tmp_path / "missing")
    shutil.copytree(TINY_MODEL_DIR, tmp_path / "no_tokenizer")
    (tmp_path / "no_tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_policy(tmp_path / "no_tokenizer")


def test_demo_trains_and_reports(tmp_path, capsys):
    assert demo.main(["--steps", "2", "--eval-problems", "6", "--out", str(tmp_path / "d")]) == 0
    printed = capsys.readouterr().out
    assert "held_out: accuracy" in printed and "->" in printed
    assert len((tmp_path / "d" / "ledger.jsonl").read_text().splitlines()) == 2


def test_demo_bad_arm_is_one_line_and_exit_2(tmp_path, capsys):
    assert demo.main(["--arm", "nope", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("demo: error:") and "\n" not in err
    assert not (tmp_path / "d").exists()
