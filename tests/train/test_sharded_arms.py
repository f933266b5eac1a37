"""Every arm family sharded (``--shard fsdp``, FSDP2 over gloo) against one process taking every
question of each step: LoRA adapters, tree steps and parallel-path steps, 3 steps of 4 pooled
questions each (``test_sharding.py`` covers flat steps, checkpoints and resumes), and the
parallel-path steps on unsharded data-parallel ranks too. Each run must end as the one-process
run did (``assert_same_run``: the ledger but timings and KV peaks, the rollouts, weights within
1e-6 of each tensor's largest, ``verify``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlvr_fast.cli.main import main
from rlvr_fast.models.lora import ADAPTER_DIR, WEIGHTS_FILE
from rlvr_fast.run.state_file import load_state

from tests.train.test_distributed import cli, read_jsonl
from tests.train.test_sharding import assert_same_run

POOLED = [
    "--set",
    "questions_per_step=4",
    "--set",
    "combine_questions=pooled",
    "--set",
    "max_new_tokens=32",
    "--set",
    "gate_min_chars=null",
    "--set",
    "eval_before=false",
    "--quiet",
    "--steps",
    "3",
]
LR = 1e-3
LORA = ["--arm", "ra_flat", "--set", f"lr={LR}", "--set", "lora_r=4"]
LORA += ["--set", "lora_target_modules=all-linear", *POOLED]
# Trees from the first step (midpoint_mst bifurcates at once).
TREE = ["--arm", "midpoint_mst", "--set", "t_min=4", "--set", "t_max=16", *POOLED]
PARALLEL = ["--arm", "shapley_vote", *POOLED]
# TRL's dapo with a KL reference (a frozen copy of the engine's weights), gradients clipped
# (every step's norm is above 0.1) and every layer's activations recomputed in backward.
TRL_LOSS = ["--arm", "ra_flat", "--set", "loss_type=dapo", "--set", "kl_beta=0.04"]
TRL_LOSS += ["--set", "max_grad_norm=0.1", "--set", "activation_checkpointing=true", *POOLED]
# Summaries generated from each response's paths, Shapley values by 4 Monte-Carlo orderings
# (drawn from each question's own generator), 2 steps.
SUMMARY = ["--arm", "shapley_summary", "--set", "shapley_permutations=4", *POOLED[:-2]]
SUMMARY += ["--set", "max_new_tokens=24", "--steps", "2"]


def one_and_sharded(base: Path, args: list[str], ranks: int = 2) -> tuple[Path, Path]:
    """A run of ``args`` on one process and on ``ranks`` sharded ranks."""
    return one_process(base, args), on_ranks(base, args, ranks, "--shard", "fsdp")


def one_process(base: Path, args: list[str]) -> Path:
    """A run of ``args`` on one process."""
    assert main(["train", *args, "--out", str(base / "one")]) == 0
    return base / "one"


def on_ranks(base: Path, args: list[str], ranks: int, *options: str) -> Path:
    """A run of ``args`` (and ``options``) on ``ranks`` ranks."""
    out = base / f"ranks{ranks}{''.join(options)}"
    done = cli("train", "--nproc", str(ranks), *options, *args, "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out


def contributing(run: Path) -> list[list[bool]]:
    """Which of each step's questions ran a loss."""
    return [[q["active"] for q in line["questions"]] for line in read_jsonl(run / "ledger.jsonl")]


@pytest.fixture(scope="module")
def lora_one(tmp_path_factory) -> Path:
    """The LoRA run of 4 questions a step on one process."""
    return one_process(tmp_path_factory.mktemp("lora"), LORA)


def assert_same_adapters(one: Path, other: Path) -> None:
    """The adapters within 2e-3 lr of each other, elementwise (AdamW moves an element whose
    gradient is below its eps by lr g / eps, so the last bits of a gradient that the sharded
    sums round otherwise show in it), and trained."""
    adapters = [load_file(run / "final" / ADAPTER_DIR / WEIGHTS_FILE) for run in (one, other)]
    assert adapters[0].keys() == adapters[1].keys() and len(adapters[0]) == 4 * 7 * 2
    for name, tensor in adapters[0].items():
        assert (adapters[1][name] - tensor).abs().max() <= 2e-3 * LR, name
    assert max(float(t.abs().max()) for n, t in adapters[1].items() if "lora_B" in n) > 0


