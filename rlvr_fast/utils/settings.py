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

A settings class may nest others by concept (``component``: a field holding the component's
settings); ``flat_fields`` lists the settings of a class and of its components, flattened
(the components' first, as their fields come first), and ``check_settings`` checks them all.
"""

from __future__ import annotations

import dataclasses
import math
import typing
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


def component(cls) -> dataclasses.Field:
    """A field holding the nested settings of class ``cls`` (its defaults)."""
    return dataclasses.field(default_factory=cls, metadata={"component": cls})


def is_component(f: dataclasses.Field) -> bool:
    return "component" in f.metadata


def flat_fields(cls) -> dict[str, dataclasses.Field]:
    """The settings of ``cls`` by name, each component's in its place, flattened."""
    flat = {}
    for f in dataclasses.fields(cls):
        flat.update(flat_fields(f.metadata["component"]) if is_component(f) else {f.name: f})
    return flat


def flat_hints(cls) -> dict:
    """The type of each setting of ``flat_fields(cls)``, read from the annotations."""
    hints, own = {}, typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hints.update(
            flat_hints(f.metadata["component"]) if is_component(f) else {f.name: own[f.name]}
        )
    return hints


class NestedSettings:
    """The base of a dataclass of settings (``@dataclass(init=False)``) that nests components:
    built from the settings' flat names (config.json's), each into its component, and read and
    set by them too (``config.epsilon`` is ``config.policy_loss.epsilon``). ``__post_init__``
    runs after, as a dataclass's."""

    def __init__(self, **settings) -> None:
        unknown = sorted(set(settings) - set(flat_fields(type(self))))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.__init__() got an unexpected keyword argument "
                f"{unknown[0]!r}"
            )
        for f in dataclasses.fields(self):
            if is_component(f):
                cls = f.metadata["component"]
                value = cls(**{k: settings[k] for k in flat_fields(cls) if k in settings})
            else:
                value = settings.get(f.name, f.default)
            object.__setattr__(self, f.name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        pass

    def _holder(self, name: str):
        """The component holding setting (or property) ``name``, or None: ours."""
        if name.startswith("_"):
            return None
        for f in dataclasses.fields(self):
            part = self.__dict__.get(f.name) if is_component(f) else None
            if part is not None and hasattr(part, name):
                return part
        return None

    def __getattr__(self, name: str):
        part = self._holder(name)
        if part is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(part, name)

    def __setattr__(self, name: str, value) -> None:
        part = self._holder(name)
        if part is None:
            object.__setattr__(self, name, value)
        else:
            setattr(part, name, value)


def is_setting(f: dataclasses.Field) -> bool:
    """A field declared by ``setting`` (an op's other fields are values of one call)."""
    return "help" in f.metadata


def check_settings(instance) -> None:
    """Each setting's checks, in field order (a component's where it is nested): the first
    that fails raises its error."""
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        if is_component(f):
            check_settings(value)
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


def check_types(instance) -> None:
    """Each setting's value against its annotation (ints are accepted where floats are; a pair
    of numbers, read from JSON as a list, becomes a tuple of floats; no float may be infinite
    or NaN), in the order of ``flat_fields``: the first wrong one raises ValueError."""
    for name, hint in flat_hints(type(instance)).items():
        value, allowed = getattr(instance, name), _accepted(hint)
        if allowed is tuple:
            if not _is_number_pair(value):
                raise ValueError(_wrong_type(name, hint, value))
            value = tuple(float(b) for b in value)
            setattr(instance, name, value)
        elif not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise ValueError(_wrong_type(name, hint, value))
        # JSON reads Infinity and NaN, which pass "> 0" checks and then poison every step.
        values = value if isinstance(value, tuple) else (value,)
        if any(isinstance(v, float) and not math.isfinite(v) for v in values):
            raise ValueError(f"{name} must be a finite number, got {value!r}")


def _wrong_type(name: str, hint, value) -> str:
    return f"{name} is of type {type_name(hint)}, got {value!r}"


def _accepted(hint) -> tuple | type:
    """The Python types an annotation accepts; ``tuple`` for a pair of numbers."""
    if typing.get_origin(hint) is tuple:
        return tuple
    members = typing.get_args(hint) or (hint,)
    accepted = set()
    for member in members:
        accepted |= {float: {int, float}}.get(member, {member})
    return tuple(sorted(accepted, key=lambda t: t.__name__))


def _is_number_pair(value) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) for b in value
    )


def type_name(hint) -> str:
    """An annotation as the values a command line's user writes: ``float | None`` -> "float or
    null", ``tuple[float, float]`` -> "[float, float]"."""
    if typing.get_origin(hint) is tuple:
        return "[" + ", ".join(type_name(member) for member in typing.get_args(hint)) + "]"
    members = typing.get_args(hint) or (hint,)
    return " or ".join("null" if m is type(None) else m.__name__ for m in members)
