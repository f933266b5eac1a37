"""Sharded training through the facade (``rlvr_fast.trl_compat.fsdp``): ``GRPOConfig(fsdp=...)``,
its ``fsdp_config`` and ``accelerate launch --use_fsdp --fsdp_version 2`` turn on rlvr_fast's FSDP2
sharding; what it does not build is refused by name. A TRL script run by 2 sharded ranks (under
torchrun, and under accelerate's FSDP2 launch) saves its models with every rank gathering and
rank 0 writing and its checkpoints' training state as each rank's DCP shards, evaluates, and ends with one process's weights (within 1e-6 of each tensor's
largest: the gradients' sums are reduced in another order); its checkpoints resume on one
process, and one process's on 2 sharded ranks. accelerate's launch runs the config file
docs/trl.md shows."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlvr_fast.data.problems import render_prompt
from rlvr_fast.run.state_file import load_state
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.trl_compat import GRPOConfig, GRPOTrainer, UnsupportedFieldError
from rlvr_fast.trl_compat.run_setup import train_config
from rlvr_fast.trl_compat.trl_checkpoint import resume_from_trl_checkpoint
from tests.docs.readme_blocks import ROOT, read_blocks
from tests.trl_compat.test_trl_launch import TIMES, free_port

DOCS = ROOT / "docs" / "trl.md"

SCRIPT = """
import json, sys
from pathlib import Path
from rlvr_fast import GRPOConfig, GRPOTrainer
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems

rows = [{"prompt": render_prompt(p.question)} for p in synthetic_problems("train", 8, seed=5)]

def varied(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]

