"""Training precision, with Lightning's names: ``fp32``, ``bf16-mixed``, ``fp16-mixed`` and
``bf16-true``.

- ``fp32``: weights, gradients and AdamW moments in float32 (the CPU's default).
- ``bf16-mixed`` (the default on CUDA): the model runs forward and backward in bfloat16, but the
  optimizer steps float32 master weights with float32 gradients and moments (``MasterWeights``).
  After every step the masters are rounded into the model's bf16 weights in place, so the
  rollout engine, which decodes from those weights (its CUDA graphs hold their addresses), sees
  each update without a copy of its own.
- ``fp16-mixed`` (TRL's ``fp16=True`` on CUDA): as bf16-mixed with float16 compute, and a dynamic
  loss scale (``rlvr_fast.train.loss_scale``): fp16 keeps 10 mantissa bits but only 5 exponent
  bits, so the loss is scaled up before backward and a step whose gradients overflow is skipped.
- ``bf16-true``: the study's recipe, bf16 weights stepped directly. At lr 1e-5 an Adam update
  is below half a bf16 ulp of any weight above ~0.0026 in magnitude, so most weights never move;
  kept to reproduce the study.
"""

from __future__ import annotations

import torch

PRECISIONS = ("fp32", "bf16-mixed", "bf16-true", "fp16-mixed")
COMPUTE_DTYPES = {
    "fp32": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "fp16-mixed": torch.float16,
}
MIXED = ("bf16-mixed", "fp16-mixed")  # float32 masters under a low-precision compute copy
# Lightning's spellings of the same recipes (its Trainer(precision=...)); "16-true" and "64-true"
# have no counterpart here.
PRECISION_ALIASES = {
    "32-true": "fp32",
    "32": "fp32",
    "16-mixed": "fp16-mixed",
    "16": "fp16-mixed",
    "bf16": "bf16-mixed",
}


def canonical_precision(name: str) -> str:
    """A precision or one of Lightning's aliases, as the name config.json records."""
    return PRECISION_ALIASES.get(name, name)


def resolve_precision(precision: str | None, device: torch.device) -> str:
    """``precision``, or (None) the device's default: bf16-mixed on CUDA, fp32 elsewhere."""
    if precision is None:
        return "bf16-mixed" if torch.device(device).type == "cuda" else "fp32"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def load_dtype(precision: str) -> torch.dtype:
    """The dtype to load a run's checkpoint in: its compute dtype, but float32 under a mixed
    precision, whose masters start from the checkpoint's own values (the model is cast after)."""
    return torch.float32 if precision in MIXED else COMPUTE_DTYPES[precision]


class MasterWeights:
    """Float32 copies of a model's trainable parameters, which the optimizer steps in their
    place. ``named_parameters()`` lists them as the model names its own, so that the Polyak
    average and the checkpoint see the masters."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.live = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.masters = {
            name: torch.nn.Parameter(p.detach().to(torch.float32, copy=True))
            for name, p in self.live.items()
        }

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.masters.values())

    def named_parameters(self):
        return iter(self.masters.items())

    @torch.no_grad()
    def take_gradients(self) -> None:
        """Add each model parameter's gradient to its master's, in float32, and free it."""
        for name, master in self.masters.items():
            grad = self.live[name].grad
            if grad is None:
                continue
            if master.grad is None:
                master.grad = grad.to(torch.float32)
            else:
                master.grad.add_(grad)
            self.live[name].grad = None

    @torch.no_grad()
    def publish(self) -> None:
        """Round the masters into the model's weights, in place (their storage stays put)."""
        for name, master in self.masters.items():
            self.live[name].copy_(master)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: master.detach().cpu() for name, master in self.masters.items()}

    def check_state(self, state: dict) -> None:
        if not isinstance(state, dict) or state.keys() != self.masters.keys():
            raise ValueError("the checkpoint's master weights are not this model's")
        for name, master in self.masters.items():
            tensor = state[name]
            if (
                not isinstance(tensor, torch.Tensor)
                or tensor.shape != master.shape
                or tensor.dtype != torch.float32
            ):
                raise ValueError(f"master weight {name} has the wrong shape or dtype")

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, master in self.masters.items():
            master.copy_(state[name])
        self.publish()
