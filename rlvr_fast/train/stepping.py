"""Optimizer stepping: what a step does with its ``StepDecision`` (``rlvr_fast.train.decision``).

An active step computes the step's gradient from its loss functions (each runs one forward and
one backward: one per step, or on a multi-question step one per contributing question, combined
as ``rlvr_fast.train.steps`` says: unit gradients averaged, ``accumulate_unit_gradients``, or
losses pooled with their weights, ``accumulate_pooled_gradients``), all-reduces it over the ranks
of a data-parallel run, clips it (the norm is logged before clipping) and takes an optimizer
step: torch's AdamW, or with ``optimizer="adafactor"`` transformers' Adafactor as TRL builds it
(``rlvr_fast.train.adafactor``). An inactive step takes a zero-gradient step, through the fused
AdamW kernel, or none (Adafactor steps zero gradients itself: the fused kernel is AdamW's).
Under ``bf16-mixed`` (``rlvr_fast.train.precision``) the optimizer steps float32 master weights:
each backward's bf16 gradients are added to the masters' float32 ones, the all-reduce, the norm
and clipping run on those, and the stepped masters are rounded into the model's weights;
``fp16-mixed`` does the same in float16, with the loss scaled (``rlvr_fast.train.loss_scale``):
the masters' gradients are unscaled after the all-reduce, and a step whose gradients overflow
takes no optimizer step (its ``Update`` says so, with no gradient norm) and halves the scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlvr_fast.ops.zero_grad_adamw import zero_grad_adamw_
from rlvr_fast.train import distributed
from rlvr_fast.train.adafactor import Adafactor, check_adafactor_state
from rlvr_fast.train.decision import StepDecision
from rlvr_fast.train.loss_scale import LossScaler
from rlvr_fast.train.precision import COMPUTE_DTYPES, MIXED, MasterWeights
from rlvr_fast.train.sharding import ShardedModel, full_optimizer_state, load_full_optimizer_state
from rlvr_fast.utils.phases import Phases


@dataclass
class Update:
    """What a step's update did: the loss and the gradient norm before clipping (None when no
    backward ran); on multi-question steps, each contributing question's loss and gradient norm
    before the combination (the norm only under unit_norm: a pooled step never forms one
    question's gradient alone)."""

    loss: float | None = None
    grad_norm: float | None = None
    question_losses: list[float] = field(default_factory=list)
    question_grad_norms: list[float | None] = field(default_factory=list)
    # fp16-mixed: the scale this step's backward ran at and whether the overflow skipped it.
    loss_scale: dict | None = None


OPTIMIZERS = ("adamw", "adafactor")
ADAMW_DEFAULTS = ((0.9, 0.999), 1e-8)  # TrainConfig's betas and eps


class OptimizerStepping:
    """AdamW (or Adafactor) over ``model``'s trainable parameters (under a mixed precision over
    their float32 masters), stepped by each step's decision. The model is cast to
    ``precision``'s compute dtype first; the masters copy its weights before the cast.
    ``after_publish`` runs after every step that moved the weights (with LoRA: the engine's
    merged weights refreshed)."""

    def __init__(
        self,
        model: torch.nn.Module,
        config,
        precision: str = "fp32",
        after_publish=None,
        *,
        sharded: ShardedModel | None = None,
    ) -> None:
        # Sharded (rlvr_fast.train.sharding): the optimizer steps the shards, which under a
        # mixed precision are the fp32 masters themselves (FSDP2 casts them for each pass).
        self.sharded = sharded
        if sharded is not None:
            model = sharded.module
        self.model = model
        self.precision = precision
        self.after_publish = after_publish
        self.masters = MasterWeights(model) if precision in MIXED and sharded is None else None
        self.scaler = LossScaler() if precision == "fp16-mixed" else None
        if sharded is None:
            model.to(COMPUTE_DTYPES[precision])
        self.params = [p for p in model.parameters() if p.requires_grad]
        # What the optimizer steps and the gradient norm, all-reduce and clipping read.
        self.stepped = self.masters.parameters() if self.masters is not None else self.params
        self.max_grad_norm = config.max_grad_norm
        self.fused_zero_grad_step = config.fused_zero_grad_step
        named = (
            self.masters.named_parameters()
            if self.masters is not None
            else ((name, p) for name, p in model.named_parameters() if p.requires_grad)
        )
        self.optimizer = make_optimizer(named, model.config, config)

    @property
    def num_params(self) -> int:
        """The model's parameters, frozen ones included (a LoRA forward runs them all): the P
        of the ledger's FLOPs."""
        return sum(p.numel() for p in self.model.parameters())

    def update(
        self,
        phase: Phases,
        decision: StepDecision,
        loss_fns,
        *,
        combination: str | None = None,
        weights: list[float] | None = None,
    ) -> Update:
        """Step on ``decision``: ``loss_fns`` (one, or with a ``combination`` one per
        contributing question of this rank: "unit_norm", or "pooled" with ``weights``) run only
        on an active step."""
        update = Update()
        scale = self.scaler.scale if self.scaler is not None else None
        if decision.active:
            self.model.train()
            # Sharded: the passes of the rank with the most, counted before any pass (FSDP2's
            # all-gathers and reduce-scatters are collectives inside each pass); unit gradients
            # take every rank's questions in turn, with no pass to level.
            passes = 0
            if self.sharded is not None:
                passes = len(loss_fns)
                if combination != "unit_norm":
                    passes = distributed.max_over_ranks(passes)
            if combination == "unit_norm" and self.sharded is not None:
                update = self.accumulate_sharded_unit_gradients(
                    phase, loss_fns, decision.contributing
                )
            elif combination == "unit_norm":
                update = self.accumulate_unit_gradients(phase, loss_fns, decision.contributing)
            elif combination == "pooled":
                update = self.accumulate_pooled_gradients(phase, loss_fns, weights)
            else:
                (loss_fn,) = loss_fns
                update.loss = self.backward(phase, loss_fn)
            if self.sharded is not None:
                self.zero_passes(phase, passes - len(loss_fns))
            elif distributed.world_size() > 1:
                with phase("all_reduce"):
                    distributed.all_reduce_gradients(self.stepped)
            finite = self.scaler is None or self.scaler.unscale_(self.stepped)
            with phase("optimizer"):
                if finite:
                    update.grad_norm = self.clip_gradients()
                    self.optimizer.step()
                    # Freed before the publish: a sharded run's refresh gathers beside them.
                    self.optimizer.zero_grad(set_to_none=True)
                    self.publish()
        elif decision.optimizer_step:
            finite = True
            with phase("optimizer"):
                moves = self.zero_grad_step_moves()
                self.zero_grad_step()
                if moves:
                    self.publish()
        if self.scaler is not None and decision.optimizer_step:
            self.scaler.update(finite)
            update.loss_scale = {"scale": scale, "skipped": not finite}
        self.optimizer.zero_grad(set_to_none=True)
        return update

    def zero_passes(self, phase: Phases, count: int) -> None:
        """Sharded: ``count`` passes of zero loss, which level this rank's passes with those of
        the rank with the most."""
        for _ in range(count):
            with phase("forward"):
                loss = self.model.run_pass(self.sharded.zero_pass)
            with phase("backward"):
                loss.backward()

    def run_loss(self, loss_fn) -> torch.Tensor:
        """``loss_fn()``, through the sharded model's root gathering when sharded."""
        return self.model.run_pass(loss_fn) if self.sharded is not None else loss_fn()

    def publish(self) -> None:
        """Under bf16-mixed, the stepped masters rounded into the model's weights; then
        ``after_publish``."""
        if self.masters is not None:
            self.masters.publish()
        if self.after_publish is not None:
            self.after_publish()

    def backward(self, phase: Phases, loss_fn) -> float:
        """Forward (``loss_fn``) and backward into the parameters' .grad; the loss."""
        with phase("forward"):
            loss = self.run_loss(loss_fn)
        with phase("backward"):
            self.scaled(loss).backward()
            if self.masters is not None:
                self.masters.take_gradients()
        return float(loss.detach())

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to run backward from: times the loss scale under fp16-mixed."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    def accumulate_unit_gradients(self, phase: Phases, loss_fns, questions: int) -> Update:
        """p.grad = (1/n) sum_q g_q / |g_q| over the n = ``questions`` contributing questions of
        the step (over all ranks), g_q the gradient of loss q alone (its own backward) and |g_q|
        its L2 norm over all parameters; a question whose gradient is exactly zero adds nothing.
        Every question then moves the weights as much as any other whatever its length or
        advantages, and with max_grad_norm >= 1 clipping never binds (|average| <= 1). The
        returned loss is the surrogate (1/n) sum_q L_q / |g_q| whose gradient this is; on
        several ranks this is the rank's part of the sum (zeros when it has no loss functions)."""
        totals = [torch.zeros_like(p) for p in self.stepped]
        update = Update(loss=0.0)
        for loss_fn in loss_fns:
            loss = self.backward(phase, loss_fn)
            with phase("backward"):
                grads = [p.grad for p in self.stepped if p.grad is not None]
                norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
                scale = 1.0 / (questions * norm) if norm > 0 else 0.0
                for p, total in zip(self.stepped, totals):
                    if p.grad is not None:
                        total.add_(p.grad, alpha=scale)
                    p.grad = None
            update.loss += scale * loss
            update.question_losses.append(loss)
            update.question_grad_norms.append(norm)
        for p, total in zip(self.stepped, totals):
            p.grad = total
        return update

    def accumulate_sharded_unit_gradients(self, phase: Phases, loss_fns, questions: int) -> Update:
        """``accumulate_unit_gradients`` sharded. A pass's reduce-scatter sums what every rank's
        backward gave, so the ranks take the step's questions in turn: in each pass one rank
        runs its question's loss and the others a zero pass, which leaves every rank its shards
        of that question's gradient alone; |g_q| is the norm of every rank's shards (a DTensor
        norm: the squared norms of the shards all-reduced), the same on every rank. Each rank
        runs every question's pass (its own losses, zero passes for the others'), against
        data parallel's own questions only."""
        counts = distributed.all_gather(len(loss_fns))
        mine = iter(loss_fns)
        totals = [torch.zeros_like(p) for p in self.stepped]
        update = Update(loss=0.0)
        for owner, count in enumerate(counts):
            for _ in range(count):
                loss = None
                if owner == distributed.rank():
                    loss = self.backward(phase, next(mine))
                else:
                    self.zero_passes(phase, 1)
                with phase("backward"):
                    grads = [p.grad for p in self.stepped if p.grad is not None]
                    norm = float(torch.nn.utils.get_total_norm(grads).full_tensor())
                    scale = 1.0 / (questions * norm) if norm > 0 else 0.0
                    for p, total in zip(self.stepped, totals):
                        if p.grad is not None:
                            total.add_(p.grad, alpha=scale)
                        p.grad = None
                if loss is not None:
                    update.loss += scale * loss
                    update.question_losses.append(loss)
                    update.question_grad_norms.append(norm)
        for p, total in zip(self.stepped, totals):
            p.grad = total
        return update

    def accumulate_pooled_gradients(self, phase: Phases, loss_fns, weights: list[float]) -> Update:
        """p.grad = sum_q c_q grad L_q, the gradient of the step's one loss sum_q c_q L_q
        (``weights`` c_q), one forward and backward per question accumulating into .grad; the
        returned loss is that sum (on several ranks this rank's part). A parameter no loss
        reached gets a zero gradient (every rank then joins the all_reduce, and AdamW steps
        every parameter, as on a backward of TRL's one loss)."""
        update = Update(loss=0.0)
        for loss_fn, weight in zip(loss_fns, weights, strict=True):
            with phase("forward"):
                loss = self.run_loss(loss_fn)
            with phase("backward"):
                self.scaled(loss * weight).backward()
                if self.masters is not None:  # summed in fp32, not in the bf16 .grad
                    self.masters.take_gradients()
            value = float(loss.detach())
            update.loss += weight * value
            update.question_losses.append(value)
            update.question_grad_norms.append(None)
        for p in self.stepped:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return update

    def clip_gradients(self) -> float:
        """Total gradient norm before clipping (clipping only when max_grad_norm is set)."""
        max_norm = self.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.stepped, max_norm if max_norm else float("inf"))
        if self.sharded is not None:  # the norm of the shards' norms, a DTensor
            norm = norm.full_tensor()
        return float(norm)

    def zero_grad_step_moves(self) -> bool:
        """Whether a zero-gradient step will move any weight: where the learning rate is not
        zero, weight decay, or (AdamW) a first moment not zero everywhere. One that moves none
        publishes nothing (sharded: gathers nothing); sharded, a rank's shards decide with
        every other rank's (an all_reduce of one flag)."""
        moves = any(
            group["lr"] != 0
            and (
                group["weight_decay"] != 0
                or any(
                    _nonzero(self.optimizer.state.get(p, {}).get("exp_avg"))
                    for p in group["params"]
                )
            )
            for group in self.optimizer.param_groups
        )
        if self.sharded is not None:
            moves = bool(distributed.max_over_ranks(int(moves), "a zero-gradient step's moves"))
        return moves

    def zero_grad_step(self) -> None:
        """One AdamW step with zero gradients. Each step's rollout reads the weights this step
        moves (weight decay and momentum move them even at g = 0), so steps are never deferred
        and folded here; the fused kernel still skips allocating and streaming P zeros."""
        if self.fused_zero_grad_step:
            zero_grad_adamw_(self.optimizer, steps=1)
            return
        for p in self.stepped:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()

    def state_dict(self) -> dict:
        if self.sharded is not None:
            return full_optimizer_state(self.optimizer)
        return self.optimizer.state_dict()

    def check_state(self, state: dict) -> None:
        if isinstance(self.optimizer, Adafactor):
            check_adafactor_state(state, self.optimizer)
        else:
            check_optimizer_state(state, self.stepped)

    def load_state_dict(self, state: dict) -> None:
        if self.sharded is not None:
            load_full_optimizer_state(self.optimizer, state)
        else:
            self.optimizer.load_state_dict(state)


