"""Adafactor as transformers' Trainer builds it for ``optim="adafactor"`` (TRL's GRPOTrainer too):
``transformers.optimization.Adafactor(params, lr, weight_decay, scale_parameter=False,
relative_step=False)``, so the learning rate is the schedule's (no relative step, no parameter
scale) and every other option is transformers' default: ``eps`` (1e-30, 1e-3), ``clip_threshold``
1.0, ``decay_rate`` -0.8, no first moment (``beta1`` None). AdamW's betas and epsilon play no part.

Per tensor and step t: beta2_t = 1 - t^-0.8; u = g^2 + 1e-30; a matrix keeps the running means
of u over its rows (R) and over its columns (C), and its second moment is their outer product
R C^T / mean(R); a vector keeps u's running mean itself. The update is g / sqrt(second moment),
divided by max(1, RMS(update)), times lr; decoupled weight decay subtracts lr * wd * w first.
The arithmetic is transformers', op for op, so the update is its own bit for bit
(tests/train/test_adafactor.py). The parameter RMS that transformers also records each step is
read only with ``scale_parameter``, so it is not computed here.

Our model stacks Hugging Face's q/k/v and gate/up projections in one tensor (``qkv_proj``,
``gate_up_proj``), and Adafactor's factors, its row normalisation and its update clipping are per
tensor: each stacked tensor is stepped as the Hugging Face tensors it holds (``row_parts``), one
factored state per part, so the update is the one TRL's model gets. Gradients in bf16 or fp16
are stepped in float32, and the state is float32 whatever the weights' dtype, as in transformers.
"""

from __future__ import annotations

import math
import re

import torch

from rlvr_fast.models.lora import part_rows

EPS_SQUARED = 1e-30  # transformers' eps[0]; eps[1] scales parameters (scale_parameter only)
CLIP_THRESHOLD = 1.0
DECAY_RATE = -0.8
LOW_PRECISION = (torch.float16, torch.bfloat16)
STACKED = re.compile(r"(?:^|\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(?:weight|bias)$")


def row_parts(name: str, shape: torch.Size, config) -> tuple[int, ...]:
    """Rows (dim 0) of each Hugging Face tensor in our parameter ``name``: the projections a
    stacked weight or bias holds, else the whole tensor."""
    stacked = STACKED.search(name)
    return part_rows(config, stacked.group(1)) if stacked else (shape[0],)


def factored(part: torch.Tensor) -> bool:
    return part.dim() >= 2


class Adafactor(torch.optim.Optimizer):
    """transformers' Adafactor with an external learning rate (see the module docstring) over
    ``named_params`` (name, parameter) of a model with ``config``; each parameter's state is its
    step and one entry per Hugging Face tensor it holds."""

    def __init__(self, named_params, config, *, lr: float, weight_decay: float = 0.0) -> None:
        named_params = list(named_params)
        params = [p for _, p in named_params]
        rows = [row_parts(name, p.shape, config) for name, p in named_params]
        super().__init__([{"params": params, "rows": rows}], dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for param, rows in zip(group["params"], group["rows"]):
                if param.grad is not None:
                    self._step_parameter(param, rows, group["lr"], group["weight_decay"])
        return loss

    def _step_parameter(self, param, rows, lr: float, weight_decay: float) -> None:
        grad = param.grad.float() if param.grad.dtype in LOW_PRECISION else param.grad
        weight = param.float() if param.dtype in LOW_PRECISION else param
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["parts"] = [zero_state(part) for part in grad.split(rows)]
        state["step"] += 1
        beta2t = 1.0 - math.pow(state["step"], DECAY_RATE)
        for g, w, moments in zip(grad.split(rows), weight.split(rows), state["parts"]):
            update = second_moment_update(g, moments, beta2t)
            update.div_((rms(update) / CLIP_THRESHOLD).clamp_(min=1.0))
            update.mul_(lr)
            if weight_decay != 0:
                w.add_(w, alpha=(-weight_decay * lr))
            w.add_(-update)
        if weight is not param:
            param.copy_(weight)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts a state's floating tensors to their parameter's dtype; Adafactor's stay
        float32 (bf16 weights included), so they are put back as saved."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            device = params[index].device
            self.state[params[index]]["parts"] = [
                {k: t.to(device=device, dtype=torch.float32, copy=True) for k, t in m.items()}
                for m in saved["parts"]
            ]


def zero_state(part: torch.Tensor) -> dict[str, torch.Tensor]:
    """A part's second-moment statistics: row and column means of a matrix, or a vector's own."""
    if factored(part):
        return {
            "exp_avg_sq_row": torch.zeros(part.shape[:-1]).to(part),
            "exp_avg_sq_col": torch.zeros(part.shape[:-2] + part.shape[-1:]).to(part),
        }
    return {"exp_avg_sq": torch.zeros_like(part)}


def second_moment_update(grad: torch.Tensor, moments: dict, beta2t: float) -> torch.Tensor:
    """The running second-moment statistics advanced by ``grad``; grad / sqrt(second moment)."""
    update = (grad**2) + EPS_SQUARED
    if not factored(grad):
        exp_avg_sq = moments["exp_avg_sq"]
        exp_avg_sq.mul_(beta2t).add_(update, alpha=(1.0 - beta2t))
        return exp_avg_sq.rsqrt().mul_(grad)
    row, col = moments["exp_avg_sq_row"], moments["exp_avg_sq_col"]
    row.mul_(beta2t).add_(update.mean(dim=-1), alpha=(1.0 - beta2t))
    col.mul_(beta2t).add_(update.mean(dim=-2), alpha=(1.0 - beta2t))
    r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
    c_factor = col.unsqueeze(-2).rsqrt()
    return torch.mul(r_factor, c_factor).mul_(grad)


def rms(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.norm(2) / (tensor.numel() ** 0.5)


def state_elements(shapes) -> int:
    """Elements of Adafactor's state for parameters (or parts) of ``shapes``: rows + columns of
    each matrix, every element of a vector."""
    total = 0
    for shape in shapes:
        shape = tuple(shape)
        total += (
            math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:])
            if len(shape) >= 2
            else math.prod(shape)
        )
    return total


def check_adafactor_state(state: dict, optimizer: Adafactor) -> None:
    """A checkpoint's Adafactor state has this run's parameters and parts, each statistic of
    the part's shape (torch checks only the number of parameters)."""
    (group,) = optimizer.param_groups
    if [tuple(r) for r in state["param_groups"][0]["rows"]] != [tuple(r) for r in group["rows"]]:
        raise ValueError("optimizer state's parts are not this model's (not an Adafactor state?)")
    params = group["params"]
    for index, entry in state["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise ValueError(f"optimizer state for parameter {index!r}, the run has {len(params)}")
        parts = params[index].detach().split(group["rows"][index])
        if not isinstance(entry.get("step"), int) or len(entry["parts"]) != len(parts):
            raise ValueError(f"Adafactor state of parameter {index} is not this model's")
        for part, moments in zip(parts, entry["parts"]):
            expected = zero_state(part)
            if set(moments) != set(expected) or any(
                moments[k].shape != v.shape for k, v in expected.items()
            ):
                raise ValueError(f"Adafactor state of parameter {index} has the wrong shape")
