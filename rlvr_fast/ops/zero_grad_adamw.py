"""``zero_grad_adamw_``: k zero-gradient AdamW steps folded into one pass over the state.

Arms 2 and 4 replace the backward pass of a homogeneous group (sigma_R = 0, every A_i = 0) with
``p.grad = zeros_like(p); optimizer.step()`` (the study's §3.2). This function leaves the
optimizer exactly as ``steps`` such rounds would, ``torch.equal`` on params, ``exp_avg``,
``exp_avg_sq`` and ``step``, without allocating a gradient, iterating the k steps in registers
with one read and one write of (p, m, v) per call. Every parameter of the optimizer is advanced,
as if each had been given a zero gradient. Which kernel a parameter takes follows which path
torch itself would take for it:

- CPU (torch's single-tensor path): the C++ kernel ``csrc/zero_grad_adamw.cpp``, which reproduces
  that path's rounding op by op. ``foreach=True`` on CPU is refused.
- CUDA in a group that runs torch's foreach path (``foreach=None``, the default, when every
  parameter of the group is a plain CUDA tensor; or ``foreach=True``): the Triton kernel
  ``rlvr_fast.kernels.zero_grad_adamw``, which reproduces the rounding of torch's CUDA foreach
  ops, one launch per device and dtype over every such tensor. Verified bit for bit against torch only on a
  GPU (tests/ops/test_zero_grad_adamw.py); on CPU the tests check it against an exact emulation.
- CUDA in a group that runs torch's single-tensor path (``foreach=False``, or a group mixing
  devices), and other devices: torch's own step k times with zero gradients, exact by
  construction but not folded.
"""

from __future__ import annotations

from typing import Sequence

import torch

REFUSED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable", "fused")


def zero_grad_adamw_(
    optimizer: torch.optim.AdamW, steps: int = 1, *, lrs: Sequence[Sequence[float]] | None = None
) -> None:
    """Advance every parameter of ``optimizer`` by ``steps`` zero-gradient AdamW steps, in place.

    ``lrs[s][g]`` is the learning rate of group g at folded step s, for a schedule that changes
    the rate between the folded steps; by default each group's current ``lr`` is used for all of
    them (so flush before ``scheduler.step()``).
    """
    _check_optimizer(optimizer, steps, lrs)
    foreach_members: dict[tuple, list[tuple[torch.Tensor, dict, list[float]]]] = {}
    for index, group in enumerate(optimizer.param_groups):
        group_lrs = [float(group["lr"])] * steps if lrs is None else [float(r[index]) for r in lrs]
        group_runs_foreach = _runs_foreach(group)
        for param in group["params"]:
            if param.device.type == "cpu":
                _fold_cpu(optimizer.state[param], param, group, group_lrs)
            elif param.device.type == "cuda" and group_runs_foreach:
                key = (param.device, param.dtype)
                foreach_members.setdefault(key, []).append((param, group, group_lrs))
            else:
                _eager_zero_grad_steps(optimizer, param, group, group_lrs, group_runs_foreach)
    for members in foreach_members.values():
        _fold_foreach(optimizer, members)


def _runs_foreach(group: dict) -> bool:
    """Whether torch's AdamW takes the foreach path for this group: ``foreach`` if set, else
    (torch's default) when every parameter is a plain tensor on CUDA."""
    if group.get("foreach") is not None:
        return bool(group["foreach"])
    return all(
        p.device.type == "cuda" and (type(p) in (torch.Tensor, torch.nn.Parameter) or _sharded(p))
        for p in group["params"]
    )


