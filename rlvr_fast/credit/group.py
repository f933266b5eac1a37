"""Group advantages of flat GRPO (seed §1): A_i = (R_i - mean R) / (std R + 1e-4), std with
Bessel's correction as ``torch.std`` computes it in the seed's code, in float32. Tree credit
(``rlvr_fast.credit.tree``) and path credit standardise with the same statistics."""

from __future__ import annotations

import torch

ADVANTAGE_EPS = 1e-4


def group_stats(rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and Bessel-corrected std (``torch.std``'s default) of all rewards, float32 scalars."""
    flat = rewards.to(torch.float32).flatten()
    if flat.numel() < 2:
        raise ValueError(f"need at least 2 rewards for a Bessel-corrected std, got {flat.numel()}")
    return flat.mean(), flat.std()


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
