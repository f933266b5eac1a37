"""Where the honoured fields of a ``GRPOConfig`` (``rlvr_fast.trl_compat.support``) land in
rlvr_fast's ``TrainConfig``: a field of the same name in both takes the value as it is
(implied: a new TRL setting that ``TrainConfig`` holds under TRL's name needs no line here);
``RENAMED`` lists those that land under another name; ``TRANSFORMED`` those of the same name
whose value ``rlvr_fast.trl_compat.run_setup.train_config`` works out itself (precision from
fp16 / bf16, scale_rewards, optim, the arm presets, the sampler's warpers, ...);
``SHARDING`` those that land in ``shard`` (and ``activation_checkpointing``), with accelerate
launch's FSDP settings (``rlvr_fast.trl_compat.fsdp``).

``TRL_SETTINGS``: the settings of ``TrainConfig`` declared as a TRL field (``trl`` in the
setting's metadata, ``rlvr_fast.utils.settings``), by TRL's name: the facade's ``GRPOConfig``
field (``rlvr_fast.trl_compat.fields``) and its line of ``support.HONOURED`` come from them,
and one under another name than TRL's is a line of ``RENAMED`` by itself.
"""

from __future__ import annotations

import dataclasses

from rlvr_fast.train.config import TrainConfig, setting_fields
from rlvr_fast.trl_compat.fsdp import shard_settings
from rlvr_fast.utils.settings import flat_hints, trl_name

# TRL's name -> (TrainConfig's setting, its type).
TRL_SETTINGS = {
    trl_name(f): (f, flat_hints(TrainConfig)[name])
    for name, f in setting_fields().items()
    if trl_name(f)
}

# GRPOConfig name -> TrainConfig name. generation_steps is GRPOConfig's derived value
# (steps_per_generation / gradient_accumulation_steps), not a field of its own.
RENAMED = {
    **{theirs: f.name for theirs, (f, _) in TRL_SETTINGS.items() if theirs != f.name},
    "num_generations": "group_size",
    "max_completion_length": "max_new_tokens",
    "learning_rate": "lr",
    "mask_truncated_completions": "mask_truncated",
    "skip_zero_variance_backward": "skip_zero_var",
    "tree_t_min": "t_min",
    "tree_t_max": "t_max",
    "gradient_checkpointing": "activation_checkpointing",
    "generation_steps": "generation_steps",
}
# Fields of the same name whose value train_config works out (TrainConfig's beta is the tree
# bonus, not TRL's KL weight; its activation_checkpointing is TRL's gradient_checkpointing).
TRANSFORMED = frozenset(
    {
        "activation_checkpointing",
        "arm",
        "beta",
        "fused_zero_grad_step",
        "max_grad_norm",
        "min_p",
        "repetition_penalty",
        "scale_rewards",
        "top_k",
        "top_p",
        "use_bias_correction_kl",
    }
)

# GRPOConfig fields -> the TrainConfig settings they turn on (with accelerate launch's
# ACCELERATE_USE_FSDP and FSDP_*: shard_settings reads them all).
SHARDING = {"fsdp": ("shard",), "fsdp_config": ("shard", "activation_checkpointing")}


def mapped_settings(args) -> dict:
    """The TrainConfig settings a GRPOConfig ``args`` gives as they are: its fields of the same
    name (but the ``TRANSFORMED``) and the ``RENAMED`` ones; then the ``SHARDING`` ones."""
    ours = set(setting_fields())
    theirs = {f.name for f in dataclasses.fields(args) if f.init}
    values = {name: getattr(args, name) for name in sorted((ours & theirs) - TRANSFORMED)}
    values.update({ours: getattr(args, theirs) for theirs, ours in RENAMED.items()})
    values.update(shard_settings(args))
    return values
