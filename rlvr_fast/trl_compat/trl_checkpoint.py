"""``train(resume_from_checkpoint=...)`` on a ``checkpoint-N`` that TRL (transformers' Trainer)
wrote: the run continues on rlvr_fast from TRL's weights, AdamW moments, schedule and RNG.

Read: the model's ``*.safetensors`` (``adapter_model.safetensors`` for LoRA), ``optimizer.pt``,
``scheduler.pt`` and ``rng_state.pth`` (``rng_state_<rank>.pth`` on several processes), each
with ``torch.load(weights_only=True)`` (numpy's array and dtype allowed, as transformers
loads the RNG file), and ``trainer_state.json``; never ``training_args.bin`` or any other
pickle. A file that needs more unpickling than that, or a layout TRL writes that is not read here
(``pytorch_model.bin`` weights, ``optimizer.bin``, per-rank optimizer shards) is refused by name.

TRL's AdamW numbers its parameters as transformers groups them: those with weight decay, then
those without (biases and norms), each in the model's ``named_parameters`` order; the moments of
each Hugging Face projection go to its rows of our packed one (``qkv_proj``, ``gate_up_proj``),
a LoRA adapter's to ours of the same peft name. The schedule is TRL's ``scheduler.pt`` loaded
into the run's own, the learning rate TRL's last. Sampling continues from TRL's restored torch
RNG (rlvr_fast's generator is seeded from it): the continued run is rlvr_fast's, not the
completions TRL would have drawn. A sharded run (``fsdp``) refuses it, by name.
"""

from __future__ import annotations

import pickle
import random
import re
from pathlib import Path

import numpy as np
import torch

from rlvr_fast.models.checkpoint import packed_to_hf
from rlvr_fast.train import distributed

OPTIMIZER, SCHEDULER = "optimizer.pt", "scheduler.pt"
# What transformers writes that this does not read, and why.
NOT_READ = {
    "optimizer.bin": "an optimizer state in another format than optimizer.pt",
    "pytorch_model.bin": "pickled weights (rlvr_fast reads safetensors)",
    "adapter_model.bin": "pickled adapter weights (rlvr_fast reads safetensors)",
}
# transformers' weight-decay rule: these parameters are grouped without decay.
NO_DECAY_PATTERNS = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


def is_trl_checkpoint(path: Path) -> bool:
    """A checkpoint holding transformers' optimizer state (TRL's) rather than rlvr_fast's."""
    return (path / OPTIMIZER).is_file() or any((path / name).is_file() for name in NOT_READ)


