"""The "mini-R1" Countdown recipe: GRPO with a format and an equation reward, TrlParser over a
YAML recipe, resuming from the last checkpoint, metrics and state saved, a model card.

Source: philschmid/deep-learning-pytorch-huggingface, training/scripts/run_r1_grpo.py with
receipes/grpo-qwen-2.5-3b-deepseek-r1-countdown.yaml (the "Mini-R1" tutorial), copied in many
repositories.
Adapted: the dataset is the local TRL_SCRIPT_DATA with Countdown-Tasks-3to4's columns (target,
nums), smaller than the 50,000 rows the script selects; the random sample files of the format
reward are not written. philschmid_recipe.yaml is the recipe ported to TRL 1.16 (dtype for
torch_dtype; no warmup_ratio, max_prompt_length or vllm_device, which 1.16 does not have;
trust_remote_code read from GRPOConfig, where 1.16 moved it from ModelConfig) and
to an offline CPU (no flash attention or tf32, no vLLM, tensorboard or Hub push, two steps).
"""

import logging
import os
import re
from dataclasses import dataclass

from datasets import load_dataset
from transformers import AutoTokenizer
from transformers.trainer_utils import get_last_checkpoint
from trl import ModelConfig, TrlParser, get_peft_config

from trl import GRPOConfig, GRPOTrainer  # drop-in: the line the tests swap


@dataclass
class ScriptArguments:
    dataset_id_or_path: str = "Jiayi-Pan/Countdown-Tasks-3to4"
    dataset_splits: str = "train"
    tokenizer_name_or_path: str = None


logging.basicConfig(level=logging.INFO)
logger = logging.getLogger(__name__)


def format_reward_func(completions, target, **kwargs):
    rewards = []
    for completion, gt in zip(completions, target):  # noqa: B007 (as published)
        try:
            completion = "<think>" + completion
            regex = (
                r"^<think>([^<]*(?:<(?!/?think>)[^<]*)*)<\/think>\n<answer>([\s\S]*?)<\/answer>$"
            )
            match = re.search(regex, completion, re.DOTALL)
            rewards.append(0.0 if match is None or len(match.groups()) != 2 else 1.0)
        except Exception:
            rewards.append(0.0)
    return rewards


def equation_reward_func(completions, target, nums, **kwargs):
    rewards = []
    for completion, gt, numbers in zip(completions, target, nums):
        try:
            completion = "<think>" + completion
            match = re.search(r"<answer>(.*?)<\/answer>", completion)
            if match is None:
                rewards.append(0.0)
                continue
            equation = match.group(1).strip()
            used_numbers = [int(n) for n in re.findall(r"\d+", equation)]
            if sorted(used_numbers) != sorted(numbers):
                rewards.append(0.0)
                continue
            if not re.match(r"^[\d+\-*/().\s]+$", equation):
                rewards.append(0.0)
                continue
            result = eval(equation, {"__builtins__": None}, {})
            rewards.append(1.0 if abs(float(result) - float(gt)) < 1e-5 else 0.0)
        except Exception:
            rewards.append(0.0)
    return rewards


def get_checkpoint(training_args: GRPOConfig):
    last_checkpoint = None
    if os.path.isdir(training_args.output_dir):
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
    return last_checkpoint


def grpo_function(model_args: ModelConfig, script_args: ScriptArguments, training_args):
    logger.info(f"Model parameters {model_args}")
    tokenizer = AutoTokenizer.from_pretrained(
        script_args.tokenizer_name_or_path or model_args.model_name_or_path,
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = load_dataset(script_args.dataset_id_or_path, split=script_args.dataset_splits)
    dataset = dataset.shuffle(seed=42).select(range(min(50000, len(dataset))))

    def generate_r1_prompt(numbers, target):
        r1_prefix = [
            {
                "role": "system",
                "content": "You are a helpful assistant. You first thinks about the reasoning "
                "process in the mind and then provides the user with the answer.",
            },
            {
                "role": "user",
                "content": f"Using the numbers {numbers}, create an equation that equals "
                f"{target}. You can use basic arithmetic operations (+, -, *, /) and each number "
                "can only be used once. Show your work in <think> </think> tags. And return the "
                "final equation and answer in <answer> </answer> tags, for example <answer> "
                "(1 + 2) / 3 = 1 </answer>.",
            },
            {"role": "assistant", "content": "Let me solve this step by step.\n<think>"},
        ]
        return {
            "prompt": tokenizer.apply_chat_template(
                r1_prefix, tokenize=False, continue_final_message=True
            ),
            "target": target,
            "nums": numbers,
        }

    dataset = dataset.map(lambda x: generate_r1_prompt(x["nums"], x["target"]))
    train_test_split = dataset.train_test_split(test_size=0.1)
    train_dataset = train_test_split["train"]
    test_dataset = train_test_split["test"]

    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=[format_reward_func, equation_reward_func],
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=test_dataset,
        peft_config=get_peft_config(model_args),
    )
    last_checkpoint = get_checkpoint(training_args)
    if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
        logger.info(f"Checkpoint detected, resuming training at {last_checkpoint}.")
    train_result = trainer.train(resume_from_checkpoint=last_checkpoint)
    metrics = train_result.metrics
    metrics["train_samples"] = len(train_dataset)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    trainer.model.config.use_cache = True
    trainer.save_model(training_args.output_dir)
    training_args.distributed_state.wait_for_everyone()
    tokenizer.save_pretrained(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        trainer.create_model_card({"tags": ["rl", "grpo", "tutorial", "philschmid"]})
    if training_args.push_to_hub is True:
        trainer.push_to_hub()


def main():
    parser = TrlParser((ModelConfig, ScriptArguments, GRPOConfig))
    model_args, script_args, training_args = parser.parse_args_and_config()
    grpo_function(model_args, script_args, training_args)


if __name__ == "__main__":
    main()
