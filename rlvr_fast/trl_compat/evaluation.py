"""TRL's evaluation of ``eval_dataset``: every eval prompt once, in TRL's order (a permutation
from a generator seeded with ``seed``, the same at every evaluation), ``num_generations_eval``
completions each, sampled as in training on the run's engine, in batches of
per_device_eval_batch_size x world size completions; scored by the reward functions. Metrics
carry TRL's names with the ``eval_`` prefix: eval_loss (the batches' mean of TRL's loss at ratio
1, with its KL term), eval_entropy (TRL's loss types), eval_runtime, eval_samples_per_second, eval_steps_per_second and the training metrics of
``rlvr_fast.trl_compat.reporting`` (means over the batches). Evaluation draws from a generator
of its own (seeded with ``seed`` and the step), so it leaves the training's sampling unchanged.
"""

from __future__ import annotations

import time

import torch

from rlvr_fast.credit.group import scored_std
from rlvr_fast.engine import EngineCounters, SamplingParams
from rlvr_fast.rollouts.generation import sample_groups
from rlvr_fast.rollouts.turns import sample_turns
from rlvr_fast.train.kinds import Question
from rlvr_fast.train.kinds.flat import Rollouts
from rlvr_fast.trl_compat.reporting import step_metrics, window_means


def batch_loss(rlvr, batch, prompts, completions, texts, groups, masks=None) -> dict:
    """TRL's eval loss of one batch (its compute_loss without gradients, at ratio 1: each
    prompt's loss through the run's kind, pooled over the batch as a training step pools them)
    and the policy figures, as a ledger record holds them; the study's sum type: no loss (the
    metrics compute its surrogate)."""
    kind, config = rlvr.kind, rlvr.config
    if not config.loss.fused:
        return {"loss": None}
    rewards = [g.rewards.tolist() for g in groups]
    step_std = scored_std([r for q in rewards for r in q])
    questions = []
    masks = masks or [None] * len(batch)
    for problem, ids, tokens, text, reward, mask in zip(
        batch, prompts, completions, texts, rewards, masks
    ):
        question = Question(problem, ids, Rollouts(tokens, EngineCounters(), masks=mask))
        batch_std = step_std if config.advantage_std == "batch" else None
        question.credit = kind.question_credit(question, text, reward, batch_std)
        if kind.reference is not None:
            kind.add_reference_logprobs(question)
        questions.append(question)
    counts = [kind.loss_count(q) for q in questions]
    # Sharded: through the engine's full copy (the same weights, no communication).
    with torch.no_grad(), rlvr.policy.full_copy_passes():
        losses = [float(kind.loss(q)) for q in questions]
    loss = sum(c * v for c, v in zip(counts, losses)) / max(sum(counts), 1)
    figures = kind.figures(questions)
    figures.pop("entropy_coef", None)  # TRL logs the coefficient at training steps only
    return {"loss": loss, "policy": figures}


def sample_batch(trainer, task, prompts, group: int, sampling, generator):
    """A batch's groups, as conversations when the run has tools (``task.turns``)."""
    engine, turns = trainer.trainer.engine, task.turns
    if turns is None:
        return sample_groups(engine, prompts, group, sampling, generator=generator)
    out = sample_turns(
        engine,
        prompts,
        group,
        sampling,
        turns.begin(prompts, group),
        max_rounds=turns.max_rounds,
        max_completion_tokens=sampling.max_new_tokens,
        generator=generator,
    )
    turns.end(out)
    return out


def eval_order(rows: int, seed: int) -> list[int]:
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed)).tolist()


def evaluate_dataset(
    trainer, task, rows: int, prefix: str = "eval", step: int = 0
) -> dict[str, float]:
    """``prefix``_* metrics of one evaluation of ``task``'s ``rows`` prompts (module docstring)."""
    args, policy, config = trainer.args, trainer.policy, trainer.trainer.config
    group = args.num_generations_eval or args.num_generations
    per_batch = max(1, args.per_device_eval_batch_size * args.world_size // group)
    sampling = SamplingParams(
        config.max_new_tokens, config.temperature, config.top_p, **config.sampler_options
    )
    generator = torch.Generator(device=policy.device).manual_seed(args.seed + step)
    problems = task.problems()
    order = eval_order(rows, args.seed)
    started, batches, losses, metrics = time.perf_counter(), 0, [], {}
    policy.model.eval()
    eos = set(policy.tokenizer.eos_token_ids) | {policy.tokenizer.pad_token_id}
    for start in range(0, rows, per_batch):
        batch = [problems[i] for i in order[start : start + per_batch]]
        prompts = [task.prompt_ids(p) for p in batch]
        out = sample_batch(trainer, task, prompts, group, sampling, generator)
        completions = [out.tokens[q * group : (q + 1) * group] for q in range(len(batch))]
        masks = None
        if task.turns is not None:
            masks = [out.masks[q * group : (q + 1) * group] for q in range(len(batch))]
        texts = [policy.tokenizer.decode_batch(c) for c in completions]
        task.rewards(batch, texts, completions)
        values = step_metrics(
            task.groups,
            config,
            eos,
            trainer.reward_func_names,
            trainer.state.num_input_tokens_seen,
            batch_loss(trainer.trainer, batch, prompts, completions, texts, task.groups, masks),
        )
        if task.turns is not None:
            values.update(task.tool_metrics)
        losses.append(values.pop("loss"))
        for name, value in values.items():
            metrics.setdefault(name, []).append(value)
        batches += 1
    runtime = time.perf_counter() - started
    logs = {f"{prefix}_{name}": value for name, value in window_means(metrics).items()}
    logs[f"{prefix}_loss"] = sum(losses) / len(losses)
    logs[f"{prefix}_runtime"] = round(runtime, 4)
    logs[f"{prefix}_samples_per_second"] = round(rows * group / runtime, 3)
    logs[f"{prefix}_steps_per_second"] = round(batches / runtime, 3)
    return logs
