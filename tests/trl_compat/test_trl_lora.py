"""``GRPOTrainer(peft_config=LoraConfig(...))`` beside TRL + peft: the settings read from the
config and the rest refused by name; one step from identical rollouts gives TRL's adapter
gradient; ``save_model`` writes an adapter that peft loads onto the transformers model with the
logits of our merged decoder."""

from __future__ import annotations

import pytest
import torch

from rlvr_fast.models.lora import LoraSettings
from rlvr_fast.models.policy import TINY_MODEL_DIR
from rlvr_fast.trl_compat import GRPOConfig, GRPOTrainer
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.trl_compat.lora import lora_fields
from trl_side_by_side import QUIET_CPU_RUN, text_rows, trl_modules, varied_reward

MODEL = str(TINY_MODEL_DIR)
ROWS = text_rows(8)
SETTINGS = dict(
    num_generations=4,
    per_device_train_batch_size=4,
    max_completion_length=16,
    temperature=0.8,
    learning_rate=1e-3,
    **QUIET_CPU_RUN,
)


def peft():
    return pytest.importorskip("peft")


def lora_settings(peft_config) -> LoraSettings:
    """The adapters a peft config trains: through the native run's lora_* settings."""
    return TrainConfig(**lora_fields(peft_config)).lora_settings


def test_lora_config_fields_are_read_and_the_unsupported_refused_by_name():
    LoraConfig = peft().LoraConfig
    settings = lora_settings(
        LoraConfig(r=4, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear")
    )
    assert settings == LoraSettings(rank=4, alpha=32.0, dropout=0.05, targets="all-linear")
    assert lora_settings(LoraConfig(task_type="CAUSAL_LM")).targets == ("q_proj", "v_proj")
    assert lora_settings(LoraConfig(target_modules=["k_proj", "o_proj"])).targets == (
        "k_proj",
        "o_proj",
    )
    assert lora_settings(LoraConfig(use_rslora=True, r=16)).scaling == 8 / 4
    refused = [
        (dict(use_dora=True), r"use_dora=True\).*DoRA"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(bias="all"), "bias='all'"),
        (dict(init_lora_weights="gaussian"), "init_lora_weights"),
        (dict(layers_to_transform=[0]), "layers_to_transform"),
        (dict(rank_pattern={"q_proj": 2}), "rank_pattern"),
        (dict(task_type="SEQ_CLS"), "causal LMs only"),
    ]
    for fields, message in refused:
        with pytest.raises(ValueError, match=message):
            lora_settings(LoraConfig(**fields))
    with pytest.raises(ValueError, match="only LoRA"):
        lora_settings(peft().PrefixTuningConfig(num_virtual_tokens=2))
    with pytest.raises(TypeError, match="peft.PeftConfig"):
        lora_settings(object())


def lora_config():
    return peft().LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


def our_lora_step(tmp_path):
    """Our first step that ran a backward, with random B (peft starts B at zero): the adapter
    gradient and weights by PeftModel's names, the completions and prompts; the trainer."""
    args = GRPOConfig(output_dir=str(tmp_path / "ours"), max_steps=3, **SETTINGS)
    trainer = GRPOTrainer(
        model=MODEL,
        reward_funcs=varied_reward,
        args=args,
        train_dataset=ROWS,
        peft_config=lora_config(),
    )
    adapters = trainer.policy.adapters
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in (p for name, p in adapters.peft_state().items() if "lora_B" in name):
            b.copy_(torch.randn(b.shape, generator=generator) * 0.1)
    trainer.policy.refresh_decoder()
    captured = []
    clip = trainer.trainer.stepping.clip_gradients

    def capture():
        state = adapters.peft_state("default")
        grads = {n: p.grad.clone() for n, p in state.items()}
        weights = {n: p.detach().clone() for n, p in state.items()}
        captured.append((grads, weights, list(trainer.task.groups)))
        return clip()

    trainer.trainer.stepping.clip_gradients = capture
    trainer.train()
    assert captured, "no step ran a backward (rewards never varied)"
    grads, weights, groups = captured[0]
    completions = [c for g in groups for c in g.completion_ids]
    prompts = [ROWS[g.row]["prompt"] for g in groups for _ in g.completion_ids]
    return trainer, grads, weights, completions, prompts


def trl_lora_gradient(trl, weights, completions, prompts, tmp_path):
    """TRL + peft's adapter gradient of one step whose generation returns ``completions``, from
    the adapter ``weights``."""
    from datasets import Dataset

    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), max_steps=1, **SETTINGS)
    trainer = trl.GRPOTrainer(
        model=MODEL,
        reward_funcs=varied_reward,
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        peft_config=lora_config(),
    )
    params = dict(trainer.model.named_parameters())
    assert {n for n, p in params.items() if p.requires_grad} == set(weights)
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    trainer._generate_single_turn = lambda *a, **k: ([list(c) for c in completions], None)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(
        trainer.model, trainer._prepare_inputs([{"prompt": p} for p in prompts])
    )
    loss.backward()
    return {name: params[name].grad for name in weights}


def test_one_lora_step_gives_trl_and_peft_adapter_gradient_and_the_adapter_loads_in_peft(tmp_path):
    trl = trl_modules()
    PeftModel = peft().PeftModel
    from transformers import AutoModelForCausalLM

    trainer, ours, weights, completions, prompts = our_lora_step(tmp_path)
    theirs = trl_lora_gradient(trl, weights, completions, prompts, tmp_path)
    scale = max(float(g.abs().max()) for g in theirs.values())
    assert scale > 0
    for name, grad in theirs.items():
        torch.testing.assert_close(
            ours[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )

    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "saved" / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "saved").eval()
    ids = torch.tensor([[5, 17, 3, 9, 41, 2, 8, 11]])
    with torch.no_grad():
        torch.testing.assert_close(
            trainer.policy.decoder(ids), loaded(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )
