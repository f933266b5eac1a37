"""TRL's GSPO example (sequence-level importance sampling), run with the flags of its docstring.

Source: huggingface/trl, examples/scripts/gspo.py (TrlParser over ScriptArguments, GRPOConfig and
ModelConfig; NuminaMath-TIR with a system prompt; think_format_reward and accuracy_reward;
``--importance_sampling_level sequence --loss_type grpo --gradient_accumulation_steps 2
--steps_per_generation 8``).
Adapted: the dataset is the local directory TRL_SCRIPT_DATA with NuminaMath-TIR's columns
(problem, solution, messages); the model and sizes come from the command line (the tests drop
--use_peft and DeepSpeed: peft is not installed, and there is one CPU).
"""

import os

import torch
from datasets import load_dataset
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config
from trl.rewards import accuracy_reward, think_format_reward

from trl import GRPOConfig, GRPOTrainer  # drop-in: the line the tests swap

if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    dtype = (
        model_args.dtype if model_args.dtype in ["auto", None] else getattr(torch, model_args.dtype)
    )
    training_args.model_init_kwargs = dict(
        revision=model_args.model_revision,
        attn_implementation=model_args.attn_implementation,
        dtype=dtype,
    )
    train_dataset, eval_dataset = load_dataset(
        os.environ["TRL_SCRIPT_DATA"], split=["train[:50%]", "test[:50%]"]
    )
    SYSTEM_PROMPT = (
        "A conversation between user and assistant. The user asks a question, and the assistant "
        "solves it. The reasoning process and answer are enclosed within <think></think> tags."
    )

    def make_conversation(example):
        return {
            "prompt": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": example["problem"]},
            ]
        }

    train_dataset = train_dataset.map(make_conversation)
    eval_dataset = eval_dataset.map(make_conversation)
    train_dataset = train_dataset.remove_columns(["messages", "problem"])
    eval_dataset = eval_dataset.remove_columns(["messages", "problem"])
    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        args=training_args,
        reward_funcs=[think_format_reward, accuracy_reward],
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    trainer.train()
    trainer.save_model(training_args.output_dir)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
