"""A model directory is checked before any tensor is read and before anything is written
(issue 28, items 4, 7, 8, 11, 12): headers first (names, shapes, dtypes, byte sizes), duplicate
tensors across shards refused, regular files inside the directory only, a bounded config.json,
and a tokenizer no larger than the model's vocabulary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hang_guard import within
from safetensors.torch import load_file, save_file

from rlvr_fast.models.checkpoint import CheckpointError, load_model, save_model
from rlvr_fast.models.config import ConfigError, ModelConfig
from rlvr_fast.models.qwen3 import Qwen3ForCausalLM
from rlvr_fast.models.policy import TINY_MODEL_DIR, load_policy
from rlvr_fast.models.tokenizer import TokenizerError

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def tiny_copy(tmp_path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL_DIR, model)
    return model


def crafted_shard(path: Path, name: str, dtype: str, shape: list[int], nbytes: int) -> None:
    """A safetensors file whose header claims one tensor of ``nbytes`` bytes, written sparse
    (the file has the size, the disk holds almost nothing)."""
    header = json.dumps({name: {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}})
    header += " " * (-len(header) % 8)
    with open(path, "wb") as file:
        file.write(len(header).to_bytes(8, "little") + header.encode())
        file.truncate(8 + len(header) + nbytes)


def split_off(model: Path, name: str) -> dict[str, torch.Tensor]:
    """The tiny checkpoint without tensor ``name`` (for a second shard to hold)."""
    tensors = load_file(model / "model.safetensors")
    removed = {name: tensors.pop(name)}
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    return removed


# The child's own peak: VmHWM belongs to the memory map exec made. ru_maxrss would not do: Linux
# carries it across fork + exec, so a child of a long-lived pytest worker reports the worker's peak.
LOAD_AND_REPORT = """
import sys
from pathlib import Path
from rlvr_fast.models.checkpoint import CheckpointError, load_model
try:
    load_model(sys.argv[1])
except CheckpointError as err:
    print(err)
