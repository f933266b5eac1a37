"""What a reader of the settings (the command line, config files, ``--help-settings``) says
about them: the nearest names of an unknown one. The settings
themselves are declared by ``rlvr_fast.utils.settings.setting``."""

from __future__ import annotations

import difflib


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