out, fsdp, batch, resume = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
args = GRPOConfig(
    output_dir=str(out), max_steps=2, num_generations=4, per_device_train_batch_size=batch,
    max_completion_length=8, learning_rate=1e-4, logging_steps=1, report_to="none",
    save_strategy="steps", save_steps=1, bf16=False, use_cpu=True, disable_tqdm=True,
    eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4, fsdp=fsdp or None,
)
trainer = GRPOTrainer(
    model="tiny", reward_funcs=varied, args=args, train_dataset=rows, eval_dataset=rows[:4]
)
trainer.train(resume_from_checkpoint=resume or None)
trainer.save_model()
rank = trainer.accelerator.process_index
(out / f"rank{rank}.json").write_text(json.dumps({
    "processes": trainer.accelerator.num_processes,
    "shard": trainer.trainer.config.shard,
    "log": trainer.state.log_history,
}))
trainer.end()
"""


def args(**fields) -> GRPOConfig:
    return GRPOConfig(
        output_dir="unused", num_generations=4, report_to="none", use_cpu=True, **fields
    )


@pytest.mark.parametrize(
    "fields",
    [
        dict(fsdp="full_shard"),
        dict(fsdp=True),
        dict(fsdp="full_shard auto_wrap", fsdp_config={"fsdp_version": 2}),
        dict(fsdp=["full_shard"], fsdp_config={"transformer_layer_cls_to_wrap": "X"}),
    ],
)
def test_fsdp_shards_the_run(fields):
    assert train_config(args(**fields), 1, 1).shard == "fsdp"


def test_no_fsdp_runs_unsharded_and_fsdp_configs_activation_checkpointing_recomputes(tmp_path):
    assert train_config(args(), 1, 1).shard is None
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_activation_checkpointing": True, "version": 2}))
    unchecked = dict(fsdp="full_shard", gradient_checkpointing=False)
    assert not train_config(args(**unchecked), 1, 1).activation_checkpointing
    config = train_config(args(**unchecked, fsdp_config=str(path)), 1, 1)
    assert config.shard == "fsdp" and config.activation_checkpointing


@pytest.mark.parametrize(
    "fields,why",
    [
        (dict(fsdp="full_shard offload"), "fsdp option offload: CPU offload"),
        (dict(fsdp="hybrid_shard"), "fsdp option hybrid_shard: hybrid sharding"),
        (dict(fsdp="shard_grad_op"), "fsdp option shard_grad_op: weights kept gathered"),
        (dict(fsdp="no_shard"), "fsdp option no_shard: data parallel"),
        (dict(fsdp="sharded"), "fsdp option 'sharded' is not one of"),
        (dict(fsdp=True, fsdp_config={"version": 1}), "version=1: FSDP1 is not built"),
        (dict(fsdp=True, fsdp_config={"cpu_offload": True}), "cpu_offload=True: CPU offload"),
        (dict(fsdp=True, fsdp_config={"reshard_after_forward": False}), "ZeRO-2"),
        (dict(fsdp=True, fsdp_config={"fsdp_backward_prefetch": "X"}), "an FSDP1 option"),
        (dict(fsdp=True, fsdp_config={"use_orig_params": True}), "an FSDP1 option"),
        (dict(fsdp=True, fsdp_config={"auto_wrap_policy": "SIZE_BASED_WRAP"}), "each decoder"),
        (dict(fsdp=True, fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"}), "whole tensors"),
        (dict(fsdp=True, fsdp_config={"xla": True}), "XLA"),
        (dict(fsdp=True, fsdp_config={"unheard_of": 1}), "'unheard_of' is not an fsdp_config"),
    ],
)
def test_fsdp_settings_not_built_are_refused_by_name(fields, why):
    name = "fsdp_config" if "fsdp_config" in fields else "fsdp"
    with pytest.raises(UnsupportedFieldError, match=f"^GRPOConfig: {name} is not supported.*{why}"):
        args(**fields)


def test_fsdp_on_one_process_is_refused_as_the_cli_refuses_it(tmp_path):
    rows = [{"prompt": render_prompt(p.question)} for p in synthetic_problems("train", 2, seed=5)]
    config = args(fsdp="full_shard", max_steps=1, per_device_train_batch_size=4)
    config.output_dir = str(tmp_path)
    with pytest.raises(ValueError, match="^shard=fsdp needs several ranks"):
        GRPOTrainer(model="tiny", reward_funcs=lambda **kw: [0.0], args=config, train_dataset=rows)
    assert not any(tmp_path.iterdir())


def test_a_sharded_run_refuses_a_checkpoint_trl_wrote(tmp_path):
    sharded = SimpleNamespace(trainer=SimpleNamespace(sharded=object()))
    with pytest.raises(ValueError, match="a checkpoint TRL wrote resumes unsharded"):
        resume_from_trl_checkpoint(sharded, tmp_path)


# What accelerate launch --use_fsdp --fsdp_version 2 sets (its defaults but the version).
FSDP2_LAUNCH = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_OFFLOAD_PARAMS": "false",
    "FSDP_MIN_NUM_PARAMS": "100000000",
    "FSDP_FORWARD_PREFETCH": "false",
    "FSDP_USE_ORIG_PARAMS": "true",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_SYNC_MODULE_STATES": "true",
    "FSDP_ACTIVATION_CHECKPOINTING": "false",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "false",
}


def test_accelerate_launchs_fsdp2_settings_shard_the_run(monkeypatch):
    for variable, value in FSDP2_LAUNCH.items():
        monkeypatch.setenv(variable, value)
    config = train_config(args(gradient_checkpointing=False), 1, 1)
    assert config.shard == "fsdp" and not config.activation_checkpointing
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    assert train_config(args(gradient_checkpointing=False), 1, 1).activation_checkpointing


@pytest.mark.parametrize(
    "variable,value,why",
    [
        ("FSDP_VERSION", "1", "FSDP_VERSION=1 .*FSDP1 is not built.*--fsdp_version 2"),
        ("FSDP_OFFLOAD_PARAMS", "true", "FSDP_OFFLOAD_PARAMS=true .*CPU offload"),
        ("FSDP_RESHARD_AFTER_FORWARD", "false", "FSDP_RESHARD_AFTER_FORWARD=false .*ZeRO-2"),
        ("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT", "FSDP_STATE_DICT_TYPE=.*whole tensors"),
        ("FSDP_AUTO_WRAP_POLICY", "NO_WRAP", "FSDP_AUTO_WRAP_POLICY=NO_WRAP"),
    ],
)
def test_accelerate_launchs_fsdp_settings_not_built_are_refused_by_name(
    monkeypatch, variable, value, why
):
    for name, setting in {**FSDP2_LAUNCH, variable: value}.items():
        monkeypatch.setenv(name, setting)
    with pytest.raises(ValueError, match=f"^accelerate launch --use_fsdp with {why}"):
        args()


def test_accelerate_launchs_fsdp_without_a_version_is_fsdp1_and_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="FSDP_VERSION=1 .*--fsdp_version 2"):
        args()


# ------------------------------------------------------------------ launched runs
def launched(command: list[str], out: Path, fsdp: str, batch: int, resume: Path | None) -> list:
    """Each rank's record of the script run by ``command`` into ``out``."""
    script = out.parent / "facade_script.py"
    script.write_text(SCRIPT)
    home = out.parent / "hf"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_HOME=str(home))
    done = subprocess.run(
        [*command, str(script), str(out), fsdp, str(batch), str(resume or "")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"] + [
        "--master_port",
        str(free_port()),
    ]


def assert_weights_match(expected_dir: Path, got_dir: Path) -> float:
    """The models' weights within 1e-6 of each tensor's largest; returns the largest ratio."""
    expected = load_file(str(expected_dir / "model.safetensors"))
    got = load_file(str(got_dir / "model.safetensors"))
    assert expected.keys() == got.keys()
    worst = 0.0
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32
        ratio = ((got[name] - tensor).abs().max() / tensor.abs().max()).item()
        assert ratio <= 1e-6, name
        worst = max(worst, ratio)
    return worst


def losses(record: dict) -> list[tuple[float, float]]:
    return [(e["loss"], e["grad_norm"]) for e in record["log"] if "loss" in e]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process with 8 completions a step; 2 sharded ranks with 4 each, by torchrun."""
    base = tmp_path_factory.mktemp("facade_fsdp")
    one = launched([sys.executable], base / "one", "", 8, None)
    two = launched(torchrun(), base / "two", "full_shard", 4, None)
    return base, one, two


@pytest.mark.slow
def test_two_sharded_ranks_end_with_one_process_weights(runs):
    base, one, two = runs
    assert [(r["processes"], r["shard"]) for r in two] == [(2, "fsdp"), (2, "fsdp")]
    assert (one[0]["processes"], one[0]["shard"]) == (1, None)
    for saved in ("", "checkpoint-1", "checkpoint-2"):
        assert_weights_match(base / "one" / saved, base / "two" / saved)
    # Each rank evaluated its share of the eval rows (the loss through the engine's full copy).
    for record in two:
        (evaluated,) = [e for e in record["log"] if "eval_loss" in e]
        assert math.isfinite(evaluated["eval_loss"]) and evaluated["step"] == 2
    for (loss, norm), (loss_one, norm_one) in zip(losses(two[0]), losses(one[0]), strict=True):
        assert norm == pytest.approx(norm_one, rel=1e-5)
        assert loss == pytest.approx(loss_one, abs=1e-6)


def untimed(records: list[dict]) -> list[dict]:
    """The ranks' records with the logged figures of time (training's and evaluation's) left
    out."""

    def timed(key: str) -> bool:
        return key in TIMES or key.endswith(("_runtime", "_per_second"))

    return [
        {**r, "log": [{k: v for k, v in e.items() if not timed(k)} for e in r["log"]]}
        for r in records
    ]


def docs_config_file() -> str:
    """The accelerate config file docs/trl.md shows."""
    (block,) = [b for b in read_blocks(DOCS) if b.lang == "yaml" and "fsdp_version: 2" in b.text]
    return block.text


@pytest.mark.slow
def test_accelerate_launchs_fsdp2_config_file_runs_sharded_as_torchrun_does(runs, tmp_path):
    base, _, two = runs
    accelerate = Path(sys.executable).parent / "accelerate"
    if not accelerate.is_file() or shutil.which("accelerate", path=str(accelerate.parent)) is None:
        pytest.skip("accelerate's launcher is not installed")
    # docs/trl.md's config file, on 2 CPU processes in fp32 (as the torchrun run).
    config = tmp_path / "fsdp2.yaml"
    config.write_text(docs_config_file())
    command = [str(accelerate), "launch", "--config_file", str(config), "--num_processes", "2"]
    command += ["--mixed_precision", "no", "--main_process_port", str(free_port())]
    by_accelerate = launched(command, tmp_path / "accelerate", "", 4, None)
    assert untimed(by_accelerate) == untimed(two)
    expected = load_file(str(base / "two" / "model.safetensors"))
    got = load_file(str(tmp_path / "accelerate" / "model.safetensors"))
    assert all(torch.equal(expected[name], got[name]) for name in expected)


@pytest.mark.slow
def test_checkpoints_resume_across_sharded_ranks_and_one_process(runs, tmp_path):
    base, _, _ = runs
    # 2 sharded ranks' checkpoint-1 finished by one process.
    launched([sys.executable], tmp_path / "on_one", "", 8, base / "two" / "checkpoint-1")
    assert_weights_match(base / "one", tmp_path / "on_one")
    # one process's checkpoint-1 finished by 2 sharded ranks.
    launched(torchrun(), tmp_path / "on_two", "full_shard", 4, base / "one" / "checkpoint-1")
    assert_weights_match(base / "one", tmp_path / "on_two")


@pytest.mark.slow
def test_a_sharded_checkpoints_state_is_each_ranks_dcp_shards_and_resumes_on_two(runs, tmp_path):
    """The weights, moments and RNG states of 2 sharded ranks' checkpoint-N are their DCP shards
    (nothing gathered, no whole optimizer in the state file), listed by the manifest; the model
    beside them is whole; 2 sharded ranks finish the run from it."""
    base, _, _ = runs
    checkpoint = base / "two" / "checkpoint-1"
    state = load_state(checkpoint / "rlvr_fast" / "state.safetensors")
    assert not {"model", "optimizer", "generator", "torch_rng"} & state.keys(), "in the shards"
    shards = checkpoint / "rlvr_fast" / state["shards"]["directory"]
    files = sorted(p.name for p in shards.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    manifest = json.loads((checkpoint / "rlvr_fast" / "manifest.json").read_text())
    assert {f"rlvr_fast/{shards.name}/{name}" for name in files} <= manifest["sha256"].keys()
    assert sorted(p.name for p in (base / "two").glob(".*")) == [], "no temp folder left"
    launched(torchrun(), tmp_path / "on_two", "full_shard", 4, checkpoint)
    assert_weights_match(base / "one", tmp_path / "on_two")
