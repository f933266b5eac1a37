"""Every ``TrainConfig`` setting as its reader sees it: section, type, default and help, read
from the fields' metadata (the one declaration); ``rlvr-fast train --help-settings`` and
docs/settings.md print them (``rlvr_fast.cli.reference``).

The sections are those ``TrainConfig``'s docstring lists under "Settings by section" (a test
keeps every field in exactly one of them); a name written ``_neg`` after ``sapo_temperature_pos``
stands for ``sapo_temperature_neg``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from rlvr_fast.train import config as config_module
from rlvr_fast.train.config import TrainConfig, setting_fields
from rlvr_fast.utils.settings import flat_fields, flat_hints, is_component, type_name

UNLISTED = "other"


@dataclass(frozen=True)
class Setting:
    name: str
    section: str
    type: str
    default: object
    help: str


def settings() -> list[Setting]:
    """Every setting, grouped by section in the docstring's order, fields in their own order."""
    sections = docstring_sections()
    order = {section: i for i, section in enumerate(dict.fromkeys(sections.values()))}
    hints = flat_hints(TrainConfig)
    found = [
        Setting(
            f.name,
            sections.get(f.name, UNLISTED),
            type_name(hints[f.name]),
            f.default,
            f.metadata["help"],
        )
        for f in setting_fields().values()
    ]
    return sorted(found, key=lambda s: order.get(s.section, len(order)))


def docstring_sections() -> dict[str, str]:
    """Each field named under "Settings by section" in ``rlvr_fast.train.config``'s docstring,
    with its section's title; a component named there (``policy_loss``) puts every setting
    it nests in that section."""
    text = config_module.__doc__.split("Settings by section")[1].split("\n\n")[0]
    fields = set(setting_fields())
    components = {
        f.name: list(flat_fields(f.metadata["component"]))
        for f in dataclasses.fields(TrainConfig)
        if is_component(f)
    }
    sections = {}
    for item in re.split(r"\n- ", text)[1:]:
        title, _, names = item.partition(":")
        title = re.sub(r"\s*\(.*\)", "", title).strip()
        previous = ""
        for name in re.findall(r"``([\w.]+)``", names):
            if name.startswith("_") and previous:
                name = previous.rsplit("_", 1)[0] + name
            if name in fields:
                sections.setdefault(name, title)
                previous = name
            for nested in components.get(name, ()):
                sections.setdefault(nested, title)
    return sections


def render_value(value) -> str:
    """A default as it is written after ``--set KEY=`` (JSON's spelling)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(render_value(v) for v in value) + "]"
    return str(value)
