"""TreeRL credit for a two-stage K x B tree (seed §4.3), as per-token loss weights.

Pair k shares a prefix of tau_k tokens (``prefix_lens[k]``) across its B leaves; leaf (k, b)
earned reward R_kb. With R̄ and sigma_R the mean and the Bessel-corrected std of all K*B
rewards (``group_stats``, the same float32 ``torch.std`` the flat trainer standardises with):

    V̂_k = mean_b R_kb,   M_k = max_b R_kb,   Ṽ_k = (1 - beta) V̂_k + beta M_k
    prefix tokens (t <= tau_k):       A_prefix(k)   = (Ṽ_k - R̄) / (sigma_R + eps)
    continuation tokens (t > tau_k):  A_cont(k, b)  = ((1 - alpha)(R_kb - R̄) + alpha (R_kb - V̂_k))
                                                      / (sigma_R + eps)
    pairs with tau_k = 0:             leaf credit (R_kb - R̄) / (sigma_R + eps) on every token.

Defaults: beta = 0 (TreeRL's descendant mean), alpha = 0.5, eps = 1e-4. Everything is computed
in float32 torch, like ``rlvr_fast.credit.group``, so a tree whose pairs all have
tau_k = 0 gets exactly the flat trainer's advantages (which could itself call ``group_stats``).

``clamped_prefix`` is the seed's Proposition 3 ablation (--clamped-prefix). The seed states it
only for one divergent pair; we read it as: on a pair whose rewards differ (min_b R_kb < M_k)
and tau_k > 0, each winning leaf (R_kb = M_k) keeps its own leaf credit (R_kb - R̄)/(sigma_R+eps)
on its copy of the prefix, and each losing leaf gets max(0, A_prefix(k)) there. Pairs whose
rewards agree, and tau_k = 0 pairs, are unchanged. Prefix weights are therefore per leaf, equal
within a pair unless clamping splits them.

Zero continuation signed-token mass (``TreeCredit.zero_continuation_mass``, the ``zero_cont_mass``
ablation; the study cites it [10] without a formula). Our reading: the continuation tokens of a
group are every token after its leaf's shared prefix (t > tau_k; all tokens of a tau_k = 0
pair, whose leaf credit sits on its continuation weight; none of a terminal_dup pair). With
n_kb = L_kb - tau_k such tokens on leaf (k, b), their signed mass is
S = sum_kb n_kb A_cont(k, b). Centering shifts every continuation weight by the same amount, the
token-count-weighted mean of the continuation weights:

    A'_cont(k, b) = A_cont(k, b) - S / N,    N = sum_kb n_kb,

so that sum_kb n_kb A'_cont(k, b) = 0. Prefix weights are unchanged. Sequence-summed GRPO gives
every token of a leaf the same weight, so sum_i A_i = 0 still leaves sum_i L_i A_i != 0 when
right and wrong leaves differ in length; the shift removes that net push on sequence length
from the continuations, the part of the tree that is not shared. A group with no continuation
tokens (N = 0) is left as it is.

    credit = tree_credit([[1, 0], [1, 1], [0, 0], [1, 0]], prefix_lens=[120, 98, 4, 0], beta=0.25)
    weights = credit.token_weights([[300, 140], [512, 200], [4, 4], [7, 90]])  # 8 tensors
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from rlvr_fast.credit.group import ADVANTAGE_EPS, group_stats


@dataclass(frozen=True)
class TreeCredit:
    """Per-leaf credit of one tree, leaves indexed [k, b].

    prefix: [K, B] float32, the weight of each prefix token of leaf (k, b).
    continuation: [K, B] float32, the weight of each token after the prefix.
    prefix_lens: tau_k per pair; for tau_k = 0 both weights hold the leaf credit.
    r_mean, sigma: R̄ and sigma_R of the K*B rewards.
    """

    prefix: torch.Tensor
    continuation: torch.Tensor
    prefix_lens: tuple[int, ...]
    r_mean: float
    sigma: float

    def zero_continuation_mass(self, leaf_lengths: Sequence[Sequence[int]]) -> "TreeCredit":
        """This credit with every continuation weight shifted by S / N (module docstring), so
        that the continuation tokens of leaves of ``leaf_lengths`` [K][B] carry zero signed
        mass; unchanged when there are no continuation tokens."""
        self._check_lengths(leaf_lengths)
        counts = torch.tensor(
            [[length - tau for length in row] for row, tau in zip(leaf_lengths, self.prefix_lens)],
            dtype=torch.float32,
        )  # n_kb, [K, B]
        total = counts.sum()
        if total == 0:
            return self
        shift = (counts * self.continuation).sum() / total
        return dataclasses.replace(self, continuation=self.continuation - shift)

    def token_weights(self, leaf_lengths: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """One 1-D float32 tensor per leaf, k-major (leaf k*B + b): the prefix weight on the
        first tau_k tokens, the continuation weight on the other L_kb - tau_k. A leaf always
        contains its prefix, so L_kb >= tau_k; L_kb = tau_k (a terminal_dup pair) leaves an
        empty continuation."""
        self._check_lengths(leaf_lengths)
        return [
            torch.cat([self.prefix[k, b].expand(tau), self.continuation[k, b].expand(length - tau)])
            for k, (row, tau) in enumerate(zip(leaf_lengths, self.prefix_lens))
            for b, length in enumerate(row)
        ]

    def _check_lengths(self, leaf_lengths: Sequence[Sequence[int]]) -> None:
        pairs, branches = self.prefix.shape
        if len(leaf_lengths) != pairs or any(len(row) != branches for row in leaf_lengths):
            raise ValueError(
                f"leaf_lengths must be [K={pairs}][B={branches}], got "
                f"{[len(row) for row in leaf_lengths]}"
            )
        for k, (row, tau) in enumerate(zip(leaf_lengths, self.prefix_lens)):
            for b, length in enumerate(row):
                if not isinstance(length, int) or length < tau:
                    raise ValueError(
                        f"leaf ({k}, {b}) has length {length!r}, shorter than its "
                        f"prefix of {tau} tokens"
                    )


def tree_credit(
    rewards: Sequence[Sequence[float]] | torch.Tensor,
    prefix_lens: Sequence[int],
    *,
    beta: float = 0.0,
    alpha: float = 0.5,
    eps: float = ADVANTAGE_EPS,
    clamped_prefix: bool = False,
) -> TreeCredit:
    """TreeRL credit of a K x B tree: rewards [K][B] (K, B >= 1, K*B >= 2), prefix_lens [K]
    (tau_k >= 0, 0 for a pair that shares nothing), beta and alpha in [0, 1], eps > 0."""
    r = _reward_grid(rewards)
    pairs, branches = r.shape
    if len(prefix_lens) != pairs:
        raise ValueError(
            f"prefix_lens must have one entry per pair ({pairs}), got {len(prefix_lens)}"
        )
    if any(not isinstance(tau, int) or isinstance(tau, bool) or tau < 0 for tau in prefix_lens):
        raise ValueError(f"prefix_lens must be integers >= 0, got {list(prefix_lens)}")
    for name, value in (("beta", beta), ("alpha", alpha)):
        if not 0 <= value <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")

    r_mean, sigma = group_stats(r)
    scale = sigma + eps
    leaf = (r - r_mean) / scale  # [K, B]
    descendant_mean = r.mean(dim=1, keepdim=True)  # V̂_k, [K, 1]
    best = r.max(dim=1, keepdim=True).values  # M_k, [K, 1]
    value = (1 - beta) * descendant_mean + beta * best  # Ṽ_k, [K, 1]
    prefix = ((value - r_mean) / scale).expand(pairs, branches)
    continuation = ((1 - alpha) * (r - r_mean) + alpha * (r - descendant_mean)) / scale
    if clamped_prefix:
        divergent = r.min(dim=1, keepdim=True).values < best
        winner = r == best
        clamped = torch.where(winner, leaf, prefix.clamp(min=0))
        prefix = torch.where(divergent, clamped, prefix)
    shares = torch.tensor([tau > 0 for tau in prefix_lens])[:, None]
    return TreeCredit(
        prefix=torch.where(shares, prefix, leaf),
        continuation=torch.where(shares, continuation, leaf),
        prefix_lens=tuple(prefix_lens),
        r_mean=float(r_mean),
        sigma=float(sigma),
    )


def _reward_grid(rewards) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor):
        rows = list(rewards)
        if not rows or any(len(row) != len(rows[0]) for row in rows):
            raise ValueError(
                f"rewards must be a non-empty [K][B] grid, got row lengths "
                f"{[len(row) for row in rows]}"
            )
        rewards = torch.tensor([[float(x) for x in row] for row in rows])
    r = rewards.to(torch.float32)
    if r.dim() != 2 or r.shape[0] < 1 or r.shape[1] < 1 or r.numel() < 2:
        raise ValueError(
            f"rewards must be [K][B] with K, B >= 1 and K*B >= 2, got shape {tuple(r.shape)}"
        )
    if not torch.isfinite(r).all():
        raise ValueError("rewards must be finite")
    return r
