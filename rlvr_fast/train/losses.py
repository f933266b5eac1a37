"""The GRPO losses, -(1/G) sum_i sum_t w_it log pi(y_t | x, y_<t), and what they need.

- ``study_loss``: the study's sum in either loss order of its registry records
  (``rlvr_fast.ops.loss_types``: token-weighted, or each sequence's NLL summed first, the seed's
  run_baseline, arm 1), and ``fused_grpo_loss``, the token-weighted one: through the fused
  ``weighted_token_nll`` op from the final hidden states and the LM head, never forming
  [tokens, vocab] logits; on the CPU the prompt is packed once with every completion
  (``shared_prompt_batch``);
- ``grpo_loss`` on eager per-token NLLs (``completion_token_nll``), both orders: the eager
  reference the fused losses are tested against;
- ``policy_loss`` (TRL's loss types, ``rlvr_fast.ops.loss_types``): through the fused
  ``fused_policy_loss`` op, with clipping against old log-probabilities, the KL term against a
  reference model's and each token's entropy from the same pass; ``completion_logprobs``, the
  log-probabilities of a model (the reference, or the policy before a generation's updates)
  without gradients;
- ``parallel_grpo_loss``: parallel-path steps, paths and summaries together;
- ``sequence_scales``: the per-sequence normalisers of the study's sum type.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlvr_fast.models.context import ForwardContext
from rlvr_fast.ops.loss_types import LossType, loss_type
from rlvr_fast.ops.policy_loss import (
    PolicyLossSettings,
    PolicyLossStats,
    fused_policy_loss,
    fused_token_logprobs,
)
from rlvr_fast.rollouts.parallel import ParallelRollout

TOKEN_WEIGHTED = loss_type("sum", order="token_weighted")


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


def study_loss(
    model,
    prompt_ids: list[int],
    completions: list[list[int]],
    loss: LossType,
    advantages: torch.Tensor | None,
    token_weights: list[torch.Tensor] | None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The study's sum of one group in the order of its registry record (``loss.study_loss``:
    sum_then_scale reads the advantages [G], token_weighted the per-token weights), from the
    final hidden states and the LM head through ``weighted_token_nll``, no [tokens, vocab]
    logits. ``temperature`` scores log softmax(logits / temperature) (TRL's convention), by
    scaling the hidden states: (h / T) W^T = (h W^T) / T."""
    hidden, targets = completion_hidden(model, prompt_ids, completions)
    if temperature != 1.0:
        hidden = hidden / temperature
    lengths = [len(c) for c in completions]
    return loss.study_loss(
        hidden, model.lm_head.weight, targets, advantages, token_weights, lengths
    )


def fused_grpo_loss(
    model,
    prompt_ids: list[int],
    completions: list[list[int]],
    token_weights: list[torch.Tensor],
    temperature: float = 1.0,
) -> torch.Tensor:
    """The token-weighted loss (``study_loss`` in order token_weighted): token t of completion i
    weighted by w_it / G (w_it = A_i on flat steps)."""
    return study_loss(
        model, prompt_ids, completions, TOKEN_WEIGHTED, None, token_weights, temperature
    )


def policy_loss(
    model,
    prompt_ids: list[int],
    completions: list[list[int]],
    advantages: torch.Tensor,
    settings: PolicyLossSettings,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    temperature: float = 1.0,
    masks: list[list[int]] | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """TRL's loss of one group (``fused_policy_loss``): ``completions`` (an empty one stands for a
    completion masked out of the loss, which TRL still counts as a sequence), their
    ``advantages`` [G], the old and reference log-probabilities of their scored tokens [N]
    (None: the current ones, detached; none). ``masks``: per completion, 1 on the tokens the
    loss scores and 0 on those it only reads (a tool's result in a conversation; TRL's
    tool_mask); None: every token scored."""
    lengths = scored_lengths(completions, masks)
    if not any(lengths):
        # Every completion masked out (a step's share of truncated ones): TRL's loss is 0, its
        # gradient zero.
        empty = torch.zeros(0, device=model.lm_head.weight.device)
        return model.lm_head.weight.sum() * 0.0, PolicyLossStats(empty, empty, empty, empty)
    hidden, targets = scored_hidden(model, prompt_ids, completions, masks)
    return fused_policy_loss(
        hidden,
        model.lm_head.weight,
        targets,
        old_logprobs,
        advantages.to(hidden.device),
        lengths,
        settings,
        ref_logprobs=ref_logprobs,
        temperature=temperature,
    )


def scored_lengths(completions: list[list[int]], masks: list[list[int]] | None) -> list[int]:
    """Each completion's count of scored tokens (all of them without ``masks``)."""
    if masks is None:
        return [len(c) for c in completions]
    return [sum(m) for m in masks]


def scored_hidden(
    model, prompt_ids: list[int], completions: list[list[int]], masks: list[list[int]] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``completion_hidden`` of the non-empty ``completions``, kept at their scored tokens: a
    masked token is read as context by the pass and left out of what it scores."""
    hidden, targets = completion_hidden(model, prompt_ids, [c for c in completions if c])
    if masks is None:
        return hidden, targets
    keep = torch.tensor([bool(m) for mask in masks for m in mask], device=hidden.device)
    return hidden[keep], targets[keep]


def completion_logprobs(
    model,
    prompt_ids: list[int],
    completions: list[list[int]],
    temperature: float = 1.0,
    masks: list[list[int]] | None = None,
) -> torch.Tensor:
    """log pi(y_t) [N] at ``temperature`` of every scored token (``masks``, as ``policy_loss``
    reads them) of the non-empty ``completions``, from ``model`` without gradients (fused, no
    [tokens, vocab] logits)."""
    return completion_stats(model, prompt_ids, completions, temperature, masks).logprobs


def completion_stats(
    model,
    prompt_ids: list[int],
    completions: list[list[int]],
    temperature: float = 1.0,
    masks: list[list[int]] | None = None,
) -> PolicyLossStats:
    """The fused pass's per-token figures [N] (log p and entropy at ``temperature``, ratio ones,
    kl zeros) of every scored token of the non-empty ``completions``, without gradients."""
    if not any(scored_lengths(completions, masks)):  # nothing scored: no tokens, no pass
        none = torch.zeros(0, device=model.lm_head.weight.device)
        return PolicyLossStats(none, none, none, none)
    with torch.no_grad():
        hidden, targets = scored_hidden(model, prompt_ids, completions, masks)
        return fused_token_logprobs(hidden, model.lm_head.weight, targets, temperature=temperature)


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


def sequence_scales(lengths: list[int], masked: list[bool] | None = None) -> torch.Tensor:
    """s_i [G] float32 of the study's sum type: token weights A_i s_i, summed and divided by G
    (as ``fused_grpo_loss`` does), give -(1/G) sum_i A_i sum_t log pi; ``masked`` completions
    (TRL's mask_truncated_completions) get 0."""
    return torch.tensor([not m for m in masked] if masked else [True] * len(lengths)).float()