def load_tensors(path: Path) -> dict:
    """``torch.load(path, weights_only=True)``, numpy's arrays and dtypes allowed (the RNG
    states); ValueError naming the file when it needs anything more."""
    np_core = getattr(np, "_core", None) or np.core
    allowed = [np_core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else "unpickling"
        raise ValueError(
            f"{path}: needs unpickling beyond tensors ({reason[:160]}); rlvr_fast reads TRL "
            "checkpoints with torch.load(weights_only=True) only"
        ) from None


def check_layout(checkpoint: Path) -> None:
    """Refuse, by name, what transformers may write that this does not read."""
    for name, what in NOT_READ.items():
        if (checkpoint / name).is_file():
            raise ValueError(
                f"{checkpoint}/{name}: {what} is not read by rlvr_fast's resume of a TRL checkpoint"
            )
    shards = sorted(checkpoint.glob(f"rank*-{OPTIMIZER}"))
    if shards:
        raise ValueError(f"{shards[0]}: per-rank optimizer shards are not read by rlvr_fast")
    for name in (OPTIMIZER, SCHEDULER):
        if not (checkpoint / name).is_file():
            raise ValueError(f"{checkpoint}: {name} is missing; the checkpoint is incomplete")


def trained_tensors(trainer) -> dict[str, torch.Tensor]:
    """The tensors AdamW steps, by our parameter names: the fp32 masters of a bf16-mixed run,
    else the trainable parameters themselves."""
    masters = trainer.trainer.stepping.masters
    if masters is not None:
        return dict(masters.named_parameters())
    return {n: p for n, p in trainer.policy.model.named_parameters() if p.requires_grad}


def adapter_name(trainer) -> str:
    """The name TRL's adapter has: a caller's PeftModel's own, else peft's "default"."""
    if trainer.peft_model is not None:
        return next(iter(trainer.peft_model.peft_config))
    return "default"


def by_trl_name(trainer, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views of ``tensors`` (by our names) under TRL's names: a LoRA adapter's peft names
    (``...lora_A.<adapter>.weight``), else the Hugging Face projections' rows of our packed
    ones."""
    adapters = trainer.policy.adapters
    if adapters is not None:
        return adapters.peft_state(adapter_name(trainer), tensors)
    state = dict(tensors)
    if trainer.policy.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    # Splits of each packed tensor along its rows: views, so writing them fills ``tensors``.
    return packed_to_hf(state, trainer.policy.config)


def trl_parameter_order(trainer, names: list[str]) -> list[str]:
    """TRL's names (``names``) in the order its optimizer numbers them: the model's
    ``named_parameters`` order (a ``peft_config=`` run's adapters are already in it), the
    decayed group first, then the rest."""
    if trainer.policy.adapters is None or trainer.peft_model is not None:
        model = trainer.peft_model if trainer.peft_model is not None else trainer.model
        ordered = [n for n, _ in model.named_parameters() if n in names]
        if sorted(ordered) != sorted(names):
            missing = sorted(set(names) - set(ordered))
            raise ValueError(f"TRL's model names no parameter {missing[0]}")
        names = ordered

    def decays(name: str) -> bool:
        return not any(re.search(p, name.lower()) for p in NO_DECAY_PATTERNS)

    return [n for n in names if decays(n)] + [n for n in names if not decays(n)]


def load_weights(trainer, checkpoint: Path, views: dict[str, torch.Tensor]) -> None:
    """TRL's saved weights (the adapter's under LoRA, as peft saves it) into ``views``: every
    name there, of the same shape."""
    from safetensors.torch import load_file

    adapter = trainer.policy.adapters is not None
    folder, pattern = checkpoint, "*.safetensors"
    if adapter:  # peft saves an adapter not named "default" in a folder of its name
        name = adapter_name(trainer)
        folder = checkpoint if name == "default" else checkpoint / name
        pattern = "adapter_model.safetensors"
    saved = {}
    for file in sorted(folder.glob(pattern)):
        saved.update(load_file(str(file)))
    if adapter:  # peft saves the names without the adapter's
        infix = adapter_name(trainer)
        saved = {f"{n.removesuffix('.weight')}.{infix}.weight": t for n, t in saved.items()}
    with torch.no_grad():
        for name, view in views.items():
            if name not in saved:
                raise ValueError(f"{checkpoint}: the saved weights have no {name}")
            if saved[name].shape != view.shape:
                raise ValueError(
                    f"{checkpoint}: {name} has shape {tuple(saved[name].shape)}, the model's "
                    f"{tuple(view.shape)}"
                )
            view.copy_(saved[name])


def optimizer_state(trainer, saved: dict, checkpoint: Path) -> dict:
    """Our AdamW state from TRL's ``optimizer.pt`` ``saved``: each parameter's step and moments
    (the Hugging Face ones placed in our packed tensors), our param group at TRL's learning
    rate."""
    tensors = trained_tensors(trainer)
    moments = {
        key: {n: torch.zeros_like(t) for n, t in tensors.items()}
        for key in ("exp_avg", "exp_avg_sq")
    }
    views = {key: by_trl_name(trainer, m) for key, m in moments.items()}
    order = trl_parameter_order(trainer, list(views["exp_avg"]))
    indices = [i for group in saved["param_groups"] for i in group["params"]]
    if len(indices) != len(order):
        raise ValueError(
            f"{checkpoint / OPTIMIZER}: {len(indices)} parameters, the model trains {len(order)}"
        )
    steps = set()
    with torch.no_grad():
        for index, name in zip(indices, order):
            entry = saved["state"].get(index)
            if entry is None:
                raise ValueError(f"{checkpoint / OPTIMIZER}: no state for {name}")
            for key in ("exp_avg", "exp_avg_sq"):
                if entry[key].shape != views[key][name].shape:
                    raise ValueError(
                        f"{checkpoint / OPTIMIZER}: {name}'s {key} has shape "
                        f"{tuple(entry[key].shape)}, the parameter's {tuple(views[key][name].shape)}"
                    )
                views[key][name].copy_(entry[key])
            steps.add(float(entry["step"]))
    if len(steps) != 1:
        raise ValueError(f"{checkpoint / OPTIMIZER}: parameters at different steps {sorted(steps)}")
    step = torch.tensor(steps.pop(), dtype=torch.float32)
    stepping = trainer.trainer.stepping
    names = {id(t): n for n, t in tensors.items()}
    ours = stepping.state_dict()
    ours["state"] = {
        i: {
            "step": step.clone(),
            "exp_avg": moments["exp_avg"][names[id(p)]],
            "exp_avg_sq": moments["exp_avg_sq"][names[id(p)]],
        }
        for i, p in enumerate(stepping.stepped)
    }
    for group in ours["param_groups"]:
        group["lr"] = saved["param_groups"][0]["lr"]
        if "initial_lr" in saved["param_groups"][0]:
            group["initial_lr"] = saved["param_groups"][0]["initial_lr"]
    return ours


def scheduler_state(saved: dict, saved_groups: int, groups: int, checkpoint: Path) -> dict:
    """TRL's ``scheduler.pt`` for our optimizer's ``groups`` param groups: its per-group lists
    (TRL has a group without weight decay beside the other) must agree across its groups, and
    are cut to ours."""
    state = dict(saved)
    for key, value in saved.items():
        if not isinstance(value, list) or len(value) != saved_groups:
            continue
        if any(v != value[0] for v in value):
            raise ValueError(
                f"{checkpoint / SCHEDULER}: {key} differs between TRL's parameter groups "
                f"({value}); rlvr_fast steps one schedule"
            )
        state[key] = value[:1] * groups
    return state


def restore_rng(trainer, checkpoint: Path) -> None:
    """Python's, numpy's and torch's RNG as TRL saved them (this process's file); rlvr_fast's
    sampling generator seeded from the restored torch RNG."""
    world = distributed.world_size()
    name = f"rng_state_{distributed.rank()}.pth" if world > 1 else "rng_state.pth"
    path = checkpoint / name
    if not path.is_file():
        raise ValueError(f"{checkpoint}: {name} is missing; the checkpoint is incomplete")
    state = load_tensors(path)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if trainer.policy.device.type == "cuda" and "cuda" in state:
        # transformers saves every device's state on one process, this process's on several.
        if world == 1:
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            torch.cuda.set_rng_state(state["cuda"])
    seed = int(torch.randint(0, 2**62, (1,)))
    trainer.trainer.generator.manual_seed(seed)


def resume_from_trl_checkpoint(trainer, checkpoint: Path) -> None:
    """Load TRL's ``checkpoint`` into ``trainer`` (the facade): weights, AdamW state, schedule,
    RNG (the trainer state is read by the caller). A sharded run (``fsdp``) refuses it: TRL's
    weights and moments would load into the engine's copy, not the shards the run steps."""
    if trainer.trainer.sharded is not None:
        raise ValueError(
            f"{checkpoint}: a checkpoint TRL wrote resumes unsharded on rlvr_fast (without "
            "fsdp); a sharded run resumes from rlvr_fast's own checkpoint-N"
        )
    check_layout(checkpoint)
    saved_optimizer = load_tensors(checkpoint / OPTIMIZER)
    saved_scheduler = load_tensors(checkpoint / SCHEDULER)
    state = optimizer_state(trainer, saved_optimizer, checkpoint)
    load_weights(trainer, checkpoint, by_trl_name(trainer, trained_tensors(trainer)))
    stepping = trainer.trainer.stepping
    if stepping.masters is not None:
        stepping.masters.publish()
    stepping.check_state(state)
    stepping.load_state_dict(state)
    groups = len(saved_optimizer["param_groups"])
    trainer.lr_scheduler.load_state_dict(
        scheduler_state(saved_scheduler, groups, len(stepping.optimizer.param_groups), checkpoint)
    )
    trainer.policy.refresh_decoder()
    restore_rng(trainer, checkpoint)
