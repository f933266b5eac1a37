"""LoRA's settings (``rlvr_fast.models.lora``, peft's names and defaults), a base of
``TrainConfig``: ``lora_r`` set trains rank-r adapters on the target projections with every other
weight frozen; unset (the default) trains every weight. Written to config.json only when set,
so runs that do not set them keep the config.json (and the resume signature) they had before
the settings existed. ``GRPOTrainer(peft_config=...)`` arrives at these same settings
(``rlvr_fast.trl_compat.lora``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlvr_fast.models.lora import DEFAULT_TARGETS, LoraSettings
from rlvr_fast.utils.settings import setting

# Settings that mean nothing without lora_r.
ADAPTER_SETTINGS = ("lora_alpha", "lora_dropout", "lora_target_modules", "use_rslora")


def _targets_valid(value) -> bool:
    if value is None or isinstance(value, str):
        return value != ""
    return bool(value) and all(isinstance(name, str) and name for name in value)


@dataclass
class AdapterConfig:
    lora_r: int | None = setting(
        None,
        "LoRA rank: train rank-r adapters (peft's LoRA) on lora_target_modules, every other "
        "weight frozen (None: train every weight)",
        lambda v: v is None or v >= 1,
        "lora_r must be >= 1 or None, got {value}",
        written_when_set=True,
    )
    lora_alpha: float = setting(
        8.0,
        "the adapters' update is scaled by lora_alpha / lora_r (/ sqrt(lora_r) with use_rslora)",
        lambda v: v > 0,
        "lora_alpha must be > 0, got {value}",
        written_when_set=True,
    )
    lora_dropout: float = setting(
        0.0,
        "dropout on each adapter's input in training",
        lambda v: 0 <= v < 1,
        "lora_dropout must be in [0, 1), got {value}",
        written_when_set=True,
    )
    lora_target_modules: str | list | None = setting(
        None,
        "the projections adapted: a list of Hugging Face names (q_proj, k_proj, v_proj, "
        "o_proj, gate_proj, up_proj, down_proj), a regular expression on the module name, or "
        "all-linear (None: peft's default for these models, q_proj and v_proj)",
        _targets_valid,
        "lora_target_modules must be a name list, a regular expression, all-linear or None, "
        "got {value!r}",
        written_when_set=True,
    )
    use_rslora: bool = setting(
        False, "rank-stabilised LoRA: scale by lora_alpha / sqrt(lora_r)", written_when_set=True
    )

    @property
    def lora_settings(self) -> LoraSettings | None:
        """The adapters' settings (None: no LoRA)."""
        if self.lora_r is None:
            return None
        targets = self.lora_target_modules
        if targets is None:
            targets = DEFAULT_TARGETS
        elif not isinstance(targets, str):
            targets = tuple(targets)
        return LoraSettings(
            rank=self.lora_r,
            alpha=float(self.lora_alpha),
            dropout=float(self.lora_dropout),
            targets=targets,
            rslora=self.use_rslora,
        )


def check_lora(config: AdapterConfig) -> None:
    """The adapter settings need lora_r."""
    if config.lora_r is not None:
        return
    defaults = {f.name: f.default for f in dataclasses.fields(AdapterConfig)}
    changed = [name for name in ADAPTER_SETTINGS if getattr(config, name) != defaults[name]]
    if changed:
        raise ValueError(f"{changed[0]} is a LoRA setting: set lora_r")