def _sharded(tensor: torch.Tensor) -> bool:
    """A DTensor (FSDP2's sharded parameters and their moments), told without importing it."""
    return hasattr(tensor, "to_local")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view of its storage): the update is elementwise, so
    each rank folds its own shard without communicating; any other tensor as it is."""
    return tensor.to_local() if _sharded(tensor) else tensor


def _check_optimizer(optimizer, steps: int, lrs) -> None:
    if type(optimizer) is not torch.optim.AdamW:
        raise TypeError(
            f"zero_grad_adamw_ needs a torch.optim.AdamW, got {type(optimizer).__name__}"
        )
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if lrs is not None and (
        len(lrs) != steps or any(len(r) != len(optimizer.param_groups) for r in lrs)
    ):
        raise ValueError(f"lrs must be [steps={steps}][groups={len(optimizer.param_groups)}]")
    for group in optimizer.param_groups:
        for flag in REFUSED_FLAGS:
            if group.get(flag):
                raise ValueError(f"zero_grad_adamw_ does not support AdamW({flag}=True)")
        if isinstance(group["lr"], torch.Tensor) or isinstance(group["betas"][0], torch.Tensor):
            raise ValueError("zero_grad_adamw_ does not support tensor lr or betas")
        if group.get("foreach") and any(p.device.type == "cpu" for p in group["params"]):
            raise ValueError(
                "zero_grad_adamw_ matches the single-tensor CPU path; "
                "AdamW(foreach=True) on CPU is not supported"
            )
        runs_foreach = _runs_foreach(group)
        folded = [
            p
            for p in group["params"]
            if p.device.type == "cpu" or (p.device.type == "cuda" and runs_foreach)
        ]
        for param in folded:
            if param.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(
                    f"zero_grad_adamw_ supports float32 and bfloat16 parameters, got {param.dtype}"
                )
            if not param.is_contiguous():
                raise ValueError("zero_grad_adamw_ needs contiguous parameters")
        if any(p.device.type == "cuda" for p in folded) and not _has_triton():
            raise RuntimeError("zero_grad_adamw_ on CUDA needs the triton package")


def _has_triton() -> bool:
    from rlvr_fast.kernels import zero_grad_adamw

    return zero_grad_adamw.triton is not None


def _init_state(state: dict, param: torch.Tensor) -> None:
    if not state:
        # What AdamW's first step creates: a float32 step counter on the CPU and zero moments.
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _step_scalars(state: dict, group: dict, lrs: list[float]) -> list[tuple[float, float, float]]:
    """(decay, denom_scale, neg_step) for each folded step: the scalars torch computes in Python
    doubles from the step counter (both kernels round them to float)."""
    beta1, beta2 = group["betas"]
    weight_decay = group["weight_decay"]
    first = float(state["step"])
    scalars = []
    for offset, lr in enumerate(lrs, start=1):
        step = first + offset
        scalars.append(
            (
                1 - lr * weight_decay if weight_decay != 0 else 1.0,
                (1 - beta2**step) ** 0.5,
                -(lr / (1 - beta1**step)),
            )
        )
    return scalars


def _fold_cpu(state: dict, param: torch.Tensor, group: dict, lrs: list[float]) -> None:
    from rlvr_fast import _C

    _init_state(state, param)
    beta1, beta2 = group["betas"]
    decay, denom_scale, neg_step = zip(*_step_scalars(state, group, lrs))
    with torch.no_grad():
        _C.zero_grad_adamw_(
            _local(param),
            _local(state["exp_avg"]),
            _local(state["exp_avg_sq"]),
            1 - beta1,
            beta2,
            group["eps"],
            list(decay),
            list(denom_scale),
            list(neg_step),
        )
        state["step"] += len(lrs)


def _fold_foreach(
    optimizer, members: list[tuple[torch.Tensor, dict, list[float]]], fold=None
) -> None:
    """Fold the steps of the (param, group, lrs) ``members``, which share a device and dtype and
    which torch steps with foreach: one call of ``fold`` (default: the Triton kernel, one launch;
    the tests also pass the emulation) over every tensor, with one scalar row per tensor."""
    from rlvr_fast.kernels.zero_grad_adamw import scalar_table, zero_grad_adamw_triton_
    from rlvr_fast.ops import launch

    fold = fold or zero_grad_adamw_triton_
    states = [optimizer.state[param] for param, _, _ in members]
    for state, (param, _, _) in zip(states, members):
        _init_state(state, param)
    table = scalar_table(
        [(1 - group["betas"][0], group["betas"][1], group["eps"]) for _, group, _ in members],
        [_step_scalars(state, group, lrs) for state, (_, group, lrs) in zip(states, members)],
    )
    with torch.no_grad(), launch.on_device(members[0][0]):
        fold(
            [_local(param) for param, _, _ in members],
            [_local(state["exp_avg"]) for state in states],
            [_local(state["exp_avg_sq"]) for state in states],
            table,
        )
        for state, (_, _, lrs) in zip(states, members):
            state["step"] += len(lrs)


def _eager_zero_grad_steps(
    optimizer, param: torch.Tensor, group: dict, lrs: list[float], foreach: bool
) -> None:
    """torch's own update for one parameter, by the path its group takes, once per lr, with a
    zero gradient."""
    solo = torch.optim.AdamW(
        [param],
        lr=lrs[0],
        betas=group["betas"],
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        foreach=foreach,
    )
    solo.state[param] = optimizer.state[param]
    saved_grad = param.grad
    for lr in lrs:
        solo.param_groups[0]["lr"] = lr
        param.grad = torch.zeros_like(param)
        solo.step()
    param.grad = saved_grad
    optimizer.state[param] = solo.state[param]
