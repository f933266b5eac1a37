"""The commands of README and docs/ run as printed, and print what the page shows (markers:
readme_blocks.py); every docs/ page is linked from README and every relative link resolves.

A block whose command was renamed, whose flag went away, whose path moved or whose printed
output went stale fails here. README's printed figures were measured on one arithmetic (its
fingerprint is in the output block's marker, ``tests/arithmetic.py``): there the lines README
marks exact must match to the character; on any other machine every line must have README's
words with numbers of its own, and an accuracy README shows rising must rise about as far.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from arithmetic import arithmetic_fingerprint
from readme_blocks import (
    PAGES,
    README,
    ROOT,
    Block,
    line_pattern,
    make_recipe,
    python_source,
    read_blocks,
    selected_commands,
)

BIN = Path(sys.executable).parent
GOLDEN_HASHES = ROOT / "tests" / "golden" / "hashes.json"
# Where README shows an accuracy rising, another machine's run must end within this many points
# of README's figure: 3 binomial standard errors of 200 problems near 75% (3 points each).
ACCURACY_POINTS = 10.0
ACCURACY = re.compile(r"accuracy ([\d.]+)% -> ([\d.]+)%")
BLOCKS = [block for page in PAGES for block in read_blocks(page)]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def run_blocks() -> list[Block]:
    return [b for b in BLOCKS if b.lang == "bash" and b.marker and "run" in b.marker]


def output_of(block: Block) -> dict[str, Block]:
    """The output blocks after ``block`` on its page (up to the next run block), by the command
    they show."""
    later = [b for b in BLOCKS[BLOCKS.index(block) + 1 :] if b.page == block.page]
    outputs = {}
    for other in later:
        if other.marker and "run" in other.marker:
            break
        if other.marker and "output" in other.marker:
            outputs[other.marker["output"]] = other
    return outputs


def test_every_readme_block_says_whether_it_runs():
    problems = []
    for block in BLOCKS:
        kinds = set(block.marker or {}) & {"run", "output", "skip"}
        if len(kinds) != 1:
            problems.append(f"{block.where}: a marker with one of run / output / skip")
        elif "skip" in kinds and not str(block.marker["skip"]).strip():
            problems.append(f"{block.where}: skip without a reason")
        elif "run" in kinds and block.lang == "bash":
            run = block.marker["run"]
            if run != "all" and not all(1 <= n <= len(block.commands) for n in run):
                problems.append(f"{block.where}: runs {run} of {len(block.commands)} commands")
    for block in run_blocks():
        for command in output_of(block):
            if not any(c.startswith(command) for c in block.commands):
                problems.append(f"{block.where}: output shown for {command!r}, not a command of it")
    # README's figures name an arithmetic the golden test knows: when the fingerprint's
    # computation changes, README's markers are re-measured with it.
    known = json.loads(GOLDEN_HASHES.read_text())["arithmetic"]
    for block in BLOCKS:
        arithmetic = (block.marker or {}).get("arithmetic")
        if arithmetic is not None and arithmetic not in known:
            problems.append(f"{block.where}: arithmetic {arithmetic} has no golden hashes")
    assert not problems, "\n".join(problems)
    assert len(run_blocks()) >= 4 and any(b.lang == "python" and "run" in b.marker for b in BLOCKS)


def output_problems(stdout: str, shown: Block, exact_arithmetic: bool) -> list[str]:
    """How ``stdout`` differs from the output block ``shown``, in order."""
    printed = [line.strip() for line in stdout.splitlines()]
    exact = set(shown.marker.get("exact", [])) if exact_arithmetic else set()
    problems, at = [], 0
    for number, line in enumerate(shown.text.splitlines(), 1):
        pattern = line_pattern(line, numbers_free=number not in exact)
        found = next((i for i in range(at, len(printed)) if pattern.match(printed[i])), None)
        if found is None:
            how = "as printed" if number in exact else "with its numbers free"
            problems.append(f"{shown.where} line {number} not printed ({how}): {line.strip()}")
            continue
        at = found + 1
        rising = ACCURACY.search(line)
        if rising and not exact_arithmetic and float(rising[2]) > float(rising[1]):
            after = float(ACCURACY.search(printed[found])[2])
            if after < float(rising[2]) - ACCURACY_POINTS:
                problems.append(f"accuracy after training {after}%, README shows {rising[2]}%")
    return problems


def scratch_directory(tmp_path: Path) -> Path:
    """A working directory where README's relative paths (scripts/, tests/) resolve."""
    for name in ("scripts", "tests", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def shell(command: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    words = command.split()
    lines = make_recipe(words[1], BIN) if words[0] == "make" else [command]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1")
    return subprocess.run(
        ["bash", "-c", " && ".join(lines)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.parametrize("block", run_blocks(), ids=lambda b: f"{b.page.stem}:{b.line}")
def test_readme_commands_run_as_printed(block, tmp_path):
    cwd = scratch_directory(tmp_path)
    outputs = output_of(block)
    for command in selected_commands(block):
        result = shell(command, cwd, timeout=block.marker.get("timeout", 300))
        assert result.returncode == 0, f"{block.where}: {command}\n{result.stderr[-3000:]}"
        shown = next((o for name, o in outputs.items() if command.startswith(name)), None)
        if shown is not None:
            arithmetic = shown.marker.get("arithmetic")
            exact = arithmetic is None or arithmetic == arithmetic_fingerprint()
            problems = output_problems(result.stdout, shown, exact)
            assert not problems, "\n".join(problems) + f"\nprinted:\n{result.stdout}"


def python_pages() -> list[Path]:
    return sorted({b.page for b in BLOCKS if b.lang == "python" and b.marker and "run" in b.marker})


@pytest.mark.slow
@pytest.mark.parametrize("page", python_pages(), ids=lambda p: p.name)
def test_readme_python_examples_run(page, tmp_path):
    """A page's Python blocks, in order, in one namespace (one script per page)."""
    blocks = [
        b
        for b in BLOCKS
        if b.page == page and b.lang == "python" and b.marker and "run" in b.marker
    ]
    script = tmp_path / "readme_examples.py"
    script.write_text("\n\n".join(python_source(b) for b in blocks) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_stale_output_block_fails():
    shown = Block(
        1,
        "",
        "arm ra_flat, 50 steps\n  executed: prefill 22,496 tokens, decode 21,908 rows",
        {"output": "make demo", "exact": [2]},
    )
    printed = "arm ra_flat, 50 steps\n  executed: prefill 2,812 tokens, decode 23,172 rows, 336 block copies\n"
    assert output_problems(printed, shown, exact_arithmetic=True)
    assert output_problems(printed, shown, exact_arithmetic=False), "a line that lost words"
    assert not output_problems(printed.replace(", 336 block copies", ""), shown, False)


def test_every_docs_page_is_linked_from_readme():
    linked = set(LINK.findall(README.read_text(encoding="utf-8")))
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in linked]
    assert not missing, f"docs pages README does not link: {missing}"


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors of ``page``'s headings (outside fenced blocks)."""
    anchors, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif line.startswith("#") and not fenced:
            title = line.lstrip("#").strip().lower()
            anchors.add("".join(c for c in title if c.isalnum() or c in " -_").replace(" ", "-"))
    return anchors


def test_every_relative_link_resolves():
    """README's and docs/'s links to files and headings point at what exists."""
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
