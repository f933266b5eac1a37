"""``setting``: a ``TrainConfig`` field with its help text and checks in its metadata."""

from __future__ import annotations

import difflib
import typing
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


def unknown_setting_error(name: str, valid: list[str]) -> str:
    """One line for a setting that does not exist: the nearest valid names, not all of them."""
    nearest = nearest_names(name, valid)
    hint = f"did you mean {' or '.join(nearest)}? " if nearest else ""
    return (
        f"unknown setting {name!r} ({hint}`rlvr-fast train --help-settings` lists all {len(valid)})"
    )


def nearest_names(name: str, valid: list[str], most: int = 3) -> list[str]:
    """The valid names a mistyped ``name`` most likely meant: its initials (learning_rate: lr),
    names it begins or is part of (temp: temperature), then the closest spellings (lrr: lr)."""
    initials = "".join(word[:1] for word in name.split("_"))
    found = [v for v in valid if v == initials]
    if len(name) >= 3:
        found += [v for v in valid if v.startswith(name)] + [v for v in valid if name in v]
    found += difflib.get_close_matches(name, valid, n=most, cutoff=0.6)
    return list(dict.fromkeys(found))[:most]


def type_name(hint) -> str:
    """An annotation as the values a command line's user writes: ``float | None`` -> "float or
    null", ``tuple[float, float]`` -> "[float, float]"."""
    if typing.get_origin(hint) is tuple:
        return "[" + ", ".join(type_name(member) for member in typing.get_args(hint)) + "]"
    members = typing.get_args(hint) or (hint,)
    return " or ".join("null" if m is type(None) else m.__name__ for m in members)
