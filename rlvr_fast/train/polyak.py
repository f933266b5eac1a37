"""Polyak tail averaging of the weights (the study's ra_mst_tail50: FP32, steps 26..50).

``PolyakAverage`` keeps an FP32 running sum of a model's parameters, one addition after each
averaged optimizer step, and their count; ``average()`` is sum / count. Summing and dividing
once (rather than updating a mean in place) makes the average exactly
(w_1 + ... + w_n) / n in float32, added in step order, the same number after a resume as
without one. Bias correction and decay do not apply: every averaged step weighs the same.

The sums live on the model's device when it has room for them (4 bytes per parameter plus a
reserve for the rollouts and the backward pass), else on the CPU: Qwen3-0.6B-Base's sums
(untied, 751.6M parameters) take 3.0 GB, which a memory-tight GPU run would rather give its KV
cache. On the CPU each averaged step copies the weights over once.

Sharded (``rlvr_fast.train.sharding``) the average is of the shards, the weights the optimizer
steps (under a mixed precision the fp32 masters, not the engine's rounded copy): each rank sums
its own shards beside them (1/W of the sums), which a sharded checkpoint writes as they are
(``rlvr_fast.train.sharded_checkpoint``); ``average``, ``averaged_weights`` and ``state_dict``
(whole sums) gather each tensor whole in turn (collectives: every rank calls them), and
``load_state_dict`` cuts whole sums (an unsharded run's) into each rank's shards.

    polyak = PolyakAverage(model)
    polyak.add(model)                  # after each step of the window
    model.load_state_dict(polyak.average(), strict=False)
"""

from __future__ import annotations

import contextlib

import torch

from rlvr_fast.train.sharding import whole_tensor

# Left free on the device after the sums: the engine's KV cache is already allocated, but the
# next backward pass still needs activations and gradients.
DEVICE_RESERVE_BYTES = 2 << 30


class PolyakAverage:
    """FP32 sums of a model's trainable parameters (by name) and the number of steps added."""

    def __init__(self, model: torch.nn.Module, device: torch.device | str | None = None) -> None:
        params = trainable(model)
        if not params:
            raise ValueError("PolyakAverage: the model has no trainable parameters")
        self.sharded = any(hasattr(p, "to_local") for p in params.values())
        if self.sharded:  # each rank's shards of the sums, beside the weights' (DTensors)
            self.device = next(iter(params.values())).device
            self.sums = {
                name: torch.zeros_like(p.detach(), dtype=torch.float32)
                for name, p in params.items()
            }
        else:
            self.device = torch.device(device) if device is not None else sum_device(params)
            self.sums = {
                name: torch.zeros(p.shape, dtype=torch.float32, device=self.device)
                for name, p in params.items()
            }
        self.count = 0

    @torch.no_grad()
    def add(self, model: torch.nn.Module) -> None:
        """Add the model's current weights (one averaged step)."""
        params = trainable(model)
        if params.keys() != self.sums.keys():
            raise ValueError("PolyakAverage.add: the model's parameters are not the averaged ones")
        for name, total in self.sums.items():
            total.add_(params[name].detach().to(device=self.device, dtype=torch.float32))
        self.count += 1

    @torch.no_grad()
    def averaged_tensors(self):
        """(name, sum / count in float32), one tensor at a time: on the sums' device, or
        sharded gathered whole onto the CPU."""
        if self.count == 0:
            raise ValueError("PolyakAverage.average: no steps were averaged")
        for name, total in self.sums.items():
            average = total / self.count
            yield name, whole_tensor(average) if self.sharded else average

    def average(self) -> dict[str, torch.Tensor]:
        """name -> sum / count in float32 (``averaged_tensors``)."""
        return dict(self.averaged_tensors())

    def state_dict(self) -> dict:
        """The sums (on the CPU, whole) and the count, for a checkpoint."""
        sums = {n: whole_tensor(t) if self.sharded else t.cpu() for n, t in self.sums.items()}
        return {"count": self.count, "sums": sums}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if state["sums"].keys() != self.sums.keys():
            raise ValueError("PolyakAverage: the checkpoint's averaged parameters differ")
        for name, total in self.sums.items():
            saved = state["sums"][name]
            if self.sharded:
                from torch.distributed.tensor import distribute_tensor

                whole = saved.to(device=total.device, dtype=torch.float32)
                saved = distribute_tensor(whole, total.device_mesh, total.placements).to_local()
                total = total.to_local()
            total.copy_(saved)
        self.count = int(state["count"])


@contextlib.contextmanager
def averaged_weights(polyak: PolyakAverage, model: torch.nn.Module):
    """The average swapped into ``model`` for the block (to evaluate and save it); the live
    weights swapped back after, whatever happens inside."""
    params = trainable(model)
    live = {name: p.detach().to("cpu", copy=True) for name, p in params.items()}
    with torch.no_grad():
        for name, average in polyak.averaged_tensors():  # (sharded: one gathered at a time)
            params[name].copy_(average)
    try:
        yield
    finally:
        model.load_state_dict(live, strict=False)


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def sum_device(params: dict[str, torch.nn.Parameter]) -> torch.device:
    """The parameters' device if its free memory holds the FP32 sums and the reserve, else the
    CPU."""
    device = next(iter(params.values())).device
    if device.type != "cuda":
        return device
    free, _ = torch.cuda.mem_get_info(device)
    numel = sum(p.numel() for p in params.values())
    return device if sums_fit(free, numel) else torch.device("cpu")


def sums_fit(free_bytes: int, numel: int) -> bool:
    """Whether FP32 sums of ``numel`` parameters and the reserve fit in ``free_bytes``."""
    return free_bytes >= 4 * numel + DEVICE_RESERVE_BYTES
