"""TRL's GRPO interface on rlvr_fast: a script written against ``trl`` runs with its import
changed to ``from rlvr_fast import GRPOConfig, GRPOTrainer`` (``TrlParser``, ``ModelConfig``,
``trl.rewards`` and the rest of TRL's helpers keep working with them).

    from datasets import Dataset
    from rlvr_fast import GRPOConfig, GRPOTrainer

    def correct(completions, answer, **kwargs):
        return [float(rlvr_fast.grade_response(c, a)) for c, a in zip(completions, answer)]

    trainer = GRPOTrainer(model="path/to/Qwen3-0.6B-Base", reward_funcs=correct,
                          args=GRPOConfig(output_dir="out", max_steps=50),
                          train_dataset=Dataset.from_list([{"prompt": ..., "answer": ...}]))
    trainer.train()

Needs ``transformers`` (GRPOConfig is a ``TrainingArguments``, as TRL's is).
"""

from rlvr_fast.trl_compat.config import GRPOConfig, UnsupportedFieldError
from rlvr_fast.trl_compat.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "UnsupportedFieldError"]
