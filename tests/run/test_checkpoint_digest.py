"""Resume state that proves itself (issue 39, item 2): a flipped bit anywhere in a checkpoint,
a checkpoint of another run (another seed, another precision) and a facade checkpoint-N with a
changed or missing file are refused naming what differs, before anything is loaded or written;
a checkpoint written before digests (state format 1) still resumes, with one warning line."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import save_file

from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import TINY_MODEL_DIR, load_policy
from rlvr_fast.run.layout import RunLayout
from rlvr_fast.run.state_file import (
    HEADER_KEY,
    UNDIGESTED_FORMAT,
    StateFileError,
    encode,
    load_state,
)
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.trainer import RLVRTrainer

PROBLEMS = synthetic_problems("train", 2, seed=3)


def trainer(out, *, steps=2, resume=False, seed=42, precision="fp32"):
    config = TrainConfig.from_arm(
        "zg_flat",
        steps=steps,
        seed=seed,
        precision=precision,
        max_new_tokens=8,
        eval_max_new_tokens=8,
        checkpoint_every=1,
    )
    return RLVRTrainer(
        load_policy("tiny"), config, PROBLEMS, {}, out_dir=out, resume=resume, progress=False
    )


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def killed_after_one_step(out: Path, **settings) -> Path:
    """A run of 2 steps cut to its state after step 1 (checkpoint at 1, ledger of 1 line)."""
    trainer(out, steps=1, **settings).train()
    (out / "summary.json").unlink()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return {
        "fp32": killed_after_one_step(root / "fp32"),
        "fp16": killed_after_one_step(root / "fp16", precision="fp16-mixed"),
        "seed7": killed_after_one_step(root / "seed7", seed=7),
    }


def copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def flip_bit(path: Path, offset: int, mask: int = 0x10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["tensor bytes", "last byte", "header number"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_flipped_bit_in_the_checkpoint_is_refused_and_nothing_is_written(
    runs, tmp_path, where, precision
):
    """Regression: one flipped bit in checkpoint/state.safetensors resumed with exit 0 and a run
    that diverged from the uninterrupted one."""
    out = copy(runs[precision], tmp_path / "run")
    state = RunLayout(out).checkpoint
    data = state.read_bytes()
    header_length = int.from_bytes(data[:8], "little")
    if where == "tensor bytes":
        offset = 8 + header_length + (len(data) - 8 - header_length) // 2
    elif where == "last byte":
        offset = len(data) - 1
    else:  # a digit of next_step's value in the JSON header ("next_step": 1)
        offset = data.index(b'next_step\\": 1') + len('next_step\\": ')
    flip_bit(state, offset, 0x01 if where == "header number" else 0x10)  # '1' -> '0'
    before = tree_digest(out)
    with pytest.raises(StateFileError, match="damaged state file"):
        trainer(out, resume=True, precision="fp16-mixed" if precision == "fp16" else "fp32")
    assert tree_digest(out) == before, "nothing written before the refusal"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("fp16", "precision 'fp16-mixed' in the checkpoint, 'fp32' in this run"),
        ("seed7", "seed 7 in the checkpoint, 42 in this run"),
    ],
)
def test_another_runs_checkpoint_is_refused_naming_what_differs(runs, tmp_path, source, message):
    """Regression: an fp16-mixed run's checkpoint copied into an fp32 run, or another seed's,
    resumed with exit 0."""
    out = copy(runs["fp32"], tmp_path / "run")
    shutil.copyfile(RunLayout(runs[source]).checkpoint, RunLayout(out).checkpoint)
    before = tree_digest(out)
    with pytest.raises(StateFileError, match=f"a checkpoint of another run \\({message}\\)"):
        trainer(out, resume=True)
    assert tree_digest(out) == before


def test_a_checkpoint_of_a_run_on_other_problems_is_refused(runs, tmp_path):
    """Found probing: same arm, seed and settings, other training problems."""
    other = tmp_path / "other"
    config = TrainConfig.from_arm(
        "zg_flat", steps=1, max_new_tokens=8, eval_max_new_tokens=8, checkpoint_every=1
    )
    problems = synthetic_problems("train", 2, seed=11)
    RLVRTrainer(load_policy("tiny"), config, problems, {}, out_dir=other, progress=False).train()
    out = copy(runs["fp32"], tmp_path / "run")
    shutil.copyfile(RunLayout(other).checkpoint, RunLayout(out).checkpoint)
    with pytest.raises(StateFileError, match="a checkpoint of another run \\(train_data "):
        trainer(out, resume=True)


def test_an_intact_checkpoint_resumes_to_the_uninterrupted_run(runs, tmp_path):
    straight = tmp_path / "straight"
    trainer(straight).train()
    out = copy(runs["fp32"], tmp_path / "run")
    trainer(out, resume=True).train()
    assert without_seconds(out / "ledger.jsonl") == without_seconds(straight / "ledger.jsonl")


def without_seconds(ledger: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k != "seconds"}
        for line in ledger.read_text().splitlines()
    ]


def test_a_checkpoint_written_before_digests_resumes_with_one_warning(runs, tmp_path, capsys):
    """Runs written by main before state format 2 (no digest, no identity) still resume."""
    out = copy(runs["fp32"], tmp_path / "run")
    path = RunLayout(out).checkpoint
    state = load_state(path)
    del state["run"]
    tensors: dict = {}
    skeleton = encode(state, tensors, {})
    header = {HEADER_KEY: json.dumps({"format": UNDIGESTED_FORMAT, "state": skeleton})}
    save_file(tensors, str(path), metadata=header)
    trainer(out, resume=True).train()
    warning = capsys.readouterr().err
    assert "written before checkpoints carried a digest" in warning
    assert warning.count("\n") == 1
    assert len((out / "ledger.jsonl").read_text().splitlines()) == 2


FACADE = dict(
    max_steps=2,
    num_generations=4,
    per_device_train_batch_size=4,
    max_completion_length=8,
    learning_rate=1e-3,
    save_strategy="steps",
    save_steps=1,
    report_to="none",
    use_cpu=True,
    disable_tqdm=True,
)


def facade(out: Path, **settings):
    from rlvr_fast.trl_compat import GRPOConfig, GRPOTrainer

    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    args = GRPOConfig(output_dir=str(out), **{**FACADE, **settings})
    return GRPOTrainer(
        model=str(TINY_MODEL_DIR),
        reward_funcs=lambda completions, **kw: [float(len(c) % 3) for c in completions],
        args=args,
        train_dataset=rows,
    )


@pytest.fixture(scope="module")
def facade_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("facade") / "out"
    facade(out).train()
    return out


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("state bit", "rlvr_fast/state.safetensors differs"),
        ("trainer state", "trainer_state.json differs"),
        ("missing weights", "model.safetensors is missing"),
    ],
)
def test_a_damaged_facade_checkpoint_is_refused_naming_the_file(
    facade_run, tmp_path, damage, message
):
    """Regression: a flipped bit in checkpoint-N's state resumed with exit 0."""
    checkpoint = tmp_path / "checkpoint-1"
    shutil.copytree(facade_run / "checkpoint-1", checkpoint)
    if damage == "state bit":
        flip_bit(checkpoint / "rlvr_fast" / "state.safetensors", -1)
    elif damage == "trainer state":
        text = (checkpoint / "trainer_state.json").read_text()
        (checkpoint / "trainer_state.json").write_text(
            text.replace('"global_step": 1', '"global_step": 2')
        )
    else:
        (checkpoint / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=message):
        facade(tmp_path / "resumed").train(resume_from_checkpoint=str(checkpoint))


def test_another_runs_facade_checkpoint_is_refused(facade_run, tmp_path):
    with pytest.raises(StateFileError, match="seed 42 in the checkpoint, 5 in this run"):
        facade(tmp_path / "resumed", seed=5).train(
            resume_from_checkpoint=str(facade_run / "checkpoint-1")
        )
