"""One rank of ``test_sharding``'s zero-gradient check (run by torchrun, 2 gloo ranks): the tiny
model sharded, a few real AdamW steps to give every moment a value, then k = 3 zero-gradient
steps folded by the fused kernel on this rank's shards against 3 torch AdamW steps with zero
gradients on a copy of them; prints the shards compared, whether every one is bitwise equal, and
the collectives the fold ran (none: it needs no gradient, and each rank's update is its own
elements'), beside those of a sharded norm, which shows that they are counted."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from rlvr_fast.models.policy import load_policy
from rlvr_fast.train import distributed
from rlvr_fast.ops.zero_grad_adamw import zero_grad_adamw_
from rlvr_fast.train.sharding import ShardedModel


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    sharded = ShardedModel(load_policy("tiny").model, "fp32")
    params = list(sharded.module.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=False)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)  # DTensor: each rank's own shard of random values
        optimizer.step()
    twin = copy.deepcopy(optimizer.state_dict())
    expected = [p.detach().to_local().clone() for p in params]
    reference = [torch.nn.Parameter(t) for t in expected]
    torch_adamw = torch.optim.AdamW(reference, lr=1e-3, weight_decay=0.1, foreach=False)
    torch_adamw.load_state_dict(
        {
            "state": {
                i: {k: v.to_local().clone() if hasattr(v, "to_local") else v.clone()
                    for k, v in entry.items()}
                for i, entry in twin["state"].items()
            },
            "param_groups": twin["param_groups"],
        }
    )  # fmt: skip
    for _ in range(3):
        for p in reference:
            p.grad = torch.zeros_like(p)
        torch_adamw.step()
    with CommDebugMode() as fold:
        zero_grad_adamw_(optimizer, steps=3)
    with CommDebugMode() as norm:
        torch.linalg.vector_norm(params[0]).full_tensor()
    equal = all(
        torch.equal(p.to_local(), r)
        and torch.equal(optimizer.state[p]["exp_avg"].to_local(), torch_adamw.state[r]["exp_avg"])
        and torch.equal(
            optimizer.state[p]["exp_avg_sq"].to_local(), torch_adamw.state[r]["exp_avg_sq"]
        )
        for p, r in zip(params, reference, strict=True)
    )
    print(
        f"rank {dist.get_rank()}: {len(params)} shards, bitwise equal {equal}, collectives "
        f"{fold.get_total_counts()} (a sharded norm's {norm.get_total_counts()})",
        flush=True,
    )
    distributed.shutdown()  # (a barrier first: a rank left alone at exit aborts)


if __name__ == "__main__":
    main()
