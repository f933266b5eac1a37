"""TRL's multi-task reward functions example, adapted to run offline on the embedded model.

Source: huggingface/trl, docs/source/grpo_trainer.md, "Example 4: Multi-task reward functions"
(a dataset of math and coding prompts with a "task" column; each reward function returns None
for the other task), with its math check written out (the docs leave check_math_solution and
test_code_solution to the reader).
Adapted: the model is TRL_SCRIPT_MODEL; args for a CPU and a one-step budget.
"""

import os
import re

from datasets import Dataset

from trl import GRPOConfig, GRPOTrainer  # drop-in: the line the tests swap

dataset = Dataset.from_list(
    [
        {"prompt": "What is 2+2?", "task": "math"},
        {"prompt": "Write a function that returns the sum of two numbers.", "task": "code"},
        {"prompt": "What is 3*4?", "task": "math"},
        {"prompt": "Write a function that returns the product of two numbers.", "task": "code"},
    ]
)


def check_math_solution(prompt, completion):
    left, op, right = re.findall(r"(\d+)([+*])(\d+)", prompt)[0]
    value = int(left) + int(right) if op == "+" else int(left) * int(right)
    return str(value) in completion


def test_code_solution(prompt, completion):
    return "def " in completion and "return" in completion


def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            rewards.append(1.0 if check_math_solution(prompt, completion) else -1.0)
        else:
            rewards.append(None)
    return rewards


def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "code":
            rewards.append(1.0 if test_code_solution(prompt, completion) else -1.0)
        else:
            rewards.append(None)
    return rewards


trainer = GRPOTrainer(
    model=os.environ["TRL_SCRIPT_MODEL"],
    reward_funcs=[math_reward_func, coding_reward_func],
    train_dataset=dataset,
    args=GRPOConfig(
        output_dir=os.environ["TRL_SCRIPT_OUT"],
        use_cpu=True,
        max_steps=1,
        max_completion_length=32,
        per_device_train_batch_size=4,
        num_generations=4,
        logging_steps=1,
        report_to="none",
    ),
)
trainer.train()
