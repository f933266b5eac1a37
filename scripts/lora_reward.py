"""Does a LoRA run raise the embedded model's reward? GRPO through the TRL drop-in with
``peft_config=LoraConfig(...)`` on the synthetic arithmetic task (the reward: a correct boxed
answer), greedy accuracy on held-out problems before and after, the mean training reward of the
first and last steps, and the saved adapter's logits under peft against our merged decoder.

    OMP_NUM_THREADS=1 python scripts/lora_reward.py --steps 40 --lr 5e-3 --rank 8
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import rlvr_fast
from rlvr_fast.data.problems import render_prompt
from rlvr_fast.data.synthetic import synthetic_problems
from rlvr_fast.models.policy import TINY_MODEL_DIR


def rows(split: str, count: int, seed: int) -> list[dict]:
    return [
        {"prompt": render_prompt(p.question), "answer": p.answer}
        for p in synthetic_problems(split, count, seed=seed)
    ]


def correct(completions, answer, **kwargs):
    return [float(rlvr_fast.grade_response(c, a)) for c, a in zip(completions, answer)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--targets", default="all-linear")
    parser.add_argument("--eval-problems", type=int, default=100)
    parser.add_argument("--max-completion-length", type=int, default=96)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--prompts-per-step", type=int, default=1)
    args = parser.parse_args()
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    out = tempfile.mkdtemp(prefix="lora-reward-")
    config = rlvr_fast.GRPOConfig(
        output_dir=out,
        max_steps=args.steps,
        num_generations=8,
        per_device_train_batch_size=8 * args.prompts_per_step,
        max_completion_length=args.max_completion_length,
        temperature=0.8,
        top_p=0.9,
        learning_rate=args.lr,
        logging_steps=1,
        eval_strategy="no",
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        disable_tqdm=True,
        seed=args.seed,
    )
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    trainer = rlvr_fast.GRPOTrainer(
        model=str(TINY_MODEL_DIR),
        reward_funcs=correct,
        args=config,
        train_dataset=rows("train", args.steps * args.prompts_per_step, args.seed),
        eval_dataset=rows("test", args.eval_problems, args.seed),
        peft_config=LoraConfig(
            r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0, target_modules=targets
        ),
    )
    adapters = trainer.policy.adapters.num_parameters()
    print(f"adapter parameters {adapters:,} of {trainer.trainer.num_params:,}")
    before = trainer.evaluate()
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    after = trainer.evaluate()
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    tenth = max(1, len(rewards) // 4)
    first, last = rewards[:tenth], rewards[-tenth:]
    print(f"train {len(rewards)} steps in {seconds:.0f} s")
    print(
        f"mean train reward, first {tenth} steps {sum(first) / tenth:.3f}, last {tenth} steps "
        f"{sum(last) / tenth:.3f}"
    )
    keys = sorted(k for k in after if k.endswith("reward"))
    for key in keys:
        print(f"{key}: before {before[key]:.3f}, after {after[key]:.3f}")
    trainer.save_model(out)
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, out).eval()
    ids = torch.tensor([trainer.task.encoded[0]])
    with torch.no_grad():
        gap = (trainer.policy.decoder(ids) - loaded(input_ids=ids).logits).abs().max()
    print(f"saved adapter under peft vs our merged decoder: max |logit difference| {gap:.2e}")


if __name__ == "__main__":
    main()
