"""Sharded training (``shard="fsdp"``): FSDP2 (``torch.distributed.fsdp.fully_shard``, DTensor)
over a 1-D mesh of the data-parallel ranks, NCCL on CUDA and gloo on CPUs, with the rollout
engine fed from the shards (verl's "hybrid engine", on rlvr_fast's engine).

Two models live on each rank:
- the trained one, ``ShardedModel.module``: a copy of the policy with ``fully_shard`` on every
  decoder layer and on the root, so each rank holds 1/W of every weight, gradient and AdamW
  moment. Under bf16-mixed (fp16-mixed) the sharded parameters are the fp32 masters and FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16 (fp16), reduce_dtype=fp32)`` casts them for each pass
  (fp16-mixed's loss scale agreed over the ranks: ``rlvr_fast.train.loss_scale``);
- the engine's, ``policy.model``: the full weights in the compute dtype, which the rollout
  engine decodes from (its CUDA graphs hold their addresses) and every pass without gradients
  reads (old and reference log-probabilities, measured figures). After each optimizer step
  ``refresh`` gathers the shards into it one FSDP group (a decoder layer, the root) at a time,
  into the same storage (with LoRA, only its adapters, a tensor at a time): the transient is
  one group, never a second full copy. A step that moves no weight (skipped, or a
  zero-gradient step with no first moment and no weight decay) publishes nothing and gathers
  nothing.

The trained copy is built without a second full copy either: its structure on the meta device,
sharded, then each rank's shards allocated and cut from the engine's weights a tensor at a time.

FSDP2's collectives run inside each pass (a layer's all-gather before its forward, its
reduce-scatter after its backward), so every rank must run the same number of passes: a rank
with fewer losses in a step than another runs passes of zero loss (``zero_pass``) until they
are level. The reduce-scatter sums (divide factor 1), as the data-parallel all_reduce does.
"""

from __future__ import annotations

import copy

import torch

from rlvr_fast.models.context import ForwardContext
from rlvr_fast.train import distributed
from rlvr_fast.train.precision import COMPUTE_DTYPES, MIXED

SHARDINGS = ("fsdp",)
SHARD_HELP = (
    "fsdp: shard the trained weights, gradients and optimizer state over the ranks (FSDP2), "
    "the rollout engine fed from the shards (None: every rank holds them all)"
)
SHARD_ERROR = "shard must be fsdp or null, got {value!r}"


def check_sharding(config) -> None:
    """What a sharded run needs before anything is built: several ranks (one line)."""
    if config.shard is None:
        return
    if distributed.world_size() < 2:
        raise ValueError(
            "shard=fsdp needs several ranks: launch with --nproc N (N >= 2) or torchrun "
            "(one process holds the whole model anyway)"
        )


def shard_policy(policy, precision: str) -> "ShardedModel":
    """The policy's trained copy sharded (``policy.sharded``); its model, the engine's copy,
    cast to the compute dtype. The shards are cut from rank 0's weights, which every rank's
    engine copy starts as (a broadcast)."""
    distributed.broadcast_parameters(policy.model)
    sharded = ShardedModel(policy.model, precision, after_refresh=policy.refresh_decoder)
    policy.sharded = sharded.module
    return sharded


def world_size_check(sharded: bool):
    """The checkpoint loader's world-size check: a checkpoint of whole tensors that a sharded
    run wrote, or one a sharded run resumes, may change the number of ranks (a step's
    questions and their seeds do not depend on it); an unsharded one may not."""

    def check(recorded: int, where, written_sharded: bool) -> None:
        if not (sharded or written_sharded):
            distributed.check_world_size(recorded, where)

    return check


