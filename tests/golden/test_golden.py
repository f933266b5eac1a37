"""Golden outputs of every arm preset: 3 steps on the embedded model, trees from the first step.

What a run writes (final weights, rollouts, ledger and evaluations without timings, the summary
without its seconds) is hashed per arm and compared with the hashes recorded in ``hashes.json``
on the reference platform (the CPU, one thread, the torch release the Makefile pins). A change
of code that should leave behaviour identical (a restructuring) keeps every hash; a change that
alters the CPU's rounding on purpose re-records them, in a commit of its own that names the cause:

    python tests/golden/test_golden.py --record
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HASHES = Path(__file__).with_name("hashes.json")
SETTINGS = dict(
    steps=3,
    max_new_tokens=32,
    eval_max_new_tokens=24,
    t_min=4,
    t_max=12,
    bifurcate_after_active=0,
    lr=1e-4,
    checkpoint_every=2,
)
# Level-1 questions of this seed give rewards that vary on most arms' steps.
TRAIN_QUESTIONS = 12
EVAL_QUESTIONS = 3


def platform_key() -> str:
    return f"{platform.machine()}-torch{torch.__version__}"


def arm_names() -> list[str]:
    from rlvr_fast.train.arms import ARMS

    return list(ARMS)


def without_timings(value):
    """``value`` with every key that holds a wall time (``seconds``, ``seconds_*``) removed."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if not str(k).startswith("seconds")}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def jsonl_digest(path: Path) -> str:
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return digest_json([without_timings(line) for line in lines])


def digest_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def weights_digest(directory: Path) -> str:
    tensors = load_file(directory / "model.safetensors")
    h = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(tensor.dtype).encode())
        h.update(str(tuple(tensor.shape)).encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_outputs(arm: str, out: Path) -> dict[str, str]:
    """Train ``arm`` for three steps into ``out`` and hash what it wrote."""
    from rlvr_fast import RLVRTrainer, TrainConfig, load_policy, synthetic_problems

    from rlvr_fast.train.arms import arm_settings

    preset = arm_settings(arm)
    overrides = dict(SETTINGS)
    if preset.get("polyak_start"):
        overrides["polyak_start"] = 2
    # The embedded model answers in a box at once: under the study's 30-character gate no
    # rollout of three steps is rewarded, and no credit or loss would reach the hashes.
    if preset.get("gate_min_chars") is not None:
        overrides["gate_min_chars"] = 0
    config = TrainConfig.from_arm(arm, **overrides)
    policy = load_policy("tiny")
    trainer = RLVRTrainer(
        policy,
        config,
        synthetic_problems("train", TRAIN_QUESTIONS, seed=2, levels=(1,)),
        {"held_out": synthetic_problems("test", EVAL_QUESTIONS, seed=8)},
        out_dir=out,
        progress=False,
    )
    summary = trainer.train()
    digests = {
        "ledger": jsonl_digest(out / "ledger.jsonl"),
        "rollouts": jsonl_digest(out / "rollouts.jsonl"),
        "final": weights_digest(out / "final"),
        "summary": digest_json(without_timings(summary)),
    }
    for path in sorted((out / "evals").rglob("*.jsonl")):
        digests[f"evals/{path.relative_to(out / 'evals')}"] = jsonl_digest(path)
    if (out / "final_polyak").exists():
        digests["final_polyak"] = weights_digest(out / "final_polyak")
    return digests


@pytest.fixture()
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("arm", arm_names())
def test_every_arm_writes_its_golden_outputs(arm, tmp_path, one_thread):
    recorded = json.loads(HASHES.read_text()) if HASHES.exists() else {}
    if platform_key() not in recorded:
        pytest.skip(f"no golden hashes recorded for {platform_key()} (reference: {list(recorded)})")
    expected = recorded[platform_key()][arm]
    assert run_outputs(arm, tmp_path / arm) == expected


def record() -> None:
    import tempfile

    torch.set_num_threads(1)
    recorded = json.loads(HASHES.read_text()) if HASHES.exists() else {}
    hashes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in arm_names():
            hashes[arm] = run_outputs(arm, Path(tmp) / arm)
            print(f"{arm}: {hashes[arm]['final'][:12]}", flush=True)
    recorded[platform_key()] = hashes
    HASHES.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit("usage: python tests/golden/test_golden.py --record")
    record()
