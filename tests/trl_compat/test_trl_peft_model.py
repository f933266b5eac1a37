"""``GRPOTrainer(model=get_peft_model(model, LoraConfig(...)))`` beside TRL: the adapter the
PeftModel carries trains from its own weights (a step from identical rollouts gives TRL's adapter
gradient, with the KL to TRL's "ref" copy of the starting adapter), the trained adapter is copied
back into the caller's PeftModel and saved by peft itself; what cannot be trained is refused by
name."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from rlvr_fast.models.policy import TINY_MODEL_DIR
from rlvr_fast.trl_compat import GRPOConfig, GRPOTrainer
from trl_side_by_side import QUIET_CPU_RUN, text_rows, trl_modules, varied_reward

MODEL = str(TINY_MODEL_DIR)
ROWS = text_rows(8)
SETTINGS = dict(
    num_generations=4,
    per_device_train_batch_size=4,
    max_completion_length=16,
    temperature=0.8,
    learning_rate=1e-3,
    beta=0.04,
    **QUIET_CPU_RUN,
)


def peft():
    return pytest.importorskip("peft")


def peft_model(init_lora_weights=True):
    """The cookbook's pattern on the embedded model, its B drawn at random (an adapter that is
    not the base model, as a loaded or partly trained one), so the starting weights matter."""
    from transformers import AutoModelForCausalLM

    config = peft().LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj", "down_proj"],
        task_type="CAUSAL_LM",
        init_lora_weights=init_lora_weights,
    )
    model = peft().get_peft_model(
        AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32), config
    )
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def adapter_tensors(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def our_first_backward(model, tmp_path):
    """Our trainer on ``model``; the adapter gradient and weights of its first step that ran a
    backward, with that step's completions and prompts."""
    args = GRPOConfig(output_dir=str(tmp_path / "ours"), max_steps=2, **SETTINGS)
    trainer = GRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=ROWS)
    adapters = trainer.policy.adapters
    captured = []
    clip = trainer.trainer.stepping.clip_gradients

    def capture():
        state = adapters.peft_state("default")
        captured.append(
            (
                {n: p.grad.clone() for n, p in state.items()},
                {n: p.detach().clone() for n, p in state.items()},
                list(trainer.task.groups),
            )
        )
        return clip()

    trainer.trainer.stepping.clip_gradients = capture
    trainer.train()
    assert captured, "no step ran a backward (rewards never varied)"
    grads, weights, groups = captured[0]
    completions = [c for g in groups for c in g.completion_ids]
    prompts = [ROWS[g.row]["prompt"] for g in groups for _ in g.completion_ids]
    return trainer, grads, weights, completions, prompts


def trl_gradient(trl, model, weights, completions, prompts, tmp_path):
    """TRL's adapter gradient of one step on the PeftModel ``model`` (its "ref" adapter the
    starting one) whose generation returns ``completions``, from the adapter ``weights``."""
    from datasets import Dataset

    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), max_steps=1, **SETTINGS)
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=varied_reward, args=args, train_dataset=Dataset.from_list(ROWS)
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


def test_a_peft_models_adapter_trains_from_its_weights_with_trls_gradient_and_peft_saves_it(
    tmp_path,
):
    trl = trl_modules()
    model = peft_model()
    start = adapter_tensors(model)
    for_trl = copy.deepcopy(model)
    trainer, ours, weights, completions, prompts = our_first_backward(model, tmp_path)
    assert trainer.model is model
    theirs = trl_gradient(trl, for_trl, weights, completions, prompts, tmp_path)
    scale = max(float(g.abs().max()) for g in theirs.values())
    assert scale > 0
    for name, grad in theirs.items():
        torch.testing.assert_close(
            ours[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )

    # The caller's PeftModel holds the trained adapter, and peft writes the files.
    trained = adapter_tensors(model)
    assert any(not torch.equal(trained[n], start[n]) for n in start)
    state = trainer.policy.adapters.peft_state("default")
    for name, tensor in trained.items():
        assert torch.equal(tensor, state[name].detach())
    saved = tmp_path / "saved"
    trainer.save_model(str(saved))
    written = json.loads((saved / "adapter_config.json").read_text())
    assert written["peft_version"] == peft().__version__
    assert written["task_type"] == "CAUSAL_LM" and written["lora_alpha"] == 8
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    loaded = peft().PeftModel.from_pretrained(base, saved).eval()
    ids = torch.tensor([[5, 17, 3, 9, 41, 2, 8, 11]])
    with torch.no_grad():
        torch.testing.assert_close(
            trainer.policy.decoder(ids), loaded(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )


def test_a_peft_model_starts_from_its_adapter_whatever_initialised_it(tmp_path):
    """init_lora_weights other than peft's default is refused for peft_config (we would draw
    them), taken for a PeftModel (its weights are read): the decoder starts as the PeftModel."""
    model = peft_model(init_lora_weights="gaussian").eval()
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, **SETTINGS)
    trainer = GRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=ROWS)
    ids = torch.tensor([[5, 17, 3, 9, 41, 2, 8, 11]])
    with torch.no_grad():
        torch.testing.assert_close(
            trainer.policy.decoder(ids), model(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_what_a_peft_model_cannot_train_is_refused_by_name(tmp_path):
    from transformers import AutoModelForCausalLM

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, **SETTINGS)

    def build(model, **kwargs):
        GRPOTrainer(
            model=model, reward_funcs=varied_reward, args=args, train_dataset=ROWS, **kwargs
        )

    with pytest.raises(ValueError, match="PeftModel` instance together with a `peft_config"):
        build(peft_model(), peft_config=peft().LoraConfig())
    two = peft_model()
    two.add_adapter("second", peft().LoraConfig(r=2))
    with pytest.raises(ValueError, match=r"2 adapters \(default, second\)"):
        build(two)
    frozen = peft_model()
    frozen.save_pretrained(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    with pytest.raises(ValueError, match="is_trainable=True"):
        build(peft().PeftModel.from_pretrained(base, tmp_path / "adapter"))
    dora = peft().get_peft_model(
        AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32),
        peft().LoraConfig(r=2, use_dora=True),
    )
    with pytest.raises(ValueError, match="DoRA"):
        build(dora)
