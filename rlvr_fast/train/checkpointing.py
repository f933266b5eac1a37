"""The ``activation_checkpointing`` setting: every decoder layer (true), none (false), or the
first layers the memory plan says must be ("auto", ``rlvr_fast.train.memory_plan``
``auto_checkpointing_plan``), and the memory a CPU run plans "auto" on."""

from __future__ import annotations

import os

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
