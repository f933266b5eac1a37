"""The Hugging Face cookbook's "Post training an LLM for reasoning with GRPO in TRL": the model
wrapped by peft.get_peft_model before it is handed to the trainer (the common LoRA pattern of
tutorials), a format and a math_verify accuracy reward, then save_model.

Source: huggingface/cookbook, notebooks/en/fine_tuning_llm_grpo_trl.ipynb (Sergio Paniego;
NuminaMath-TIR with a system prompt, Qwen2-0.5B-Instruct, LoraConfig r=8 on q_proj and v_proj).
Adapted: the model is TRL_SCRIPT_MODEL (the embedded model with a chat template), the dataset the
local directory TRL_SCRIPT_DATA with NuminaMath-TIR's columns (problem, solution, messages), whole
splits in place of the notebook's 5%; for a CPU and a short budget: float32 (no bf16), two
accumulation steps in place of 16, shorter completions, logging and saving every step, two steps;
no tensorboard and no Hub push (offline); no max_prompt_length, which TRL 1.16 does not have;
the notebook's cells (the printed examples and the
inference check after training) are left out.
The import line marked below is the one the tests change to rlvr_fast's.
"""

import os
import re

from datasets import load_dataset
from math_verify import LatexExtractionConfig, parse, verify
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from trl import GRPOConfig, GRPOTrainer  # drop-in: the line the tests swap

train_dataset, test_dataset = load_dataset(os.environ["TRL_SCRIPT_DATA"], split=["train", "test"])

SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think><answer> answer here </answer>"
)


def make_conversation(example):
    return {
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": example["problem"]},
        ]
    }


train_dataset = train_dataset.map(make_conversation)
test_dataset = test_dataset.map(make_conversation)
train_dataset = train_dataset.remove_columns(["messages", "problem"])

model_id = os.environ["TRL_SCRIPT_MODEL"]
model = AutoModelForCausalLM.from_pretrained(model_id, dtype="auto", device_map="auto")

lora_config = LoraConfig(
    task_type="CAUSAL_LM", r=8, lora_alpha=32, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]
)

model = get_peft_model(model, lora_config)
model.print_trainable_parameters()


def format_reward(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    rewards_list = [1.0 if match else 0.0 for match in matches]
    return rewards_list


def accuracy_reward(completions, **kwargs):
    """Reward function that checks if the completion is the same as the ground truth."""
    solutions = kwargs["solution"]
    completion_contents = [completion[0]["content"] for completion in completions]
    rewards = []
    for content, solution in zip(completion_contents, solutions):
        gold_parsed = parse(
            solution, extraction_mode="first_match", extraction_config=[LatexExtractionConfig()]
        )
        answer_parsed = parse(
            content, extraction_mode="first_match", extraction_config=[LatexExtractionConfig()]
        )
        if len(gold_parsed) != 0:
            try:
                rewards.append(float(verify(answer_parsed, gold_parsed)))
            except Exception:
                rewards.append(0.0)
        else:
            rewards.append(1.0)
    return rewards


# Configure training arguments using GRPOConfig
training_args = GRPOConfig(
    output_dir=os.environ["TRL_SCRIPT_OUT"],
    learning_rate=1e-5,
    remove_unused_columns=False,  # to access the solution column in accuracy_reward
    gradient_accumulation_steps=2,
    num_train_epochs=1,
    bf16=False,
    use_cpu=True,
    max_steps=2,
    # Parameters that control de data preprocessing
    max_completion_length=32,  # default: 256
    num_generations=4,  # default: 8
    # Parameters related to reporting and saving
    report_to="none",
    logging_steps=1,
    push_to_hub=False,
    save_strategy="steps",
    save_steps=1,
)

trainer = GRPOTrainer(
    model=model,
    reward_funcs=[format_reward, accuracy_reward],
    args=training_args,
    train_dataset=train_dataset,
)

trainer.train()

trainer.save_model(training_args.output_dir)
