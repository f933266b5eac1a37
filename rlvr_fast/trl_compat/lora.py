"""``GRPOTrainer(peft_config=LoraConfig(...))``: the LoRA settings rlvr_fast honours, read from
a ``peft`` config, and the rest refused by name.

Honoured: ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules`` (names, a regular
expression, "all-linear", or None for peft's default of this architecture, q_proj and v_proj) and
``use_rslora``, with ``bias="none"`` and peft's default initialisation: the native run's
``lora_*`` settings, by which ``RLVRTrainer`` adds the adapters. Every other field of the
config that differs from its default is refused, naming it (DoRA, modules_to_save, a LoRA bias,
rank or alpha patterns, layer selection, another initialisation, ...): the adapters trained would
not be the ones the config describes.
"""

from __future__ import annotations

# Fields that name or describe the adapter's file and surroundings, not its computation.
BOOKKEEPING = frozenset(
    {
        "peft_type",
        "task_type",
        "auto_mapping",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "runtime_config",
    }
)
HONOURED = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora")
NAMED_REASONS = {
    "use_dora": "DoRA (weight-decomposed adapters)",
    "modules_to_save": "modules trained in full beside the adapters",
    "bias": "trained biases (bias='none' only)",
    "lora_bias": "a bias on lora_B",
    "init_lora_weights": "initialisations other than peft's default (Kaiming A, zero B)",
}


def lora_fields(peft_config, weights_given: bool = False) -> dict:
    """The ``TrainConfig`` LoRA settings (``rlvr_fast.train.lora_config``) of a
    ``peft.LoraConfig``; ValueError naming what is not supported. ``weights_given``: the
    adapters start from a PeftModel's weights, so how peft initialised them does not matter."""
    peft_type = getattr(peft_config, "peft_type", None)
    if peft_type is None or not hasattr(peft_config, "to_dict"):
        raise TypeError(
            f"peft_config must be a peft.PeftConfig (e.g. peft.LoraConfig), "
            f"got {type(peft_config).__name__}"
        )
    if str(getattr(peft_type, "value", peft_type)) != "LORA":
        raise ValueError(
            f"GRPOTrainer: peft_config of type {type(peft_config).__name__} is not supported by "
            "rlvr_fast: only LoRA (peft.LoraConfig)"
        )
    task = getattr(peft_config, "task_type", None)
    if task is not None and str(getattr(task, "value", task)) != "CAUSAL_LM":
        raise ValueError(f"LoraConfig(task_type={task!r}): rlvr_fast trains causal LMs only")
    fields, defaults = peft_config.to_dict(), type(peft_config)().to_dict()
    for name, value in fields.items():
        if name in BOOKKEEPING or name in HONOURED or value == defaults.get(name):
            continue
        if weights_given and name == "init_lora_weights":
            continue
        reason = NAMED_REASONS.get(name, "rlvr_fast's LoRA honours only " + ", ".join(HONOURED))
        raise ValueError(
            f"LoraConfig({name}={value!r}) is not supported by rlvr_fast: {reason} "
            f"(leave {name} at its default)"
        )
    targets = peft_config.target_modules
    if targets is not None and not isinstance(targets, str):
        targets = sorted(targets)  # peft holds a list as a set
    return dict(
        lora_r=peft_config.r,
        lora_alpha=float(peft_config.lora_alpha),
        lora_dropout=float(peft_config.lora_dropout),
        lora_target_modules=targets,
        use_rslora=bool(peft_config.use_rslora),
    )
