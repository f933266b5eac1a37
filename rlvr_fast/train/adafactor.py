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

Sharded (FSDP2, ``rlvr_fast.train.sharding``: each rank holds a run of rows, dim 0, of every
tensor) each rank steps its own rows: a row's statistics are its own, and what spans rows (a
matrix's column means, the mean of its row means, the update's RMS) is summed over the ranks,
one all-reduce of those sums per tensor and one of the squared updates; the state keeps the
rank's rows of each part and whole column means (``state_dict`` gathers the rows whole, so a
checkpoint holds what an unsharded run's does; ``load_state_dict`` cuts them again).
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist

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
                if param.grad is None:
                    continue
                if sharded(param):
                    self._step_shard(param, rows, group["lr"], group["weight_decay"])
                else:
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

    def _step_shard(self, param, rows, lr: float, weight_decay: float) -> None:
        """``_step_parameter``'s arithmetic on this rank's rows of ``param`` (a DTensor), the
        statistics that span rows summed over the ranks (the module docstring)."""
        local = param.to_local()
        grad = param.grad.to_local()
        grad = grad.float() if grad.dtype in LOW_PRECISION else grad
        weight = local.float() if local.dtype in LOW_PRECISION else local
        spans = local_spans(param, rows)
        state = self.state[param]
        if not state:
            state["step"] = 0
            state["parts"] = [
                zero_shard_state(grad[a:b], part_rows_count)
                for (a, b), part_rows_count in zip(spans, rows)
            ]
        state["step"] += 1
        beta2t = 1.0 - math.pow(state["step"], DECAY_RATE)
        group = param.device_mesh.get_group()
        parts = [
            (grad[a:b], weight[a:b], m, n) for (a, b), m, n in zip(spans, state["parts"], rows)
        ]
        # The sums over all ranks' rows: each matrix part's column sums of u and the sum of its
        # running row means, in one all-reduce.
        sums = [shard_second_moment_sums(g, m, beta2t) for g, _, m, _ in parts]
        if factored(grad):
            flat = torch.cat([torch.cat([columns, total.reshape(1)]) for columns, total in sums])
            dist.all_reduce(flat, group=group)
            sums = flat.split([columns.numel() + 1 for columns, _ in sums])
        updates = [shard_update(g, m, beta2t, total, n) for (g, _, m, n), total in zip(parts, sums)]
        squares = torch.stack([u.square().sum() for u in updates])
        dist.all_reduce(squares, group=group)
        columns = param.shape[1] if factored(param) else 1
        for (_, w, _, n), update, square in zip(parts, updates, squares):
            part_rms = square.sqrt() / ((n * columns) ** 0.5)
            update.div_((part_rms / CLIP_THRESHOLD).clamp_(min=1.0))
            update.mul_(lr)
            if weight_decay != 0:
                w.add_(w, alpha=(-weight_decay * lr))
            w.add_(-update)
        if weight is not local:
            local.copy_(weight)

    def state_dict(self) -> dict:
        """torch's, with a sharded parameter's row statistics gathered whole (a collective:
        every rank calls it), so that the state is an unsharded run's."""
        state = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        for index, entry in state["state"].items():
            param = params[index]
            if sharded(param):
                rows = self.param_groups[0]["rows"][index]
                state["state"][index] = {**entry, "parts": whole_parts(param, rows, entry["parts"])}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts a state's floating tensors to their parameter's dtype; Adafactor's stay
        float32 (bf16 weights included), so they are put back as saved (a sharded parameter's:
        its rows of each part)."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            param = params[index]
            device = param.device
            parts = [
                {k: t.to(device=device, dtype=torch.float32, copy=True) for k, t in m.items()}
                for m in saved["parts"]
            ]
            if sharded(param):
                parts = local_parts(param, self.param_groups[0]["rows"][index], parts)
            self.state[param]["parts"] = parts


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


def sharded(param: torch.Tensor) -> bool:
    """A DTensor (FSDP2's sharded parameter), told without importing it."""
    return hasattr(param, "to_local")