class ShardedModel:
    """``model``'s trained copy, sharded over every rank (module docstring); ``model`` itself
    becomes the engine's full copy in ``precision``'s compute dtype. ``after_refresh`` runs
    after each refresh (with LoRA: the engine's merged weights recomputed from the adapters)."""

    def __init__(self, model: torch.nn.Module, precision: str, after_refresh=None) -> None:
        # Imported here: torch.distributed.fsdp takes seconds to import, which a run that does
        # not shard should not pay.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            MixedPrecisionPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )

        device = model.lm_head.weight.device
        self.mesh = init_device_mesh(device.type, (distributed.world_size(),))
        # The trained copy's structure with its parameters on the meta device: sharded first,
        # then allocated shard by shard and cut from the engine's weights, so that no rank
        # ever holds a second full copy of the model.
        module = structure_copy(model).to(
            torch.float32 if precision in MIXED else COMPUTE_DTYPES[precision]
        )
        # Frozen weights (LoRA's base) have no fp32 masters: kept in the compute dtype, as an
        # unsharded run keeps them.
        for param in module.parameters():
            if not param.requires_grad:
                param.data = param.data.to(COMPUTE_DTYPES[precision])
        mixed = None
        if precision in MIXED:
            mixed = MixedPrecisionPolicy(
                param_dtype=COMPUTE_DTYPES[precision], reduce_dtype=torch.float32
            )
        settings = {"mesh": self.mesh} if mixed is None else {"mesh": self.mesh, "mp_policy": mixed}
        for layer in module.model.layers:
            fully_shard(layer, **settings)
        fully_shard(module, **settings)
        module.to_empty(device=device)
        # The losses run through the model's inner decoder and its LM head's weight:
        # run_pass brackets them with the root's all-gather as forward would.
        register_fsdp_forward_method(module, "run_pass")
        # Gradients summed over the ranks, not averaged (the data-parallel all_reduce's SUM),
        # by a plain SUM reduce-scatter (gloo has no pre-multiplied sum).
        for sharded in module.modules():
            if hasattr(sharded, "set_gradient_divide_factor"):
                sharded.set_gradient_divide_factor(1.0)
                sharded.set_force_sum_reduction_for_comms(True)
        self.module = module
        self.cut_shards(dict(model.named_parameters()))
        self.engine_model = model.to(COMPUTE_DTYPES[precision])
        self.engine_weights = dict(model.named_parameters())
        self.after_refresh = after_refresh
        # Each FSDP group (a decoder layer, the root) with the engine's tensors of its trained
        # parameters, by their names in the group, and whether the group trains all of its
        # parameters: what refresh gathers at a time.
        self.groups = []
        for prefix, group, names in fsdp_groups(module):
            trained = [name for name in names if group.get_parameter(name).requires_grad]
            targets = [(name, self.engine_weights[f"{prefix}{name}"]) for name in trained]
            if targets:
                self.groups.append((group, targets, len(trained) == len(names)))

    @torch.no_grad()
    def refresh(self) -> None:
        """The engine's trained weights from the shards, copied into the engine's own storage
        (its tensors keep their addresses: its CUDA graphs). A group whose every weight trains
        (a decoder layer, the root) is gathered whole by one all-gather (FSDP2 casts the shards
        to the compute dtype first), copied, and freed: the transient is that group, never a
        second full copy. In a group with frozen weights (LoRA's base, which never moves) the
        trained ones (the adapters) are gathered one tensor at a time."""
        for group, targets, whole in self.groups:
            if whole:
                group.unshard()
                for name, engine in targets:
                    engine.copy_(group.get_parameter(name))
                group.reshard()
            else:
                for name, engine in targets:
                    engine.copy_(group.get_parameter(name).full_tensor())
        if self.after_refresh is not None:
            self.after_refresh()

    @torch.no_grad()
    def cut_shards(self, weights: dict[str, torch.Tensor]) -> None:
        """Each rank's shards cut from full ``weights`` (by name), one tensor at a time and
        without communication: every rank holds the same full weights."""
        from torch.distributed.tensor import distribute_tensor

        for name, param in self.module.named_parameters():
            full = weights[name].to(device=param.device)
            mine = distribute_tensor(full, self.mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(mine.to_local())

    def load_full(self, weights: dict[str, torch.Tensor]) -> None:
        """Each rank's shards cut from full ``weights`` (by name; a checkpoint's, which every
        rank loaded), then the engine's copy refreshed from them."""
        self.cut_shards(weights)
        self.refresh()

    def components(self, precision: str) -> dict:
        """The checkpoint's components beyond an unsharded run's model (the engine's copy) and
        optimizer: under a mixed precision the fp32 masters, the shards gathered whole."""
        return {"masters": ShardedWeights(self)} if precision in MIXED else {}

    def saved_weights(self, precision: str) -> dict[str, torch.Tensor] | None:
        """What final/ holds in place of the engine's weights: the fp32 masters under a mixed
        precision (gathered; every rank calls this), else None (the engine's copy is whole)."""
        return self.full_state() if precision in MIXED else None

    def after_load(self, precision: str) -> None:
        """After a checkpoint loaded into the engine's copy: in fp32 and bf16-true its weights
        are the trained ones, cut into the shards (a mixed precision's masters loaded them)."""
        if precision not in MIXED:
            self.load_full(self.engine_weights)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered whole, one at a time, onto the CPU (a collective: every rank
        calls it)."""
        return {
            name: param.full_tensor().detach().cpu()
            for name, param in self.module.named_parameters()
        }

    def zero_pass(self) -> torch.Tensor:
        """A loss of zero through every sharded module as a loss reaches them (the decoder,
        then the LM head's weight; run it through ``module.run_pass``): its all-gathers and,
        in backward, its reduce-scatters, adding nothing, for a rank with fewer losses than
        another."""
        model = self.module
        ids = torch.zeros((1, 1), dtype=torch.long, device=model.lm_head.weight.device)
        hidden = model.model(ids, ForwardContext(torch.zeros_like(ids)))
        return (hidden.sum() + model.lm_head.weight.sum()) * 0.0


def structure_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters are empty tensors on the meta device (tied ones
    stay tied): its structure without a byte of its weights."""
    meta = {
        id(param): torch.nn.Parameter(
            torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
        )
        for param in model.parameters()
    }
    return copy.deepcopy(model, memo=meta)


def fsdp_groups(module: torch.nn.Module):
    """(name prefix, FSDP module, names of the parameters its group holds) for every module
    ``fully_shard`` wrapped: its parameters but those of the groups inside it."""
    from torch.distributed.fsdp import FSDPModule

    groups = [(name, sub) for name, sub in module.named_modules() if isinstance(sub, FSDPModule)]
    for prefix, group in groups:
        inner = {
            id(param)
            for sub in group.modules()
            if sub is not group and isinstance(sub, FSDPModule)
            for param in sub.parameters()
        }
        names = [name for name, param in group.named_parameters() if id(param) not in inner]
        yield (f"{prefix}." if prefix else ""), group, names


class ShardedWeights:
    """A checkpoint component: the sharded weights gathered whole, by name (what an unsharded
    bf16-mixed run's ``MasterWeights`` keeps), and restored by cutting each rank's shards."""

    def __init__(self, sharded: ShardedModel) -> None:
        self.sharded = sharded

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.sharded.full_state()

    def check_state(self, state: dict) -> None:
        params = dict(self.sharded.module.named_parameters())
        if not isinstance(state, dict) or state.keys() != params.keys():
            raise ValueError("the checkpoint's master weights are not this model's")
        for name, param in params.items():
            tensor = state[name]
            if not isinstance(tensor, torch.Tensor) or tensor.shape != param.shape:
                raise ValueError(f"master weight {name} has the wrong shape")

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.sharded.load_full(state)


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with each sharded moment gathered whole onto the CPU, one
    tensor at a time (every rank calls this): the state an unsharded run's optimizer keeps."""
    state = optimizer.state_dict()
    return {
        "state": {
            index: {key: whole_tensor(value) for key, value in entry.items()}
            for index, entry in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Restore whole moments (``full_optimizer_state``'s, or an unsharded run's) onto the
    optimizer's sharded parameters: each rank keeps its shard of each."""
    from torch.distributed.tensor import distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    sharded = {}
    for index, entry in state["state"].items():
        param = params[index]
        sharded[index] = {
            key: distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
            if isinstance(value, torch.Tensor) and value.shape == param.shape
            else value
            for key, value in entry.items()
        }
    optimizer.load_state_dict({"state": sharded, "param_groups": state["param_groups"]})


def whole_tensor(value):
    """A sharded tensor (DTensor) gathered whole onto the CPU; anything else as it is."""
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor().detach().cpu() if full_tensor is not None else value
