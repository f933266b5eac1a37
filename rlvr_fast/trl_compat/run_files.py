"""What a TRL run leaves on disk beside the model, written as TRL writes it: the model card
``README.md`` in ``output_dir`` (at every checkpoint, and by ``create_model_card``),
``training_args.bin`` (``torch.save`` of the args, beside every saved model, as transformers'
``Trainer._save``; rlvr_fast never loads one), the model's config with the tokenizer's pad token
(TRL mirrors it onto ``config.json`` and ``generation_config.json``) and ``use_cache`` off under
gradient checkpointing, and ``trainer_state.json``'s ``stateful_callbacks``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TRAINING_ARGS = "training_args.bin"
# TrainerState's eval_steps when args name none (transformers' dataclass default).
TRAINER_STATE_EVAL_STEPS = 500


def write_training_args(args, directory: Path) -> None:
    """``training_args.bin``: the args pickled by ``torch.save``, as transformers writes them."""
    torch.save(args, directory / TRAINING_ARGS)


def mirror_pad_token(model, tokenizer, gradient_checkpointing: bool) -> None:
    """TRL's model config agrees with the tokenizer on the pad token (config and generation
    config), and transformers' Trainer aligns the special tokens with its own
    ``align_special_tokens`` (whose output differs by version: 5.17 writes the generation
    config's end-of-sequence token as a list, later versions as the number); under gradient
    checkpointing the Trainer turns the KV cache off in the config."""
    from transformers import PreTrainedTokenizerBase, ProcessorMixin
    from transformers.trainer_utils import align_special_tokens

    if isinstance(tokenizer, (PreTrainedTokenizerBase, ProcessorMixin)):
        align_special_tokens(model, tokenizer)
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.pad_token_id = tokenizer.pad_token_id
    if gradient_checkpointing:
        model.config.use_cache = False


def record_stateful_callbacks(state, control, callbacks) -> None:
    """transformers' ``stateful_callbacks`` in the trainer state at a save: the control's and
    every callback's that exports its state (``ExportableState``), by class name."""
    from transformers.trainer_callback import ExportableState

    for callback in [*callbacks, control]:
        if not isinstance(callback, ExportableState):
            continue
        name, exported = type(callback).__name__, callback.state()
        if isinstance(state.stateful_callbacks.get(name), list):
            state.stateful_callbacks[name].append(exported)
        else:
            state.stateful_callbacks[name] = exported


def card_model_name(args) -> str:
    """The model name TRL's checkpoint card carries: hub_model_id's last part, else
    output_dir's name."""
    if args.hub_model_id is not None:
        return args.hub_model_id.split("/")[-1]
    return Path(args.output_dir).name


def model_card(trainer, model_name, dataset_name, tags) -> str:
    """A model card as TRL's: its front matter (base model when it names no local directory,
    library, model name, tags), what was trained from what, how, with which settings."""
    args = trainer.args
    base = str(trainer.model_dir) if trainer.model_dir is not None else None
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    settings = {
        name: getattr(args, name)
        for name in (
            "learning_rate",
            "num_generations",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "max_completion_length",
            "temperature",
            "loss_type",
            "scale_rewards",
            "seed",
        )
    }
    name_or_path = getattr(trainer.model.config, "_name_or_path", "") or ""
    front = [
        *(
            [f"base_model: {name_or_path}"]
            if name_or_path and not Path(name_or_path).is_dir()
            else []
        ),
        "library_name: transformers",
        f"model_name: {model_name or args.output_dir}",
        f"tags: {json.dumps(['rlvr_fast', 'trl', 'grpo', *tags])}",
        "licence: license",
    ]
    lines = [
        "---",
        *front,
        "---",
        f"# Model Card for {model_name or args.output_dir}",
        "",
        f"Trained from {base or 'a transformers model'} with GRPO on rlvr_fast's drop-in for "
        "TRL's GRPOTrainer" + (f", on {dataset_name}." if dataset_name else "."),
        "",
        f"Steps: {trainer.state.global_step}. Reward functions: "
        f"{', '.join(trainer.reward_func_names)}.",
        "",
        "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()),
        "",
    ]
    return "\n".join(lines)
