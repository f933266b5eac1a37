"""Sharded training through the facade: ``GRPOConfig(fsdp=...)`` with its ``fsdp_config``, and
``accelerate launch --use_fsdp --fsdp_version 2`` (or a config file with ``distributed_type:
FSDP`` and ``fsdp_version: 2``, which set ``ACCELERATE_USE_FSDP`` and the ``FSDP_*`` variables),
turn on rlvr_fast's own sharding (``TrainConfig.shard="fsdp"``, ``rlvr_fast.train.sharding``):
FSDP2's ``fully_shard`` on every decoder layer and on the root over all the ranks, each weight
resharded after its forward (full shard), whole tensors in the models it saves and DCP shards
in a checkpoint's training state.

What that builds is honoured; a setting asking for something else is refused by name (CPU
offload, hybrid or ZeRO-2 sharding, FSDP1 and its options, size-based wrapping, sharded state
dicts, XLA). Settings of how FSDP loads or wraps that cannot change what is computed have no
effect (``transformer_layer_cls_to_wrap``: rlvr_fast wraps each decoder layer; ``sync_module_states``:
rank 0's weights are broadcast before sharding anyway). ``activation_checkpointing`` recomputes
each decoder layer, as ``gradient_checkpointing`` does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

OFFLOAD = "CPU offload of the shards is not built"
HYBRID = (
    "hybrid sharding (replicas of shards across nodes) is not built: rlvr_fast shards over all "
    "the ranks"
)
FSDP1 = "FSDP1 is not built: rlvr_fast shards with FSDP2 (fully_shard)"
XLA = "FSDP on XLA devices is not built"

# fsdp's options (transformers' FSDPOption): None where honoured, else why not.
FSDP_OPTIONS = {
    "full_shard": None,
    "auto_wrap": None,  # every decoder layer is wrapped, as transformer-based auto wrap does
    "shard_grad_op": "weights kept gathered after forward (ZeRO-2) are not built: rlvr_fast "
    "reshards after forward (full_shard)",
    "hybrid_shard": HYBRID,
    "hybrid_shard_zero2": HYBRID,
    "no_shard": "data parallel is rlvr_fast's run without fsdp (several processes run data "
    "parallel)",
    "offload": OFFLOAD,
}


def _true(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _anything(value) -> bool:
    return True


# fsdp_config keys (transformers strips a leading "fsdp_"): (accepted(value), why not).
FSDP_CONFIG_LIMITS = {
    "version": (lambda v: str(v).strip() == "2", FSDP1),
    "reshard_after_forward": (
        lambda v: _true(v) or str(v).strip().lower() == "full_shard",
        "weights kept gathered after forward (ZeRO-2) are not built: rlvr_fast reshards after "
        "forward (full shard)",
    ),
    "cpu_offload": (lambda v: not _true(v), OFFLOAD),
    "offload_params": (lambda v: not _true(v), OFFLOAD),
    "activation_checkpointing_offload": (lambda v: not _true(v), "offloaded activations"),
    "auto_wrap_policy": (
        lambda v: v is None or str(v).upper() == "TRANSFORMER_BASED_WRAP",
        "rlvr_fast shards each decoder layer and the root (TRANSFORMER_BASED_WRAP)",
    ),
    "state_dict_type": (
        lambda v: v is None or str(v).upper() == "FULL_STATE_DICT",
        "save_model and checkpoint-N's model hold whole tensors (FULL_STATE_DICT); a "
        "checkpoint's training state is in DCP shards either way",
    ),
    "ignored_modules": (lambda v: not v, "modules left unsharded"),
    "xla": (lambda v: not _true(v), XLA),
    "xla_fsdp_v2": (lambda v: not _true(v), XLA),
    "xla_fsdp_grad_ckpt": (lambda v: not _true(v), XLA),
    "xla_fsdp_settings": (lambda v: not v, XLA),
    # No effect: how FSDP wraps (each decoder layer) and loads (rank 0's weights broadcast).
    "transformer_layer_cls_to_wrap": (_anything, ""),
    "min_num_params": (_anything, ""),
    "cpu_ram_efficient_loading": (_anything, ""),
    "sync_module_states": (_anything, ""),
    # Honoured: each decoder layer recomputed in backward.
    "activation_checkpointing": (_anything, ""),
}
FSDP1_OPTIONS = ("forward_prefetch", "backward_prefetch", "use_orig_params", "limit_all_gathers")

# accelerate launch's variables -> the fsdp_config key each stands for. FSDP_SHARDING_STRATEGY,
# FSDP_FORWARD_PREFETCH, FSDP_BACKWARD_PREFETCH and FSDP_USE_ORIG_PARAMS, which the launcher
# sets whatever the version, are FSDP1's: FSDP2 (accelerate's too) reads none of them.
ACCELERATE_VARIABLES = {
    "FSDP_VERSION": "version",
    "FSDP_RESHARD_AFTER_FORWARD": "reshard_after_forward",
    "FSDP_OFFLOAD_PARAMS": "offload_params",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "activation_checkpointing_offload",
    "FSDP_AUTO_WRAP_POLICY": "auto_wrap_policy",
    "FSDP_STATE_DICT_TYPE": "state_dict_type",
    "FSDP_IGNORED_MODULES": "ignored_modules",
    "FSDP_ACTIVATION_CHECKPOINTING": "activation_checkpointing",
}


def fsdp_options(value) -> list[str]:
    """``fsdp``'s options: a string of them, a list, True (full shard), or none."""
    if value in (None, False, "", []):
        return []
    if value is True:
        return ["full_shard"]
    items = value.split() if isinstance(value, str) else list(value)
    return [str(getattr(item, "value", item)).strip().lower() for item in items]


