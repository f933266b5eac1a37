"""State files: tensors in safetensors, the rest in JSON; nothing is unpickled."""

from __future__ import annotations

import json
import math
import os
import pickle

import pytest
import torch
from safetensors.torch import save_file

from rlvr_fast.run.state_file import HEADER_KEY, StateFileError, load_state, save_state


def test_an_optimizer_and_model_state_round_trips_exactly(tmp_path):
    model = torch.nn.Linear(5, 3).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 5, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    state = {
        "next_step": 7,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "generator": torch.Generator().manual_seed(3).get_state(),
        "extra": None,
        "counts": (1, 2.5, float("nan"), -math.inf),
        "polyak": {"count": 0, "sums": {}},
    }
    save_state(tmp_path / "state.safetensors", state)
    loaded = load_state(tmp_path / "state.safetensors")
    assert loaded["next_step"] == 7 and loaded["extra"] is None
    assert loaded["polyak"] == {"count": 0, "sums": {}}
    assert loaded["counts"][:2] == (1, 2.5) and math.isnan(loaded["counts"][2])
    assert loaded["counts"][3] == -math.inf
    for name, tensor in state["model"].items():
        assert (
            torch.equal(loaded["model"][name], tensor)
            and loaded["model"][name].dtype == tensor.dtype
        )
    assert set(loaded["optimizer"]["state"]) == {0, 1}, "integer parameter indices come back"
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    for index, moments in state["optimizer"]["state"].items():
        for key, tensor in moments.items():
            assert torch.equal(loaded["optimizer"]["state"][index][key], tensor)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(loaded["optimizer"])
    assert torch.equal(loaded["generator"], state["generator"])


def test_a_tied_weight_is_stored_once(tmp_path):
    weight = torch.randn(4, 3)
    save_state(tmp_path / "s.safetensors", {"embed": weight, "head": weight, "half": weight[:2]})
    loaded = load_state(tmp_path / "s.safetensors")
    assert torch.equal(loaded["embed"], weight) and torch.equal(loaded["half"], weight[:2])
    assert loaded["embed"] is loaded["head"]


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_crafted_pickle_in_the_checkpoint_directory_is_never_loaded(tmp_path, monkeypatch):
    """Regression: checkpoint/state.pt was read with torch.load(weights_only=False): a crafted file
    ran code. State files are safetensors now; a pickle under the state file's name is refused
    without being unpickled."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "state.safetensors"
    path.write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(StateFileError, match="state.safetensors: unreadable state file"):
        load_state(path)
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize(
    "damage",
    [
        "truncated",
        "no header",
        "bad json",
        "unknown tag",
        "missing tensor",
        "deep nesting",
        "empty",
    ],
)
def test_a_damaged_state_file_is_one_clear_error(tmp_path, damage):
    path = tmp_path / "state.safetensors"
    save_state(path, {"next_step": 1, "w": torch.ones(1000)})
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        header = {
            "no header": None,
            "bad json": "{",
            "unknown tag": json.dumps({"format": "rlvr_fast state 1", "state": {"x": 1}}),
            "missing tensor": json.dumps({"format": "rlvr_fast state 1", "state": {"tensor": "9"}}),
            "deep nesting": "[" * 100_000 + "]" * 100_000,
        }[damage]
        save_file(
            {"0": torch.ones(2)},
            str(path),
            metadata=None if header is None else {HEADER_KEY: header},
        )
    with pytest.raises(StateFileError, match="state.safetensors: "):
        load_state(path)


def test_states_that_are_not_data_are_refused_before_writing(tmp_path):
    with pytest.raises(TypeError, match="cannot store a object"):
        save_state(tmp_path / "s.safetensors", {"x": object()})
    assert not list(tmp_path.iterdir())


def test_no_code_unpickles_anything():
    """No torch.load, pickle or numpy pickle load in the package, its scripts or benchmarks:
    every file rlvr_fast reads back is safetensors or JSON. The one exception is named: the reader
    of a checkpoint TRL wrote, whose every torch.load is weights_only=True (pickle imported there
    for its error type only)."""
    import re

    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sources = [
        p
        for folder in ("rlvr_fast", "scripts", "benchmarks", "kernels")
        for p in (root / folder).rglob("*.py")
        if "wheels" not in p.parts
    ]
    assert len(sources) > 50
    readers = (
        "torch.load(",
        "import pickle",
        "pickle.load",
        "allow_pickle=True",
        "import dill",
        "import joblib",
        "weights_only=False",
    )
    trl_reader = root / "rlvr_fast" / "trl_compat" / "trl_checkpoint.py"
    found = [
        f"{p.relative_to(root)}: {r}"
        for p in sources
        if p != trl_reader
        for r in readers
        if r in p.read_text(encoding="utf-8")
    ]
    assert not found, found
    text = trl_reader.read_text(encoding="utf-8")
    calls = re.findall(r"torch\.load\(([^)]*)\)", text)
    assert calls and all("weights_only=True" in call for call in calls), calls
    assert set(re.findall(r"pickle\.\w+", text)) == {"pickle.UnpicklingError"}
    assert not any(r in text for r in readers if r not in ("torch.load(", "import pickle"))
