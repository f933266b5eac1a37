"""LoRA from the native settings (``lora_r`` ...): a run trains the adapters alone, its
config.json says so (and a run without them keeps the config.json it had), a stopped run
resumes to the bytes of one that was not, and the settings refuse what they cannot mean."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.lora import ADAPTER_DIR, LoraLinear
from rlvr_fast.models.policy import load_policy
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.trainer import RLVRTrainer

# Level-1 questions of this seed give rewards that vary on the first steps.
PROBLEMS = synthetic_problems("train", 3, seed=2, levels=(1,))
LORA = dict(lora_r=2, lora_alpha=4.0, lora_target_modules=["q_proj", "down_proj"])
SETTINGS = dict(max_new_tokens=12, eval_max_new_tokens=12, lr=1e-2, checkpoint_every=1, **LORA)


def trainer(out, steps, resume=False):
    config = TrainConfig.from_arm("zg_flat", steps=steps, **SETTINGS)
    return RLVRTrainer(
        load_policy("tiny"), config, PROBLEMS, {}, out_dir=out, resume=resume, progress=False
    )


def test_a_lora_run_trains_only_its_adapters_says_so_and_resumes_to_the_same_bytes(tmp_path):
    base = {n: p.detach().clone() for n, p in load_policy("tiny").model.named_parameters()}
    whole_dir = tmp_path / "whole"
    whole = trainer(whole_dir, 2)
    adapters = whole.policy.adapters
    stepped = {id(p) for group in whole.optimizer.param_groups for p in group["params"]}
    assert stepped == {id(p) for p in adapters.parameters()}
    assert sorted(adapters.targets()) == ["down_proj", "q_proj"]
    assert all(isinstance(m, LoraLinear) for m in adapters.layers.values())
    summary = whole.train()
    assert summary["steps"] == 2
    trained = dict(whole.policy.model.named_parameters())
    assert all(torch.equal(trained[n], value) for n, value in base.items()), "the base moved"
    moved = [
        float(t.detach().abs().max()) for n, t in adapters.peft_state().items() if "lora_B" in n
    ]
    assert max(moved) > 0, "no adapter trained (rewards never varied)"
    meta = json.loads((whole_dir / "config.json").read_text())
    assert {k: meta["config"][k] for k in LORA} == LORA
    assert meta["trainable_parameters"] == sum(p.numel() for p in trained.values())

    stopped = tmp_path / "stopped"
    trainer(stopped, 1).train()
    trainer(stopped, 2, resume=True).train()
    ours, theirs = (load_file(d / "final" / "model.safetensors") for d in (stopped, whole_dir))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    ledgers = [
        [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in lines]
        for lines in ((d / "ledger.jsonl").read_text().splitlines() for d in (stopped, whole_dir))
    ]
    assert ledgers[0] == ledgers[1]


def test_a_run_without_lora_writes_no_lora_setting_and_the_settings_need_lora_r():
    assert not any(k.startswith("lora") or k == "use_rslora" for k in TrainConfig().to_json())
    assert TrainConfig().lora_settings is None
    settings = TrainConfig(lora_r=16, use_rslora=True, lora_target_modules="all-linear")
    assert settings.lora_settings.scaling == 8.0 / 4 and settings.lora_settings.targets == (
        "all-linear"
    )
    with pytest.raises(ValueError, match="lora_dropout is a LoRA setting: set lora_r"):
        TrainConfig(lora_dropout=0.1)
    with pytest.raises(ValueError, match="lora_target_modules must be"):
        TrainConfig(lora_r=4, lora_target_modules=["q_proj", 3])
    with pytest.raises(ValueError, match="lora_r must be >= 1"):
        TrainConfig(lora_r=0)


def test_lora_under_bf16_mixed_steps_fp32_masters_of_the_adapters_over_a_frozen_bf16_base(tmp_path):
    config = TrainConfig.from_arm("zg_flat", steps=1, precision="bf16-mixed", **SETTINGS)
    run = RLVRTrainer(
        load_policy("tiny"), config, PROBLEMS, {}, out_dir=tmp_path / "run", progress=False
    )
    model = run.policy.model
    masters = dict(run.stepping.masters.named_parameters())
    assert set(masters) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert masters and all("lora_" in n and m.dtype == torch.float32 for n, m in masters.items())
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert {p.dtype for p in base.values()} == {torch.bfloat16}
    run.train()
    trained = dict(model.named_parameters())
    assert all(torch.equal(trained[n], value) for n, value in base.items()), "the base moved"
    assert max(float(m.abs().max()) for n, m in masters.items() if "lora_B" in n) > 0
    for name, master in masters.items():
        assert torch.equal(trained[name], master.detach().to(torch.bfloat16)), name
    saved = load_file(tmp_path / "run" / "final" / ADAPTER_DIR / "adapter_model.safetensors")
    peft_names = run.policy.adapters.peft_state(weights=run.stepping.masters.state_dict())
    assert saved.keys() == peft_names.keys()
    assert all(
        torch.equal(saved[k], peft_names[k]) and saved[k].dtype == torch.float32 for k in saved
    )
