"""``zero_grad_adamw_``: k zero-gradient AdamW steps folded into one pass over the state.

Arms 2 and 4 replace the backward pass of a homogeneous group (sigma_R = 0, every A_i = 0) with
``p.grad = zeros_like(p); optimizer.step()`` (the study's §3.2). This function leaves the
optimizer exactly as ``steps`` such rounds would, ``torch.equal`` on params, ``exp_avg``,
``exp_avg_sq`` and ``step``, without allocating a gradient: on CPU a C++ kernel
(``csrc/zero_grad_adamw.cpp``) reproduces the rounding of torch's single-tensor CPU path op by op
and iterates the k steps in registers, one read and one write of (p, m, v) per call. Every
parameter of the optimizer is advanced, as if each had been given a zero gradient.

CUDA tensors take torch's own step k times with zero gradients (exact by construction, no
folding): the Triton kernel that would fold them needs a GPU to be verified bit for bit against
torch's foreach CUDA path.
"""

from __future__ import annotations

from typing import Sequence

import torch

REFUSED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable", "fused")


def zero_grad_adamw_(optimizer: torch.optim.AdamW, steps: int = 1, *,
                     lrs: Sequence[Sequence[float]] | None = None) -> None:
    """Advance every parameter of ``optimizer`` by ``steps`` zero-gradient AdamW steps, in place.

    ``lrs[s][g]`` is the learning rate of group g at folded step s, for a schedule that changes
    the rate between the folded steps; by default each group's current ``lr`` is used for all of
    them (so flush before ``scheduler.step()``).
    """
    _check_optimizer(optimizer, steps, lrs)
    for index, group in enumerate(optimizer.param_groups):
        group_lrs = [float(group["lr"])] * steps if lrs is None else [float(r[index]) for r in lrs]
        for param in group["params"]:
            if param.device.type != "cpu":
                _eager_zero_grad_steps(optimizer, param, steps, group_lrs)
                continue
            _fold_cpu(optimizer.state[param], param, group, group_lrs)


def _check_optimizer(optimizer, steps: int, lrs) -> None:
    if type(optimizer) is not torch.optim.AdamW:
        raise TypeError(f"zero_grad_adamw_ needs a torch.optim.AdamW, got {type(optimizer).__name__}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if lrs is not None and (len(lrs) != steps or any(len(r) != len(optimizer.param_groups)
                                                      for r in lrs)):
        raise ValueError(f"lrs must be [steps={steps}][groups={len(optimizer.param_groups)}]")
    for group in optimizer.param_groups:
        for flag in REFUSED_FLAGS:
            if group.get(flag):
                raise ValueError(f"zero_grad_adamw_ does not support AdamW({flag}=True)")
        if isinstance(group["lr"], torch.Tensor) or isinstance(group["betas"][0], torch.Tensor):
            raise ValueError("zero_grad_adamw_ does not support tensor lr or betas")
        on_cpu = all(p.device.type == "cpu" for p in group["params"])
        if on_cpu and group.get("foreach"):
            raise ValueError("zero_grad_adamw_ matches the single-tensor CPU path; "
                             "AdamW(foreach=True) on CPU is not supported")
        for param in group["params"]:
            if param.device.type == "cpu" and param.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"zero_grad_adamw_ supports float32 and bfloat16 parameters, "
                                 f"got {param.dtype}")
            if param.device.type == "cpu" and not param.is_contiguous():
                raise ValueError("zero_grad_adamw_ needs contiguous parameters")


def _fold_cpu(state: dict, param: torch.Tensor, group: dict, lrs: list[float]) -> None:
    from rlvr_fast import _C

    if not state:
        # What AdamW's first step creates: a float32 step counter and zero moments.
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    beta1, beta2 = group["betas"]
    weight_decay, eps = group["weight_decay"], group["eps"]
    first = float(state["step"])
    decay, denom_scale, neg_step = [], [], []
    for offset, lr in enumerate(lrs, start=1):
        # The scalars torch computes in Python doubles at each step (cast to float in the kernel).
        step = first + offset
        decay.append(1 - lr * weight_decay if weight_decay != 0 else 1.0)
        denom_scale.append((1 - beta2 ** step) ** 0.5)
        neg_step.append(-(lr / (1 - beta1 ** step)))
    with torch.no_grad():
        _C.zero_grad_adamw_(param, state["exp_avg"], state["exp_avg_sq"], 1 - beta1, beta2, eps,
                            decay, denom_scale, neg_step)
        state["step"] += len(lrs)


def _eager_zero_grad_steps(optimizer, param: torch.Tensor, steps: int, lrs: list[float]) -> None:
    """torch's own update for one parameter, ``steps`` times with a zero gradient."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    solo = torch.optim.AdamW([param], lr=lrs[0], betas=group["betas"], eps=group["eps"],
                             weight_decay=group["weight_decay"], foreach=group.get("foreach"))
    solo.state[param] = optimizer.state[param]
    saved_grad = param.grad
    for lr in lrs:
        solo.param_groups[0]["lr"] = lr
        param.grad = torch.zeros_like(param)
        solo.step()
    param.grad = saved_grad
    optimizer.state[param] = solo.state[param]
