"""TRL's own GRPO script, run as its docs say: ``python grpo.py --config recipe.yaml``.

Source: huggingface/trl, trl/scripts/grpo.py (GRPOScriptArguments, TrlParser over
(script args, GRPOConfig, ModelConfig, DatasetMixtureConfig), the reward-function registry,
train, save, ``trainer.accelerator.print``, ``trainer.end()``), with trl_grpo_recipe.yaml.
Adapted: GRPOConfig and GRPOTrainer are imported on one line (the line the tests swap), the
dataset is a local directory (dataset_name), the model the embedded one (model_name_or_path),
both given on the command line; the Hub push branch is kept.
"""

import argparse
import importlib
import os
import sys
from dataclasses import dataclass, field

from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from trl import get_dataset, get_peft_config, get_quantization_config

from trl import GRPOConfig, GRPOTrainer  # drop-in: the line the tests swap


@dataclass
class GRPOScriptArguments(ScriptArguments):
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Reward model id or local path."}
    )
    reward_funcs: list[str] | None = field(
        default=None, metadata={"help": "Reward functions by registry name or dotted path."}
    )


def main(script_args, training_args, model_args, dataset_args):
    import transformers
    from datasets import load_dataset
    from packaging.version import Version
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    reward_funcs_registry = {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(
            max_completion_len=1280, soft_punish_cache=256
        ),
    }
    reward_funcs = []
    if script_args.reward_model_name_or_path:
        reward_funcs.append(script_args.reward_model_name_or_path)
    for func_name in script_args.reward_funcs or []:
        if func_name in reward_funcs_registry:
            reward_funcs.append(reward_funcs_registry[func_name])
        elif "." in func_name:
            module_path, func_name = func_name.rsplit(".", 1)
            sys.path.insert(0, os.getcwd())
            reward_funcs.append(getattr(importlib.import_module(module_path), func_name))
        else:
            raise ValueError(f"Could not load reward function {func_name!r}")

    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs

    if dataset_args.datasets:
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    else:
        raise ValueError("Either `datasets` or `dataset_name` must be provided.")

    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split]
        if training_args.eval_strategy != "no"
        else None,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("Training completed.")
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()


def make_parser(prog: str | None = None) -> argparse.ArgumentParser:
    dataclass_types = (GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig)
    return TrlParser(dataclass_types, prog=prog)


if __name__ == "__main__":
    parser = make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(
        fail_with_unknown_args=False
    )
    main(script_args, training_args, model_args, dataset_args)
