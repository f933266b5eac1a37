"""The ``activation_checkpointing`` setting: every decoder layer (true), none (false), or the
first layers the memory plan says must be ("auto": ``auto_checkpointing_plan``, which
``rlvr_fast.train.memory_plan.plan_for_training`` calls), and the memory a CPU run plans "auto"
on."""

from __future__ import annotations

import os
from dataclasses import replace

from rlvr_fast.models.config import ModelConfig
from rlvr_fast.train.memory_plan import MemoryPlan, RunShape, plan_memory

CHECKPOINTING_HELP = (
    "recompute each decoder layer in backward instead of saving its activations (about "
    '1/layers of the activation memory for one more forward); "auto": only the first '
    "layers the memory plan says must be, on the GPU's memory or the host's available RAM"
)
CHECKPOINTING_ERROR = 'activation_checkpointing must be true, false or "auto", got {value!r}'


def is_checkpointing(value) -> bool:
    return isinstance(value, bool) or value == "auto"


def host_memory() -> int:
    """Bytes a run on the CPU can plan on: the host's available memory (``MemAvailable``) and
    what this process already holds (``VmRSS``: its loaded weights count, as the GPU plan counts
    the allocated ones); without /proc, the free pages."""
    try:
        fields = dict(
            line.split(":", 1)
            for path in ("/proc/meminfo", "/proc/self/status")
            for line in open(path).read().splitlines()
            if ":" in line
        )
        return (int(fields["MemAvailable"].split()[0]) + int(fields["VmRSS"].split()[0])) * 1024
    except (OSError, KeyError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def auto_checkpointing_plan(config: ModelConfig, device_memory: int, run: RunShape) -> MemoryPlan:
    """``activation_checkpointing="auto"``: the plan that checkpoints the fewest decoder layers
    (the first k) with which the KV cache still holds every row a step samples (G x Q) at full
    length; failing that, the fewest with which the run fits at all; failing that, every layer
    (whose plan then names what does not fit)."""
    layers = config.num_hidden_layers
    plans = [
        plan_memory(config, device_memory, replace(run, activation_checkpointing=k))
        for k in range(layers + 1)
    ]
    roomy = [p for p in plans if p.fits and p.rows_at_full_length >= p.rows_wanted]
    fitting = [p for p in plans if p.fits]
    chosen = (roomy or fitting or plans[-1:])[0]
    if roomy:
        why = "the fewest that leave the KV cache room for every row of a step"
    elif fitting:
        why = "the fewest with which the run fits (the KV cache holds fewer rows than a step)"
    else:
        why = "all: the run does not fit even so"
    chosen.notes.append(
        f"activation_checkpointing auto: {chosen.checkpointed_layers} of {layers} layers "
        f"checkpointed, {why}"
    )
    return chosen
