"""``setting``: a ``TrainConfig`` field with its help text and checks in its metadata."""

from __future__ import annotations

from dataclasses import field
from typing import Callable

FLAT_ONLY = (
    "flat",
    "loss_type, scale_rewards, tempered_logprobs, mask_truncated, advantage_std and TRL's "
    "policy-loss settings apply to flat arms only",
)


def setting(
    default,
    help: str,
    check: Callable | None = None,
    error: str = "",
    *,
    also: tuple[Callable, str] | None = None,
    only_for: tuple[str, str] | None = None,
    written_when_set: bool = False,
):
    """A field with its help text; ``check(value)`` false raises ``error`` (formatted with the
    value), then ``also``, a second (check, error). ``only_for``: (the sampler the setting
    belongs to, the error another sampler raises for a value other than the default).
    ``written_when_set``: config.json (and so the resume signature) holds the setting only when
    it is not the default, which is what runs written before the setting existed did."""
    checks = tuple(c for c in ((check, error), also) if c is not None and c[0] is not None)
    metadata = {
        "help": help,
        "checks": checks,
        "only_for": only_for,
        "written_when_set": written_when_set,
    }
    return field(default=default, metadata=metadata)


def one_of(valid: tuple[str, ...]) -> Callable:
    return lambda value: value in valid


def _valid(name: str, valid: tuple[str, ...]) -> str:
    return f"{name} must be one of {', '.join(valid)}, got {{value!r}}"