def _nonzero(moment) -> bool:
    """Whether an optimizer state tensor (this rank's shard of a sharded one) holds a value
    other than zero; False when there is none."""
    if moment is None:
        return False
    local = moment.to_local() if hasattr(moment, "to_local") else moment
    return bool(local.any())


def make_optimizer(named_params, model_config, config) -> torch.optim.Optimizer:
    """The run's optimizer (``config.optimizer``) over ``named_params`` (name, parameter) of a
    model with ``model_config``."""
    if config.optimizer == "adafactor":
        return Adafactor(named_params, model_config, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.AdamW(
        [p for _, p in named_params],
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=True if config.adamw_fused else None,
    )


def check_optimizer_settings(config) -> None:
    """Settings that only one optimizer has (the zero-gradient kernel reproduces the
    single-tensor AdamW step, betas and eps are AdamW's), and fp16-mixed's loss scale."""
    if config.adamw_fused and config.fused_zero_grad_step:
        raise ValueError(
            "adamw_fused needs fused_zero_grad_step=false: the zero-gradient kernel "
            "reproduces the single-tensor AdamW step's rounding, not the fused kernel's"
        )
    unit_norm = config.questions_per_step > 1 and config.combine_questions == "unit_norm"
    if config.precision == "fp16-mixed" and unit_norm:
        raise ValueError(
            "precision fp16-mixed scales the loss: combine_questions unit_norm would normalise "
            "the scaled gradients (use combine_questions pooled)"
        )
    if config.optimizer != "adafactor":
        return
    if config.fused_zero_grad_step:
        raise ValueError(
            "optimizer adafactor needs fused_zero_grad_step=false: the zero-gradient kernel is "
            "AdamW's (Adafactor steps zero gradients itself)"
        )
    if config.adamw_fused:
        raise ValueError("adamw_fused is an AdamW kernel: optimizer adafactor takes none")
    if (config.betas, config.eps) != ADAMW_DEFAULTS:
        raise ValueError(
            "betas and eps are AdamW's: optimizer adafactor keeps no first moment and takes "
            "transformers' eps, as TRL's optim='adafactor' does"
        )


def check_optimizer_state(state: dict, params: list[torch.Tensor]) -> None:
    """AdamW moments of a checkpoint have the shapes of the run's parameters (torch's
    load_state_dict checks only the number of parameters, and a wrong shape would fail at the
    next optimizer step)."""
    moments = state["state"]
    if not isinstance(moments, dict):
        raise ValueError("optimizer state is not a mapping")
    for index, entry in moments.items():
        if not isinstance(index, int) or not 0 <= index < len(params):
            raise ValueError(f"optimizer state for parameter {index!r}, the run has {len(params)}")
        for name in ("exp_avg", "exp_avg_sq"):
            tensor = entry[name]
            if not isinstance(tensor, torch.Tensor) or tensor.shape != params[index].shape:
                raise ValueError(f"optimizer {name} of parameter {index} has the wrong shape")
