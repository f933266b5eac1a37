"""``optimizer="adafactor"``: transformers' Adafactor as TRL's optim='adafactor' builds it, bit for
bit on the Hugging Face tensors our stacked projections hold (zero-gradient steps included), its
state checkpointed so that a resumed run continues it bit for bit, and the AdamW-only settings
refused by name."""

from __future__ import annotations

import pytest
import torch

from rlvr_fast.models.checkpoint import packed_to_hf
from rlvr_fast.models.lora import LoraSettings, apply_lora
from rlvr_fast.models.policy import load_policy
from rlvr_fast.run.checkpoint import Checkpointer
from rlvr_fast.train.adafactor import Adafactor
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.decision import StepDecision
from rlvr_fast.train.memory_plan import RunShape, plan_memory
from rlvr_fast.train.memory_terms import adafactor_state_elements
from rlvr_fast.train.stepping import OptimizerStepping
from rlvr_fast.utils.phases import Phases

ACTIVE = StepDecision(active=True, optimizer_step=True, contributing=1)
ZERO_GRAD = StepDecision(active=False, optimizer_step=True, contributing=0)
TOKENS = torch.tensor([[5, 17, 40, 3, 99, 120, 7, 64, 2, 31, 8]])
TINY_CONFIG = load_policy("tiny").config
ADAFACTOR = dict(optimizer="adafactor", fused_zero_grad_step=False)


def next_token_loss(model):
    logits = model(TOKENS[:, :-1]).float()
    return torch.nn.functional.cross_entropy(logits[0], TOKENS[0, 1:])


def hf_tensors(named) -> dict[str, torch.Tensor]:
    """Hugging Face name -> tensor, of our (name, tensor) pairs."""
    return packed_to_hf({n: t.detach() for n, t in named}, TINY_CONFIG)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_adafactor_steps_the_hugging_face_tensors_as_transformers_does(precision):
    """transformers' Adafactor (as TRL builds it) on the Hugging Face tensors, fed our gradients
    split as TRL's model holds them, moves them exactly as we move our stacked ones (under
    bf16-mixed: the fp32 masters); weight decay and a zero-gradient step included."""
    optimization = pytest.importorskip("transformers.optimization")
    model = load_policy("tiny", dtype=torch.float32).model
    config = TrainConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=None, **ADAFACTOR)
    stepping = OptimizerStepping(model, config, precision)
    assert isinstance(stepping.optimizer, Adafactor)
    stepped = stepping.masters if stepping.masters is not None else model
    hf = {
        n: torch.nn.Parameter(t.clone()) for n, t in hf_tensors(stepped.named_parameters()).items()
    }
    reference = optimization.Adafactor(
        list(hf.values()), lr=1e-3, weight_decay=0.1, scale_parameter=False, relative_step=False
    )
    grads = {}
    clip = stepping.clip_gradients

    def keep_gradients():
        grads.update(hf_tensors((n, p.grad) for n, p in stepped.named_parameters()))
        return clip()

    stepping.clip_gradients = keep_gradients
    for decision in (ACTIVE, ZERO_GRAD, ACTIVE):
        grads.clear()
        stepping.update(Phases(torch.device("cpu")), decision, [lambda: next_token_loss(model)])
        for name, param in hf.items():
            param.grad = grads[name].clone() if decision.active else torch.zeros_like(param)
        reference.step()
    ours = hf_tensors(stepped.named_parameters())
    start = hf_tensors(load_policy("tiny").model.named_parameters())
    assert all(torch.equal(ours[name], p) for name, p in hf.items())
    assert all(not torch.equal(ours[name], start[name]) for name in hf)


def step(stepping, model, decisions) -> None:
    for decision in decisions:
        stepping.update(Phases(torch.device("cpu")), decision, [lambda: next_token_loss(model)])


@pytest.mark.parametrize("precision", ["fp32", "bf16-true"])
def test_the_adafactor_state_is_checkpointed_and_a_resumed_run_continues_bit_for_bit(
    tmp_path, precision
):
    """Through the run's Checkpointer and state file; under bf16-true the state stays float32
    (torch's load_state_dict would cast it to the weights' bf16)."""
    config = TrainConfig(lr=1e-3, weight_decay=0.1, **ADAFACTOR)
    path = tmp_path / "state.safetensors"

    def run():
        model = load_policy("tiny", dtype=torch.float32).model
        stepping = OptimizerStepping(model, config, precision)
        return (
            model,
            stepping,
            Checkpointer({"model": model, "optimizer": stepping}, steps=4, identity={}),
        )

    model, stepping, checkpointer = run()
    step(stepping, model, (ACTIVE, ZERO_GRAD))
    checkpointer.save(path, next_step=2, world_size=1)
    step(stepping, model, (ACTIVE, ACTIVE))
    resumed_model, resumed, resumed_checkpointer = run()
    assert resumed_checkpointer.load(path, lambda size, path, sharded: None) == 2
    step(resumed, resumed_model, (ACTIVE, ACTIVE))
    theirs = dict(resumed_model.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in model.named_parameters())
    for a, b in zip(stepping.optimizer.state.values(), resumed.optimizer.state.values()):
        assert a["step"] == b["step"] == 4
        for x, y in zip(a["parts"], b["parts"], strict=True):
            assert all(y[k].dtype == torch.float32 and torch.equal(x[k], y[k]) for k in x)


def test_adamw_settings_are_refused_with_adafactor_by_name():
    with pytest.raises(ValueError, match="optimizer adafactor needs fused_zero_grad_step=false"):
        TrainConfig(optimizer="adafactor")
    with pytest.raises(ValueError, match="adamw_fused is an AdamW kernel"):
        TrainConfig(optimizer="adafactor", fused_zero_grad_step=False, adamw_fused=True)
    with pytest.raises(ValueError, match="betas and eps are AdamW's"):
        TrainConfig(optimizer="adafactor", fused_zero_grad_step=False, betas=(0.8, 0.99))
    with pytest.raises(ValueError, match="optimizer must be one of adamw, adafactor"):
        TrainConfig(optimizer="sgd")
    assert "optimizer" not in TrainConfig().to_json()
    assert TrainConfig(**ADAFACTOR).to_json()["optimizer"] == "adafactor"


@pytest.mark.parametrize("lora", [None, LoraSettings(rank=4, targets="all-linear")])
def test_the_memory_plan_counts_the_state_adafactor_keeps(lora):
    """Rows + columns of each Hugging Face matrix, a vector's every element (the adapters'
    alone under LoRA), in float32, in place of AdamW's two moments."""
    model = load_policy("tiny").model
    if lora is not None:
        apply_lora(model, lora, torch.Generator().manual_seed(0))
    stepping = OptimizerStepping(model, TrainConfig(**ADAFACTOR))
    for param in stepping.stepped:
        param.grad = torch.ones_like(param)
    stepping.optimizer.step()
    states = stepping.optimizer.state.values()
    kept = [t for state in states for part in state["parts"] for t in part.values()]
    untied = not model.config.tie_word_embeddings
    elements = adafactor_state_elements(model.config, untied, lora)
    assert sum(t.numel() for t in kept) == elements
    assert all(t.dtype == torch.float32 for t in kept)
    run = RunShape(optimizer="adafactor", lora=lora, untied=untied)
    terms = {t.name: t.bytes for t in plan_memory(model.config, 1 << 40, run).terms}
    assert terms["Adafactor state (fp32)"] == 4 * elements
    assert not any(name.startswith("AdamW moments") for name in terms)
