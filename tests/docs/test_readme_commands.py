"""README's commands run as printed, and print what README shows (markers: readme_blocks.py).

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
BLOCKS = read_blocks()


def run_blocks() -> list[Block]:
    return [b for b in BLOCKS if b.lang == "bash" and b.marker and "run" in b.marker]


def output_of(block: Block) -> dict[str, Block]:
    """The output blocks after ``block`` (up to the next run block), by the command they show."""
    later = BLOCKS[BLOCKS.index(block) + 1 :]
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
@pytest.mark.parametrize("block", run_blocks(), ids=lambda b: f"line{b.line}")
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


@pytest.mark.slow
def test_readme_python_examples_run(tmp_path):
    blocks = [b for b in BLOCKS if b.lang == "python" and b.marker and "run" in b.marker]
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
