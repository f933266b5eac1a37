"""A ``peft.PeftModel`` as ``GRPOTrainer``'s model (the cookbook pattern: ``get_peft_model(model,
LoraConfig(...))`` handed to the trainer): its LoRA adapter is trained as TRL continues it.

The base model's weights (each adapted projection's ``base_layer``) build rlvr_fast's model; the
adapter's ``LoraConfig`` gives the adapters' settings (``rlvr_fast.trl_compat.lora``, the same
machinery as ``peft_config=``), and its current A and B tensors are where they start (so an
adapter loaded from disk, or initialised otherwise than peft's default, continues from what it
holds). With ``beta`` > 0 the reference is the adapted model as handed over, as TRL copies the
adapter into a frozen "ref" adapter (``rlvr_fast.train.policy.ReferenceModel``). The trained
adapters are copied back into the caller's PeftModel, which saves itself (peft's own
``save_pretrained``: its ``adapter_config.json``, ``adapter_model.safetensors`` and model card).
A ``peft_config=`` run's ``adapter_config.json`` is written by peft too (``write_adapter_config``).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

from rlvr_fast.models.lora import ALL_LINEAR, PEFT_PREFIX
from rlvr_fast.trl_compat.lora import lora_fields


def peft_model_of(model):
    """``model`` when it is a ``peft.PeftModel``, else None (a PeftModel exists only once peft
    is imported)."""
    peft = sys.modules.get("peft")
    return model if peft is not None and isinstance(model, peft.PeftModel) else None


def adapter_config(peft_model, peft_config):
    """The LoraConfig of the adapter ``peft_model`` trains; ValueError for what TRL or rlvr_fast
    refuses: a ``peft_config`` beside it (TRL's error), several adapters, one loaded for
    inference (its weights do not train), LoRA settings rlvr_fast does not train
    (``rlvr_fast.trl_compat.lora``)."""
    if peft_config is not None:
        raise ValueError(
            "You passed a `PeftModel` instance together with a `peft_config` to the trainer. "
            "Please first merge and unload the existing adapter, save the resulting base model, "
            "and then pass that base model along with the new `peft_config` to the trainer."
        )
    names = list(peft_model.peft_config)
    if len(names) != 1:
        raise ValueError(
            f"GRPOTrainer: a PeftModel with {len(names)} adapters ({', '.join(names)}) is not "
            "supported by rlvr_fast: it trains one adapter (delete the others)"
        )
    config = peft_model.peft_config[names[0]]
    lora_fields(config, weights_given=True)  # refuses, by name, what rlvr_fast's LoRA lacks
    if not any(p.requires_grad for p in peft_model.parameters()):
        raise ValueError(
            "GRPOTrainer: the PeftModel's adapter is frozen (loaded for inference): load it with "
            "PeftModel.from_pretrained(..., is_trainable=True) to train it"
        )
    return config


def base_state(peft_model) -> dict[str, torch.Tensor]:
    """The base model's weights by transformers' names: each adapted projection's
    ``base_layer`` under the projection's own name, the adapters left out."""
    state = {}
    for name, tensor in peft_model.get_base_model().state_dict().items():
        if ".lora_" in name:
            continue
        state[name.replace(".base_layer.", ".")] = tensor
    return state


def adapter_state(peft_model) -> dict[str, torch.Tensor]:
    """The adapter's A and B by peft's saved names (``get_peft_model_state_dict``), the names
    ``rlvr_fast.models.lora.LoraAdapters.load_peft_state`` reads; anything else it saves (a
    trained embedding, a bias) refused by name."""
    from peft import get_peft_model_state_dict

    name = next(iter(peft_model.peft_config))
    state = get_peft_model_state_dict(peft_model, adapter_name=name)
    for name in state:
        if not name.startswith(PEFT_PREFIX) or not name.endswith(
            (".lora_A.weight", ".lora_B.weight")
        ):
            raise ValueError(
                f"GRPOTrainer: the PeftModel's adapter saves {name}, which rlvr_fast's LoRA "
                "does not train (only lora_A / lora_B of the projections)"
            )
    return state


@torch.no_grad()
def copy_adapters_into(peft_model, adapters, weights=None) -> None:
    """The trained adapters (``weights``: a bf16-mixed run's fp32 masters, by our names) into
    ``peft_model``'s own adapter parameters."""
    name = next(iter(peft_model.peft_config))
    params = dict(peft_model.named_parameters())
    for key, tensor in adapters.peft_state(name, weights).items():
        params[key].copy_(tensor)


def write_adapter_config(peft_config, adapters, base_model: str, directory: Path) -> None:
    """``adapter_config.json`` of a ``peft_config=`` run as a PeftModel of it saves it: the
    caller's LoraConfig written by peft (``save_pretrained``: every field, ``peft_version``),
    with the base model, ``inference_mode`` on and the target modules peft resolved (the
    adapted projections' names; a regular expression stays as given)."""
    config = copy.deepcopy(peft_config)
    targets = config.target_modules
    if not (isinstance(targets, str) and targets != ALL_LINEAR):
        config.target_modules = set(adapters.targets())
    config.base_model_name_or_path = base_model
    config.inference_mode = True
    config.save_pretrained(str(directory))
