"""One rank of ``test_sharded_optimizers``' per-implementation check (torchrun, gloo ranks): the
tiny model sharded (FSDP2), each optimizer stepped on this rank's shards of the same whole
gradients every rank draws (a random step, a zero-gradient step, a random step), against the
same optimizer stepped on the whole tensors in this process. Prints, per optimizer, the largest
difference of a shard from the whole tensor's rows (relative to that tensor's largest
magnitude) and whether every shard is bitwise those rows. Adafactor's state is then gathered
whole (``state_dict``), compared with the whole run's, loaded into a fresh sharded optimizer and
stepped once more on both sides."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from rlvr_fast.models.policy import load_policy
from rlvr_fast.train import distributed
from rlvr_fast.train.adafactor import Adafactor
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.sharding import ShardedModel
from rlvr_fast.train.stepping import make_optimizer

SETTINGS = dict(lr=1e-3, weight_decay=0.1)
# What each implementation is built from: the run's optimizer settings (make_optimizer), or
# torch's foreach AdamW (what a sharded CUDA run's default AdamW takes) named directly.
IMPLEMENTATIONS = {
    "adamw for-loop": dict(fused_zero_grad_step=False),
    "adamw foreach": None,
    "adamw fused": dict(adamw_fused=True, fused_zero_grad_step=False),
    "adafactor": dict(optimizer="adafactor", fused_zero_grad_step=False),
}


def build(name: str, named, model_config) -> torch.optim.Optimizer:
    settings = IMPLEMENTATIONS[name]
    if settings is None:
        return torch.optim.AdamW([p for _, p in named], foreach=True, **SETTINGS)
    return make_optimizer(named, model_config, TrainConfig(**settings, **SETTINGS))


def gradients(whole: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Whole random gradients, the same on every rank (seed 0: zeros, a zero-gradient step)."""
    if seed == 0:
        return {n: torch.zeros_like(p) for n, p in whole.items()}
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=generator) for n, p in whole.items()}


def step(sharded_params, whole_params, optimizers, seed: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    grads = gradients(whole_params, seed)
    for name, p in sharded_params.items():
        p.grad = distribute_tensor(grads[name], p.device_mesh, p.placements)
        whole_params[name].grad = grads[name].clone()
    for optimizer in optimizers:
        optimizer.step()


def rows_of(whole: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``whole`` as FSDP2 shards it (torch.chunk on dim 0)."""
    chunks = torch.chunk(whole, dist.get_world_size())
    rank = dist.get_rank()
    return chunks[rank] if rank < len(chunks) else whole[:0]


def compare(sharded_params, whole_params) -> tuple[float, bool]:
    worst, bitwise = 0.0, True
    for name, p in sharded_params.items():
        shard, expected = p.detach().to_local(), rows_of(whole_params[name].detach())
        scale = float(whole_params[name].detach().abs().max())
        if shard.numel():
            worst = max(worst, float((shard - expected).abs().max()) / scale)
        bitwise = bitwise and torch.equal(shard, expected)
    return worst, bitwise


def report(line: str) -> None:
    """Every rank's ``line``, printed by rank 0 (the ranks' own prints would interleave)."""
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    base = load_policy("tiny").model
    for name in IMPLEMENTATIONS:
        sharded = ShardedModel(copy.deepcopy(base), "fp32")
        sharded_params = dict(sharded.module.named_parameters())
        whole = copy.deepcopy(base).float()
        whole_params = dict(whole.named_parameters())
        optimizer = build(name, list(sharded_params.items()), base.config)
        reference = build(name, list(whole_params.items()), base.config)
        for seed in (1, 0, 2):
            step(sharded_params, whole_params, [optimizer, reference], seed)
        worst, bitwise = compare(sharded_params, whole_params)
        report(f"rank {rank}: {name}: largest difference {worst:.1e}, bitwise {bitwise}")
        if isinstance(optimizer, Adafactor):
            check_gathered_adafactor_state(rank, optimizer, reference, sharded_params, whole_params)
    distributed.shutdown()  # (a barrier first: a rank left alone at exit aborts)


def check_gathered_adafactor_state(rank, optimizer, reference, sharded_params, whole_params):
    """The sharded Adafactor's state gathered whole against the whole run's, then loaded into a
    fresh optimizer over the shards, which steps as the whole run does."""
    state, expected = optimizer.state_dict(), reference.state_dict()
    worst = max(
        relative_difference(part[key], whole_part[key])
        for index, entry in expected["state"].items()
        for part, whole_part in zip(state["state"][index]["parts"], entry["parts"])
        for key in whole_part
    )
    resumed = Adafactor(list(sharded_params.items()), load_policy("tiny").config, **SETTINGS)
    resumed.load_state_dict(state)
    step(sharded_params, whole_params, [resumed, reference], 3)
    stepped, _ = compare(sharded_params, whole_params)
    report(f"rank {rank}: adafactor state gathered {worst:.1e}, loaded and stepped {stepped:.1e}")


if __name__ == "__main__":
    main()