def test_lora_adapters_shard_and_train_as_on_one_process(lora_one, tmp_path):
    """The adapters are sharded with the frozen base (one FSDP group per layer): the merged
    weights end within 1e-6 of each tensor's largest, the adapters as ``assert_same_adapters``
    says."""
    two = on_ranks(tmp_path, LORA, 2, "--shard", "fsdp")
    assert_same_run(lora_one, two)
    active = contributing(lora_one)
    assert any(any(a[:2]) and any(a[2:]) for a in active), "both ranks run losses in a step"
    assert_same_adapters(lora_one, two)
    state = load_state(two / "checkpoint" / "state.safetensors")
    assert "shards" in state, "the adapters and their moments in DCP"
    moments = state["shards"]["moments"]
    assert moments and all(".lora_" in name for name in moments), "the frozen base has none"


def test_lora_shards_stopped_after_two_steps_resume_on_one_process(lora_one, tmp_path):
    """The DCP checkpoint holds the adapters and their moments; the base is the model's."""
    stopped = tmp_path / "run"
    args = [*LORA[:-2], "--steps", "2"]
    assert LORA[-2:] == ["--steps", "3"]
    done = cli("train", "--nproc", "2", "--shard", "fsdp", *args, "--out", str(stopped))
    assert done.returncode == 0, done.stderr
    assert main(["train", *LORA, "--out", str(stopped), "--resume"]) == 0
    assert_same_run(lora_one, stopped)
    assert_same_adapters(lora_one, stopped)


def test_a_kl_reference_clipping_and_checkpointing_shard_as_on_one_process(tmp_path):
    """The step's TRL figures (entropy, kl, clip ratios) are of every rank's questions."""
    one, two = one_and_sharded(tmp_path, TRL_LOSS)
    assert_same_run(one, two)
    lines = read_jsonl(one / "ledger.jsonl")
    assert lines[-1]["policy"]["kl"] > 0, "the reference pulls"
    assert all(line["grad_norm"] > 0.1 for line in lines[1:]), "clipped"


def test_tree_steps_shard_as_on_one_process(tmp_path):
    one, two = one_and_sharded(tmp_path, TREE)
    assert_same_run(one, two)
    lines = read_jsonl(one / "rollouts.jsonl")
    assert all("categories" in q for line in lines for q in line["questions"]), "tree steps"
    active = contributing(one)
    assert any(any(a[:2]) for a in active) and any(any(a[2:]) for a in active)


@pytest.mark.slow
def test_tree_steps_on_four_sharded_ranks_as_on_one_process(tmp_path):
    one, four = one_and_sharded(tmp_path, TREE, ranks=4)
    assert_same_run(one, four)


@pytest.fixture(scope="module")
def parallel_one(tmp_path_factory) -> Path:
    """The parallel-path run of 4 questions a step on one process."""
    return one_process(tmp_path_factory.mktemp("parallel"), PARALLEL)


def test_parallel_path_steps_shard_as_on_one_process(parallel_one, tmp_path):
    """Each rank samples, votes and credits its questions from the seeds one process gives them
    (one engine batch of its questions' paths)."""
    assert_same_run(parallel_one, on_ranks(tmp_path, PARALLEL, 2, "--shard", "fsdp"))
    lines = read_jsonl(parallel_one / "rollouts.jsonl")
    assert all("parallel" in q for line in lines for q in line["questions"])
    active = contributing(parallel_one)
    assert any(any(a[:2]) and any(a[2:]) for a in active), "both ranks run losses in a step"
    assert any(any(a[:2]) and not any(a[2:]) for a in active), "rank 1 runs zero passes"


@pytest.mark.slow
def test_parallel_path_steps_on_four_sharded_ranks_as_on_one_process(parallel_one, tmp_path):
    assert_same_run(parallel_one, on_ranks(tmp_path, PARALLEL, 4, "--shard", "fsdp"))


def test_summarised_monte_carlo_parallel_steps_on_two_data_parallel_ranks(tmp_path):
    """Unsharded, the summaries and the Monte-Carlo orderings of each question are those of one
    process, bit for bit (the gradients' all_reduce adds two ranks' sums as one process adds
    its questions')."""
    one, two = one_process(tmp_path, SUMMARY), on_ranks(tmp_path, SUMMARY, 2)
    assert_same_run(one, two)
    lines = read_jsonl(one / "rollouts.jsonl")
    assert all(q["parallel"]["summary_texts"] for line in lines for q in line["questions"])
    errors = [se for line in lines for q in line["questions"] for se in q["parallel"]["phi_se"]]
    assert max(errors) > 0, "Monte-Carlo orderings, not the exact values"
    weights = [load_file(run / "final" / "model.safetensors") for run in (one, two)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
