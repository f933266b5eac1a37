"""docs/trl.md lists what of TRL 1.16's GRPO surface is still refused: every field the support
table refuses and every accelerate launch option the facade refuses is named there."""

from __future__ import annotations

from pathlib import Path

from rlvr_fast.trl_compat.launch import REFUSED as REFUSED_LAUNCH_OPTIONS
from rlvr_fast.trl_compat.support import REFUSED

DOCS = Path(__file__).parents[2] / "docs" / "trl.md"


def refused_section() -> str:
    text = DOCS.read_text()
    start = text.index("## What of TRL 1.16's GRPO surface is still refused")
    return text[start : text.index("\n## ", start + 1)]


def test_every_refused_field_and_launch_option_is_listed_in_the_docs():
    section = refused_section()
    missing = [name for name in REFUSED if f"`{name}`" not in section]
    assert not missing, f"docs/trl.md does not list the refused fields {missing}"
    for option, _ in REFUSED_LAUNCH_OPTIONS.values():
        assert option in section, option
