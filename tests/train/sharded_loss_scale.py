"""One rank of ``test_sharded_precision``'s loss-scale check (torchrun, 2 gloo ranks), the tiny
model sharded under fp16-mixed: an infinity put in rank 1's shard alone is found by both ranks;
then a pooled step whose scaled fp16 backward overflows on rank 0's question alone (rank 1's
fits) is skipped on both ranks (no weight moves, the scale halves on both), and the next clean
step steps both at the halved scale. Rank 0 prints what every rank found."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from rlvr_fast.models.context import ForwardContext
from rlvr_fast.models.policy import load_policy
from rlvr_fast.train import distributed
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.decision import StepDecision
from rlvr_fast.train.sharding import ShardedModel
from rlvr_fast.train.stepping import OptimizerStepping
from rlvr_fast.utils.phases import Phases

ACTIVE = StepDecision(active=True, optimizer_step=True, contributing=2)
TOKENS = torch.tensor([[5, 17, 40, 3, 99, 120, 7, 64, 2, 31, 8, 250]])


def next_token_loss(model, factor: float) -> torch.Tensor:
    """test_fp16_mixed's losses, through the decoder and the LM head's weight as the trainer's
    run (``run_pass`` brackets them): factor 1e-3 fits fp16 at the 2^16 scale, 1 overflows it."""
    ids = TOKENS[:, :-1]
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    hidden = model.model(ids, ForwardContext(positions))
    logits = (hidden @ model.lm_head.weight.T).float()
    return torch.nn.functional.cross_entropy(logits[0], TOKENS[0, 1:]) * factor


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sharded = ShardedModel(load_policy("tiny", dtype=torch.float32).model, "fp16-mixed")
    config = TrainConfig(lr=1e-3, weight_decay=0.01)
    stepping = OptimizerStepping(sharded.engine_model, config, "fp16-mixed", sharded=sharded)
    params = stepping.stepped
    for p in params:
        p.grad = torch.zeros_like(p)
    if rank == 1:
        params[3].grad.to_local()[0] = float("inf")
    found = stepping.scaler.unscale_(params)
    stepping.optimizer.zero_grad(set_to_none=True)
    phase, model = Phases(torch.device("cpu")), sharded.module
    weights = [[p.detach().to_local().clone() for p in params]]
    updates = []
    for factor in (1.0 if rank == 0 else 1e-3, 1e-3):
        loss_fn = functools.partial(next_token_loss, model, factor)
        updates.append(
            stepping.update(phase, ACTIVE, [loss_fn], combination="pooled", weights=[1.0])
        )
        weights.append([p.detach().to_local().clone() for p in params])
    moved = [not all(map(torch.equal, a, b)) for a, b in zip(weights, weights[1:])]
    line = (
        f"rank {rank}: an infinity in rank 1's shard found {not found}; "
        f"overflow on rank 0: {updates[0].loss_scale}, grad norm {updates[0].grad_norm}; "
        f"clean: {updates[1].loss_scale}, stepped {updates[1].grad_norm is not None}; "
        f"scale {stepping.scaler.scale}; weights moved {moved}"
    )
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    if rank == 0:
        print("\n".join(lines), flush=True)
    distributed.shutdown()  # (a barrier first: a rank left alone at exit aborts)


if __name__ == "__main__":
    main()
