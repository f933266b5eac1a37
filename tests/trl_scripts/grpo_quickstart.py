"""TRL's GRPO quick start, adapted to run offline on the embedded model.

Source: huggingface/trl, docs/source/grpo_trainer.md, "Quick start" (train_grpo.py: DeepMath-103K
prompts, trl.rewards.accuracy_reward, Qwen2.5-0.5B-Instruct).
Adapted: the model is TRL_SCRIPT_MODEL (the embedded model with a chat template), the dataset the
local directory TRL_SCRIPT_DATA with DeepMath-103K's columns (a conversational "prompt" and a
"solution"); args are added for a CPU and a one-step budget (TRL's defaults need a bf16 GPU).
The import line marked below is the one the tests change to rlvr_fast's.
"""

import os

from datasets import load_dataset
from trl.rewards import accuracy_reward

from trl import GRPOConfig, GRPOTrainer  # drop-in: the line the tests swap

dataset = load_dataset(os.environ["TRL_SCRIPT_DATA"], split="train")

trainer = GRPOTrainer(
    model=os.environ["TRL_SCRIPT_MODEL"],
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
    args=GRPOConfig(
        output_dir=os.environ["TRL_SCRIPT_OUT"],
        use_cpu=True,
        max_steps=1,
        max_completion_length=32,
        logging_steps=1,
        report_to="none",
    ),
)
trainer.train()
