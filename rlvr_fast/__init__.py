"""rlvr_fast: fast GRPO for reinforcement learning with verifiable rewards on math reasoning.

import torch, rlvr_fast
policy = rlvr_fast.load_policy("tiny")                      # or a local HF checkpoint dir
problem = rlvr_fast.synthetic_problems("test", 1)[0]
out = rlvr_fast.sample(policy, [rlvr_fast.render_prompt(problem.question)] * 8,
                       generator=torch.Generator().manual_seed(0))
rewards = [rlvr_fast.grade_response(text, problem.answer) for text in out.texts]
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Each public name and the module that defines it; a name is imported when first asked for.
_PUBLIC = {
    "DataError": "rlvr_fast.data.problems",
    "Problem": "rlvr_fast.data.problems",
    "load_problems": "rlvr_fast.data.problems",
    "render_prompt": "rlvr_fast.data.problems",
    "save_problems": "rlvr_fast.data.problems",
    "synthetic_problems": "rlvr_fast.data.synthetic",
    "worked_solution": "rlvr_fast.data.synthetic",
    "RolloutEngine": "rlvr_fast.engine",
    "SamplingParams": "rlvr_fast.engine",
    "SampleOutput": "rlvr_fast.rollouts.generation",
    "generate": "rlvr_fast.rollouts.generation",
    "sample": "rlvr_fast.rollouts.generation",
    "sample_group": "rlvr_fast.rollouts.generation",
    "extract_boxed": "rlvr_fast.grading",
    "grade": "rlvr_fast.grading",
    "grade_response": "rlvr_fast.grading",
    "passes_gate": "rlvr_fast.grading",
    "ModelConfig": "rlvr_fast.models.config",
    "Policy": "rlvr_fast.models.policy",
    "load_policy": "rlvr_fast.models.policy",
    "TrainConfig": "rlvr_fast.train.config",
    "RLVRTrainer": "rlvr_fast.train.trainer",
    "GRPOConfig": "rlvr_fast.trl_compat",
    "GRPOTrainer": "rlvr_fast.trl_compat",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'rlvr_fast' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
