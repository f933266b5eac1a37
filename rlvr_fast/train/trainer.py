"""Single-question GRPO (the study's §1), one loop that reads top-down.

Per step, for the next training question x:
  1. rollouts, on the run's one rollout engine: G samples at temperature T, top-p, capped at
     max_new_tokens, the prompt prefilled once and forked G times (finished rows leave the batch
     at once); tree arms, once ``bifurcate_after_active`` active steps have run, sample a K x B
     tree instead (``rlvr_fast.rollouts.trees.sample_tree``, Stage 2 forked on the paged KV cache);
  2. rewards: R_i = 1 when the last boxed answer grades correct (and, with the derivation gate,
     ``\\boxed`` starts at or after gate_min_chars characters);
  3. credit: flat steps A_i = (R_i - mean R) / (std R + 1e-4), std with Bessel's correction as
     ``torch.std`` computes it in the seed's code, on every token of rollout i; tree steps the
     TreeRL per-token credit of ``rlvr_fast.credit.tree`` (prefix / continuation weights);
  4. loss: -(1/G) sum_i sum_t w_it log pi(y_t), summed in the order the arm names (token-weighted
     arms go through the fused ``weighted_token_nll`` op; ``baseline`` keeps the seed's eager
     sum-then-scale path on purpose); flat steps may take TRL's normalisations instead
     (``loss_type`` grpo / dapo / dr_grpo, ``sequence_scales``), its unscaled advantages
     (``scale_rewards`` off), log pi of logits / temperature (``tempered_logprobs``) and zero
     weight on completions cut at the cap (``mask_truncated``): what ``rlvr_fast.trl_compat``
     maps TRL's settings onto;
  5. backward, gradient-norm clipping (norm logged before clipping), AdamW step. Arms that skip
     homogeneous groups (sigma_R = 0) run no backward there and either take a zero-gradient AdamW
     step or none.
Parallel-path arms (``sampler="parallel"``, the Parallel-Shapley seed) sample ``group_size``
responses of ``num_paths`` paths each (``rlvr_fast.rollouts.parallel``), aggregate each response by vote
or by a summary, and credit every path by its Shapley value (or leave-one-out, or alone) under
a utility on coalitions of paths, mixed with the outcome reward (``rlvr_fast.credit.paths``); the
loss sums over paths and summaries, -(1/(paths + summaries)) sum_seq sum_t w_t log pi(y_t).
Every step appends one checked line to the ledger. Arms are presets (``rlvr_fast.train.arms``). The
trainer asks its task for a step's prompt ids and rewards: ``MathTask`` (the study's prompt and
boxed-answer grading) unless one is given (``rlvr_fast.trl_compat`` gives TRL's reward functions).

The study's remaining ablations are settings of the same loop:
- ``questions_per_step`` Q > 1 (accum4): a step takes the next Q questions, samples all their
  rollouts in one engine batch, credits each question as above, computes each contributing
  question's gradient g_q (its own forward and backward) and steps once on the average of the
  unit gradients, (1/n) sum_q g_q / |g_q| over the n questions whose rewards vary, clipped as
  usual; zero-variance questions contribute nothing and are counted; when every question is
  homogeneous the step is a zero-gradient AdamW step (or none). One ledger line per step holds
  a sub-record per question (``ledger.MultiQuestionRecord``).
- ``zero_cont_mass``: tree steps centre the continuation tokens' weights to zero signed token
  mass (``TreeCredit.zero_continuation_mass``).
- ``polyak_start`` s > 0 (ra_mst_tail50): an FP32 average of the weights after steps s, s + 1,
  ... to the last (counted from 1: the study's 26..50), kept beside the live weights
  (``rlvr_fast.train.polyak``, on the CPU when the device is short of memory), in every checkpoint,
  evaluated (evals/polyak/) and saved as final_polyak/ at the end.
- ``active_steps`` N: the run ends after the step that makes N steps with a backward pass, or
  after ``steps`` steps, whichever comes first (the study's act30 / act35).

Data parallel (``rlvr_fast.train.distributed``, launched by torchrun or ``rlvr-fast train --nproc N``):
W ranks share each multi-question step, rank r taking its contiguous W-th of the Q questions
with the sampling seeds one process would give them; the contributing questions are counted
over all ranks (the step is active iff any rank has one, and n is that count), each rank sums
its g_q / (n |g_q|) (zeros if it has none) and the sums are all-reduced before clipping and the
AdamW step, so the run is the one-process run up to fp32 rounding. Rank 0 writes the ledger from
every rank's records, the checkpoints and the evaluations, which the ranks share item by item.

    trainer = RLVRTrainer(load_policy("tiny"), TrainConfig.from_arm("ra_flat"), problems)
    summary = trainer.train()
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from rlvr_fast.train import distributed
from rlvr_fast.train.arms import ARMS, arm_settings
from rlvr_fast.credit.tree import ADVANTAGE_EPS, group_stats, tree_credit
from rlvr_fast.data.problems import Problem, render_prompt
from rlvr_fast.engine import EngineCounters, RolloutEngine, SamplingParams
from rlvr_fast.rollouts.evaluation import EvalResult, check_prompt_lengths, encode_prompts
from rlvr_fast.utils.files import append_line, write_json_atomic, write_text_atomic
from rlvr_fast.rollouts.generation import base_seed, sample_groups
from rlvr_fast.grading import final_answer, grade_many
from rlvr_fast.credit.judge import GenerativeJudge
from rlvr_fast.engine.counters import SUMMED_COUNTERS
from rlvr_fast.ledger.records import (
    FLOP_FIELDS,
    TOTALLED_FIELDS,
    LedgerWriter,
    ParallelStats,
    StepRecord,
    flat_step_record,
    multi_question_step_record,
    parallel_step_record,
    tree_step_record,
)
from rlvr_fast.models.context import ForwardContext
from rlvr_fast.ops import weighted_token_nll
from rlvr_fast.ops.zero_grad_adamw import zero_grad_adamw_
from rlvr_fast.rollouts.pairs import PairCategory
from rlvr_fast.rollouts.parallel import AGGREGATORS, ParallelRollout, sample_parallel
from rlvr_fast.credit.paths import (
    PATH_CREDITS,
    PATH_REWARD_NORMS,
    PATH_UTILITIES,
    ParallelCredit,
    outcome_utility,
    parallel_credit,
)
from rlvr_fast.train.polyak import PolyakAverage, trainable
from rlvr_fast.rollouts.trees import EARLY_EOS_MODES, TreeRollout, sample_trees_ids
from rlvr_fast.run.directory import (
    RESUME_MAY_CHANGE,
    check_eval_name,
    open_run_directory,
    run_signature,
    whole_lines,
)
from rlvr_fast.credit.shapley import (
    MAX_EXACT_PLAYERS,
    MAX_PERMUTATIONS as MAX_SHAPLEY_PERMUTATIONS,
    MAX_PLAYERS,
    MajorityVote,
)
from rlvr_fast.rollouts.limits import (
    MAX_BATCH,
    MAX_GROUP_SIZE,
    MAX_NEW_TOKENS,
    MAX_QUESTIONS_PER_STEP,
    MAX_SEED,
)
from rlvr_fast.run.state_file import StateFileError, load_state, save_state

LOSS_ORDERS = ("sum_then_scale", "token_weighted")
# Per-sequence normalisers of the token-weighted loss (``sequence_scales``): the study's sum and
# TRL's grpo, dapo and dr_grpo.
LOSS_TYPES = ("sum", "grpo", "dapo", "dr_grpo")
ZERO_VAR_STEPS = ("zero_grad", "skip")
SAMPLERS = ("flat", "tree", "parallel")
CHECKPOINT_FILE = "state.safetensors"
# Where run_evals writes each evaluation, under RUN/evals/.
EVAL_DIRS = {"before": "before", "after": "", "polyak": "polyak"}


@dataclass
class TrainConfig:
    arm: str = "baseline"
    steps: int = 50
    seed: int = 42
    group_size: int = 8
    temperature: float = 0.8
    top_p: float = 0.9
    max_new_tokens: int = 512
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    loss_order: str = "sum_then_scale"
    skip_zero_var: bool = False
    zero_var_step: str = "skip"
    gate_min_chars: int | None = None
    loss_type: str = "sum"
    scale_rewards: bool = True
    tempered_logprobs: bool = False
    mask_truncated: bool = False
    eval_max_new_tokens: int = 2048
    max_batch: int = 256
    cuda_graphs: bool = True
    eval_before: bool = True
    checkpoint_every: int = 10
    fused_zero_grad_step: bool = True
    sampler: str = "flat"
    early_eos_mode: str = "terminal_dup"
    tree_k: int = 4
    tree_b: int = 2
    t_min: int = 96
    t_max: int = 160
    beta: float = 0.0
    alpha: float = 0.5
    clamped_prefix: bool = False
    bifurcate_after_active: int = 0
    tree_reprefill: bool = False
    num_paths: int = 4
    aggregator: str = "vote"
    path_utility: str = "vote"
    path_credit: str = "shapley"
    shapley_permutations: int = 0
    shapley_antithetic: bool = True
    path_reward_norm: str = "zscore"
    lambda_outcome: float = 0.5
    lambda_path: float = 0.5
    judge_model: str = "policy"
    allow_nonfinite: bool = False
    questions_per_step: int = 1
    zero_cont_mass: bool = False
    polyak_start: int = 0
    active_steps: int | None = None

    def __post_init__(self) -> None:
        self._check_types()
        checks = [
            (self.arm in ARMS, f"unknown arm {self.arm!r} (valid: {', '.join(ARMS)})"),
            (self.steps >= 1, f"steps must be >= 1, got {self.steps}"),
            (0 <= self.seed <= MAX_SEED, f"seed must be in [0, 2**63 - 1], got {self.seed}"),
            (
                2 <= self.group_size <= MAX_GROUP_SIZE and self.group_size % 2 == 0,
                f"group_size must be even and in [2, {MAX_GROUP_SIZE}] (rollouts are ledgered in "
                f"pairs), got {self.group_size}",
            ),
            (self.temperature > 0, f"temperature must be > 0 for rollouts, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (
                1 <= self.max_new_tokens <= MAX_NEW_TOKENS,
                f"max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}",
            ),
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (
                len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                f"betas must be two numbers in [0, 1), got {self.betas}",
            ),
            (self.eps > 0, f"eps must be > 0, got {self.eps}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (
                self.max_grad_norm is None or self.max_grad_norm > 0,
                f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}",
            ),
            (
                self.loss_order in LOSS_ORDERS,
                f"loss_order must be one of {', '.join(LOSS_ORDERS)}, got {self.loss_order!r}",
            ),
            (
                self.zero_var_step in ZERO_VAR_STEPS,
                f"zero_var_step must be one of {', '.join(ZERO_VAR_STEPS)}, got {self.zero_var_step!r}",
            ),
            (
                self.gate_min_chars is None or self.gate_min_chars >= 0,
                f"gate_min_chars must be >= 0 or None, got {self.gate_min_chars}",
            ),
            (
                self.loss_type in LOSS_TYPES,
                f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}",
            ),
            (
                self.loss_order == "token_weighted"
                or not (self.loss_type != "sum" or self.tempered_logprobs or self.mask_truncated),
                "loss_type other than sum, tempered_logprobs and mask_truncated need loss_order "
                "token_weighted",
            ),
            (
                self.sampler == "flat"
                or (
                    self.loss_type == "sum"
                    and self.scale_rewards
                    and not self.tempered_logprobs
                    and not self.mask_truncated
                ),
                "loss_type, scale_rewards, tempered_logprobs and mask_truncated apply to flat "
                "arms only",
            ),
            (
                1 <= self.eval_max_new_tokens <= MAX_NEW_TOKENS,
                f"eval_max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got "
                f"{self.eval_max_new_tokens}",
            ),
            (
                1 <= self.max_batch <= MAX_BATCH,
                f"max_batch must be in [1, {MAX_BATCH}], got {self.max_batch}",
            ),
            (self.checkpoint_every >= 1, "checkpoint_every must be >= 1"),
            (
                self.sampler in SAMPLERS,
                f"sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}",
            ),
            (
                self.early_eos_mode in EARLY_EOS_MODES,
                f"early_eos_mode must be one of "
                f"{', '.join(EARLY_EOS_MODES)}, got {self.early_eos_mode!r}",
            ),
            (self.tree_b == 2, f"tree_b must be 2 (the ledger records pairs), got {self.tree_b}"),
            (
                1 <= self.tree_k <= MAX_GROUP_SIZE // 2,
                f"tree_k must be in [1, {MAX_GROUP_SIZE // 2}], got {self.tree_k}",
            ),
            (
                self.sampler != "tree" or self.group_size == self.tree_k * self.tree_b,
                f"tree arms need group_size = tree_k * tree_b ({self.tree_k * self.tree_b}) so flat "
                f"warmup and tree steps train on as many leaves, got {self.group_size}",
            ),
            (
                self.sampler != "tree" or 1 <= self.t_min <= self.t_max < self.max_new_tokens,
                f"need 1 <= t_min <= t_max < max_new_tokens, got {self.t_min}, {self.t_max}, "
                f"{self.max_new_tokens}",
            ),
            (0 <= self.beta <= 1, f"beta must be in [0, 1], got {self.beta}"),
            (0 <= self.alpha <= 1, f"alpha must be in [0, 1], got {self.alpha}"),
            (self.bifurcate_after_active >= 0, "bifurcate_after_active must be >= 0"),
            (
                self.sampler == "flat" or self.loss_order == "token_weighted",
                "tree and parallel arms weight every token, so they need loss_order token_weighted",
            ),
            (
                1 <= self.num_paths <= MAX_PLAYERS,
                f"num_paths must be in [1, {MAX_PLAYERS}], got {self.num_paths}",
            ),
            (
                self.aggregator in AGGREGATORS,
                f"aggregator must be one of {', '.join(AGGREGATORS)}, got {self.aggregator!r}",
            ),
            (
                self.path_utility in PATH_UTILITIES,
                f"path_utility must be one of "
                f"{', '.join(PATH_UTILITIES)}, got {self.path_utility!r}",
            ),
            (
                self.path_credit in PATH_CREDITS,
                f"path_credit must be one of {', '.join(PATH_CREDITS)}, got {self.path_credit!r}",
            ),
            (
                self.path_reward_norm in PATH_REWARD_NORMS,
                f"path_reward_norm must be one of "
                f"{', '.join(PATH_REWARD_NORMS)}, got {self.path_reward_norm!r}",
            ),
            (
                0 <= self.shapley_permutations <= MAX_SHAPLEY_PERMUTATIONS,
                f"shapley_permutations must be in [0, {MAX_SHAPLEY_PERMUTATIONS}] (0: exact)",
            ),
            (
                self.shapley_permutations > 0
                or self.path_credit != "shapley"
                or self.num_paths <= MAX_EXACT_PLAYERS,
                f"exact Shapley takes at most "
                f"{MAX_EXACT_PLAYERS} paths; set shapley_permutations for {self.num_paths}",
            ),
            (
                not self.shapley_antithetic
                or self.shapley_permutations == 0
                or (self.shapley_permutations >= 4 and self.shapley_permutations % 2 == 0),
                "antithetic Monte-Carlo Shapley needs an even shapley_permutations >= 4 "
                "(or shapley_antithetic false)",
            ),
            (self.shapley_permutations != 1, "Monte-Carlo Shapley needs shapley_permutations >= 2"),
            (
                self.lambda_outcome >= 0 and self.lambda_path >= 0,
                "lambda_outcome and lambda_path must be >= 0",
            ),
            (
                1 <= self.questions_per_step <= MAX_QUESTIONS_PER_STEP,
                f"questions_per_step must be in [1, {MAX_QUESTIONS_PER_STEP}], got "
                f"{self.questions_per_step}",
            ),
            (
                self.questions_per_step == 1 or self.skip_zero_var,
                "questions_per_step > 1 needs "
                "skip_zero_var: a zero-variance question has no gradient to scale to unit norm",
            ),
            (
                self.questions_per_step == 1 or self.loss_order == "token_weighted",
                "questions_per_step > 1 needs loss_order token_weighted",
            ),
            (
                self.questions_per_step == 1 or self.sampler != "parallel",
                "parallel-path arms take one question per step (questions_per_step 1)",
            ),
            (
                not self.zero_cont_mass or self.sampler == "tree",
                "zero_cont_mass centres tree continuations: it needs sampler tree",
            ),
            (
                0 <= self.polyak_start <= self.steps,
                f"polyak_start must be in [0, steps = "
                f"{self.steps}] (0: no Polyak average), got {self.polyak_start}",
            ),
            (
                self.active_steps is None or 1 <= self.active_steps <= self.steps,
                f"active_steps must be in [1, steps = {self.steps}] (steps caps the run), got "
                f"{self.active_steps}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def _check_types(self) -> None:
        """Overrides arrive from the command line as JSON: refuse a wrong type by name here
        rather than fail inside a comparison later. Ints are accepted where floats are."""
        numbers = (int, float)
        expected = {
            "arm": (str,),
            "loss_order": (str,),
            "zero_var_step": (str,),
            "sampler": (str,),
            "early_eos_mode": (str,),
            "loss_type": (str,),
            "scale_rewards": (bool,),
            "tempered_logprobs": (bool,),
            "mask_truncated": (bool,),
            "aggregator": (str,),
            "path_utility": (str,),
            "path_credit": (str,),
            "path_reward_norm": (str,),
            "judge_model": (str,),
            "shapley_antithetic": (bool,),
            "lambda_outcome": numbers,
            "lambda_path": numbers,
            "skip_zero_var": (bool,),
            "eval_before": (bool,),
            "fused_zero_grad_step": (bool,),
            "clamped_prefix": (bool,),
            "tree_reprefill": (bool,),
            "cuda_graphs": (bool,),
            "allow_nonfinite": (bool,),
            "beta": numbers,
            "alpha": numbers,
            "zero_cont_mass": (bool,),
            "active_steps": (int, type(None)),
            "temperature": numbers,
            "top_p": numbers,
            "lr": numbers,
            "eps": numbers,
            "weight_decay": numbers,
            "max_grad_norm": numbers + (type(None),),
            "gate_min_chars": (int, type(None)),
        }
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "betas":
                ok = isinstance(value, (list, tuple)) and all(
                    isinstance(b, numbers) and not isinstance(b, bool) for b in value
                )
                if ok:
                    self.betas = tuple(float(b) for b in value)
            else:
                types = expected.get(f.name, (int,))
                ok = isinstance(value, types) and (bool in types or not isinstance(value, bool))
            if not ok:
                raise ValueError(f"{f.name} has the wrong type: {value!r}")
            # JSON reads Infinity and NaN, which pass "> 0" checks and then poison every step.
            if any(
                isinstance(v, float) and not math.isfinite(v)
                for v in (value if f.name == "betas" else (value,))
            ):
                raise ValueError(f"{f.name} must be a finite number, got {value!r}")

    @classmethod
    def from_arm(cls, name: str, **overrides) -> "TrainConfig":
        """The arm's preset with ``overrides`` applied (any field of TrainConfig)."""
        if "arm" in overrides:
            raise ValueError("the arm is chosen by name (--arm), not overridden")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(
                f"unknown setting {unknown[0]!r} (valid: "
                f"{', '.join(f.name for f in dataclasses.fields(cls))})"
            )
        return cls(arm=name, **{**arm_settings(name), **overrides})

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def questions_needed(self) -> int:
        """Training questions a run of ``steps`` steps reads (it cycles through fewer)."""
        return self.steps * self.questions_per_step


