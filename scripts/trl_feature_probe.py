"""Probe single TRL GRPO features on trl and on rlvr_fast: one tiny run per feature per side (the
embedded model, one step, short completions, the CPU), and a table of what each side did: ran,
or failed with its first error line (rlvr_fast's refusals name the setting and the reason).

    python scripts/trl_feature_probe.py --out benchmarks/results/trl-probe.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import tempfile
import traceback
from pathlib import Path

import torch

from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import TINY_MODEL_DIR

BASE = dict(
    max_steps=1,
    num_generations=4,
    per_device_train_batch_size=4,
    max_completion_length=8,
    temperature=0.8,
    learning_rate=1e-4,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    bf16=False,
    use_cpu=True,
    disable_tqdm=True,
)
TEXT = [
    {"prompt": render_prompt(p.question), "answer": p.answer}
    for p in synthetic_problems("train", 8, seed=5)
]
CHAT = [
    {"prompt": [{"role": "user", "content": p.question}], "answer": p.answer}
    for p in synthetic_problems("train", 8, seed=5)
]


def varied(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


def length(completions, **kwargs):
    return [float(len(str(c))) for c in completions]


async def async_varied(completion_ids, **kwargs):
    await asyncio.sleep(0)
    return varied(completion_ids)


def reward_model_dir(directory: Path) -> str:
    import transformers

    config = transformers.AutoConfig.from_pretrained(TINY_MODEL_DIR)
    config.num_labels = 1
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(TINY_MODEL_DIR).save_pretrained(directory)
    return str(directory)


def chat_model(directory: Path) -> str:
    import json
    import shutil

    shutil.copytree(TINY_MODEL_DIR, directory)
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    path.write_text(json.dumps(config))
    return str(directory)


# name: (GRPOConfig settings, trainer arguments(tmp dir) or None)
FEATURES = {
    "loss_type=dapo (default)": ({}, None),
    "loss_type=grpo": ({"loss_type": "grpo"}, None),
    "loss_type=dr_grpo": ({"loss_type": "dr_grpo"}, None),
    "loss_type=bnpo": ({"loss_type": "bnpo"}, None),
    "loss_type=cispo": ({"loss_type": "cispo"}, None),
    "loss_type=sapo": ({"loss_type": "sapo"}, None),
    "loss_type=vespo": ({"loss_type": "vespo"}, None),
    "loss_type=luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, None),
    "scale_rewards=batch": ({"scale_rewards": "batch", "per_device_train_batch_size": 8}, None),
    "scale_rewards=none": ({"scale_rewards": "none"}, None),
    "mask_truncated_completions": ({"mask_truncated_completions": True}, None),
    "importance_sampling_level=sequence": ({"importance_sampling_level": "sequence"}, None),
    "epsilon_high=0.28 (clip-higher)": ({"epsilon_high": 0.28}, None),
    "delta=1.5 (two-sided clip)": ({"delta": 1.5}, None),
    "beta=0.04 (KL)": ({"beta": 0.04}, None),
    "num_iterations=2": ({"num_iterations": 2}, None),
    "beta=0.04, sync_ref_model every step": (
        {"beta": 0.04, "sync_ref_model": True, "ref_model_sync_steps": 1},
        None,
    ),
    "num_iterations=2, epsilon_high=0.28": ({"num_iterations": 2, "epsilon_high": 0.28}, None),
    "top_k=10": ({"top_k": 10}, None),
    "min_p=0.1": ({"min_p": 0.1}, None),
    "repetition_penalty=1.1": ({"repetition_penalty": 1.1}, None),
    "generation_kwargs top_k=10, min_p=0.1": (
        {"generation_kwargs": {"top_k": 10, "min_p": 0.1}},
        None,
    ),
    "top_p=0.9": ({"top_p": 0.9}, None),
    "2 prompts per step (batch 8)": ({"per_device_train_batch_size": 8}, None),
    "gradient_accumulation_steps=2": (
        {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
        None,
    ),
    "steps_per_generation=2 (reuse)": ({"steps_per_generation": 2, "max_steps": 2}, None),
    "reward_weights, two functions": (
        {"reward_weights": [1.0, 0.5]},
        lambda tmp: {"reward_funcs": [varied, length]},
    ),
    "multi_objective_aggregation=normalize_then_sum": (
        {"multi_objective_aggregation": "normalize_then_sum"},
        None,
    ),
    "async reward function": ({}, lambda tmp: {"reward_funcs": async_varied}),
    "reward model as a path": ({}, lambda tmp: {"reward_funcs": reward_model_dir(tmp / "rm")}),
    "conversational prompts, model path with chat template": (
        {"chat_template_kwargs": {}},
        lambda tmp: {"model": chat_model(tmp / "chat"), "train_dataset": CHAT},
    ),
    "lr_scheduler_type=cosine, warmup_steps=0.5": (
        {"lr_scheduler_type": "cosine", "warmup_steps": 0.5, "max_steps": 2},
        None,
    ),
    "lr_scheduler_type=cosine_with_restarts + kwargs": (
        {"lr_scheduler_type": "cosine_with_restarts", "lr_scheduler_kwargs": {"num_cycles": 2}},
        None,
    ),
    "optim=adamw_torch": ({"optim": "adamw_torch"}, None),
    "optim=adafactor": ({"optim": "adafactor"}, None),
    "max_grad_norm=0.1, weight_decay=0.1": ({"max_grad_norm": 0.1, "weight_decay": 0.1}, None),
    "save_strategy=steps, save_total_limit=1": (
        {"save_strategy": "steps", "save_steps": 1, "save_total_limit": 1, "max_steps": 2},
        None,
    ),
    "save_strategy=epoch": ({"save_strategy": "epoch", "max_steps": 2}, None),
    "eval_strategy=steps with eval_dataset": (
        {"eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 4},
        lambda tmp: {"eval_dataset": TEXT[:2]},
    ),
    "log_completions": ({"log_completions": True, "num_completions_to_print": 2}, None),
    "logging_strategy=epoch": ({"logging_strategy": "epoch"}, None),
    "report_to=tensorboard": ({"report_to": "tensorboard"}, None),
    "report_to=wandb": ({"report_to": "wandb"}, None),
    "gradient_checkpointing=False": ({"gradient_checkpointing": False}, None),
    "use_liger_kernel": ({"use_liger_kernel": True}, None),
    "top_entropy_quantile=0.2": ({"top_entropy_quantile": 0.2}, None),
    "entropy_coef=0.01": ({"entropy_coef": 0.01}, None),
    "top_entropy_quantile=0.2, entropy_coef=0.01": (
        {"top_entropy_quantile": 0.2, "entropy_coef": 0.01},
        None,
    ),
    "use_adaptive_entropy (entropy_target=1.0)": (
        {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 1.0, "max_steps": 2},
        None,
    ),
    "off_policy_mask_threshold=0.5, num_iterations=2": (
        {"off_policy_mask_threshold": 0.5, "num_iterations": 2, "max_steps": 2},
        None,
    ),
    "num_train_epochs=1 (no max_steps)": ({"max_steps": -1, "num_train_epochs": 1}, None),
    "shuffle_dataset=False": ({"shuffle_dataset": False}, None),
    "remove_unused_columns=True": ({"remove_unused_columns": True}, None),
    "disable_dropout": ({"disable_dropout": True}, None),
    "bf16=True on the CPU": ({"bf16": True}, None),
    "fp16=True on the CPU": ({"fp16": True}, None),
    "use_vllm": ({"use_vllm": True}, None),
    "use_transformers_continuous_batching": ({"use_transformers_continuous_batching": True}, None),
    "peft_config (LoRA)": ({}, lambda tmp: {"peft_config": lora_config()}),
    "model as a loaded transformers model": ({}, lambda tmp: {"model": loaded_model()}),
    "callbacks (a TrainerCallback)": ({}, lambda tmp: {"callbacks": [printer()]}),
}


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules=["q_proj"])


def loaded_model():
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR)


def printer():
    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            print(f"step {state.global_step}")

    return Steps()


def classes(side: str):
    if side == "trl":
        import trl

        return trl.GRPOConfig, trl.GRPOTrainer
    import rlvr_fast

    return rlvr_fast.GRPOConfig, rlvr_fast.GRPOTrainer


def probe(side: str, settings: dict, arguments) -> str:
    from datasets import Dataset

    config_cls, trainer_cls = classes(side)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            torch.manual_seed(0)
            args = config_cls(output_dir=str(Path(tmp) / "out"), **{**BASE, **settings})
            kwargs = dict(model=str(TINY_MODEL_DIR), reward_funcs=varied, train_dataset=TEXT)
            kwargs.update(arguments(Path(tmp)) if arguments else {})
            for name in ("train_dataset", "eval_dataset"):
                if isinstance(kwargs.get(name), list):
                    kwargs[name] = Dataset.from_list(kwargs[name])
            trainer_cls(args=args, **kwargs).train()
            return "runs"
        except Exception as err:  # the probe records whatever stops a run
            first_line = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
            return f"{outcome(err)}: {type(err).__name__}: {first_line}".replace("|", "/")


def outcome(err: Exception) -> str:
    """Refused: a ValueError / TypeError that rlvr_fast's drop-in raises on purpose (its last frame
    in rlvr_fast/trl_compat); fails: anything else (a crash, or an error of trl)."""
    frames = traceback.extract_tb(err.__traceback__)
    ours = bool(frames) and f"rlvr_fast{os.sep}trl_compat" in frames[-1].filename
    return "refused" if ours and isinstance(err, (ValueError, TypeError)) else "fails"


def commit() -> str:
    """The commit probed (a + marks uncommitted changes)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", default=None, help="comma-separated feature names")
    options = parser.parse_args(argv)
    names = options.only.split(",") if options.only else list(FEATURES)
    rows = ["| feature | trl 1.16 | rlvr_fast |", "|---|---|---|"]
    for name in names:
        settings, arguments = FEATURES[name]
        results = [probe(side, settings, arguments) for side in ("trl", "rlvr_fast")]
        rows.append(f"| {name} | {results[0]} | {results[1]} |".replace("\n", " "))
        print(rows[-1], flush=True)
    cells = [r.strip("| ").split(" | ") for r in rows[2:]]
    trl_runs = [c for c in cells if c[1] == "runs"]
    ours = {kind: sum(c[2].startswith(kind) for c in trl_runs) for kind in ("runs", "refused")}
    summary = (
        f"\n{len(cells)} features probed; TRL runs {len(trl_runs)}; of those rlvr_fast runs "
        f"{ours['runs']}, refuses {ours['refused']} by name and fails on "
        f"{len(trl_runs) - ours['runs'] - ours['refused']} otherwise "
        f"(load average {os.getloadavg()[0]:.1f}; commit {commit()})."
    )
    print(summary)
    if options.out is not None:
        options.out.write_text(
            "# Single TRL features, one tiny run each (scripts/trl_feature_probe.py)\n\n"
            + "\n".join(rows)
            + "\n"
            + summary
            + "\n"
        )


if __name__ == "__main__":
    main()