def fsdp_refusal(value) -> str | None:
    """Why ``fsdp=value`` cannot be honoured, or None."""
    try:
        options = fsdp_options(value)
    except TypeError:
        return f"fsdp takes a string of options or a list, got {type(value).__name__}"
    for option in options:
        if option in ("true", "1"):
            continue
        if option not in FSDP_OPTIONS:
            return f"fsdp option {option!r} is not one of {', '.join(FSDP_OPTIONS)}"
        if FSDP_OPTIONS[option] is not None:
            return f"fsdp option {option}: {FSDP_OPTIONS[option]}"
    return None


def fsdp_config_dict(value) -> dict:
    """``fsdp_config`` as a dict, keys without transformers' optional "fsdp_" prefix (a path
    names a JSON file)."""
    if value is None:
        return {}
    if isinstance(value, (str, Path)):
        value = json.loads(Path(value).read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"fsdp_config is a dict or a JSON file's path, got {type(value).__name__}")
    return {(k[5:] if k.startswith("fsdp_") else k): v for k, v in value.items()}


def fsdp_config_problem(value) -> tuple[str, str] | None:
    """The first key of an ``fsdp_config`` (or of accelerate's FSDP settings as one) that
    cannot be honoured, with why; None when every key can."""
    try:
        config = fsdp_config_dict(value)
    except (OSError, ValueError) as err:
        return "", str(err).splitlines()[0]
    for key, setting in config.items():
        if key in FSDP1_OPTIONS:
            return key, f"{key} is an FSDP1 option: {FSDP1}"
        if key not in FSDP_CONFIG_LIMITS:
            return key, f"{key!r} is not an fsdp_config key rlvr_fast knows"
        accepted, why = FSDP_CONFIG_LIMITS[key]
        if not accepted(setting):
            return key, f"{key}={setting!r}: {why}"
    return None


def fsdp_config_refusal(value) -> str | None:
    """Why ``fsdp_config=value`` cannot be honoured, or None."""
    problem = fsdp_config_problem(value)
    return None if problem is None else problem[1]


def accelerate_fsdp_settings() -> dict | None:
    """accelerate launch's FSDP settings as an fsdp_config (by their variables; FSDP_VERSION
    unset is accelerate's default, 1), or None when it did not launch with FSDP."""
    if not _true(os.environ.get("ACCELERATE_USE_FSDP", "false")):
        return None
    settings = {
        key: os.environ[variable]
        for variable, key in ACCELERATE_VARIABLES.items()
        if variable in os.environ
    }
    return {"version": "1", **settings}


def refuse_accelerate_fsdp() -> None:
    """ValueError naming the ``accelerate launch`` FSDP setting rlvr_fast cannot honour."""
    settings = accelerate_fsdp_settings()
    problem = None if settings is None else fsdp_config_problem(settings)
    if problem is None:
        return
    key, why = problem
    variable = next(v for v, k in ACCELERATE_VARIABLES.items() if k == key)
    raise ValueError(
        f"accelerate launch --use_fsdp with {variable}={settings[key]} is not supported by "
        f"rlvr_fast: {why.split(': ', 1)[-1]}"
        + (" (launch with --fsdp_version 2)" if key == "version" else "")
    )


def shard_settings(args) -> dict:
    """The TrainConfig settings sharding adds: shard="fsdp" when ``args.fsdp`` is on or
    accelerate launched with FSDP, and activation checkpointing when their settings ask for it;
    nothing otherwise."""
    launched = accelerate_fsdp_settings()
    if not fsdp_options(args.fsdp) and launched is None:
        return {}
    config = {**fsdp_config_dict(args.fsdp_config), **(launched or {})}
    settings = {"shard": "fsdp"}
    if _true(config.get("activation_checkpointing", False)):
        settings["activation_checkpointing"] = True
    return settings