class NonFiniteError(ValueError):
    """Training produced a non-finite loss, gradient norm or weight."""


@dataclass
class StepResult:
    rewards: list[float]
    texts: list[str]
    record: dict = field(default_factory=dict)


class Phases:
    """Wall time per phase of a step, inside ``record_function`` (and NVTX on CUDA) ranges so
    profiler timelines show the same names."""

    def __init__(self, device: torch.device) -> None:
        self.seconds: dict[str, float] = {}
        self.nvtx = device.type == "cuda"

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        with torch.profiler.record_function(name):
            if self.nvtx:
                torch.cuda.nvtx.range_push(name)
            try:
                yield
            finally:
                if self.nvtx:
                    torch.cuda.synchronize()
                    torch.cuda.nvtx.range_pop()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def completion_batch(
    prompt_ids: list[int], completions: list[list[int]], device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt + completion ids [G, W]; completion targets [G, T_max] and their
    mask. Right padding needs no attention mask: causal attention never lets a real token see a
    later pad."""
    width = len(prompt_ids) + max(len(c) for c in completions)
    ids = torch.zeros((len(completions), width), dtype=torch.long)
    for row, completion in enumerate(completions):
        ids[row, : len(prompt_ids) + len(completion)] = torch.tensor(prompt_ids + completion)
    ids = ids.to(device)
    targets = ids[:, len(prompt_ids) :]
    lengths = torch.tensor([len(c) for c in completions], device=device)
    mask = torch.arange(targets.shape[1], device=device)[None, :] < lengths[:, None]
    return ids, targets, mask


def completion_token_nll(
    model, prompt_ids: list[int], completions: list[list[int]]
) -> torch.Tensor:
    """Eager -log pi(y_t) for every completion token: [G, T_max] (0 past each completion's end)."""
    ids, targets, mask = completion_batch(prompt_ids, completions, model.lm_head.weight.device)
    logits = model(ids[:, :-1])[:, len(prompt_ids) - 1 :]
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    return nll.view_as(targets) * mask


def fused_grpo_loss(
    model,
    prompt_ids: list[int],
    completions: list[list[int]],
    token_weights: list[torch.Tensor],
    temperature: float = 1.0,
) -> torch.Tensor:
    """The token-weighted GRPO loss through ``weighted_token_nll``: token t of completion i
    weighted by w_it / G (w_it = A_i on flat steps), from the final hidden states and the LM
    head, no [tokens, vocab] logits. ``temperature`` scores log softmax(logits / temperature)
    (TRL's convention), by scaling the hidden states: (h / T) W^T = (h W^T) / T."""
    device = model.lm_head.weight.device
    if device.type == "cpu":
        # The prompt once and no padding: on a CPU the pass costs what it computes. On CUDA the
        # padded batch keeps SDPA's causal flash path, which an arbitrary mask would leave.
        ids, context, rows, targets = shared_prompt_batch(prompt_ids, completions, device)
        hidden = model.model(ids, context)[0].index_select(0, rows)
    else:
        ids, padded_targets, mask = completion_batch(prompt_ids, completions, device)
        hidden = model(ids[:, :-1], return_hidden=True)[:, len(prompt_ids) - 1 :][mask]
        targets = padded_targets[mask]
    if temperature != 1.0:
        hidden = hidden / temperature
    weights = torch.cat(token_weights).to(hidden.device) / len(completions)
    return weighted_token_nll(hidden, model.lm_head.weight, targets, weights)


def shared_prompt_batch(
    prompt_ids: list[int], completions: list[list[int]], device
) -> tuple[torch.Tensor, ForwardContext, torch.Tensor, torch.Tensor]:
    """One packed row: the prompt once, then each completion but its last token. A completion
    token sees the whole prompt and its own earlier tokens at the positions it has in its own
    sequence, so its hidden state is the one the padded batch computes. Returns ids [1, L], the
    pass's context (positions, mask [1, 1, L, L]), the row of the hidden state that predicts
    each completion token [N] (completion order) and those tokens [N]."""
    prompt_len = len(prompt_ids)
    bodies = [c[:-1] for c in completions]
    ids = torch.tensor([prompt_ids + [t for body in bodies for t in body]], device=device)
    segment = torch.cat(
        [torch.full((prompt_len,), -1)] + [torch.full((len(b),), i) for i, b in enumerate(bodies)]
    ).to(device)
    positions = torch.cat(
        [torch.arange(prompt_len)] + [prompt_len + torch.arange(len(b)) for b in bodies]
    ).to(device)
    order = torch.arange(ids.shape[1], device=device)
    visible = (segment[:, None] == segment[None, :]) | (segment[None, :] == -1)
    mask = (visible & (order[:, None] >= order[None, :]))[None, None]
    rows, start = [], prompt_len
    for body in bodies:
        rows += [prompt_len - 1] + list(range(start, start + len(body)))
        start += len(body)
    targets = torch.tensor([t for c in completions for t in c], device=device)
    return (
        ids,
        ForwardContext(positions[None], mask=mask),
        torch.tensor(rows, device=device),
        targets,
    )


def grpo_loss(token_nll: torch.Tensor, advantages: torch.Tensor, loss_order: str) -> torch.Tensor:
    """-(1/G) sum_i A_i sum_t log pi(y_t): "sum_then_scale" sums each sequence's NLL first (the
    seed's run_baseline), "token_weighted" scales every token's NLL by A_i first (run_experiment)."""
    group = token_nll.shape[0]
    if loss_order == "sum_then_scale":
        return (advantages * token_nll.sum(dim=1)).sum() / group
    return (advantages[:, None] * token_nll).sum() / group


def parallel_grpo_loss(
    model,
    prompt_ids: list[int],
    rollout: ParallelRollout,
    path_weights: list[torch.Tensor],
    summary_weights: list[torch.Tensor],
) -> torch.Tensor:
    """-(1/(paths + summaries)) sum over paths and summaries of sum_t w_t log pi(y_t): the paths
    share the prompt (one batch), each summary has its own prompt (its serialised paths)."""
    paths = len(rollout.paths)
    loss = fused_grpo_loss(model, prompt_ids, rollout.paths, path_weights) * paths
    for prompt, summary, weights in zip(
        rollout.summary_prompts, rollout.summaries, summary_weights
    ):
        loss = loss + fused_grpo_loss(model, prompt, [summary], [weights])
    return loss / (paths + len(rollout.summaries))


def standardised_advantages(
    rewards: list[float], *, scale: bool = True
) -> tuple[torch.Tensor, float]:
    """A_i = (R_i - mean R) / (std R + 1e-4), or R_i - mean R without ``scale``, and std R.
    NaN rewards (no reward function scored the completion) are left out of the mean and std and
    get A_i = 0, as TRL does; fewer than two scored rewards give every A_i = 0."""
    r = torch.tensor(rewards, dtype=torch.float32)
    scored = r[~r.isnan()]
    if scored.numel() < 2:
        return torch.zeros_like(r), 0.0
    mean, sigma = group_stats(scored)
    advantages = r - mean
    if scale:
        advantages = advantages / (sigma + ADVANTAGE_EPS)
    return advantages.nan_to_num(0.0), float(sigma)


def sequence_scales(
    lengths: list[int], loss_type: str, max_new_tokens: int, masked: list[bool] | None = None
) -> torch.Tensor:
    """s_i [G] float32 such that token weights A_i s_i, summed and divided by G (as
    ``fused_grpo_loss`` does), give each loss type's normalisation of sum_t A_i log pi:
    "sum" (the study's) 1; "grpo" 1 / |o_i| (per-sequence mean); "dapo" G / sum_j |o_j| (mean
    over the group's tokens); "dr_grpo" 1 / max_new_tokens. ``masked`` completions (TRL's
    mask_truncated_completions) get 0 and leave dapo's token count."""
    group = len(lengths)
    kept = torch.tensor([not m for m in masked] if masked else [True] * group)
    counts = torch.tensor(lengths, dtype=torch.float32)
    if loss_type == "sum":
        scales = torch.ones(group)
    elif loss_type == "grpo":
        scales = 1.0 / counts.clamp(min=1.0)
    elif loss_type == "dapo":
        scales = torch.full((group,), group / float((counts * kept).sum().clamp(min=1.0)))
    elif loss_type == "dr_grpo":
        scales = torch.full((group,), 1.0 / max_new_tokens)
    else:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    return scales * kept


@dataclass
class Rollouts:
    """One question's completions (leaf order), the work the engine executed for them (for
    questions sampled in one batch, the batch's) and, for a tree step, the tree they came
    from."""

    completions: list[list[int]]
    executed: EngineCounters
    tree: TreeRollout | None = None


@dataclass
class QuestionCredit:
    """One question's graded rollouts and credit: texts, rewards, lengths, sigma_R, the
    per-rollout advantages (flat steps; the sum_then_scale loss reads them) and the per-token
    weights of every completion."""

    texts: list[str]
    rewards: list[float]
    lengths: list[int]
    sigma: float
    advantages: torch.Tensor | None
    token_weights: list[torch.Tensor]


@dataclass
class Update:
    """What ``RLVRTrainer.update`` did: the loss and the gradient norm before clipping (None
    when no backward ran); on multi-question steps, each contributing question's loss and
    gradient norm before unit scaling."""

    loss: float | None = None
    grad_norm: float | None = None
    question_losses: list[float] = field(default_factory=list)
    question_grad_norms: list[float] = field(default_factory=list)


class MathTask:
    """The study's task: a question in the study's prompt template; reward 1 when the last
    boxed answer grades correct against the problem's answer (with the derivation gate: and
    starts at or after ``gate_min_chars`` characters). The trainer asks its task for a step's
    prompt ids and rewards (``rlvr_fast.trl_compat`` supplies TRL's reward functions instead)."""

    def __init__(self, tokenizer, gate_min_chars: int | None) -> None:
        self.tokenizer, self.gate_min_chars = tokenizer, gate_min_chars

    def prompt_ids(self, problem: Problem) -> list[int]:
        return self.tokenizer.encode(render_prompt(problem.question))

    def rewards(
        self, problem: Problem, texts: list[str], completions: list[list[int]]
    ) -> list[float]:
        answers = [final_answer(t, min_chars=self.gate_min_chars) for t in texts]
        return [float(ok) for ok in grade_many(answers, [problem.answer] * len(answers))]


class RLVRTrainer:
    def __init__(
        self,
        policy,
        config: TrainConfig,
        train_data: Sequence[Problem],
        eval_data: dict[str, Sequence[Problem]] | None = None,
        *,
        out_dir: str | os.PathLike | None = None,
        resume: bool = False,
        progress: bool = True,
        profile_steps: int = 0,
        task=None,
    ) -> None:
        if not train_data:
            raise ValueError("train_data is empty")
        if task is not None and config.sampler == "parallel":
            raise ValueError("parallel-path arms vote on graded answers, so they take no task")
        self.policy, self.config = policy, config
        self.task = task or MathTask(policy.tokenizer, config.gate_min_chars)
        distributed.check_questions_per_step(config.questions_per_step)
        self.train_data = list(train_data)
        self.eval_data = {
            check_eval_name(name): problems for name, problems in (eval_data or {}).items()
        }
        # Every prompt fits the model beside its completion, checked before anything is written.
        check_prompt_lengths(
            policy,
            self.train_data,
            [self.task.prompt_ids(p) for p in self.train_data],
            config.max_new_tokens,
        )
        for problems in self.eval_data.values():
            encode_prompts(policy, problems, config.eval_max_new_tokens)
        run_dir = Path(out_dir) if out_dir is not None else None
        # Every rank reads the run directory (to resume); rank 0 alone writes it and prints.
        self.out_dir = run_dir if distributed.is_main() else None
        self.progress = progress and distributed.is_main()
        self.profile_steps = profile_steps
        self.params = [p for p in policy.model.parameters() if p.requires_grad]
        self.num_params = sum(p.numel() for p in self.params)
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
        self.generator = torch.Generator(device=policy.device).manual_seed(config.seed)
        self.sampling = SamplingParams(config.max_new_tokens, config.temperature, config.top_p)
        # One engine, one KV cache, for every rollout and evaluation of the run.
        self.engine = RolloutEngine.for_policy(
            policy, max_batch=config.max_batch, cuda_graphs=config.cuda_graphs
        )
        self.judge = None
        if config.sampler == "parallel" and config.path_utility == "judge":
            own = config.judge_model == "policy"
            self.judge = GenerativeJudge(
                policy if own else config.judge_model,
                engine=self.engine if own else None,
                device=policy.device,
            )
        # Allocated after the engine, so that a device short of memory keeps the KV cache.
        self.polyak = PolyakAverage(policy.model) if config.polyak_start else None
        self.start_step = 0
        self.active_steps = 0
        self.ledger = None
        self.finished_summary = None
        self.eval_before: dict | None = None  # in every checkpoint, for a resumed run's summary
        if run_dir is not None:
            self._open_run_dir(run_dir, resume)
        distributed.broadcast_parameters(policy.model)

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict:
        if self.finished_summary is not None:
            return self.finished_summary
        config = self.config
        summary: dict = {"arm": config.arm}
        if config.eval_before and self.start_step == 0 and self.eval_data:
            self.eval_before = self.run_evals("before")
        if self.eval_before is not None:
            summary["eval_before"] = self.eval_before
        totals: dict[str, float] = {}
        step = self.start_step
        profiler = self._start_profiler()
        with tqdm(
            desc=f"train {config.arm}",
            unit="step",
            disable=not self.progress,
            initial=step,
            total=config.steps,
        ) as bar:
            while step < config.steps and not self.reached_active_steps():
                result = self.run_step(step)
                if not config.allow_nonfinite:
                    self.check_finite(step, result.record)
                if profiler is not None and step + 1 - self.start_step >= self.profile_steps:
                    profiler = self._stop_profiler(profiler)
                for key in (*TOTALLED_FIELDS, *SUMMED_COUNTERS, *FLOP_FIELDS):
                    totals[key] = totals.get(key, 0) + result.record[key]
                for phase, seconds in result.record["seconds"].items():
                    totals[f"seconds_{phase}"] = totals.get(f"seconds_{phase}", 0.0) + seconds
                step += 1
                bar.update()
                if self.polyak is not None and step >= config.polyak_start:
                    self.polyak.add(self.policy.model)
                if self.out_dir is not None and (
                    step % config.checkpoint_every == 0
                    or step == config.steps
                    or self.reached_active_steps()
                ):
                    self.save_checkpoint(step)
        if profiler is not None:
            self._stop_profiler(profiler)
        summary["steps"] = step
        summary["totals_this_run"] = totals
        if self.eval_data:
            summary["eval_after"] = self.run_evals("after")
        if self.out_dir is not None:
            self.policy.save(self.out_dir / "final")
        if self.polyak is not None:
            summary.update(self.finish_polyak())
        if self.out_dir is not None:
            write_json_atomic(self.out_dir / "summary.json", summary)
            self.ledger.close()
        return summary

    def reached_active_steps(self) -> bool:
        return (
            self.config.active_steps is not None and self.active_steps >= self.config.active_steps
        )

    def run_step(self, step: int) -> StepResult:
        """Step ``step`` on its questions: the next ``questions_per_step`` of the training data,
        which the run cycles through."""
        count = self.config.questions_per_step
        problems = [
            self.train_data[(step * count + i) % len(self.train_data)] for i in range(count)
        ]
        if count == 1:
            return self.train_step(step, problems[0])
        return self.multi_question_step(step, problems)

    def train_step(self, step: int, problem: Problem) -> StepResult:
        if self.config.sampler == "parallel":
            return self.parallel_step(step, problem)
        config, model = self.config, self.policy.model
        phase = Phases(self.policy.device)
        prompt_ids = self.task.prompt_ids(problem)
        with phase("rollout"):
            model.eval()
            (rollouts,) = self.sample([prompt_ids], self.tree_step_due())
        with phase("reward"):
            credit = self.question_credit(problem, rollouts)

        def loss_fn():
            if config.loss_order == "sum_then_scale":
                token_nll = completion_token_nll(model, prompt_ids, rollouts.completions)
                return grpo_loss(
                    token_nll, credit.advantages.to(token_nll.device), config.loss_order
                )
            return fused_grpo_loss(
                model,
                prompt_ids,
                rollouts.completions,
                credit.token_weights,
                config.temperature if config.tempered_logprobs else 1.0,
            )

        active = not (credit.sigma == 0 and config.skip_zero_var)
        update = self.update(phase, active, loss_fn)
        record = self.question_record(
            step,
            problem,
            prompt_ids,
            rollouts,
            credit,
            active=active,
            optimizer_step=active or config.zero_var_step == "zero_grad",
            loss=update.loss,
            grad_norm=update.grad_norm,
            seconds=phase.seconds,
            executed=rollouts.executed,
        )
        if self.ledger is not None:
            self.ledger.write(record)
            self._append_rollouts(
                step,
                problem,
                len(prompt_ids),
                credit.texts,
                credit.lengths,
                credit.rewards,
                rollouts.tree,
            )
        return StepResult(rewards=credit.rewards, texts=credit.texts, record=record.to_json())

    def multi_question_step(self, step: int, problems: list[Problem]) -> StepResult:
        """One optimizer step on several questions: their rollouts sampled in one batch, each
        question credited on its own, the unit-normalised average of the contributing
        questions' gradients (``update``), one ledger line with a sub-record per question.
        On several ranks (``rlvr_fast.train.distributed``) each takes its share of the questions,
        with the sampling seeds one process would give them; whether the step is active, and
        the average's divisor, are summed over the ranks."""
        config, model = self.config, self.policy.model
        phase = Phases(self.policy.device)
        bases = [base_seed(self.generator) for _ in problems]
        mine = distributed.shard(len(problems))
        problems, bases = problems[mine], bases[mine]
        prompts = [self.task.prompt_ids(problem) for problem in problems]
        with phase("rollout"):
            model.eval()
            batch = self.sample(prompts, self.tree_step_due(), bases)
        with phase("reward"):
            credits = [self.question_credit(p, r) for p, r in zip(problems, batch)]
        contributing = [q for q, credit in enumerate(credits) if credit.sigma != 0]
        step_contributing = distributed.sum_over_ranks(len(contributing))
        update = self.update(
            phase,
            step_contributing > 0,
            *[
                functools.partial(
                    fused_grpo_loss,
                    model,
                    prompts[q],
                    batch[q].completions,
                    credits[q].token_weights,
                    config.temperature if config.tempered_logprobs else 1.0,
                )
                for q in contributing
            ],
            questions=step_contributing,
        )
        optimizer_step = step_contributing > 0 or config.zero_var_step == "zero_grad"
        losses = dict(zip(contributing, update.question_losses))
        norms = dict(zip(contributing, update.question_grad_norms))
        questions = [
            self.question_record(
                step,
                problem,
                prompt,
                rollouts,
                credit,
                active=q in losses,
                optimizer_step=optimizer_step,
                loss=losses.get(q),
                grad_norm=norms.get(q),
                seconds={},
                executed=EngineCounters(),
            )
            for q, (problem, prompt, rollouts, credit) in enumerate(
                zip(problems, prompts, batch, credits)
            )
        ]
        lines = [
            rollouts_line(
                step,
                problem,
                len(prompt),
                credit.texts,
                credit.lengths,
                credit.rewards,
                rollouts.tree,
            )
            for problem, prompt, rollouts, credit in zip(problems, prompts, batch, credits)
        ]
        questions, lines, executed, loss = distributed.gather_step(
            questions, lines, batch[0].executed, update.loss
        )
        record = multi_question_step_record(
            step=step,
            questions=questions,
            active=step_contributing > 0,
            optimizer_step=optimizer_step,
            executed=executed,
            loss=loss,
            grad_norm=update.grad_norm,
            seconds=phase.seconds,
        )
        if self.ledger is not None:
            self.ledger.write(record)
            self._write_rollouts({"step": step, "questions": lines})
        return StepResult(
            rewards=[r for line in lines for r in line["rewards"]],
            texts=[t for line in lines for t in line["texts"]],
            record=record.to_json(),
        )

    def tree_step_due(self) -> bool:
        """Tree arms sample trees once ``bifurcate_after_active`` steps ran a backward pass."""
        return (
            self.config.sampler == "tree"
            and self.active_steps >= self.config.bifurcate_after_active
        )

    def question_credit(self, problem: Problem, rollouts: Rollouts) -> QuestionCredit:
        """Rewards (the task's: the study's grading with the arm's derivation gate by default)
        and credit of one question's rollouts: the standardised advantage on every token of a
        flat group (scaled per sequence as ``loss_type`` says), TreeRL credit on a tree (its
        continuations centred with ``zero_cont_mass``)."""
        config = self.config
        texts = self.policy.tokenizer.decode_batch(rollouts.completions)
        rewards = self.task.rewards(problem, texts, rollouts.completions)
        lengths = [len(c) for c in rollouts.completions]
        tree = rollouts.tree
        if tree is None:
            advantages, sigma = standardised_advantages(rewards, scale=config.scale_rewards)
            eos = self.policy.tokenizer.eos_token_ids
            truncated = [c[-1] not in eos for c in rollouts.completions]
            scales = sequence_scales(
                lengths,
                config.loss_type,
                config.max_new_tokens,
                truncated if config.mask_truncated else None,
            )
            return QuestionCredit(
                texts,
                rewards,
                lengths,
                sigma,
                advantages,
                [(a * s).expand(n) for a, s, n in zip(advantages, scales, lengths)],
            )
        credit = tree_credit(
            [rewards[2 * k : 2 * k + 2] for k in range(len(tree.pairs))],
            tree.prefix_lens,
            beta=config.beta,
            alpha=config.alpha,
            clamped_prefix=config.clamped_prefix,
        )
        leaf_lengths = [p.lengths for p in tree.pairs]
        if config.zero_cont_mass:
            credit = credit.zero_continuation_mass(leaf_lengths)
        return QuestionCredit(
            texts, rewards, lengths, credit.sigma, None, credit.token_weights(leaf_lengths)
        )

    def question_record(
        self,
        step: int,
        problem: Problem,
        prompt_ids: list[int],
        rollouts: Rollouts,
        credit: QuestionCredit,
        *,
        active: bool,
        optimizer_step: bool,
        loss: float | None,
        grad_norm: float | None,
        seconds: dict[str, float],
        executed: EngineCounters,
    ) -> StepRecord:
        """The ledger record of one question's flat or tree rollouts."""
        common = dict(
            step=step,
            question_id=problem.id,
            rewards=credit.rewards,
            sigma_r=credit.sigma,
            active=active,
            optimizer_step=optimizer_step,
            prompt_len=len(prompt_ids),
            executed=executed,
            max_new_tokens=self.config.max_new_tokens,
            params=self.num_params,
            loss=loss,
            grad_norm=grad_norm,
            seconds=seconds,
        )
        if rollouts.tree is not None:
            return tree_step_record(
                pairs=rollouts.tree.pairs, stage2_gen=rollouts.tree.stage2_generated, **common
            )
        category = PairCategory.FLAT_WARMUP if self.config.sampler == "tree" else PairCategory.FLAT
        return flat_step_record(lengths=credit.lengths, category=category, **common)

    def update(
        self, phase: "Phases", active: bool, *loss_fns, questions: int | None = None
    ) -> Update:
        """Every arm's stepping rule: an active step computes the step's gradient from
        ``loss_fns`` (each runs one forward; one per step, or on a multi-question step one per
        contributing question of the ``questions`` the step has over all ranks,
        ``accumulate_unit_gradients``, summed over the ranks), clips it and takes an AdamW
        step; an inactive one takes a zero-gradient AdamW step or none (``zero_var_step``)."""
        update = Update()
        if active:
            self.policy.model.train()
            if self.config.questions_per_step > 1:
                update = self.accumulate_unit_gradients(phase, loss_fns, questions)
            else:
                (loss_fn,) = loss_fns
                update.loss = self.backward(phase, loss_fn)
            if distributed.world_size() > 1:
                with phase("all_reduce"):
                    distributed.all_reduce_gradients(self.params)
            with phase("optimizer"):
                update.grad_norm = self.clip_gradients()
                self.optimizer.step()
            self.active_steps += 1
        elif self.config.zero_var_step == "zero_grad":
            with phase("optimizer"):
                self.zero_grad_step()
        self.optimizer.zero_grad(set_to_none=True)
        return update

    def backward(self, phase: "Phases", loss_fn) -> float:
        """Forward (``loss_fn``) and backward into the parameters' .grad; the loss."""
        with phase("forward"):
            loss = loss_fn()
        with phase("backward"):
            loss.backward()
        return float(loss.detach())

    def accumulate_unit_gradients(
        self, phase: "Phases", loss_fns, questions: int | None = None
    ) -> Update:
        """p.grad = (1/n) sum_q g_q / |g_q| over the n loss functions (questions), g_q the
        gradient of loss q alone (its own backward) and |g_q| its L2 norm over all parameters; a
        question whose gradient is exactly zero adds nothing. Every question then moves the
        weights as much as any other whatever its length or advantages, and with
        max_grad_norm >= 1 clipping never binds (|average| <= 1). The returned loss is the
        surrogate (1/n) sum_q L_q / |g_q| whose gradient this is. On several ranks n is
        ``questions``, the step's count over all of them, and this is the rank's part of the
        sum (zeros when it has no loss functions)."""
        n = len(loss_fns) if questions is None else questions
        totals = [torch.zeros_like(p) for p in self.params]
        update = Update(loss=0.0)
        for loss_fn in loss_fns:
            loss = self.backward(phase, loss_fn)
            with phase("backward"):
                grads = [p.grad for p in self.params if p.grad is not None]
                norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
                scale = 1.0 / (n * norm) if norm > 0 else 0.0
                for p, total in zip(self.params, totals):
                    if p.grad is not None:
                        total.add_(p.grad, alpha=scale)
                    p.grad = None
            update.loss += scale * loss
            update.question_losses.append(loss)
            update.question_grad_norms.append(norm)
        for p, total in zip(self.params, totals):
            p.grad = total
        return update

    def parallel_step(self, step: int, problem: Problem) -> StepResult:
        """The step of parallel-path arms: R responses of K paths, graded paths and aggregates,
        each path credited, then the loss, stepping and ledger rules of the other arms. Summaries
        are graded without the derivation gate: they condense paths that carry the derivation."""
        config, model, tokenizer = self.config, self.policy.model, self.policy.tokenizer
        phase = Phases(self.policy.device)
        prompt_ids = tokenizer.encode(render_prompt(problem.question))
        with phase("rollout"):
            model.eval()
            rollout = self.sample_parallel(prompt_ids)
        with phase("reward"):
            texts = tokenizer.decode_batch(rollout.paths)
            answers = [final_answer(t, min_chars=config.gate_min_chars) for t in texts]
            correct = grade_many(answers, [problem.answer] * len(answers))
            summary_texts = tokenizer.decode_batch(rollout.summaries) if rollout.summaries else []
            summary_answers = [final_answer(t) for t in summary_texts]
            summary_correct = grade_many(summary_answers, [problem.answer] * len(summary_answers))
        with phase("shapley"):
            credit = self.path_credit(problem, rollout, texts, answers, correct, summary_correct)
        path_weights, summary_weights = credit.token_weights(
            [len(p) for p in rollout.paths], [len(s) for s in rollout.summaries]
        )
        active = not (credit.homogeneous and config.skip_zero_var)
        update = self.update(
            phase,
            active,
            lambda: parallel_grpo_loss(model, prompt_ids, rollout, path_weights, summary_weights),
        )

        rewards = credit.path_returns.tolist()
        lengths = [len(p) for p in rollout.paths]
        stats = ParallelStats(
            paths_per_response=config.num_paths,
            aggregator=config.aggregator,
            path_utility=config.path_utility,
            path_credit=config.path_credit,
            permutations=config.shapley_permutations,
            path_reward_norm=config.path_reward_norm,
            lambda_outcome=config.lambda_outcome,
            lambda_path=config.lambda_path,
            phi=credit.phi,
            phi_se=[float(x) for a in credit.attributions for x in a.se],
            utility_full=[a.full for a in credit.attributions],
            utility_empty=[a.empty for a in credit.attributions],
            r_out=credit.r_out,
            utility_calls=credit.utility_calls,
            summary_prompt_lens=[len(p) for p in rollout.summary_prompts],
            summary_lengths=[len(s) for s in rollout.summaries],
            summary_rewards=credit.summary_returns.tolist(),
        )
        record = parallel_step_record(
            step=step,
            question_id=problem.id,
            rewards=rewards,
            sigma_r=credit.sigma,
            homogeneous=credit.homogeneous,
            active=active,
            optimizer_step=active or config.zero_var_step == "zero_grad",
            prompt_len=len(prompt_ids),
            lengths=lengths,
            parallel=stats,
            executed=rollout.executed,
            max_new_tokens=config.max_new_tokens,
            params=self.num_params,
            loss=update.loss,
            grad_norm=update.grad_norm,
            seconds=phase.seconds,
        )
        if self.ledger is not None:
            self.ledger.write(record)
            details = dict(
                question=problem.question,
                gold=problem.answer,
                paths_per_response=config.num_paths,
                aggregator=config.aggregator,
                path_answers=answers,
                path_correct=[bool(c) for c in correct],
                r_out=credit.r_out,
                phi=credit.phi,
                phi_se=stats.phi_se,
                utility_full=stats.utility_full,
                utility_empty=stats.utility_empty,
                utility_tables=credit.tables,
                summary_texts=summary_texts,
                summary_answers=summary_answers,
                summary_seeds=rollout.summary_seeds,
                path_returns=rewards,
                path_ids=rollout.paths if rollout.summaries else None,
            )
            # As on every arm, the log's rewards are the texts' grades; the returns trained on
            # (the ledger's rewards) sit in the parallel section.
            self._append_rollouts(
                step,
                problem,
                len(prompt_ids),
                texts,
                lengths,
                [float(c) for c in correct],
                None,
                details,
            )
        return StepResult(rewards=rewards, texts=texts, record=record.to_json())

    def path_credit(
        self,
        problem: Problem,
        rollout: ParallelRollout,
        texts: list[str],
        answers: list[str | None],
        correct: list[bool],
        summary_correct: list[bool],
    ) -> ParallelCredit:
        """Each response's utility on its K paths, its outcome reward, and the step's credit."""
        config, k = self.config, self.config.num_paths
        utilities, r_out = [], []
        for r in range(rollout.responses):
            part = slice(r * k, (r + 1) * k)
            if config.path_utility == "judge":
                utilities.append(self.judge.game(problem.question, problem.answer, texts[part]))
            else:
                utilities.append(outcome_utility(config.path_utility, answers[part], correct[part]))
            r_out.append(
                float(summary_correct[r])
                if rollout.summaries
                else MajorityVote(answers[part], correct[part]).value((1 << k) - 1)
            )
        return parallel_credit(
            utilities,
            r_out,
            k,
            method=config.path_credit,
            permutations=config.shapley_permutations,
            antithetic=config.shapley_antithetic,
            generator=self.generator,
            norm=config.path_reward_norm,
            lambda_outcome=config.lambda_outcome,
            lambda_path=config.lambda_path,
            summaries=bool(rollout.summaries),
        )

    def sample_parallel(self, prompt_ids: list[int]) -> ParallelRollout:
        config = self.config
        return sample_parallel(
            self.engine,
            prompt_ids,
            responses=config.group_size,
            paths=config.num_paths,
            params=self.sampling,
            aggregator=config.aggregator,
            encode=self.policy.tokenizer.encode,
            generator=self.generator,
        )

    def sample(
        self, prompts: list[list[int]], tree_step: bool, bases: list[int] | None = None
    ) -> list[Rollouts]:
        """Each prompt's G rollouts (a K x B tree on tree steps), all prompts in one engine
        batch, prompt q from base seed ``bases[q]`` (default: one draw of the run's generator
        per prompt); every ``Rollouts.executed`` is the batch's work."""
        config = self.config
        if tree_step:
            trees = sample_trees_ids(
                self.engine,
                prompts,
                newline_token_ids=self.policy.tokenizer.newline_token_ids,
                k=config.tree_k,
                b=config.tree_b,
                t_min=config.t_min,
                t_max=config.t_max,
                max_new_tokens=config.max_new_tokens,
                early_eos_mode=config.early_eos_mode,
                temperature=config.temperature,
                top_p=config.top_p,
                generator=self.generator,
                bases=bases,
                reprefill=config.tree_reprefill,
            )
            return [Rollouts(tree.leaves, tree.executed, tree) for tree in trees]
        group = config.group_size
        out = sample_groups(
            self.engine, prompts, group, self.sampling, generator=self.generator, bases=bases
        )
        return [
            Rollouts(out.tokens[q * group : (q + 1) * group], out.counters)
            for q in range(len(prompts))
        ]

    def zero_grad_step(self) -> None:
        """One AdamW step with zero gradients. Each step's rollout reads the weights this step
        moves (weight decay and momentum move them even at g = 0), so steps are never deferred
        and folded here; the fused kernel still skips allocating and streaming P zeros."""
        if self.config.fused_zero_grad_step:
            zero_grad_adamw_(self.optimizer, steps=1)
            return
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()

    def _start_profiler(self):
        if not self.profile_steps or self.out_dir is None:
            return None
        profiler = torch.profiler.profile()
        profiler.start()
        return profiler

    def _stop_profiler(self, profiler) -> None:
        profiler.stop()
        profiler.export_chrome_trace(str(self.out_dir / "trace.json"))
        return None

    def clip_gradients(self) -> float:
        """Total gradient norm before clipping (clipping only when max_grad_norm is set)."""
        max_norm = self.config.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm else float("inf"))
        return float(norm)

    def run_evals(self, label: str) -> dict[str, dict]:
        summaries = {}
        for name, problems in self.eval_data.items():
            result: EvalResult = distributed.evaluate_sharded(
                self.policy,
                problems,
                max_new_tokens=self.config.eval_max_new_tokens,
                progress=self.progress,
                desc=f"eval {name} ({label})",
                engine=self.engine,
            )
            summaries[name] = result.summary()
            if self.out_dir is not None:
                # The final evaluation is evals/NAME.jsonl; the others sit beside it.
                directory = self.out_dir / "evals" / EVAL_DIRS[label]
                write_text_atomic(
                    directory / f"{name}.jsonl",
                    "".join(json.dumps(i.to_json()) + "\n" for i in result.items),
                )
        return summaries

    # ------------------------------------------------------------------ run directory
    def _open_run_dir(self, run_dir: Path, resume: bool) -> None:
        """Start the run in ``run_dir``, or resume it there (see ``rlvr_fast.run.directory``):
        from its checkpoint, or from step 0 when it was killed before the first one. On several
        ranks rank 0 (which holds ``self.out_dir``) alone checks, cleans and writes the
        directory; every rank reads the checkpoint and the ledger's active steps."""
        config = json.loads(json.dumps(self.config.to_json()))  # as config.json holds it
        signature = run_signature(config, self.policy, self.train_data, self.eval_data)
        recorded = None
        if self.out_dir is not None:
            recorded = open_run_directory(run_dir, signature, config, self.train_data, resume)
        recorded = distributed.all_gather(recorded)[0]
        checkpoint = run_dir / "checkpoint" / CHECKPOINT_FILE
        if recorded is not None and checkpoint.exists():
            self.start_step = self.load_checkpoint(checkpoint)
        summary = run_dir / "summary.json"
        if recorded is not None and recorded["config"]["steps"] == config["steps"]:
            self.finished_summary = finished_summary(summary)
            if self.finished_summary is not None:
                return
        if self.out_dir is not None:
            whole_lines(self.out_dir / "ledger.jsonl", self.start_step)
            whole_lines(self.out_dir / "rollouts.jsonl", self.start_step)
        self.active_steps = count_active_steps(run_dir / "ledger.jsonl", self.start_step)
        distributed.agree((self.start_step, self.active_steps), "the step to resume from")
        if self.out_dir is None:
            return
        if recorded is None or recorded["config"] != config:
            # summary.json goes first: a kill in between leaves an unfinished run to resume.
            summary.unlink(missing_ok=True)
            write_json_atomic(self.out_dir / "config.json", self.run_meta(signature, recorded))
        self.ledger = LedgerWriter(self.out_dir / "ledger.jsonl")

    def run_meta(self, signature: dict, recorded: dict | None) -> dict:
        """config.json: the run's signature, settings and provenance; a resume that changes a
        setting it may change (an extension) keeps the first start's provenance and lists the
        change."""
        config = json.loads(json.dumps(self.config.to_json()))
        if recorded is None:
            meta = {
                "rlvr_fast_run": signature,
                "config": config,
                "model": str(self.policy.path),
                "trainable_parameters": self.num_params,
                "versions": package_versions(),
                "git_commit": git_commit(),
                "changes": [],
            }
            if distributed.world_size() > 1:
                meta["world_size"] = distributed.world_size()
            return meta
        change = {
            name: [recorded["config"].get(name), config[name]]
            for name in RESUME_MAY_CHANGE
            if recorded["config"].get(name) != config[name]
        }
        return {
            **recorded,
            "rlvr_fast_run": signature,
            "config": config,
            "changes": [*recorded.get("changes", []), {"at_step": self.start_step, **change}],
        }

    def _append_rollouts(
        self, step, problem, prompt_len, texts, lengths, rewards, tree, parallel: dict | None = None
    ) -> None:
        self._write_rollouts(
            rollouts_line(step, problem, prompt_len, texts, lengths, rewards, tree, parallel)
        )

    def _write_rollouts(self, line: dict) -> None:
        append_line(self.out_dir / "rollouts.jsonl", json.dumps(line))

    def finish_polyak(self) -> dict:
        """The Polyak average's summary entries: the steps it spans and, when it holds any (an
        ``active_steps`` run can end first), its evaluation (evals/polyak/) and final_polyak/.
        The averaged weights are swapped in for that and the live ones swapped back after."""
        info = {
            "polyak": {"first_step": self.config.polyak_start, "steps_averaged": self.polyak.count}
        }
        if self.polyak.count == 0:
            return info
        model = self.policy.model
        live = {name: p.detach().to("cpu", copy=True) for name, p in trainable(model).items()}
        model.load_state_dict(self.polyak.average(), strict=False)
        try:
            if self.eval_data:
                info["eval_polyak"] = self.run_evals("polyak")
            if self.out_dir is not None:
                self.policy.save(self.out_dir / "final_polyak")
        finally:
            model.load_state_dict(live, strict=False)
        return info

    def save_checkpoint(self, next_step: int) -> None:
        """Weights, optimizer and RNG state after ``next_step`` steps, in one safetensors file
        written atomically (``rlvr_fast.run.state_file``: no pickle), with the world size, the Polyak
        sums and the before-training evaluation's summary."""
        save_state(
            self.out_dir / "checkpoint" / CHECKPOINT_FILE,
            {
                "next_step": next_step,
                "world_size": distributed.world_size(),
                "model": self.policy.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(),
                "torch_rng": torch.get_rng_state(),
                "polyak": self.polyak.state_dict() if self.polyak is not None else None,
                "eval_before": self.eval_before,
            },
        )

    def load_checkpoint(self, path: Path) -> int:
        """Restore a checkpoint of this run; returns the step to continue from. The file is
        checked against the run (step range, parameter names and shapes) before anything is
        restored, so that a damaged or foreign file fails here, not steps later."""
        # State files load onto the CPU: Generator.set_state and torch.set_rng_state take CPU
        # byte tensors (a CUDA generator's state too); load_state_dict copies weights and
        # moments onto the parameters' device.
        state = load_state(path)
        distributed.check_world_size(state.get("world_size", 1), path)
        try:
            next_step = state["next_step"]
            if (
                isinstance(next_step, bool)
                or not isinstance(next_step, int)
                or not 0 <= next_step <= self.config.steps
            ):
                raise ValueError(f"next_step {next_step!r} is outside [0, {self.config.steps}]")
            check_optimizer_state(state["optimizer"], self.params)
            self.policy.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.generator.set_state(state["generator"])
            torch.set_rng_state(state["torch_rng"])
            if self.polyak is not None:
                self.polyak.load_state_dict(state["polyak"])
            if state["eval_before"] is not None and not isinstance(state["eval_before"], dict):
                raise ValueError("eval_before is not a mapping")
            self.eval_before = state["eval_before"]
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as err:
            message = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
            raise StateFileError(f"{path}: not a checkpoint of this run ({message})") from None
        return next_step

    def check_finite(self, step: int, record: dict) -> None:
        """Stop at the first step whose loss, gradient norm or weights are not finite, before
        it is checkpointed: the last checkpoint stays the last good state."""
        bad = [
            f"{name} {record[name]}"
            for name in ("loss", "grad_norm")
            if record.get(name) is not None and not math.isfinite(record[name])
        ]
        finite = torch.stack([p.detach().isfinite().all() for p in self.params]).all()
        if not bad and bool(finite):
            return
        if not bool(finite):
            bad.append(
                "weight "
                + next(
                    name
                    for name, p in self.policy.model.named_parameters()
                    if not p.detach().isfinite().all()
                )
            )
        checkpoint = None if self.out_dir is None else self.out_dir / "checkpoint" / CHECKPOINT_FILE
        kept = (
            ""
            if checkpoint is None
            else (
                f"; {checkpoint} keeps the last good state"
                if checkpoint.exists()
                else "; no checkpoint was written yet"
            )
        )
        raise NonFiniteError(
            f"step {step}: non-finite {', '.join(bad)} (lr "
            f"{self.config.lr:g}){kept}; --set allow_nonfinite=true trains on"
        )


def check_optimizer_state(state: dict, params: list[torch.Tensor]) -> None:
    """AdamW moments of the checkpoint have the shapes of the run's parameters (torch's
    load_state_dict checks only the number of parameters, and a wrong shape would fail at the
    next optimizer step)."""
    moments = state["state"]
    if not isinstance(moments, dict):
        raise ValueError("optimizer state is not a mapping")
    for index, entry in moments.items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise ValueError(f"optimizer state for parameter {index!r}, the run has {len(params)}")
        for name in ("exp_avg", "exp_avg_sq"):
            tensor = entry[name]
            if not isinstance(tensor, torch.Tensor) or tensor.shape != params[index].shape:
                raise ValueError(f"optimizer {name} of parameter {index} has the wrong shape")


def rollouts_line(
    step, problem, prompt_len, texts, lengths, rewards, tree, parallel: dict | None = None
) -> dict:
    """What ``rlvr-fast verify`` re-derives a question's ledger record from: the answer to
    re-grade the texts against, the prompt length, and on tree steps what the sampler reported
    per pair (|p^(k)| is not in the texts: Stage 1's discarded tail is); on parallel-path steps
    the paths, votes and credit of ``parallel_step``. A multi-question step's line holds one per
    question under "questions"."""
    line = {
        "step": step,
        "question_id": problem.id,
        "answer": problem.answer,
        "prompt_len": prompt_len,
        "texts": texts,
        "lengths": lengths,
        "rewards": rewards,
    }
    if tree is not None:
        line.update(
            prefix_lens=tree.prefix_lens,
            categories=[p.category for p in tree.pairs],
            stage1_lengths=[p.stage1_len for p in tree.pairs],
            stage2_gen=tree.stage2_generated,
        )
    if parallel is not None:
        line["parallel"] = parallel
    return line


def finished_summary(path: Path) -> dict | None:
    """summary.json of a finished run; None when there is none, or one that does not parse (the
    run then finishes again from its last checkpoint and writes it anew)."""
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return summary if isinstance(summary, dict) else None


def count_active_steps(ledger: Path, steps: int) -> int:
    """Steps among the first ``steps`` whole ledger lines that ran a backward pass (tree arms
    bifurcate after a number of them)."""
    if not ledger.exists():
        return 0
    with open(ledger, encoding="utf-8") as file:
        lines = [line for line in file if line.endswith("\n") and line.strip()][:steps]
    return sum(json.loads(line).get("active") is True for line in lines)


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("rlvr_fast", "torch", "triton", "transformers", "tokenizers", "safetensors"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            continue
    return versions


def git_commit() -> str | None:
    import subprocess

    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
