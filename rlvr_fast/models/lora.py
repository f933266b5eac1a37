"""LoRA on the decoder's projections, as peft computes it, and the merged decoder the rollout
engine runs.

An adapted projection computes ``W x + b + s B A dropout(x)`` with A ``[r, in]``, B ``[out, r]``
and s = lora_alpha / r (lora_alpha / sqrt(r) under rsLoRA); W and b are frozen, A starts
Kaiming-uniform and B at zero (peft's ``init_lora_weights=True``), so the adapted model starts as
the base model. Names are Hugging Face's per-projection modules (``q_proj`` ... ``down_proj``),
which our packed ``qkv_proj`` / ``gate_up_proj`` stack: an adapted ``q_proj`` is one (A, B) pair
on the q rows of ``qkv_proj``, with its own dropout draw, as in peft.

The rollout engine decodes from a twin of the model (``LoraAdapters.decoder``) whose adapted
weights are merged, W + s B A, and refreshed in place after each optimizer step (``refresh``;
the engine's CUDA graphs hold their addresses); every other tensor is the model's own. Adapter
files are peft's: ``adapter_config.json`` and ``adapter_model.safetensors`` with its names
(``base_model.model.<module>.lora_A.weight``), which ``peft.PeftModel.from_pretrained`` loads
onto the Hugging Face model of the base checkpoint; a run's saved model directory holds the
merged weights and the adapter files in its ``adapter/`` subdirectory (``ADAPTER_DIR``).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from rlvr_fast.models.config import ModelConfig
from rlvr_fast.models.qwen3 import Qwen3ForCausalLM
from rlvr_fast.utils.files import replaced_directory

# Our projection modules (by name suffix) and the Hugging Face projections stacked in each.
PROJECTIONS = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
# peft's defaults for these architectures when target_modules is None.
DEFAULT_TARGETS = ("q_proj", "v_proj")
ALL_LINEAR = "all-linear"
PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# A run's saved model keeps its adapter files in this subdirectory: beside the merged weights,
# transformers' from_pretrained would find adapter_config.json and apply the adapter again.
ADAPTER_DIR = "adapter"


@dataclass(frozen=True)
class LoraSettings:
    """What peft's ``LoraConfig`` says that rlvr_fast honours: ``rank`` (r), ``alpha``
    (lora_alpha), ``dropout`` (lora_dropout), ``targets`` (target_modules: names matched on a
    module name's last components, a regular expression matched on the whole name, or
    "all-linear": every projection but the LM head) and ``rslora`` (use_rslora)."""

    rank: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    targets: str | tuple[str, ...] = DEFAULT_TARGETS
    rslora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora_alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora_dropout must lie in [0, 1), got {self.dropout!r}")
        if not isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(sorted(self.targets)))
            if not self.targets:
                raise ValueError("LoRA target_modules is empty")
        elif self.targets != ALL_LINEAR:
            try:
                re.compile(self.targets)
            except (re.error, RecursionError, OverflowError) as err:
                raise ValueError(
                    f"LoRA target_modules {self.targets!r}: not a regular expression "
                    f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
                ) from None

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def matches(self, name: str) -> bool:
        """Whether the module of Hugging Face name ``name`` is a target (peft's rule)."""
        if self.targets == ALL_LINEAR:
            return name.rsplit(".", 1)[-1] in PART_NAMES
        if isinstance(self.targets, str):
            return re.fullmatch(self.targets, name) is not None
        return any(name == t or name.endswith(f".{t}") for t in self.targets)


PART_NAMES = frozenset(p for parts in PROJECTIONS.values() for p in parts)


def part_rows(config: ModelConfig, suffix: str) -> tuple[int, ...]:
    """Output rows of each Hugging Face projection stacked in our module ``suffix``."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {
        "self_attn.qkv_proj": (q, kv, kv),
        "self_attn.o_proj": (config.hidden_size,),
        "mlp.gate_up_proj": (config.intermediate_size, config.intermediate_size),
        "mlp.down_proj": (config.hidden_size,),
    }[suffix]


def in_features(config: ModelConfig, suffix: str) -> int:
    """The input width of our projection module ``suffix``."""
    return {
        "self_attn.qkv_proj": config.hidden_size,
        "self_attn.o_proj": config.num_attention_heads * config.head_dim,
        "mlp.gate_up_proj": config.hidden_size,
        "mlp.down_proj": config.intermediate_size,
    }[suffix]


def adapted_projections(config: ModelConfig, settings: LoraSettings) -> dict[str, tuple]:
    """Our projection modules that ``settings`` adapt (``model.layers.N.<suffix>``) -> (suffix,
    the Hugging Face parts adapted in it): what ``apply_lora`` adapts, and what the memory plan
    counts, from the model's config alone. Targets that match none are refused (ValueError)."""
    adapted = {}
    for layer in range(config.num_hidden_layers):
        for suffix, parts in PROJECTIONS.items():
            name = f"model.layers.{layer}.{suffix}"
            owner = name.rsplit(".", 1)[0]
            chosen = tuple(p for p in parts if settings.matches(f"{owner}.{p}"))
            if chosen:
                adapted[name] = (suffix, chosen)
    if not adapted:
        raise ValueError(
            f"LoRA target_modules {settings.targets!r} match none of the model's projections "
            f"({', '.join(sorted(PART_NAMES))})"
        )
    return adapted


def adapter_parameters(config: ModelConfig, settings: LoraSettings) -> int:
    """Parameters of every (A, B) pair: r x (in + rows) per adapted part."""
    total = 0
    for suffix, parts in adapted_projections(config, settings).values():
        rows = dict(zip(PROJECTIONS[suffix], part_rows(config, suffix)))
        total += sum(settings.rank * (in_features(config, suffix) + rows[p]) for p in parts)
    return total


class LoraLinear(nn.Module):
    """A frozen projection whose weight stacks ``parts`` (name -> rows, in order), with an
    (A, B) pair on each part named in ``adapted``. ``weight`` and ``bias`` are the frozen
    projection's own parameters (so their names do not change)."""

    def __init__(
        self,
        base: nn.Linear,
        parts: dict[str, int],
        adapted: tuple[str, ...],
        settings,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.parts, self.adapted = dict(parts), tuple(adapted)
        self.scaling, self.dropout = settings.scaling, settings.dropout
        factory = dict(device=base.weight.device, dtype=base.weight.dtype)
        rank, width = settings.rank, base.in_features
        self.lora_A = nn.ParameterDict(
            {p: nn.Parameter(torch.empty(rank, width, **factory)) for p in self.adapted}
        )
        self.lora_B = nn.ParameterDict(
            {p: nn.Parameter(torch.zeros(self.parts[p], rank, **factory)) for p in self.adapted}
        )
        with torch.no_grad():
            for a in self.lora_A.values():
                # Drawn on the CPU: the same values from ``generator`` on every device.
                draw = torch.empty(a.shape, dtype=torch.float32)
                a.copy_(nn.init.kaiming_uniform_(draw, a=math.sqrt(5), generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if len(self.parts) == 1:
            return out + self.low_rank(x, self.adapted[0])
        pieces = out.split(list(self.parts.values()), dim=-1)
        return torch.cat(
            [
                piece + self.low_rank(x, part) if part in self.lora_A else piece
                for part, piece in zip(self.parts, pieces)
            ],
            dim=-1,
        )

    def low_rank(self, x: torch.Tensor, part: str) -> torch.Tensor:
        """s B A dropout(x) of ``part``, in peft's order of operations."""
        x = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return F.linear(F.linear(x, self.lora_A[part]), self.lora_B[part]) * self.scaling

    def merged_weight(self) -> torch.Tensor:
        """W + s B A on each adapted part's rows, formed in float32 and rounded once to the
        weight's dtype (a bf16 product would round the delta before the sum)."""
        pieces = self.weight.split(list(self.parts.values()), dim=0)
        return torch.cat(
            [
                (piece.float() + self.delta(part)).to(piece.dtype) if part in self.lora_A else piece
                for part, piece in zip(self.parts, pieces)
            ]
        )

    def delta(self, part: str) -> torch.Tensor:
        """s B A of ``part``, float32 [rows, in]."""
        return (self.lora_B[part].float() @ self.lora_A[part].float()) * self.scaling


def apply_lora(
    model: Qwen3ForCausalLM, settings: LoraSettings, generator: torch.Generator | None = None
) -> "LoraAdapters":
    """Freeze ``model`` and put adapters on its target projections (in place), each A drawn
    from ``generator`` (a CPU one; None: torch's global one, as peft)."""
    for name, module in model.named_modules():
        leaf = not any(True for _ in module.children())
        if leaf and not name.endswith(tuple(PROJECTIONS)) and settings.matches(name):
            raise ValueError(
                f"LoRA target_modules {settings.targets!r} match {name} "
                f"({type(module).__name__}): rlvr_fast adapts only the projections "
                f"{', '.join(sorted(PART_NAMES))}"
            )
    for param in model.parameters():
        param.requires_grad_(False)
    layers = {}
    for name, (suffix, adapted) in adapted_projections(model.config, settings).items():
        parent_name, attribute = name.rsplit(".", 1)
        parts = dict(zip(PROJECTIONS[suffix], part_rows(model.config, suffix)))
        module = model.get_submodule(name)
        layers[name] = LoraLinear(module, parts, adapted, settings, generator)
        setattr(model.get_submodule(parent_name), attribute, layers[name])
    return LoraAdapters(model, settings, layers)


class LoraAdapters:
    """The adapted layers of one model (by our module name), the merged decoder the engine
    runs, and peft's adapter files."""

    def __init__(
        self, model: Qwen3ForCausalLM, settings: LoraSettings, layers: dict[str, LoraLinear]
    ) -> None:
        self.model, self.settings, self.layers = model, settings, layers
        self._decoder: Qwen3ForCausalLM | None = None
        # Whether the adapters start at zero (B = 0: the model starts as its base), or from
        # weights given (``load_peft_state``: a PeftModel's adapters, which TRL's reference
        # copies).
        self.start_at_base = True

    def parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers.values() for p in layer.parameters() if p.requires_grad]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def decoder(self) -> Qwen3ForCausalLM:
        """The model with merged weights, made on first use (after the stepping has cast the
        model to its compute dtype): every parameter is the model's own object except each
        adapted weight, which is a merged copy."""
        if self._decoder is None:
            self._decoder = merged_twin(self.model, self.layers)
        return self._decoder

    @torch.no_grad()
    def refresh(self) -> None:
        """The decoder's merged weights recomputed from the adapters, in place."""
        if self._decoder is None:
            return
        for name, layer in self.layers.items():
            self._decoder.get_submodule(name).weight.copy_(layer.merged_weight())

    def targets(self) -> list[str]:
        """The Hugging Face projection names adapted (peft's resolved target_modules)."""
        return sorted({part for layer in self.layers.values() for part in layer.adapted})

    def peft_state(
        self, adapter: str | None = None, weights: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Adapter tensors by peft's names: as saved (``adapter`` None) or as a ``PeftModel``
        names its parameters (``...lora_A.<adapter>.weight``); ``weights`` by our parameter
        names (a bf16-mixed run's fp32 masters) in place of the model's own."""
        infix = "" if adapter is None else f".{adapter}"
        weights = weights or {}
        state = {}
        for name, layer in self.layers.items():
            owner = name.rsplit(".", 1)[0]
            for part in layer.adapted:
                stem = f"{PEFT_PREFIX}{owner}.{part}"
                for matrix, tensors in (("lora_A", layer.lora_A), ("lora_B", layer.lora_B)):
                    ours = weights.get(f"{name}.{matrix}.{part}", tensors[part])
                    state[f"{stem}.{matrix}{infix}.weight"] = ours
        return state

    @torch.no_grad()
    def load_peft_state(self, state: dict[str, torch.Tensor]) -> None:
        """Start from the adapter tensors ``state`` (by peft's saved names, as ``peft_state()``
        gives them; peft's ``get_peft_model_state_dict``): every adapter's A and B, no other
        name; ValueError naming a missing, extra or misshapen tensor."""
        ours = self.peft_state()
        missing, extra = sorted(set(ours) - set(state)), sorted(set(state) - set(ours))
        if missing or extra:
            raise ValueError(
                "adapter weights do not match the adapters: "
                + (f"missing {missing[0]}" if missing else f"unexpected {extra[0]}")
                + f" ({len(missing)} missing, {len(extra)} unexpected)"
            )
        for name, tensor in ours.items():
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"adapter weight {name}: shape {tuple(state[name].shape)}, the adapter's "
                    f"{tuple(tensor.shape)}"
                )
            tensor.copy_(state[name])
        self.start_at_base = False
        self.refresh()

    def peft_config(self, base_model: str, task_type: str | None = "CAUSAL_LM") -> dict:
        """adapter_config.json as peft writes it for these settings (fields left out take
        peft's defaults when it reads the file)."""
        s = self.settings
        return {
            "peft_type": "LORA",
            "task_type": task_type,
            "base_model_name_or_path": base_model,
            "r": s.rank,
            "lora_alpha": s.alpha,
            "lora_dropout": s.dropout,
            "use_rslora": s.rslora,
            "target_modules": self.targets(),
            "bias": "none",
            "fan_in_fan_out": False,
            "init_lora_weights": True,
            "inference_mode": True,
        }

    def write_files(
        self, directory: Path, base_model: str, weights=None, task_type="CAUSAL_LM"
    ) -> None:
        """adapter_config.json + adapter_model.safetensors into an existing ``directory``
        (``weights`` as ``peft_state`` takes them)."""
        state = self.peft_state(weights=weights)
        tensors = {n: t.detach().cpu().contiguous() for n, t in state.items()}
        save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        config = self.peft_config(base_model, task_type)
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    def save(self, directory: str | os.PathLike, base_model: str) -> None:
        """The adapter files as the whole of ``directory``, atomically."""
        with replaced_directory(directory) as staging:
            self.write_files(staging, base_model)


def merged_twin(model: Qwen3ForCausalLM, layers: dict[str, LoraLinear]) -> Qwen3ForCausalLM:
    """A decoder sharing every parameter object of ``model`` but the adapted weights, which
    are merged copies (frozen, as the engine reads them under inference mode)."""
    return _twin(
        model,
        layers,
        lambda layer: nn.Parameter(layer.merged_weight().detach(), requires_grad=False),
    )


def base_twin(model: Qwen3ForCausalLM, layers: dict[str, LoraLinear]) -> Qwen3ForCausalLM:
    """The frozen base model with the adapters left out (peft's ``disable_adapter``): a
    decoder sharing every parameter object of ``model``, each adapted projection its frozen
    weight alone; nothing is copied."""
    return _twin(model, layers, lambda layer: layer.weight)


def _twin(model: Qwen3ForCausalLM, layers: dict[str, LoraLinear], weight_of) -> Qwen3ForCausalLM:
    with torch.device("meta"):
        twin = Qwen3ForCausalLM(model.config)
    for name, module in twin.named_modules():
        source = model.get_submodule(name)
        for key in list(module._parameters):
            if name in layers and key == "weight":
                module._parameters[key] = weight_of(layers[name])
            else:
                module._parameters[key] = getattr(source, key)
    return twin.eval()
