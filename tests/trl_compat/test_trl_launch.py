"""``accelerate launch`` runs a GRPOTrainer script data-parallel exactly as ``torchrun`` does (two
CPU processes, gloo: each rank logs the same steps under either launcher); what accelerate
sets is honoured or refused by name (``rlvr_fast.trl_compat.launch``)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlvr_fast.trl_compat import GRPOConfig
from rlvr_fast.trl_compat.run_setup import train_config, training_device

SCRIPT = """
import json, sys
from pathlib import Path
from rlvr_fast import GRPOConfig, GRPOTrainer
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems

rows = [{"prompt": render_prompt(p.question)} for p in synthetic_problems("train", 8, seed=5)]

def varied(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]

out = Path(sys.argv[1])
args = GRPOConfig(
    output_dir=str(out), max_steps=2, num_generations=4, per_device_train_batch_size=4,
    max_completion_length=8, learning_rate=1e-3, logging_steps=1, report_to="none",
    save_strategy="no", bf16=False, use_cpu=True, disable_tqdm=True,
)
trainer = GRPOTrainer(model="tiny", reward_funcs=varied, args=args, train_dataset=rows)
trainer.train()
rank = trainer.accelerator.process_index
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{rank}.json").write_text(json.dumps(
    {"processes": trainer.accelerator.num_processes, "log": trainer.state.log_history}
))
trainer.end()
"""
# Logged figures of time, which differ between any two runs.
TIMES = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_logs(command: list[str], out: Path, tmp_path: Path) -> list[dict]:
    """Each rank's process count and logs (time figures left out) of the script under
    ``command``."""
    script = tmp_path / "facade_script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    done = subprocess.run(
        [*command, str(script), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = []
    for rank in (0, 1):
        record = json.loads((out / f"rank{rank}.json").read_text())
        record["log"] = [{k: v for k, v in e.items() if k not in TIMES} for e in record["log"]]
        ranks.append(record)
    return ranks


@pytest.mark.slow
def test_accelerate_launch_runs_the_facade_data_parallel_as_torchrun_does(tmp_path):
    accelerate = Path(sys.executable).parent / "accelerate"
    if not accelerate.is_file() or shutil.which("accelerate", path=str(accelerate.parent)) is None:
        pytest.skip("accelerate's launcher is not installed")
    by_accelerate = launched_logs(
        [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2"]
        + ["--main_process_port", str(free_port())],
        tmp_path / "accelerate",
        tmp_path,
    )
    by_torchrun = launched_logs(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        + ["--master_port", str(free_port())],
        tmp_path / "torchrun",
        tmp_path,
    )
    assert [r["processes"] for r in by_accelerate] == [2, 2]
    assert by_accelerate == by_torchrun
    assert [e["step"] for e in by_accelerate[0]["log"] if "loss" in e] == [1, 2]


def args(**fields) -> GRPOConfig:
    return GRPOConfig(output_dir="unused", num_generations=4, report_to="none", **fields)


@pytest.mark.parametrize(
    "variable,option",
    [
        ("ACCELERATE_USE_DEEPSPEED", "--use_deepspeed"),
        ("ACCELERATE_USE_MEGATRON_LM", "--use_megatron_lm"),
    ],
)
def test_accelerate_launch_options_rlvr_fast_lacks_are_refused_by_name(
    monkeypatch, variable, option
):
    monkeypatch.setenv(variable, "true")
    with pytest.raises(ValueError, match=f"accelerate launch {option} .*not supported"):
        args()


def test_accelerate_launchs_mixed_precision_and_cpu_are_honoured(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    # bf16 set by neither: transformers takes accelerate's, bf16 (float32 on the CPU).
    assert train_config(args(bf16=False), 1, 1).precision is None
    assert train_config(args(bf16=False, use_cpu=True), 1, 1).precision is None
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert train_config(args(bf16=False), 1, 1).precision == "fp32"
    assert train_config(args(bf16=True, use_cpu=True), 1, 1).precision is None
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert training_device(args(bf16=False)).type == "cpu"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ValueError, match="--mixed_precision fp8 .*not supported"):
        args()
