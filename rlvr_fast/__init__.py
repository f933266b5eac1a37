"""rlvr_fast: fast GRPO for reinforcement learning with verifiable rewards on math reasoning.

import torch, rlvr_fast
policy = rlvr_fast.load_policy("tiny")                      # or a local HF checkpoint dir
problem = rlvr_fast.synthetic_problems("test", 1)[0]
out = rlvr_fast.sample(policy, [rlvr_fast.render_prompt(problem.question)] * 8,
                       generator=torch.Generator().manual_seed(0))
rewards = [rlvr_fast.grade_response(text, problem.answer) for text in out.texts]
"""

from rlvr_fast.data import (
    DataError,
    Problem,
    load_problems,
    render_prompt,
    save_problems,
    synthetic_problems,
    worked_solution,
)
from rlvr_fast.engine import RolloutEngine, SamplingParams
from rlvr_fast.generation import SampleOutput, generate, sample, sample_group
from rlvr_fast.grading import extract_boxed, grade, grade_response, passes_gate
from rlvr_fast.models.config import ModelConfig
from rlvr_fast.policy import Policy, load_policy
from rlvr_fast.trainer import RLVRTrainer, TrainConfig
from rlvr_fast.trl_compat import GRPOConfig, GRPOTrainer

__version__ = "0.1.0"

__all__ = [
    "DataError",
    "GRPOConfig",
    "GRPOTrainer",
    "ModelConfig",
    "Policy",
    "Problem",
    "RLVRTrainer",
    "RolloutEngine",
    "SampleOutput",
    "SamplingParams",
    "extract_boxed",
    "generate",
    "grade",
    "grade_response",
    "load_policy",
    "load_problems",
    "passes_gate",
    "render_prompt",
    "sample",
    "sample_group",
    "save_problems",
    "synthetic_problems",
    "TrainConfig",
    "worked_solution",
]
