"""The study's training arms as presets: one table of settings, no per-arm code paths.

Flags follow the seed's names (grpo_diagnostics_paper.md, Table 1):
- ``loss_order``: "sum_then_scale" computes -A_i * (sum_t log p) per sequence, as the seed's
  run_baseline does; "token_weighted" multiplies each token's NLL by A_i before summing, as its
  run_experiment (compute_weighted_logprob) does. The two differ only by float rounding.
- ``skip_zero_var``: homogeneous groups (sigma_R = 0, so every A_i = 0) skip the backward pass.
- ``zero_var_step``: on such a skipped group, "zero_grad" still takes an AdamW step with zero
  gradients (moments decay, bias corrections and weight decay advance; --zero-var-momentum-step),
  "skip" takes no optimizer step at all.
- ``gate_min_chars``: reward only responses whose last ``\\boxed`` starts at or after this many
  characters (the 30-character pre-boxed derivation gate), None for the ungated reward.
- ``sampler``: "flat" (G independent rollouts) or "tree" (two-stage K x B, seed §4.2) once
  ``bifurcate_after_active`` steps with a backward pass have run (the seed's 3 warmup steps);
  ``early_eos_mode`` picks the branching rule (``--early-eos-mode``; "midpoint" is the seed's
  run without ``--strict-causal-tau``), ``beta`` the sibling-disagreement prefix bonus and
  ``clamped_prefix`` the one-sided clamping ablation (Proposition 3).
Tree arms keep ra_flat's reward and stepping: the gate, and a zero-gradient AdamW step on
homogeneous groups.
- The study's Table 3 ablations (``rlvr_fast.train.trainer`` explains each setting):
  ``ra_mst_tail50`` is midpoint_ra_mst with an FP32 Polyak average of the weights after steps
  26..50 (``polyak_start``); ``zero_cont_mass`` is stopped_tree (beta = 0) with its
  continuation tokens centred to zero signed token mass; ``accum4`` adds four questions per
  step to it, each question's gradient scaled to unit norm (``questions_per_step``). Longer
  active budgets are ``active_steps`` (``--active-steps``) on any arm.
- ``sampler="parallel"`` (the Parallel-Shapley seed): ``group_size`` responses of ``num_paths``
  paths, ``aggregator`` "vote" or "summary" (``rlvr_fast.rollouts.parallel``); each path credited by
  ``path_credit`` ("shapley", exact when ``shapley_permutations`` is 0; "loo", the paper's
  leave-one-out ablation; "independent", each path graded alone) under ``path_utility``, its
  reward lambda_path * normalise(phi) (``path_reward_norm``) + lambda_outcome * r_out
  (``rlvr_fast.credit.paths``). Parallel arms keep ra_flat's reward and stepping too.
"""

from __future__ import annotations

ARMS: dict[str, dict] = {
    "baseline": dict(
        loss_order="sum_then_scale", skip_zero_var=False, zero_var_step="skip", gate_min_chars=None
    ),
    "zg_flat": dict(
        loss_order="token_weighted",
        skip_zero_var=True,
        zero_var_step="zero_grad",
        gate_min_chars=None,
    ),
    "gate_flat": dict(
        loss_order="token_weighted", skip_zero_var=True, zero_var_step="skip", gate_min_chars=30
    ),
    "ra_flat": dict(
        loss_order="token_weighted",
        skip_zero_var=True,
        zero_var_step="zero_grad",
        gate_min_chars=30,
    ),
    "skip_zero_var": dict(
        loss_order="token_weighted", skip_zero_var=True, zero_var_step="skip", gate_min_chars=None
    ),
}
_TREE = dict(ARMS["ra_flat"], sampler="tree", bifurcate_after_active=3)
ARMS.update(
    {
        "stopped_tree": dict(_TREE, early_eos_mode="terminal_dup", beta=0.0),
        "stopped_tree_bonus": dict(_TREE, early_eos_mode="terminal_dup", beta=0.25),
        "root_restart": dict(_TREE, early_eos_mode="root_resample", beta=0.0),
        "root_restart_bonus": dict(_TREE, early_eos_mode="root_resample", beta=0.25),
        "midpoint_ra_mst": dict(_TREE, early_eos_mode="midpoint", beta=0.25),
        "midpoint_mst": dict(_TREE, early_eos_mode="midpoint", beta=0.25, bifurcate_after_active=0),
        "clamped_prefix": dict(
            _TREE,
            early_eos_mode="midpoint",
            beta=0.25,
            bifurcate_after_active=0,
            clamped_prefix=True,
        ),
    }
)
ARMS.update(
    {
        "ra_mst_tail50": dict(ARMS["midpoint_ra_mst"], polyak_start=26),
        "zero_cont_mass": dict(ARMS["stopped_tree"], zero_cont_mass=True),
    }
)
ARMS["accum4"] = dict(ARMS["zero_cont_mass"], questions_per_step=4)

_PARALLEL = dict(
    ARMS["ra_flat"],
    sampler="parallel",
    group_size=4,
    num_paths=4,
    path_utility="vote",
    lambda_outcome=0.5,
    lambda_path=0.5,
)
ARMS.update(
    {
        "shapley_vote": dict(_PARALLEL, aggregator="vote", path_credit="shapley"),
        "shapley_summary": dict(_PARALLEL, aggregator="summary", path_credit="shapley"),
        "loo_vote": dict(_PARALLEL, aggregator="vote", path_credit="loo"),
        "independent_vote": dict(_PARALLEL, aggregator="vote", path_credit="independent"),
    }
)


def arm_settings(name: str) -> dict:
    if name not in ARMS:
        raise ValueError(f"unknown arm {name!r} (valid: {', '.join(ARMS)})")
    return dict(ARMS[name])
