"""docs/cli.md and docs/settings.md are what the code generates (``rlvr_fast.cli.reference``):
a new option, setting, default or help text that was not regenerated fails here."""

from __future__ import annotations

import sys

import pytest

from rlvr_fast.cli.reference import DOCS, PAGES, PAGES_PYTHON, main


@pytest.mark.parametrize("name", list(PAGES))
def test_the_committed_reference_is_the_generated_one(name):
    if name == "cli.md" and sys.version_info[:2] != PAGES_PYTHON:
        pytest.skip(f"argparse's layout is that of Python {PAGES_PYTHON}, not this one's")
    committed = (DOCS / name).read_text(encoding="utf-8")
    assert committed == PAGES[name](), (
        f"docs/{name} is out of date: run python -m rlvr_fast.cli.reference"
    )


def test_the_check_fails_on_a_stale_page(tmp_path, monkeypatch, capsys):
    for name in PAGES:
        (tmp_path / name).write_text(PAGES[name]())
    monkeypatch.setattr("rlvr_fast.cli.reference.DOCS", tmp_path)
    assert main(["--check"]) == 0
    (tmp_path / "settings.md").write_text(PAGES["settings.md"]().replace("AdamW", "Adam"))
    assert main(["--check"]) == 1
    assert "docs/settings.md is out of date" in capsys.readouterr().err