def local_rows(param) -> tuple[int, int]:
    """The rows (start, stop) of ``param`` (a DTensor sharded on dim 0 as FSDP2 shards it:
    torch.chunk's rows, ceil(n / W) a rank, the last ranks fewer or none) this rank holds."""
    from torch.distributed.tensor import Shard

    if tuple(param.placements) != (Shard(0),) or param.dim() > 2:
        raise ValueError(
            "Adafactor steps shards of dim 0 of vectors and matrices (FSDP2's), got "
            f"{tuple(param.placements)} of a {param.dim()}-D tensor"
        )
    total, mesh = param.shape[0], param.device_mesh
    chunk = -(-total // mesh.size())
    first = min(mesh.get_local_rank() * chunk, total)
    last = min(first + chunk, total)
    if param.to_local().shape[0] != last - first:
        raise ValueError("Adafactor: a shard's rows are not torch.chunk's (not FSDP2's sharding)")
    return first, last


def local_spans(param, rows) -> list[tuple[int, int]]:
    """(start, stop) in this rank's rows of each part of ``param``; a part with no row here
    has start == stop."""
    first, last = local_rows(param)
    spans, start = [], 0
    for count in rows:
        lo, hi = max(start, first), min(start + count, last)
        spans.append((lo - first, max(lo, hi) - first))
        start += count
    return spans


def zero_shard_state(part: torch.Tensor, rows: int) -> dict[str, torch.Tensor]:
    """A part's statistics on a rank holding ``part``, its rows of a part of ``rows`` rows:
    its rows' means and whole column means of a matrix, or a vector's own."""
    state = zero_state(part)
    if factored(part):
        state["exp_avg_sq_col"] = torch.zeros(part.shape[-1:]).to(part)
    return state


def shard_second_moment_sums(grad, moments: dict, beta2t: float):
    """The rank's rows' running row means (or a vector's second moment) advanced by
    ``grad``; a matrix's (column sums of u, sum of its rows' running means), to be summed over
    the ranks, else an empty tensor and a zero."""
    update = (grad**2) + EPS_SQUARED
    if not factored(grad):
        moments["exp_avg_sq"].mul_(beta2t).add_(update, alpha=(1.0 - beta2t))
        return update.new_zeros(0), update.new_zeros(())
    row = moments["exp_avg_sq_row"]
    row.mul_(beta2t).add_(update.mean(dim=-1), alpha=(1.0 - beta2t))
    return update.sum(dim=-2), row.sum()


def shard_update(grad, moments: dict, beta2t: float, sums, rows: int) -> torch.Tensor:
    """grad / sqrt(second moment) on the rank's rows, ``sums`` (``shard_second_moment_sums``'
    summed over the ranks) giving the whole part's column means and mean row mean."""
    if not factored(grad):
        return moments["exp_avg_sq"].rsqrt().mul_(grad)
    col = moments["exp_avg_sq_col"]
    col.mul_(beta2t).add_(sums[:-1] / rows, alpha=(1.0 - beta2t))
    row = moments["exp_avg_sq_row"]
    r_factor = (row / (sums[-1] / rows)).rsqrt_().unsqueeze(-1)
    c_factor = col.unsqueeze(-2).rsqrt()
    return torch.mul(r_factor, c_factor).mul_(grad)


ROW_KEYS = ("exp_avg_sq_row", "exp_avg_sq")  # the statistics of a part's own rows


def whole_parts(param, rows, parts: list[dict]) -> list[dict]:
    """Each part's statistics whole: the rows every rank holds gathered (a collective)."""
    from torch.distributed.tensor import DTensor

    key = ROW_KEYS[0] if factored(param) else ROW_KEYS[1]
    mine = torch.cat([part[key] for part in parts])
    whole = DTensor.from_local(
        mine, param.device_mesh, param.placements, shape=param.shape[:1], stride=(1,)
    ).full_tensor()
    return [
        {**part, key: rows_of_part.clone()}
        for part, rows_of_part in zip(parts, whole.split(list(rows)))
    ]


def local_parts(param, rows, parts: list[dict]) -> list[dict]:
    """Whole parts' statistics (``whole_parts``') cut to this rank's rows of each."""
    key = ROW_KEYS[0] if factored(param) else ROW_KEYS[1]
    spans, starts = local_spans(param, rows), [sum(rows[:i]) for i in range(len(rows))]
    first, _ = local_rows(param)
    return [
        {**part, key: part[key][first + a - start : first + b - start].clone()}
        for part, (a, b), start in zip(parts, spans, starts)
    ]


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
        # (the global shape: a sharded parameter's whole parts)
        parts = torch.empty(params[index].shape, device="meta").split(group["rows"][index])
        if not isinstance(entry.get("step"), int) or len(entry["parts"]) != len(parts):
            raise ValueError(f"Adafactor state of parameter {index} is not this model's")
        for part, moments in zip(parts, entry["parts"]):
            expected = zero_state(part)
            if set(moments) != set(expected) or any(
                moments[k].shape != v.shape for k, v in expected.items()
            ):
                raise ValueError(f"Adafactor state of parameter {index} has the wrong shape")
