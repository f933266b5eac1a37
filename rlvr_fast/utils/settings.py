"""``setting``: a dataclass field declared once, with its default, help text and checks in the
field's metadata; every copy of the setting elsewhere (``TrainConfig``'s field, the facade's
``GRPOConfig`` field and its line of ``support.HONOURED``) is derived from that declaration.

A setting's ``metadata`` holds:
- ``help``: what it does (``rlvr-fast train --help-settings``, TRL's parser help);
- ``checks``: (check(value) -> bool, error) pairs; a false check raises ``ValueError(error)``,
  the error formatted with ``value`` and the field's ``name`` (``check_settings``);
- ``only_for``: None, or (the sampler the setting belongs to, the error another sampler raises
  for a value other than the default);
- ``written_when_set``: config.json (and so the resume signature) holds the setting only when
  it is not the default, which is what runs written before the setting existed did;
- ``trl``: TRL's ``GRPOConfig`` field this setting is (same type and default, honoured as the
  help says): True when it has the setting's name, else its name, or None (``trl_name``);
- ``run_name``: for a setting of an op (``rlvr_fast.ops.policy_loss.PolicyLossSettings``), the
  name of the run's setting (``TrainConfig``'s field) it is derived into, or None: its own;
- ``part``: for a setting of an op, the term it shapes, which places it among the run's
  settings (``rlvr_fast.train.policy_config``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable


def setting(
    default,
    help: str,
    check: Callable | None = None,
    error: str = "",
    *,
    also: tuple[Callable, str] | None = None,
    only_for: tuple[str, str] | None = None,
    written_when_set: bool = False,
    trl: bool | str | None = None,
    run_name: str | None = None,
    part: str | None = None,
):
    """A field with its help text; ``check(value)`` false raises ``error`` (formatted with the
    value), then ``also``, a second (check, error). The other keywords: the module docstring."""
    checks = tuple(c for c in ((check, error), also) if c is not None and c[0] is not None)
    metadata = {
        "help": help,
        "checks": checks,
        "only_for": only_for,
        "written_when_set": written_when_set,
        "trl": trl,
        "run_name": run_name,
        "part": part,
    }
    return dataclasses.field(default=default, metadata=metadata)


def is_setting(f: dataclasses.Field) -> bool:
    """A field declared by ``setting`` (an op's other fields are values of one call)."""
    return "help" in f.metadata


def check_settings(instance) -> None:
    """Each setting's checks, in field order: the first that fails raises its error."""
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        for check, error in f.metadata.get("checks", ()):
            if not check(value):
                raise ValueError(error.format(value=value, name=f.name))


def trl_name(f: dataclasses.Field) -> str | None:
    """The name of TRL's GRPOConfig field that setting ``f`` is, or None."""
    trl = f.metadata.get("trl")
    return f.name if trl is True else trl or None


def one_of(valid: tuple) -> Callable:
    return lambda value: value in valid


def must_be_one_of(name: str, valid: tuple) -> str:
    """The error of ``one_of(valid)``, formatted later with the value."""
    return f"{name} must be one of {', '.join(valid)}, got {{value!r}}"