status = Path("/proc/self/status").read_text().splitlines()
print(next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) // 1024)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
def test_a_sparse_4_gib_q_proj_fails_from_its_header_before_memory_grows(tiny_copy):
    """Regression: 8.5 GB RSS before the shape error (tensors were read and concatenated before
    shapes were checked)."""
    split_off(tiny_copy, Q_PROJ)
    crafted_shard(tiny_copy / "model-2.safetensors", Q_PROJ, "F32", [1 << 23, 128], 1 << 32)
    done = subprocess.run(
        [sys.executable, "-c", LOAD_AND_REPORT, str(tiny_copy)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    message, peak_mib = done.stdout.strip().splitlines()
    assert f"{Q_PROJ} has shape (8388608, 128), config implies (128, 128)" in message, done.stderr
    assert int(peak_mib) < 1500, f"peak RSS {peak_mib} MiB: the tensor was read"


def test_a_tensor_in_two_shards_is_refused(tiny_copy):
    """Regression: two shards holding the same tensor loaded silently (the last one won)."""
    tensors = load_file(tiny_copy / "model.safetensors")
    save_file({Q_PROJ: tensors[Q_PROJ] + 1}, str(tiny_copy / "model-2.safetensors"))
    with pytest.raises(CheckpointError, match=f"model.safetensors: tensor '{Q_PROJ}' is also in"):
        load_model(tiny_copy)


@pytest.mark.parametrize(
    "dtype, shape, nbytes, message",
    [
        ("I64", [128, 128], 128 * 128 * 8, "dtype 'I64', not a float"),
        ("F32", [128, 128], 100, "do not hold a F32 tensor of shape \\[128, 128\\]"),
        ("F32", [128, -1], 0, "shape \\[128, -1\\] is not a list of sizes"),
    ],
    ids=["an integer tensor", "bytes that are not its shape's", "a negative size"],
)
def test_a_header_that_lies_is_refused_before_reading(tiny_copy, dtype, shape, nbytes, message):
    split_off(tiny_copy, Q_PROJ)
    crafted_shard(tiny_copy / "model-2.safetensors", Q_PROJ, dtype, shape, nbytes)
    with pytest.raises(CheckpointError, match=message):
        load_model(tiny_copy)


def test_a_header_longer_than_the_file_is_refused(tiny_copy):
    (tiny_copy / "model-2.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="not a safetensors file \\(header length"):
        load_model(tiny_copy)


def test_sharded_checkpoints_load_as_one(tiny_copy):
    reference = load_model(TINY_MODEL_DIR)
    removed = split_off(tiny_copy, Q_PROJ)
    save_file(removed, str(tiny_copy / "model-2.safetensors"))
    loaded = load_model(tiny_copy)
    for (name, a), b in zip(reference.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_a_fifo_in_a_model_directory_is_refused_at_once(tiny_copy, name):
    """Regression: a FIFO as config.json or model.safetensors hung train and eval forever."""
    (tiny_copy / name).unlink()
    os.mkfifo(tiny_copy / name)
    with (
        within(20),
        pytest.raises(
            (CheckpointError, ConfigError, TokenizerError),
            match=f"{name}: not a regular file \\(a FIFO\\)",
        ),
    ):
        load_policy(tiny_copy)


def test_a_config_json_linked_to_dev_zero_is_refused_at_once(tiny_copy):
    (tiny_copy / "config.json").unlink()
    os.symlink("/dev/zero", tiny_copy / "config.json")
    with (
        within(20),
        pytest.raises(CheckpointError, match="config.json: a symlink to /dev/zero, outside"),
    ):
        load_model(tiny_copy)


@pytest.mark.parametrize("name", ["vocab.json", "special_tokens_map.json", "model.safetensors"])
def test_a_model_file_linked_out_of_the_directory_is_refused_before_anything_is_written(
    tiny_copy, tmp_path, name
):
    """Regression: vocab.json and special_tokens_map.json linked to a file outside ended up,
    with that file's contents, in the run's final/. Links are resolved and must stay inside
    the directory."""
    secret = tmp_path / "secret"
    shutil.copy(tiny_copy / name, secret) if (tiny_copy / name).exists() else secret.write_text(
        "{}"
    )
    (tiny_copy / name).unlink(missing_ok=True)
    os.symlink(secret, tiny_copy / name)
    with pytest.raises(
        CheckpointError, match=f"{name}: a symlink to .*secret, outside the directory"
    ):
        load_policy(tiny_copy)


def test_links_inside_the_directory_and_a_hugging_face_cache_snapshot_load(tmp_path):
    """The Hugging Face cache's layout: snapshots/REV/* link to ../../blobs/HASH."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in TINY_MODEL_DIR.iterdir():
        shutil.copy(file, blobs / file.name)
        os.symlink(Path("..", "..", "blobs", file.name), snapshot / file.name)
    policy = load_policy(snapshot)
    reference = load_policy(TINY_MODEL_DIR)
    assert torch.equal(policy.model.lm_head.weight, reference.model.lm_head.weight)
    policy.save(tmp_path / "final")
    assert not any(p.is_symlink() for p in (tmp_path / "final").iterdir())


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_anything_is_written(tmp_path):
    """Regression: a model with 40 embedding rows under the tiny tokenizer (384 tokens) failed
    at the first prompt with `add: token ids must lie in [0, 40)`, naming no file, after the run
    directory's config.json and ledger existed."""
    config = ModelConfig.from_file(TINY_MODEL_DIR / "config.json")
    config.vocab_size = 40
    model_dir = tmp_path / "small-vocab"
    save_model(Qwen3ForCausalLM(config), model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MODEL_DIR / name, model_dir / name)
    with pytest.raises(
        CheckpointError,
        match="the tokenizer has 384 tokens, more than the model's vocabulary \\(vocab_size 40",
    ):
        load_policy(model_dir)
    root = str(Path(__file__).resolve().parents[2])
    out = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlvr_fast.cli",
            "train",
            "--arm",
            "zg_flat",
            "--model",
            str(model_dir),
            "--steps",
            "1",
            "--out",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "more than the model's vocabulary" in done.stderr
    assert not out.exists(), "nothing written"


def test_a_config_json_over_its_cap_is_refused_unread(tiny_copy):
    with open(tiny_copy / "config.json", "ab") as file:
        file.truncate(1 << 30)
    with (
        within(20),
        pytest.raises(ConfigError, match="over the 16,777,216-byte limit of a model config"),
    ):
        load_model(tiny_copy)


def test_a_weight_holding_nan_is_refused_at_load(tiny_copy):
    """Regression: a model with NaN weights evaluated to 0% with exit 0."""
    tensors = load_file(tiny_copy / "model.safetensors")
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, str(tiny_copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.norm.weight holds NaN or infinite values"):
        load_model(tiny_copy)
