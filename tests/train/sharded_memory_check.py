"""One rank of ``test_sharded_memory`` (run by torchrun, 2 gloo ranks): what sharding a model and
refreshing the engine's copy from the shards hold in memory, and when the refresh runs.

The model is tied, 8 decoder layers of 3.9M parameters and an embedding of 4.2M (143 MB in
fp32), so that one FSDP group is small against the whole. Each rank prints one JSON line:
- ``startup``: the peak resident set's rise while ``ShardedModel`` is built, beside the bytes of
  this rank's shards, of the full copy and of the largest group;
- for fp32 and bf16-mixed, ``refresh``: the rise while the engine's copy is refreshed from
  shards moved by hand, the all-gathers it made (one per FSDP group: 8 layers and the root),
  whether every engine tensor then equals its gathered shards (in the engine's dtype) and
  whether every engine tensor kept its address;
- ``publishes``: the refreshes that steps ran, with weight decay 0: a zero-gradient step before
  any moment (moves nothing), an active step, a zero-gradient step after it (the first moment
  moves the weights), and whether the first one left the shards as they were.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.qwen3 import Qwen3ForCausalLM
from rlvr_fast.train.config import TrainConfig
from rlvr_fast.train.decision import StepDecision
from rlvr_fast.train.losses import fused_grpo_loss
from rlvr_fast.train.sharding import ShardedModel
from rlvr_fast.train.stepping import OptimizerStepping
from rlvr_fast.utils.phases import Phases

CONFIG = ModelConfig(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    tie_word_embeddings=True,
)
ACTIVE = StepDecision(active=True, optimizer_step=True, contributing=1)
ZERO_GRAD = StepDecision(active=False, optimizer_step=True, contributing=0)


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def peak_rise(run) -> tuple[object, int]:
    """``run()``'s result and the peak resident set's rise above the resident set before it."""
    Path("/proc/self/clear_refs").write_text("5")
    before = status_bytes("VmRSS")
    result = run()
    return result, status_bytes("VmHWM") - before


def local_bytes(tensors) -> int:
    return sum(t.to_local().numel() * t.to_local().element_size() for t in tensors)


def counting(function, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return counted


def refreshed(precision: str) -> dict:
    """The refresh of a sharded model in ``precision`` whose shards moved."""
    torch.manual_seed(0)
    sharded = ShardedModel(Qwen3ForCausalLM(CONFIG), precision)
    engine = dict(sharded.engine_model.named_parameters())
    addresses = {name: tensor.data_ptr() for name, tensor in engine.items()}
    with torch.no_grad():
        for param in sharded.module.parameters():
            param.to_local().add_(torch.randn_like(param.to_local()))
    gathers = []
    # FSDP2's all-gather: all_gather_single in torch 2.13, all_gather_into_tensor before.
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {name: getattr(dist, name) for name in names}
    for name, original in originals.items():
        setattr(dist, name, counting(original, gathers))
    try:
        _, rise = peak_rise(sharded.refresh)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    params = dict(sharded.module.named_parameters())
    return {
        "rise": rise,
        "all_gathers": len(gathers),
        "equal": all(
            torch.equal(engine[name], param.full_tensor().to(engine[name].dtype))
            for name, param in params.items()
        ),
        "same_addresses": all(engine[name].data_ptr() == addresses[name] for name in engine),
        "engine_dtype": str(next(iter(engine.values())).dtype),
    }


def publishes() -> dict:
    """Refreshes run by three steps of weight decay 0 (module docstring)."""
    torch.manual_seed(0)
    sharded = ShardedModel(Qwen3ForCausalLM(CONFIG), "fp32")
    config = TrainConfig.from_arm(
        "ra_flat",
        shard="fsdp",
        questions_per_step=2,
        combine_questions="pooled",
        weight_decay=0.0,
        lr=1e-3,
    )
    counts = []

    def refresh() -> None:
        counts.append(len(counts))
        sharded.refresh()

    stepping = OptimizerStepping(
        sharded.engine_model, config, "fp32", after_publish=refresh, sharded=sharded
    )
    generator = torch.Generator().manual_seed(dist.get_rank())
    completions = [torch.randint(CONFIG.vocab_size, (6,), generator=generator).tolist()]

    def loss():
        return fused_grpo_loss(sharded.module, [1, 2, 3], completions, [torch.ones(6)])

    phases = Phases(torch.device("cpu"))
    before = [p.to_local().clone() for p in sharded.module.parameters()]
    refreshes = []
    for decision in (ZERO_GRAD, ACTIVE, ZERO_GRAD):
        kwargs = {"combination": "pooled", "weights": [1.0]} if decision.active else {}
        stepping.update(phases, decision, [loss] if decision.active else [], **kwargs)
        refreshes.append(len(counts))
        if len(refreshes) == 1:
            unmoved = all(
                torch.equal(p.to_local(), b)
                for p, b in zip(sharded.module.parameters(), before, strict=True)
            )
    return {"refreshes_after_each_step": refreshes, "first_left_the_shards": unmoved}


def startup() -> dict:
    """The peak's rise while a model is sharded, beside what it holds."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(CONFIG)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = CONFIG.vocab_size * CONFIG.hidden_size * 4
    sharded, rise = peak_rise(lambda: ShardedModel(model, "fp32"))
    return {
        "rise": rise,
        "shards": local_bytes(sharded.module.parameters()),
        "full": full,
        "largest_group": max(embedding, (full - embedding) // CONFIG.num_hidden_layers),
    }


def main() -> None:
    dist.init_process_group("gloo")
    import torch.distributed.fsdp  # noqa: F401  (its import is not the model's memory)

    figures = {"rank": dist.get_rank(), "startup": startup()}
    figures["fp32"] = refreshed("fp32")
    figures["bf16-mixed"] = refreshed("bf16-mixed")
    figures["publishes"] = publishes()
    print(json.dumps(figures), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
