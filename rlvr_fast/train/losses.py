"""The GRPO losses, -(1/G) sum_i sum_t w_it log pi(y_t | x, y_<t), and what they need.

- ``fused_grpo_loss`` (token-weighted) and ``fused_sum_then_scale_loss`` (each sequence's NLL
  summed first: the seed's run_baseline, arm 1): through the fused ``weighted_token_nll`` op from
  the final hidden states and the LM head, never forming [tokens, vocab] logits; on the CPU the
  prompt is packed once with every completion (``shared_prompt_batch``);
- ``grpo_loss`` on eager per-token NLLs (``completion_token_nll``), both orders: the eager
  reference the fused losses are tested against;
- ``parallel_grpo_loss``: parallel-path steps, paths and summaries together;
- ``sequence_scales``: the per-sequence normalisers of ``loss_type`` (the study's sum and TRL's
  grpo, dapo and dr_grpo).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlvr_fast.models.context import ForwardContext
from rlvr_fast.ops import weighted_token_nll
from rlvr_fast.rollouts.parallel import ParallelRollout

LOSS_ORDERS = ("sum_then_scale", "token_weighted")
# Per-sequence normalisers of the token-weighted loss (``sequence_scales``): the study's sum and
# TRL's grpo, dapo and dr_grpo.
LOSS_TYPES = ("sum", "grpo", "dapo", "dr_grpo")


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
    hidden, targets = completion_hidden(model, prompt_ids, completions)
    if temperature != 1.0:
        hidden = hidden / temperature
    weights = torch.cat(token_weights).to(hidden.device) / len(completions)
    return weighted_token_nll(hidden, model.lm_head.weight, targets, weights)


def fused_sum_then_scale_loss(
    model, prompt_ids: list[int], completions: list[list[int]], advantages: torch.Tensor
) -> torch.Tensor:
    """Arm 1's loss, -(1/G) sum_i A_i (sum_t log pi(y_it)), in the seed's order (each
    completion's NLL summed, then scaled by its advantage, summed and divided by G) through
    ``weighted_token_nll``: no [tokens, vocab] logits."""
    hidden, targets = completion_hidden(model, prompt_ids, completions)
    loss = weighted_token_nll(
        hidden,
        model.lm_head.weight,
        targets,
        advantages.to(hidden.device),
        sequence_lengths=[len(c) for c in completions],
    )
    return loss / len(completions)


def completion_hidden(
    model, prompt_ids: list[int], completions: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The final hidden state that predicts each completion token [N, H] and those tokens [N],
    completion after completion."""
    device = model.lm_head.weight.device
    if device.type == "cpu":
        # The prompt once and no padding: on a CPU the pass costs what it computes. On CUDA the
        # padded batch keeps SDPA's causal flash path, which an arbitrary mask would leave.
        ids, context, rows, targets = shared_prompt_batch(prompt_ids, completions, device)
        return model.model(ids, context)[0].index_select(0, rows), targets
    ids, padded_targets, mask = completion_batch(prompt_ids, completions, device)
    hidden = model(ids[:, :-1], return_hidden=True)[:, len(prompt_ids) - 1 :][mask]
    return hidden, padded_targets[mask]


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
